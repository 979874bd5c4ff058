"""``use_async=True`` saves (Colossal-AI's flag) under FSDP2, PP and ZeRO-2 on 2 real ranks.

See ``_async_parity_worker``: gathered and sliced async saves of model and optimizer, training
on while the last one is written, then bit-exact loads of the values saved. And a 2-rank async
CheckpointManager run whose every rank's train state ``verify`` checks against its hashes.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import WorldPool

TIMEOUT_S = 200.0


@pytest.mark.timeout(TIMEOUT_S + 20)
def test_world2_async_saves(tmp_path: Any, world_pool: WorldPool) -> None:
    results = world_pool.run(
        2, "_async_parity_worker:async_cases", str(tmp_path), ["fsdp2x2", "pp2", "zero2x2"], timeout=TIMEOUT_S
    )
    failed = [c for c in results[0].values() if not c.ok]
    assert not failed, "\n\n".join(f"{c.name}:\n{c.error[:4000]}" for c in failed)


@pytest.mark.timeout(TIMEOUT_S + 20)
def test_world2_manager_run_verifies_every_ranks_train_state(tmp_path: Any, world_pool: WorldPool) -> None:
    results = world_pool.run(2, "_async_parity_worker:manager_cases", str(tmp_path), timeout=TIMEOUT_S)
    failed = [c for c in results[0].values() if not c.ok]
    assert not failed, "\n\n".join(f"{c.name}:\n{c.error[:4000]}" for c in failed)


@pytest.mark.timeout(TIMEOUT_S + 20)
def test_world2_plain_named_optimizer_under_plugins(tmp_path: Any, world_pool: WorldPool) -> None:
    """A torch optimizer built from named_parameters(), not the wrapper, saves and loads through the
    Booster under FSDP2, PP and ZeRO-2; under FSDP2 also through the bare IO (its param_names)."""
    results = world_pool.run(
        2, "_async_parity_worker:named_cases", str(tmp_path), ["fsdp2x2", "pp2", "zero2x2"], timeout=TIMEOUT_S
    )
    failed = [c for c in results[0].values() if not c.ok]
    assert not failed, "\n\n".join(f"{c.name}:\n{c.error[:4000]}" for c in failed)
