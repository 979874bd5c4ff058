"""Ranks that pass different arguments to a collective call all raise one clear error.

For every argument of ``save_model``, ``save_optimizer``, ``load_model``, ``load_optimizer``,
the scheduler pair and ``CheckpointManager.save``/``load`` (ranks in
``_arg_divergence_worker.py``), the last rank of a 2-rank gloo world (20 s collective timeout)
passes another value: every rank must raise a ``DistributedError`` naming the argument and
each rank's value, well inside the timeout, commit nothing, and stay in step for the next call.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import run_world

PG_TIMEOUT_S = 20
BOUND_S = 10.0

pytestmark = pytest.mark.timeout(400)

CASES = [
    "save_model.shard",
    "save_model.gather_dtensor",
    "save_model.prefix",
    "save_model.size_per_shard",
    "save_model.size_per_shard_bad",
    "save_model.use_safetensors",
    "save_model.use_async",
    "save_model.checkpoint",
    "save_optimizer.shard",
    "save_optimizer.gather_dtensor",
    "save_optimizer.prefix",
    "save_optimizer.size_per_shard",
    "save_optimizer.use_async",
    "load_model.checkpoint",
    "load_model.strict",
    "load_model.verify",
    "load_model.prefix",
    "load_model.allow_dtype_cast",
    "load_optimizer.checkpoint",
    "load_optimizer.verify",
    "load_optimizer.prefix",
    "save_lr_scheduler.checkpoint",
    "load_lr_scheduler.checkpoint",
    "manager.save.step",
    "manager.save.force",
    "manager.save.optimizer",
    "manager.save.lr_scheduler",
    "manager.load.resume_from_checkpoint",
    "manager.load.resume_none",
    "manager.load.optimizer",
    "manager.init.save_steps",
    "manager.init.async_save",
]


@pytest.fixture(scope="module")
def obs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("argdiv")
    return run_world(
        2,
        "_arg_divergence_worker:arg_divergence_cases",
        str(root),
        timeout=360,
        env={"UNICKPT_TEST_PG_TIMEOUT_S": str(PG_TIMEOUT_S)},
    )


def test_every_case_ran(obs: list[dict[str, Any]]) -> None:
    assert sorted(obs[0]) == sorted(CASES)


@pytest.mark.parametrize("name", CASES)
def test_every_rank_names_the_differing_argument(obs: list[dict[str, Any]], name: str) -> None:
    both = [o[name] for o in obs]
    for r, o in enumerate(both):
        assert "case_error" not in o, f"rank {r}: {name} failed:\n{o['case_error']}"
        assert o["raised"] == "DistributedError", f"rank {r}: {o}"
        arg = o["argument"]
        assert f"{arg} differs (rank 0: {arg}=" in o["message"], o["message"]
        assert f", rank 1: {arg}=" in o["message"], o["message"]
        assert o["seconds"] < BOUND_S, f"rank {r}: took {o['seconds']:.1f} s"
        assert o.get("committed") in (None, False), f"rank {r}: {name} committed"
        assert o["in_step"], f"rank {r}: out of step after {name}"
    assert both[0]["message"] == both[1]["message"]


def test_message_shows_each_rank_value(obs: list[dict[str, Any]]) -> None:
    msg = obs[0]["save_model.shard"]["message"]
    assert (
        "save_model: every rank must pass the same arguments, but shard differs (rank 0: shard=True, rank 1: shard=False)"
        in msg
    )
    assert (
        "size_per_shard differs (rank 0: size_per_shard=1024, rank 1: size_per_shard=-1)"
        in (obs[1]["save_model.size_per_shard_bad"]["message"])
    )
