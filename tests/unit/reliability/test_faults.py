"""The fault-injection switch: named stages, armed per rank, nothing when disarmed."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from unickpt import _dist, _faults
from unickpt._faults import RANK0_ONLY, STAGES, InjectedFault, arm, injected, maybe_fail
from unickpt.errors import DistributedError

PKG = Path(__file__).resolve().parents[3] / "unickpt"


def test_disarmed_does_nothing_and_armed_raises_on_the_named_rank_only() -> None:
    for s in STAGES:
        maybe_fail(s)
    with injected("save.write", 0):
        with pytest.raises(InjectedFault, match=r"stage 'save.write' on rank 0") as ei:
            maybe_fail("save.write")
        assert ei.value.stage == "save.write" and ei.value.rank == 0
        maybe_fail("save.plan")  # another stage: nothing
    maybe_fail("save.write")  # disarmed again
    with injected("load.read", 1):
        maybe_fail("load.read")  # this process is rank 0
    with injected("load.read", "*"), pytest.raises(InjectedFault):
        maybe_fail("load.read")


def test_unknown_stage_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown stage 'save\.nope'"):
        arm("save.nope@0")
    assert not _faults._armed


def test_environment_arms_a_fresh_process() -> None:
    env = dict(os.environ, UNICKPT_FAULTS="open@0, model.plan@1")
    code = (
        "from unickpt._faults import maybe_fail, InjectedFault\n"
        "maybe_fail('model.plan')\n"
        "try:\n    maybe_fail('open')\nexcept InjectedFault as e:\n    print('raised', e.stage)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "raised open"


def test_every_stage_is_called_somewhere_and_every_call_is_a_known_stage() -> None:
    called: set[str] = set()
    for path in PKG.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "maybe_fail"
                and node.args
                and isinstance(node.args[0], ast.Constant)
            ):
                called.add(node.args[0].value)
    assert called == set(STAGES)
    assert set(STAGES) >= RANK0_ONLY


def test_injected_fault_travels_between_ranks() -> None:
    import pickle

    e = pickle.loads(pickle.dumps(InjectedFault("save.list", 3)))
    assert (e.stage, e.rank, str(e)) == ("save.list", 3, "injected fault at stage 'save.list' on rank 3")


def test_agreed_outside_a_world_raises_the_original_error() -> None:
    assert _dist.agreed(lambda: 7, "x") == 7
    with pytest.raises(KeyError):
        _dist.agreed(lambda: {}["k"], "x")
    with pytest.raises(DistributedError, match="boom"):
        _dist.agreed(lambda: (_ for _ in ()).throw(DistributedError("boom")), "x")
