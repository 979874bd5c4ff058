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


def _manager_case(root: str) -> None:
    """A 2-rank FSDP2 CheckpointManager run: `verify` checks both ranks' train-state hashes."""
    from unickpt.manager import CheckpointManager
    from unickpt.tools.run import verify_run

    s = Setup("fsdp2x2")
    run = os.path.join(root, "manager_run")
    mgr = CheckpointManager(run, s.booster, save_steps=1, keep_last=None, async_save=True)
    for step in (1, 2):
        s.train_step(step)
        mgr.save(step, s.model, s.optim)
    mgr.wait()
    dist.barrier()
    if dist.get_rank() == 0:
        results = verify_run(run, all_steps=True, require_hashes=True)
        assert [(r.step, r.part) for r in results] == [
            (1, "model"),
            (1, "optimizer"),
            (1, "train_state"),
            (2, "model"),
            (2, "optimizer"),
            (2, "train_state"),
        ]
        assert all(not r.failures for r in results), [r.failures for r in results]
        assert results[-1].checked == "2 rank(s), 4 file(s) rehashed"
        victim = os.path.join(run, "step-2", "train_state", "rank-00001.safetensors")
        with open(victim, "rb") as f:
            raw = bytearray(f.read())
        raw[-1] ^= 1
        with open(victim, "wb") as f:
            f.write(bytes(raw))
        bad = [f for r in verify_run(run) for f in r.failures]
        assert len(bad) == 1 and "rank-00001.safetensors: expected xxh3-64" in bad[0], bad
    dist.barrier()


def manager_cases(root: str) -> dict[str, object]:
    return run_cases([("manager_run_verify", lambda: _manager_case(root))])


def _named_setup(layout: str, seed: int) -> Setup:
    """``Setup`` with the optimizer built from ``model.named_parameters()`` (one group)."""
    import _pp_zero_hybrid_worker as w
    import torch

    orig = w.make_optimizer
    w.make_optimizer = lambda model: torch.optim.AdamW(model.named_parameters(), lr=1e-2, foreach=False)
    try:
        return Setup(layout, seed)
    finally:
        w.make_optimizer = orig


def _named_case(layout: str, root: str) -> None:
    """The plain torch optimizer (no wrapper) under a plugin, where it knows its FQNs."""
    from unickpt.errors import UnsupportedError

    s = _named_setup(layout, 0)
    s.train_step(0)
    exp = s.expected()
    d = os.path.join(root, f"named_{layout}")
    s.booster.save_model(s.model, os.path.join(d, "m"), shard=True, gather_dtensor=False)
    raw = s.optim.optim  # the user's own torch optimizer object, not the wrapper
    if layout == "zero2x2":  # it now updates flat shards, which have no FQN: the IO alone cannot name them
        assert "param_names" not in raw.param_groups[0]
        try:
            s.booster.checkpoint_io.save_optimizer(raw, os.path.join(d, "o_io"))
        except UnsupportedError as e:
            assert "or an optimizer built from model.named_parameters()" in str(e)
        else:
            raise AssertionError("saving ZeRO's raw optimizer through the IO should need the wrapper")
    elif layout == "fsdp2x2":  # the IO alone names the state from param_names
        s.booster.checkpoint_io.save_optimizer(raw, os.path.join(d, "o_io"), shard=True, gather_dtensor=False)
    # Through the Booster, the raw optimizer is the one boost() saw: its model names the state.
    s.booster.save_optimizer(raw, os.path.join(d, "o"), shard=True, gather_dtensor=False)
    for src in ("o", "o_io") if layout == "fsdp2x2" else ("o",):
        t = _named_setup(layout, 9)
        t.booster.load_model(t.model, os.path.join(d, "m"))
        t.booster.load_optimizer(t.optim.optim, os.path.join(d, src))
        assert_bits(exp, t.expected(), f"{layout} named optimizer ({src})")


def named_cases(root: str, layouts: list[str]) -> dict[str, object]:
    return run_cases([(f"named_{lay}", lambda lay=lay: _named_case(lay, root)) for lay in layouts])  # type: ignore[misc]
