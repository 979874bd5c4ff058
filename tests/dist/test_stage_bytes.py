"""Async saves stage exactly the bytes each rank writes, and ranks that write nothing never stall.

See ``_stage_worker``. The worlds run with a 20 s collective timeout: a rank entering a collective
alone (the other ranks never join) fails the case within it instead of hanging.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import run_world

PG_TIMEOUT_S = 20
pytestmark = pytest.mark.timeout(400)


def _world(n: int, target: str, *args: Any) -> list[dict[str, Any]]:
    return run_world(n, target, *args, timeout=300, env={"UNICKPT_TEST_PG_TIMEOUT_S": str(PG_TIMEOUT_S)})


def _values(results: list[dict[str, Any]], prefix: str = "") -> dict[str, Any]:
    """The cases named ``prefix...`` (the prefix dropped): none failed; their values per rank."""
    names = [name for name in results[0] if name.startswith(prefix)]
    assert names, (prefix, sorted(results[0]))
    failed = [results[0][name] for name in names if not results[0][name].ok]
    assert not failed, "\n\n".join(f"{c.name}:\n{c.error[:4000]}" for c in failed)
    return {name[len(prefix) :]: [res[name].value for res in results] for name in names}


def _run(n: int, target: str, *args: Any) -> dict[str, Any]:
    return _values(_world(n, target, *args))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The 2-rank case sets of this module, run in one world (see ``_stage_worker.two_rank_cases``)."""
    return _world(2, "_stage_worker:two_rank_cases", str(tmp_path_factory.mktemp("stage2")))


@pytest.mark.parametrize("n", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_staged_bytes_equal_written_bytes_per_rank(
    tmp_path: Any, n: int, request: pytest.FixtureRequest
) -> None:
    if n == 2:
        got = _values(request.getfixturevalue("two_ranks"), "stage/")
    else:
        got = _run(n, "_stage_worker:stage_cases", str(tmp_path), ["ddp", f"fsdp2x{n}"])
    for layout, per_rank in got.items():
        for kind in ("model", "optimizer"):
            staged = [r[kind]["staged"] for r in per_rank]
            written = [r[kind]["written"] for r in per_rank]
            assert staged == written, (layout, kind, staged, written)
            held = [r[kind]["held"] for r in per_rank]
            if layout == "ddp":  # every rank holds everything, and writes about 1/n of it
                assert all(h == held[0] for h in held)
                assert sum(staged) == held[0], (staged, held)
                assert max(staged) < held[0], (staged, held)


def test_async_saves_where_a_rank_writes_nothing_2_ranks(two_ranks: list[dict[str, Any]]) -> None:
    got = _values(two_ranks, "idle/")
    for msgs in got["diverged"]:
        assert "1 replicated tensor slice(s) differ across ranks" in msgs["differ"], msgs
        assert "tensor '0.weight': rank 0: xxh3 " in msgs["differ"] and "; rank 1: xxh3 " in msgs["differ"]
        assert "tensor 'state.0.bias.exp_avg'" in msgs["missing"] and "rank 1: missing" in msgs["missing"], (
            msgs
        )


@pytest.mark.slow  # the 2-rank case above runs in make test
def test_async_gathered_save_where_ranks_hold_no_rows_4_ranks(tmp_path: Any) -> None:
    _run(4, "_stage_worker:idle_cases", str(tmp_path))


def test_slow_retention_does_not_hold_the_other_ranks(two_ranks: list[dict[str, Any]]) -> None:
    """keep_last deletes on rank 0 after the save's last collective: a deletion that takes 8 s
    delays rank 0 only, and a failing one is a warning there, retried by the next save."""
    got = _values(two_ranks, "retention/")
    for case, (r0, r1) in got.items():
        assert r0["slow"] >= 8.0, (case, r0)
        assert r1["slow"] < 4.0, (case, r1)
        for r in (r0, r1):
            assert r["after_slow"] == [2] and r["after_failed"] == [2, 3] and r["after_retry"] == [4], (
                case,
                r,
            )
        assert r1["warnings"] == []
        if case == "async=False":  # an async save's warning is issued in its background thread
            assert len(r0["warnings"]) == 1, r0
            msg = r0["warnings"][0]
            assert (
                "step 3 is committed" in msg and "keep_last=1" in msg and "injected deletion failure" in msg
            ), msg


def test_cpu_collectives_use_the_gloo_twin_of_a_pure_nccl_world(two_ranks: list[dict[str, Any]]) -> None:
    """With the world taken for a group without a CPU backend, no collective of a save, a load or
    an async save (CheckpointIO and CheckpointManager) runs on it: each runs on the world's gloo
    twin, made once at setup on the main thread, or on the background saves' gloo group."""
    got = _values(two_ranks, "routes/")["cpu_routes"]
    for r in got:
        # Async saves are written by writer processes in a gloo world of their own: no background
        # thread of this process makes a collective.
        assert r["calls"] > 20 and r["background_calls"] == 0, r
        assert r["twins"] == 1 and r["twin_at_setup"] == ["setup"], r
        assert all(thread == "MainThread" for thread, _ in r["made"]), r
