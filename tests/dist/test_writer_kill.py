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
