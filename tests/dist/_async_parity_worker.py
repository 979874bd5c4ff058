"""Worker side of test_async_parity: Colossal-AI style ``use_async=True`` saves under real plugins.

For each layout (FSDP2 x2, PP x2, ZeRO-2 x2) a rank trains one step, records the full state,
starts async saves (gathered single file, gathered sharded, sliced; model and optimizer), trains
another step while the last save is still being written (training collectives and the save's
background collectives run at once), waits with ``checkpoint_io._sync_io()`` and loads every
checkpoint into a fresh model of the same layout: every tensor must equal the recorded state
bit for bit (the values of the moment each save was called, not the later ones).
"""

from __future__ import annotations

import os

import torch.distributed as dist
from _pp_zero_hybrid_worker import Setup, assert_bits
from harness import run_cases


def _async_case(layout: str, root: str) -> None:
    s = Setup(layout)
    s.train_step(0)
    exp = s.expected()
    d = os.path.join(root, layout)
    b = s.booster
    b.save_model(s.model, os.path.join(d, "m_single"), use_safetensors=True, use_async=True)
    b.save_optimizer(s.optim, os.path.join(d, "o_single"), use_async=True)
    b.save_model(s.model, os.path.join(d, "m_shard"), shard=True, size_per_shard=1, use_async=True)
    b.save_optimizer(s.optim, os.path.join(d, "o_shard"), shard=True, size_per_shard=1, use_async=True)
    b.save_model(s.model, os.path.join(d, "m_sliced"), shard=True, gather_dtensor=False, use_async=True)
    b.save_optimizer(s.optim, os.path.join(d, "o_sliced"), shard=True, gather_dtensor=False, use_async=True)
    s.train_step(1)  # while the sliced optimizer save is in flight
    b.checkpoint_io._sync_d2h()
    b.checkpoint_io._sync_io()
    for kind in ("single", "shard", "sliced"):
        t = Setup(layout, seed=9)
        t.booster.load_model(t.model, os.path.join(d, f"m_{kind}"))
        t.booster.load_optimizer(t.optim, os.path.join(d, f"o_{kind}"))
        assert_bits(exp, t.expected(), f"{layout} async {kind}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        assert os.path.isfile(os.path.join(d, "m_single", "model.safetensors"))
        assert os.path.isfile(os.path.join(d, "o_single", "optimizer.safetensors"))


def async_cases(root: str, layouts: list[str]) -> dict[str, object]:
    return run_cases([(f"async_{lay}", lambda lay=lay: _async_case(lay, root)) for lay in layouts])  # type: ignore[misc]
