"""A writer process killed mid-save on one rank of 2 (``_writer_kill_worker``): every rank's ``wait()``
raises, the previous step stays committed and loads bit-exact, the next save commits."""

from __future__ import annotations

from typing import Any

import pytest
from harness import WorldPool

TIMEOUT_S = 240.0


@pytest.mark.timeout(TIMEOUT_S + 20)
def test_world2_writer_killed_mid_save(tmp_path: Any, world_pool: WorldPool) -> None:
    results = world_pool.run(2, "_writer_kill_worker:kill_cases", str(tmp_path), timeout=TIMEOUT_S)
    failed = [c for c in results[0].values() if not c.ok]
    assert not failed, "\n\n".join(f"{c.name}:\n{c.error[:4000]}" for c in failed)
    for r in (0, 1):
        case = results[r]["writer_killed_mid_save"]
        assert case.value["error"], (r, case.value)
    assert "WriterDiedError" in results[1]["writer_killed_mid_save"].value["error"]


def _search(tmp_path: Any, world_pool: WorldPool, full: bool, timeout: float) -> dict[str, Any]:
    results = world_pool.run(
        2, "_writer_kill_search_worker:search_cases", str(tmp_path), full, timeout=timeout
    )
    case = results[0]["writer_kill_search"]
    assert case.ok, case.error[:6000]
    report = case.value
    print(report)
    # Both ranks' writers were killed, at steps of several kinds, with both outcomes seen.
    assert report["cases"] >= 2 * 3 and report["committed"] and report["not"], report
    assert {"rename", "replace", "fsync", "pwrite"} <= set(report["killed_kinds"]), report
    return report


@pytest.mark.timeout(600)
def test_world2_writer_killed_at_its_steps_on_either_rank(tmp_path: Any, world_pool: WorldPool) -> None:
    """One rank's writer SIGKILLed at its last step, for each rank, and at the first step of each
    kind that stages or publishes, the ranks taking the kinds in turn (``_writer_kill_search_worker``);
    ``-m slow`` at every step of either rank."""
    _search(tmp_path, world_pool, full=False, timeout=560)


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_world2_writer_killed_at_every_step_on_either_rank(tmp_path: Any, world_pool: WorldPool) -> None:
    _search(tmp_path, world_pool, full=True, timeout=3500)
