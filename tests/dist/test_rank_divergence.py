"""Ranks that disagree, and parameters that never stepped, on a real 2-rank gloo world.

See ``_rank_divergence_worker`` for the cases. One world (20 s collective timeout) runs them
all; every error must reach both ranks well inside that timeout.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import run_world

PG_TIMEOUT_S = 20
BOUND_S = 10.0

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def obs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("divergence")
    return run_world(
        2,
        "_rank_divergence_worker:divergence_cases",
        str(root),
        timeout=540,
        env={"UNICKPT_TEST_PG_TIMEOUT_S": str(PG_TIMEOUT_S)},
    )


def case(obs: list[dict[str, Any]], name: str) -> list[Any]:
    both = [o[name] for o in obs]
    for r, o in enumerate(both):
        assert not (isinstance(o, dict) and "case_error" in o), f"rank {r}: {name} failed:\n{o['case_error']}"
    return both


def raised_fast(o: dict[str, Any], error: str) -> None:
    assert o["raised"] is not None, f"returned normally: {o}"
    assert error in o["mro"], f"raised {o['raised']}, not {error}:\n{o.get('traceback')}"
    assert o["seconds"] < BOUND_S, f"took {o['seconds']:.1f} s"


# ---------------------------------------------------------------- replicas


def test_divergent_replicas_warn_by_default(obs: list[dict[str, Any]]) -> None:
    for r, o in enumerate(case(obs, "replicas_differ")):
        for layout in ("sliced", "gathered"):
            w = o[f"warn/{layout}"]
            assert w["raised"] is None and w["committed"], (r, layout, w)
            assert len(w["warnings"]) == 1, (r, layout, w["warnings"])
            msg = w["warnings"][0]["message"]
            assert "1 replicated tensor slice(s) differ across ranks" in msg, msg
            assert "tensor 'up.weight': rank 0: xxh3 " in msg and "; rank 1: xxh3 " in msg, msg
            assert "down.weight" not in msg
        assert o["identical"]["raised"] is None and o["identical"]["warnings"] == []


def test_divergent_replicas_raise_on_every_rank_when_asked(obs: list[dict[str, Any]]) -> None:
    for r, o in enumerate(case(obs, "replicas_differ")):
        for layout in ("sliced", "gathered"):
            e = o[f"raise/{layout}"]
            raised_fast(e, "DistributedError")
            assert "tensor 'up.weight'" in e["message"] and not e["committed"], (r, layout, e)
            off = o[f"off/{layout}"]
            assert off["raised"] is None and off["warnings"] == [] and off["committed"]


def test_tensor_held_by_some_ddp_ranks_only(obs: list[dict[str, Any]]) -> None:
    for o in case(obs, "tensor_missing_on_one_rank"):
        raised_fast(o, "DistributedError")
        assert "tensor 'state.up.bias.exp_avg'" in o["message"] and "rank 1: missing" in o["message"], o
        assert not o["committed"]


def test_gathered_save_with_disagreeing_shapes_refused_everywhere(obs: list[dict[str, Any]]) -> None:
    for o in case(obs, "gathered_shapes_differ"):
        for layout in ("sharded", "single"):
            e = o[layout]
            raised_fast(e, "DistributedError")
            assert "disagree on the dtype or global shape of 3 tensor(s)" in e["message"], e["message"]
            assert "tensor 'up.weight': rank 0: F32[10, 4]; rank 1: F32[12, 4]" in e["message"]
            assert not e["committed"]


# ---------------------------------------------------------------- one-rank errors


def test_optimizer_of_another_class_on_one_rank(obs: list[dict[str, Any]]) -> None:
    for o in case(obs, "optimizer_class_differs"):
        for what in ("save", "load"):
            raised_fast(o[what], "DistributedError")
            assert "optimizers of different classes" in o[what]["message"]
            assert "ranks [0]: torch.optim.adamw.AdamW; ranks [1]: torch.optim.sgd.SGD" in o[what]["message"]
        assert not o["save"]["committed"] and o["load"]["model_unchanged"]


def test_unsupported_group_value_on_one_rank(obs: list[dict[str, Any]]) -> None:
    r0, r1 = case(obs, "unsupported_group_value_on_one_rank")
    raised_fast(r1, "UnsupportedError")
    raised_fast(r0, "UnsupportedError")
    for o in (r0, r1):
        assert "[rank 1] UnsupportedError: param_groups[0]['hook']: value of type function" in o["message"]
        assert not o["committed"]


def test_scheduler_failing_on_one_rank(obs: list[dict[str, Any]]) -> None:
    r0, r1 = case(obs, "scheduler_fails_on_one_rank")
    raised_fast(r1, "KeyError")  # the failing rank keeps its own error
    raised_fast(r0, "DistributedError")
    assert '[rank 1] KeyError: "rank 1\'s scheduler refuses this state"' in r0["message"]


def test_boost_refuses_objects_that_differ_between_ranks(obs: list[dict[str, Any]]) -> None:
    for o in case(obs, "boost_inputs_differ"):
        for plugin in ("ddp", "fsdp2"):
            c = o[f"class/{plugin}"]
            raised_fast(c, "DistributedError")
            assert "the ranks passed different models or optimizers" in c["message"]
            assert (
                "optimizer class: rank 0: 'torch.optim.adamw.AdamW'; rank 1: 'torch.optim.sgd.SGD'"
                in c["message"]
            )
            f = o[f"frozen/{plugin}"]
            raised_fast(f, "DistributedError")
            assert "parameters: rank 0: " in f["message"], f["message"]


# ---------------------------------------------------------------- never-stepped parameters

LAYOUTS = ["ddp", "fsdp2", "tp", "zero2", "pp2"]
HYBRID = ["hyb_fsdp_dp2tp2", "hyb_pp2tp2"]


@pytest.fixture(scope="module")
def obs4(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The hybrid layouts (dp2 x tp2 with FSDP2, pp2 x tp2) on one 4-rank world."""
    root = tmp_path_factory.mktemp("divergence4")
    return run_world(
        4,
        "_rank_divergence_worker:never_stepped_cases",
        str(root),
        HYBRID,
        timeout=540,
        env={"UNICKPT_TEST_PG_TIMEOUT_S": str(PG_TIMEOUT_S)},
    )


@pytest.mark.parametrize("layout", LAYOUTS + HYBRID)
def test_never_stepped_parameters_round_trip_and_resume_exactly(
    obs: list[dict[str, Any]], obs4: list[dict[str, Any]], layout: str
) -> None:
    for r, o in enumerate(case(obs4 if layout in HYBRID else obs, f"never_stepped_{layout}")):
        never = {"blocks.0.ln.weight", "blocks.2.expert.weight", "blocks.2.expert.bias"}
        assert o["frozen_unchanged"], f"rank {r}: the frozen parameter changed during training"
        if layout != "zero2":
            # ZeRO keeps one flat state per bucket: every parameter in it has state
            assert not never & set(o["ref_with_state"]), (r, o["ref_with_state"])
        for mode in ("sliced", "gathered"):
            m = o[mode]
            assert m["saved_with_state"] == o["ref_with_state"]
            assert m["save_changed"] == [], f"rank {r} {mode}: saving changed {m['save_changed']}"
            assert m["load_differs"] == [], f"rank {r} {mode}: loaded state differs: {m['load_differs']}"
            assert m["resume_differs"] == [], f"rank {r} {mode}: resumed run differs: {m['resume_differs']}"


def test_never_stepped_parameters_through_the_manager(obs: list[dict[str, Any]]) -> None:
    for o in case(obs, "never_stepped_manager"):
        assert o["step"] == 2 and o["resume_differs"] == [], o
