"""Worker side of test_stage_bytes: what an async save copies, and ranks that write nothing.

* ``stage_cases``: under DDP and FSDP2 (2 or 4 ranks) the bytes an async save stages on each
  rank (``io.stage.stage_written``) equal the data bytes of the files that rank writes, counted
  from the files on disk; the checkpoint loads bit for bit.
* ``idle_cases``: async saves in which some ranks write nothing: a 2-row tensor column-sharded
  over 4 ranks, saved gathered (ranks 2 and 3 hold no row of it), and one small replicated tensor
  only rank 0 writes; divergent replicas and a tensor missing on one rank still refused from the
  copy.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import torch
import torch.distributed as dist
from harness import run_cases

from unickpt.io.stage import stage_written


def _data_bytes(path: str) -> int:
    """Bytes of tensor data in a safetensors file: its size less the length word and header."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
    return os.path.getsize(path) - 8 - n


def _files(directory: str) -> list[str]:
    return sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))


def _boost(layout: str) -> tuple[Any, Any, Any]:
    from _pp_zero_hybrid_worker import loss_fn, make_model, make_optimizer, make_plugin

    from unickpt.booster import Booster
    from unickpt.plugins.ddp import DDPPlugin

    plugin = DDPPlugin() if layout == "ddp" else make_plugin(layout)
    booster = Booster(plugin)
    model = make_model(0)
    model, optim, *_ = booster.boost(model, make_optimizer(model), criterion=loss_fn)
    return booster, model, optim


def _stage_case(root: str, layout: str) -> dict[str, Any]:
    from _pp_zero_hybrid_worker import batch, loss_fn

    booster, model, optim = _boost(layout)
    x, y = batch(0)
    booster.backward(loss_fn(model(x), y), optim)
    optim.step()
    optim.zero_grad()
    io = booster.checkpoint_io
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}
    for kind, payload in (("model", io.plan_model(model)), ("optimizer", io.plan_optimizer(optim))):
        held = sum(sl.tensor.nbytes for sls in payload.slices.values() for sl in sls)
        staged = stage_written(payload, {}, io.group)
        assert staged.staged is not None
        copied = sum(
            sl.tensor.nbytes
            for sls in staged.slices.values()
            for sl in sls
            if sl.tensor.device.type != "meta"
        )
        assert copied == staged.staged.nbytes, (copied, staged.staged.nbytes)
        d = os.path.join(root, f"{layout}x{world}", kind)
        io.write(staged, d, shard=True, gather_dtensor=False, size_per_shard=float("inf"))
        counts = [0] * world
        dist.all_gather_object(counts, staged.staged.nbytes)
        writers = [r for r in range(world) if counts[r] > 0]
        files = _files(d)
        assert len(files) == len(writers), (files, counts)
        written = _data_bytes(os.path.join(d, files[writers.index(rank)])) if rank in writers else 0
        assert staged.staged.nbytes == written, (kind, rank, staged.staged.nbytes, written)
        out[kind] = {"held": held, "staged": staged.staged.nbytes, "written": written}
    # The staged copy makes the same checkpoint: it loads bit for bit.
    fresh_booster, fresh, fresh_optim = _boost(layout)
    fresh_booster.load_model(fresh, os.path.join(root, f"{layout}x{world}", "model"))
    fresh_booster.load_optimizer(fresh_optim, os.path.join(root, f"{layout}x{world}", "optimizer"))
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        b = b.full_tensor() if hasattr(b, "full_tensor") else b
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == torch.bfloat16 else a,
            b.view(torch.uint8) if b.dtype == torch.bfloat16 else b,
        ), n
    return out


def _stage_list(root: str, layouts: list[str]) -> list[tuple[str, Any]]:
    return [(lay, lambda lay=lay: _stage_case(root, lay)) for lay in layouts]


def stage_cases(root: str, layouts: list[str]) -> dict[str, object]:
    return run_cases(_stage_list(root, layouts))


def _empty_rows(root: str) -> None:
    """Ranks 2 and 3 hold no column of a [2, 1] tensor and no row of it after the row move."""
    from safetensors.torch import load_file
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from unickpt.io import CheckpointIO

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = torch.nn.Module()
    full = torch.tensor([[3.0], [5.0]])
    m.w = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(1)]))
    m.b = torch.nn.Parameter(distribute_tensor(torch.arange(8.0).reshape(2, 4), mesh, [Shard(1)]))
    io = CheckpointIO(mesh=mesh)
    path = os.path.join(root, "rows")
    io.save_model(m, path, shard=False, use_async=True)
    io.wait()
    got = load_file(os.path.join(path, "model.safetensors"))
    assert torch.equal(got["w"], full) and torch.equal(got["b"], torch.arange(8.0).reshape(2, 4)), got


def _one_writer(root: str) -> None:
    """A DDP model of one 2-element tensor: rank 0 writes it, the other ranks nothing."""
    from unickpt.plugins.ddp import DDPCheckpointIO

    m = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[1.5, -2.0]]))
    io = DDPCheckpointIO(check_replicas="raise")
    for name, kw in (("sliced", {"gather_dtensor": False}), ("gathered", {})):
        path = os.path.join(root, name)
        io.save_model(m, path, shard=True, use_async=True, **kw)
        io.wait()
        back = torch.nn.Linear(2, 1, bias=False)
        io.load_model(back, path)
        assert torch.equal(back.weight, m.weight), (back.weight, m.weight)


def _diverged(root: str) -> dict[str, str]:
    """Replicas that differ, and a parameter frozen on rank 1 only, refused from the staged copy."""
    from unickpt.errors import DistributedError
    from unickpt.plugins.ddp import DDPCheckpointIO
    from unickpt.wrappers import OptimizerWrapper

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 10), torch.nn.Linear(10, 3))
    if dist.get_rank() == 1:
        with torch.no_grad():
            model[0].weight[3, 1] += 1.0
    io = DDPCheckpointIO(check_replicas="raise")
    out: dict[str, str] = {}
    io.save_model(model, os.path.join(root, "differ"), shard=True, gather_dtensor=False, use_async=True)
    try:
        io.wait()
    except DistributedError as e:
        out["differ"] = str(e)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 10), torch.nn.Linear(10, 3))
    if dist.get_rank() == 1:
        model[0].bias.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    io.save_optimizer(OptimizerWrapper(opt, model), os.path.join(root, "missing"), shard=True, use_async=True)
    try:
        io.wait()
    except DistributedError as e:
        out["missing"] = str(e)
    return out


def _idle_list(root: str) -> list[tuple[str, Any]]:
    cases: list[tuple[str, Any]] = [("one_writer", lambda: _one_writer(root))]
    if dist.get_world_size() >= 4:
        cases.append(("empty_rows", lambda: _empty_rows(root)))
    else:
        cases.append(("diverged", lambda: _diverged(root)))
    return cases


def idle_cases(root: str) -> dict[str, object]:
    return run_cases(_idle_list(root))


def _retention(root: str, async_save: bool) -> dict[str, Any]:
    """keep_last=1 with a slow, then a failing deletion on rank 0: the other ranks do not wait."""
    import time
    import warnings

    from unickpt.manager import CheckpointManager, RetentionWarning

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    run = os.path.join(root, f"run-{async_save}")
    mgr = CheckpointManager(run, save_steps=1, keep_last=1, async_save=async_save)
    real = mgr.storage.remove_step

    def slow(step: int) -> None:
        time.sleep(SLOW_DELETE_S)
        real(step)

    def failing(step: int) -> None:
        raise OSError(5, "injected deletion failure", os.path.join(run, f"step-{step}"))

    def save(step: int) -> float:
        t0 = time.monotonic()
        mgr.save(step, model, None)
        mgr.wait()
        return time.monotonic() - t0

    out: dict[str, Any] = {"first": save(1)}
    if dist.get_rank() == 0:
        mgr.storage.remove_step = slow  # type: ignore[method-assign]
    out["slow"] = save(2)
    dist.barrier()
    out["after_slow"] = sorted(mgr.all_steps())
    if dist.get_rank() == 0:
        mgr.storage.remove_step = failing  # type: ignore[method-assign]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save(3)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RetentionWarning)]
    dist.barrier()
    out["after_failed"] = sorted(mgr.all_steps())
    mgr.storage.remove_step = real  # type: ignore[method-assign]
    save(4)
    dist.barrier()
    out["after_retry"] = sorted(mgr.all_steps())
    return out


SLOW_DELETE_S = 8.0


def _retention_list(root: str) -> list[tuple[str, Any]]:
    # An async step's retention runs in its writer process, which this process's slow deletion
    # (a local function) cannot reach: the synchronous save is the case measured here.
    return [(f"async={a}", lambda a=a: _retention(root, a)) for a in (False,)]


_OPS = (
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "send",
    "recv",
    "all_to_all_single",
    "gather",
    "scatter",
    "all_reduce",
)


def _cpu_routes(root: str) -> dict[str, Any]:
    """The world stands for a pure NCCL group (no CPU backend): every collective of a save, a load
    and an async save (CheckpointIO and CheckpointManager) must run on its gloo twin or on a
    background group, and the twin must be made at setup, on the main thread."""
    import threading

    from _pp_zero_hybrid_worker import make_model, make_optimizer

    from unickpt import _dist
    from unickpt.booster import Booster
    from unickpt.manager import CheckpointManager
    from unickpt.plugins.ddp import DDPPlugin

    world = dist.group.WORLD
    real = {op: getattr(dist, op) for op in _OPS}
    real_new_group = dist.new_group
    real_capable = _dist._cpu_capable
    made: list[tuple[str, str, Any]] = []
    calls: list[tuple[str, str, bool]] = []
    recording = False

    def new_group(*a: Any, **kw: Any) -> Any:
        g = real_new_group(*a, **kw)
        made.append((threading.current_thread().name, "setup" if not recording else "save", g))
        return g

    def wrap(op: str) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            g = kw.get("group")
            if recording:
                calls.append((op, threading.current_thread().name, g is None or g is world))
            return real[op](*a, **kw)

        return call

    try:
        _dist._cpu_capable = lambda g: g is not None and g is not world and real_capable(g)  # type: ignore[assignment]
        dist.new_group = new_group  # type: ignore[assignment]
        for op in _OPS:
            setattr(dist, op, wrap(op))
        booster = Booster(DDPPlugin())
        plain = make_model(0)
        model, optim, *_ = booster.boost(plain, make_optimizer(plain))
        mgr = CheckpointManager(
            os.path.join(root, "run"), booster, save_steps=1, keep_last=1, async_save=True
        )
        twin = _dist.cpu_group(None)
        assert twin is not None and twin is not world
        recording = True
        io = booster.checkpoint_io
        for name, kw in (("sliced", {"gather_dtensor": False}), ("gathered", {})):
            path = os.path.join(root, name)
            io.save_model(model, path, shard=True, **kw)
            booster.load_model(model, path)
            io.save_model(model, path + "-async", shard=True, use_async=True, **kw)
            io.wait()
            booster.load_model(model, path + "-async")
        io.save_optimizer(optim, os.path.join(root, "o"), shard=True, use_async=True)
        io.wait()
        booster.load_optimizer(optim, os.path.join(root, "o"))
        for step in (1, 2):
            mgr.save(step, model, optim)
        mgr.wait()
        mgr.load(model, optim)
    finally:
        recording = False
        _dist._cpu_capable = real_capable  # type: ignore[assignment]
        dist.new_group = real_new_group  # type: ignore[assignment]
        for op, fn in real.items():
            setattr(dist, op, fn)
    on_world = [(op, t) for op, t, w in calls if w]
    assert not on_world, f"collectives on the NCCL group: {on_world[:20]}"
    twins = [g for _, _, g in made if g is twin]
    return {
        "calls": len(calls),
        "background_calls": sum(1 for _, t, _ in calls if t != "MainThread"),
        "made": [(t, when) for t, when, _ in made],
        "twins": len(twins),
        "twin_at_setup": [when for _, when, g in made if g is twin],
    }


def two_rank_cases(root: str) -> dict[str, object]:
    """Every case set of make test's 2-rank tests in one world (each world costs seconds to start),
    named ``SET/CASE``, each set in a directory of its own; the routes last: they take the world
    for a group without a CPU backend."""
    sets = {
        "stage": _stage_list(os.path.join(root, "stage"), ["ddp", "fsdp2x2"]),
        "idle": _idle_list(os.path.join(root, "idle")),
        "retention": _retention_list(os.path.join(root, "retention")),
        "routes": [("cpu_routes", lambda: _cpu_routes(os.path.join(root, "routes")))],
    }
    return run_cases([(f"{set_}/{name}", fn) for set_, cases in sets.items() for name, fn in cases])
