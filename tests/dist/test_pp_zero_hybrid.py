"""PP, ZeRO-1/2 and hybrid layouts: each saves and loads against the others, bit for bit.

Worlds come from the session's ``world_pool`` and run many cases each (see
``_pp_zero_hybrid_worker``): 2 ranks save PP x2, ZeRO-2 x2 and FSDP2 x2 and load each other's
checkpoints; 4 ranks save ZeRO-1 x4, FSDP2 x4, hybrid dp2 x tp2 (FSDP2 over TP: ``_StridedShard``
placements, and DDP) and pp2 x tp2 and load a representative subset; 2 ranks then load 4-rank
checkpoints; one process loads every checkpoint (sliced and gathered) and merges the
``_StridedShard`` and pipeline ones with ``unickpt.merge_checkpoint``. Every load compares full
model and optimizer tensors with the saver's own full state.

Not every layout loads every other: each pair below adds a different code path (the target's
kind of block: replicated, ``Shard(0)``, ``_StridedShard`` x ``Shard``, ``Shard(1)``, flat ZeRO
ranges, pipeline stages with a tied weight; and the source's, sliced or gathered). Training
continuity: ZeRO-1 x4 -> PP x2 and hybrid dp2 x tp2 -> FSDP2 x4 each train on after the load, with
losses matching an uninterrupted single-process run. The 3D run (dp2 x pp2 x tp2, 8 processes)
is marked slow (``make test-slow``).
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import WorldPool, run_world

L2 = ["fsdp2x2", "pp2", "zero2x2"]
L4 = ["zero1x4", "fsdp2x4", "hyb_fsdp_dp2tp2", "hyb_ddp_dp2tp2", "hyb_pp2tp2"]
TIMEOUT_S = 200.0

# (destination layout, source layout, "s" sliced and/or "g" gathered checkpoint)
LOADS2 = [
    ("pp2", "zero2x2", "sg"),
    ("zero2x2", "pp2", "sg"),
    ("fsdp2x2", "pp2", "sg"),
    ("pp2", "fsdp2x2", "s"),
]
LOADS4 = [
    ("zero1x4", "hyb_fsdp_dp2tp2", "sg"),
    ("zero1x4", "pp2", "s"),
    ("fsdp2x4", "hyb_pp2tp2", "sg"),
    ("fsdp2x4", "zero2x2", "s"),
    ("hyb_fsdp_dp2tp2", "hyb_pp2tp2", "sg"),
    ("hyb_fsdp_dp2tp2", "zero1x4", "s"),
    ("hyb_fsdp_dp2tp2", "fsdp2x4", "g"),
    ("hyb_ddp_dp2tp2", "hyb_fsdp_dp2tp2", "sg"),
    ("hyb_ddp_dp2tp2", "zero2x2", "s"),
    ("hyb_pp2tp2", "hyb_fsdp_dp2tp2", "s"),
    ("hyb_pp2tp2", "hyb_ddp_dp2tp2", "g"),
    ("hyb_pp2tp2", "pp2", "s"),
]
LOADS2_FROM4 = [
    ("fsdp2x2", "hyb_fsdp_dp2tp2", "s"),
    ("pp2", "hyb_pp2tp2", "sg"),
    ("zero2x2", "zero1x4", "s"),
    ("zero2x2", "hyb_ddp_dp2tp2", "g"),
]


def _check(results: list[Any]) -> None:
    failed = [c for c in results[0].values() if not c.ok]
    assert not failed, "\n\n".join(f"{c.name}:\n{c.error[:4000]}" for c in failed)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("ppzh"))


@pytest.mark.timeout(TIMEOUT_S + 20)
def test_world2_save_and_cross_load(root: str, world_pool: WorldPool) -> None:
    target = "_pp_zero_hybrid_worker:world_worker"
    _check(world_pool.run(2, target, root, L2, LOADS2, [], ["uneven_tp"], timeout=TIMEOUT_S))


@pytest.mark.timeout(TIMEOUT_S + 20)
def test_world4_save_and_cross_load(root: str, world_pool: WorldPool) -> None:
    conts = [("hyb_fsdp_dp2tp2", "fsdp2x4")]
    target = "_pp_zero_hybrid_worker:world_worker"
    _check(world_pool.run(4, target, root, L4, LOADS4, conts, [], timeout=TIMEOUT_S))


@pytest.mark.timeout(TIMEOUT_S + 20)
def test_world2_loads_world4(root: str, world_pool: WorldPool) -> None:
    conts = [("zero1x4", "pp2")]
    target = "_pp_zero_hybrid_worker:world_worker"
    _check(world_pool.run(2, target, root, [], LOADS2_FROM4, conts, [], timeout=TIMEOUT_S))


@pytest.mark.timeout(TIMEOUT_S + 20)
def test_single_process_loads_everything(root: str, world_pool: WorldPool) -> None:
    loads = [("single", s, "sg") for s in [*L2, *L4]]
    checks = ["merge:hyb_fsdp_dp2tp2", "merge:hyb_pp2tp2"]
    target = "_pp_zero_hybrid_worker:world_worker"
    _check(world_pool.run(1, target, root, ["single"], loads, [], checks, timeout=TIMEOUT_S))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_3d_dp2_pp2_tp2(tmp_path: Any) -> None:
    """dp2 x pp2 x tp2 on 8 processes: save, load into itself, FSDP2 x2 and one process; train on."""
    root = str(tmp_path)
    target = "_pp_zero_hybrid_worker:world_worker"
    loads8 = [("hyb_3d", "hyb_3d", "sg")]
    _check(run_world(8, target, root, ["hyb_3d"], loads8, [("hyb_3d", "hyb_3d")], [], timeout=540))
    _check(
        run_world(
            2, target, root, [], [("fsdp2x2", "hyb_3d", "sg"), ("pp2", "hyb_3d", "s")], [], [], timeout=300
        )
    )
    _check(
        run_world(
            1, target, root, ["single"], [("single", "hyb_3d", "sg")], [], ["merge:hyb_3d"], timeout=300
        )
    )
