"""A failure on one rank at EVERY fault stage of save and load: every rank raises within seconds.

One 2-rank gloo world (20 s collective timeout) runs ``_fault_stages_worker.stage_cases``:
DDP, FSDP2, TP, ZeRO-2 and PP, model/optimizer/scheduler save and load (gathered, sliced, single file) and
the CheckpointManager's save (sync and async) and load, each with each stage it reaches failing on one rank.
A rank left waiting in a collective would need the 20 s timeout; the bound here is 10 s.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import run_world

from unickpt._faults import RANK0_ONLY, STAGES

PG_TIMEOUT_S = 20
BOUND_S = 10.0
KINDS = ("ddp", "fsdp2", "tp", "zero2", "pp2")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fault_stages")
    return run_world(
        2,
        "_fault_stages_worker:stage_cases",
        str(root),
        KINDS,
        timeout=540,
        env={"UNICKPT_TEST_PG_TIMEOUT_S": str(PG_TIMEOUT_S)},
    )


def _pairs(result: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    r0, r1 = result[0]["runs"], result[1]["runs"]
    assert len(r0) == len(r1)
    for a, b in zip(r0, r1, strict=True):
        assert (a["kind"], a["op"], a["stage"]) == (b["kind"], b["op"], b["stage"])
    return list(zip(r0, r1, strict=True))


def test_every_stage_is_injected(result: list[dict[str, Any]]) -> None:
    injected = {a["stage"] for a, _ in _pairs(result)}
    assert injected == set(STAGES), f"never injected: {sorted(set(STAGES) - injected)}"
    for both in _pairs(result):
        if both[0]["stage"] in RANK0_ONLY:
            assert both[0]["fail_rank"] == 0


def test_operations_reach_their_stages(result: list[dict[str, Any]]) -> None:
    traced = result[0]["traced"]
    for kind in ("ddp", "fsdp2"):
        r0 = set(traced[f"{kind}/save_model_sliced"][0])
        r1 = set(traced[f"{kind}/save_model_sliced"][1])
        assert {"save.list", "save.plan", "save.prepare", "save.write", "save.commit", "model.plan"} <= r0
        assert {"save.list", "save.plan", "save.write", "model.plan", "replicas.digest"} <= r1
        assert "save.commit" not in r1 and "save.prepare" not in r1
        # Gathered saves: rank 0 creates the files, every rank writes its own bytes into them.
        g0 = set(traced[f"{kind}/save_model_gathered"][0])
        g1 = set(traced[f"{kind}/save_model_gathered"][1])
        assert {"save.hf_create", "save.hf_write", "save.commit"} <= g0
        assert "save.hf_write" in g1 and "save.hf_create" not in g1
        load = set(traced[f"{kind}/load_optimizer"][1])
        assert {"open", "optimizer.load.prepare", "optimizer.load.apply", "load.match", "load.read"} <= load
        mgr = set(traced[f"{kind}/manager_save"][0])
        assert {
            "manager.start",
            "manager.capture",
            "manager.train_state",
            "manager.hf_copy",
            "manager.commit",
        } <= mgr
        # The Hugging Face copy is shared: every rank copies its part of the files.
        assert "manager.hf_copy" in set(traced[f"{kind}/manager_save"][1])


def test_every_rank_raises_within_seconds(result: list[dict[str, Any]]) -> None:
    slow = []
    for both in _pairs(result):
        stage, fail = both[0]["stage"], both[0]["fail_rank"]
        where = f"{both[0]['kind']}/{both[0]['op']} @ {stage} on rank {fail}"
        fault = f"InjectedFault: injected fault at stage '{stage}' on rank {fail}"
        for r, o in enumerate(both):
            assert o["raised"] is not None, f"{where}: rank {r} returned normally"
            if r == fail and o["raised"] == "InjectedFault":
                assert o["stage"] == stage, f"{where}: rank {r}: {o}"
            elif r == fail:
                # a fault while copying in place: the load says the model is partly loaded
                assert o["raised"] == "IncompleteCheckpointError" and stage == "load.read", (where, o)
                assert "partly loaded" in o["message"] and fault in o["message"], (where, o["message"])
            else:
                assert o["raised"] in ("DistributedError", both[fail]["raised"]), (
                    f"{where}: rank {r} raised {o['raised']}:\n{o['traceback']}"
                )
                assert f"[rank {fail}] " in o["message"] and fault in o["message"], (
                    f"{where}: rank {r}'s message does not name the failing rank and fault: {o['message']}"
                )
            if o["seconds"] >= BOUND_S:
                slow.append(f"{where}: rank {r} took {o['seconds']:.1f} s")
    assert not slow, "\n".join(slow)
    worst = max(o["seconds"] for both in _pairs(result) for o in both)
    print(f"{len(_pairs(result))} injected failures, slowest rank raised after {worst:.2f} s")


def test_no_committed_checkpoint_is_damaged(result: list[dict[str, Any]]) -> None:
    for both in _pairs(result):
        where = f"{both[0]['kind']}/{both[0]['op']} @ {both[0]['stage']}"
        for r, o in enumerate(both):
            assert "intact_error" not in o, f"{where}: rank {r}:\n{o['intact_error']}"
            assert o["good_intact"], f"{where}: rank {r}: a committed checkpoint changed"
            assert o["target"] in ("none", "not committed", "committed and verified"), o["target"]
            # the manager's committed steps: step 1, and step 2 once its traced save ran
            steps = o["manager_steps"]
            assert 1 in steps and set(steps) <= {1, 2}, f"{where}: committed steps {steps}"
            if both[0]["op"] == "manager_save":
                assert steps == [1, 2], f"{where}: a failed manager save committed: {steps}"
        # a failed save leaves its directory uncommitted (model.hf_config fails after the commit)
        op, stage = both[0]["op"], both[0]["stage"]
        if op.startswith("save_") and op != "save_lr_scheduler" and stage != "model.hf_config":
            assert both[0]["target"] in ("none", "not committed"), f"{where}: {both[0]['target']}"


def test_world_healthy_and_state_exact_after_all_failures(result: list[dict[str, Any]]) -> None:
    for rank, res in enumerate(result):
        for kind, f in res["final"].items():
            assert f["reload"]["raised"] is None, f"rank {rank} {kind}: {f['reload']}"
            assert f["good_intact"]
