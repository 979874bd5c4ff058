"""Resharded resume of a torchtitan run through ``unickpt.integrations.torchtitan``: torchtitan's
llama3 debug model (2 layers), its ``OptimizersContainer``, ``LRSchedulersContainer`` and
``ParallelAwareDataloader`` (tests/dist/_titan_worker.py) trained on a 2-rank FSDP2 world
(gloo, CPU) saving every 2 steps; step 2 resumed on 1 rank, and a 1-rank step 2 resumed on 2
ranks (``-m slow``): the losses match the uninterrupted run to 1e-5 relative (FSDP's gradient averaging
rounds differently from one rank's sum). torchtitan's dataloader cannot change its degree, as
in torchtitan: the resumed run excludes it from loading and skips the batches already seen
(the synthetic stream gives a global batch the same samples at any degree)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from _titan_worker import GLOBAL_BATCH, SEQ
from harness import run_world

pytest.importorskip(
    "torchtitan.trainer", reason="torchtitan and its runtime modules (make peers) not installed"
)

pytestmark = pytest.mark.timeout(400)

STEPS = 4
COMMON: dict[str, Any] = {"interval": 2, "keep_latest_k": 0, "last_save_model_only": False}


def _step2_only(src: Path, dst: Path) -> None:
    """A copy of the run ``src`` holding only its step 2 (so that step 2 is the one resumed)."""
    shutil.copytree(src / "checkpoint" / "step-2", dst / "checkpoint" / "step-2")


def _close(a: dict[int, float], b: dict[int, float]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert abs(a[k] - b[k]) <= 1e-5 * abs(b[k]), (k, a[k], b[k])


RESUME: dict[str, Any] = {**COMMON, "skip_batches": 2, "exclude_from_loading": ["dataloader"]}


def _train(nprocs: int, folder: Path, kw: dict[str, Any]) -> list[dict[str, Any]]:
    return run_world(nprocs, "_titan_worker:train_remote", str(folder), STEPS, kw, timeout=300)


def test_two_rank_fsdp_resumes_on_one_rank(tmp_path: Path) -> None:
    two = _train(2, tmp_path / "two", COMMON)
    assert two[0]["losses"] == two[1]["losses"] and not two[0]["loaded"]
    _step2_only(tmp_path / "two", tmp_path / "two_to_one")
    got = _train(1, tmp_path / "two_to_one", RESUME)
    assert got[0]["loaded"] is True and sorted(got[0]["losses"]) == [3, 4]
    _close(got[0]["losses"], {k: two[0]["losses"][k] for k in (3, 4)})
    # the train state is per rank (torchtitan counts each rank's tokens): rank 0's, then 1 rank's
    assert got[0]["step"] == STEPS
    assert got[0]["ntokens_seen"] == 2 * (GLOBAL_BATCH // 2) * SEQ + 2 * GLOBAL_BATCH * SEQ


@pytest.mark.slow
def test_one_rank_resumes_on_two_rank_fsdp(tmp_path: Path) -> None:
    one = _train(1, tmp_path / "one", COMMON)
    _step2_only(tmp_path / "one", tmp_path / "one_to_two")
    got = _train(2, tmp_path / "one_to_two", RESUME)
    assert all(r["loaded"] is True for r in got) and got[0]["losses"] == got[1]["losses"]
    _close(got[0]["losses"], {k: one[0]["losses"][k] for k in (3, 4)})
