"""The prepared GPU check: one process on one GPU, an FSDP2 model, unickpt beside DCP.

Run on a machine with a GPU (about 6 GB of fp32 parameters by default; the whole check stays
under 8 minutes and needs nothing beyond torch and unickpt)::

    python benchmarks/gpu_check.py --json /tmp/gpu_check.json

``--dry-run`` runs the same phases on CPU under gloo with a model of a few MB (what
``tests/unit/project/test_gpu_check.py`` runs, so that the script cannot rot on machines without a GPU).

Phases, each timed between device synchronisations and reported as one row (a failed phase is
a row with its error, and the next phase still runs):

1. ``save``: a sliced save (``shard=True, gather_dtensor=False``) beside ``dcp.save`` of the same
   state, GB/s of the state's bytes (durable: both end with their files fsynced);
2. ``load``: both checkpoints loaded in place into zeroed models, GB/s, and the loaded tensors
   compared bit for bit with the saved ones and with each other (``bitwise_equal``);
3. ``async``: a training loop (forward, backward, SGD step) timed without any save, then with
   unickpt's ``save_model(use_async=True)`` and with DCP's ``async_save`` (``DefaultStager`` with
   pinned memory) issued at the same step: how long the call blocks, how long until committed,
   and the mean step time while the save is in flight against the loop alone; unickpt's async
   checkpoint is loaded back and compared bit for bit with the state at the step it was called.
   The call's blocking time is host time (no device synchronisation: unickpt's copies run on a
   side stream and the first optimizer step waits for them, DCP's ``DefaultStager`` stages
   on a stream of its own); the steps are timed on the compute stream only
   (``first_step_s``: the step right after the call, which waits for unickpt's copies);
4. ``pool``: the host memory held for async snapshots: unickpt's pool (``unickpt.io.pinned``:
   exact sizes, ``cudaHostRegister``) after two more async saves of the same state against the
   state's bytes (``held_ratio``; 1.0 is exact), the buffers the second save allocated (0: reused),
   what ``release_staging()`` freed, and the CUDA caching host allocator's pinned bytes
   (``torch.empty(pin_memory=True)`` rounds to powers of two) where torch reports them.

The ``load`` phase loads into CUDA tensors through unickpt's device loader
(``unickpt/io/load.py``: two pinned host buffers, one non-blocking host-to-device copy a
chunk, casts on the device).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack(nn.Module):
    """``layers`` square Linear layers of width ``width`` (no bias), and a small head."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width, bias=False) for _ in range(layers))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x)


def _sync(device: torch.device, whole: bool = True) -> None:
    """Wait for the device: every stream (``whole``), or the compute stream only."""
    if device.type != "cuda":
        return
    if whole:
        torch.cuda.synchronize(device)
    else:
        torch.cuda.current_stream(device).synchronize()


def _local(t: torch.Tensor) -> torch.Tensor:
    to_local = getattr(t, "to_local", None)
    return (to_local() if to_local is not None else t).detach()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return _local(t).contiguous().view(-1).view(torch.uint8)


def _state_bytes(model: nn.Module) -> int:
    return sum(_local(v).numel() * _local(v).element_size() for v in model.state_dict().values())


def _equal(a: nn.Module, b: dict[str, torch.Tensor]) -> bool:
    sa = a.state_dict()
    return set(sa) == set(b) and all(torch.equal(_bits(sa[k]), b[k]) for k in b)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


def _timed(device: torch.device, fn: Callable[[], Any], whole: bool = True) -> float:
    _sync(device, whole)
    t0 = time.perf_counter()
    fn()
    _sync(device, whole)
    return time.perf_counter() - t0


def _host_pinned_bytes() -> int | None:
    """The CUDA caching host allocator's pinned bytes in use, where torch reports them."""
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    try:
        got = stats()
    except Exception:
        return None
    for key in ("reserved_bytes.current", "allocated_bytes.current", "allocated_bytes.all.current"):
        if key in got:
            return int(got[key])
    return None


def _row(rows: list[dict[str, Any]], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    t0 = time.perf_counter()
    try:
        row = {"phase": name, "status": "ok", **fn()}
    except Exception as e:  # a failed phase is reported, and the next one still runs
        row = {"phase": name, "status": "failed", "error": f"{type(e).__name__}: {e}"[:2000]}
    row["wall_s"] = round(time.perf_counter() - t0, 3)
    rows.append(row)
    print(json.dumps(row), flush=True)


def _boosted(width: int, layers: int, seed: int) -> tuple[Any, Any, Any]:
    from unickpt import Booster
    from unickpt.plugins import FSDP2Plugin

    torch.manual_seed(seed)
    model = Stack(width, layers)
    booster = Booster(plugin=FSDP2Plugin())
    bmodel, optim, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=1e-4))
    return booster, bmodel, optim


def _zero(model: nn.Module) -> None:
    with torch.no_grad():
        for v in model.state_dict().values():
            _local(v).zero_()


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    device_kind = "cpu" if args.dry_run else "cuda"
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    if args.dry_run:
        dist.init_process_group("gloo")
    # else: the plugin makes the group (torch's default backend map: nccl for CUDA, gloo for CPU)

    width = args.width
    layers = max(1, int(args.gb * 2**30 // (width * width * 4)))
    booster, model, optim = _boosted(width, layers, seed=0)
    device = next(model.unwrap().parameters()).device
    if device.type != device_kind:
        raise SystemExit(f"the model trains on {device}, expected {device_kind}")
    nbytes = _state_bytes(model)
    saved = {k: _bits(v).clone() for k, v in model.state_dict().items()}
    work = Path(args.workdir or tempfile.mkdtemp(prefix="unickpt-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "state_bytes": nbytes,
        "layers": layers,
        "width": width,
        "rows": rows,
    }
    gb = nbytes / 1e9
    u_dir, d_dir = work / "unickpt", work / "dcp"

    def save() -> dict[str, Any]:
        t_u = _timed(device, lambda: booster.save_model(model, str(u_dir), shard=True, gather_dtensor=False))

        def dcp_save() -> None:
            dcp.save(get_model_state_dict(model.unwrap()), checkpoint_id=str(d_dir))
            _fsync_tree(d_dir)

        t_d = _timed(device, dcp_save)
        return {
            "unickpt_s": t_u,
            "dcp_s": t_d,
            "unickpt_gb_s": gb / t_u,
            "dcp_gb_s": gb / t_d,
            "ratio": t_d / t_u,
        }

    def load() -> dict[str, Any]:
        _, m_u, _ = _boosted(width, layers, seed=1)
        _zero(m_u)
        t_u = _timed(device, lambda: booster.load_model(m_u, str(u_dir)))
        _, m_d, _ = _boosted(width, layers, seed=2)
        _zero(m_d)
        t_d = _timed(device, lambda: dcp.load(get_model_state_dict(m_d.unwrap()), checkpoint_id=str(d_dir)))
        from_dcp = {k: _bits(v).clone() for k, v in m_d.state_dict().items()}
        return {
            "unickpt_s": t_u,
            "dcp_s": t_d,
            "unickpt_gb_s": gb / t_u,
            "dcp_gb_s": gb / t_d,
            "ratio": t_d / t_u,
            "bitwise_equal": _equal(m_u, saved) and _equal(m_u, from_dcp),
            "dcp_bitwise_equal": _equal(m_d, saved),
        }

    x = torch.randn(args.batch, width, device=device)

    def step() -> None:
        optim.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        optim.step()

    def loop(n: int, during: Callable[[], Any] | None = None) -> tuple[list[float], float]:
        """``n`` steps timed on the compute stream; ``during`` is called before the first
        (its blocking time, host time, is returned)."""
        times, blocked = [], 0.0
        _sync(device)
        for i in range(n):
            if i == 0 and during is not None:
                t0 = time.perf_counter()
                during()
                blocked = time.perf_counter() - t0
            times.append(_timed(device, step, whole=False))
        return times, blocked

    def async_phase() -> dict[str, Any]:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        for _ in range(args.warmup):
            step()
        base, _ = loop(args.steps)
        res: dict[str, Any] = {"step_s": sum(base) / len(base)}
        io = booster.checkpoint_io
        a_dir = work / "unickpt_async"
        at_save = {k: _bits(v).clone() for k, v in model.state_dict().items()}
        t0 = time.perf_counter()
        times, blocked = loop(
            args.steps,
            lambda: booster.save_model(model, str(a_dir), shard=True, gather_dtensor=False, use_async=True),
        )
        io.wait()
        res["unickpt"] = {
            "blocked_s": blocked,
            "committed_s": time.perf_counter() - t0,
            "first_step_s": times[0],
            "step_during_s": sum(times[1:]) / max(1, len(times) - 1),
        }
        # The async checkpoint holds the state of the step it was called at, not a later one.
        _, m_a, _ = _boosted(width, layers, seed=3)
        _zero(m_a)
        booster.load_model(m_a, str(a_dir))
        res["unickpt"]["bitwise_equal"] = _equal(m_a, at_save)
        del m_a
        stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=device.type == "cuda",
                use_shared_memory=False,
                use_async_staging=True,
                use_non_blocking_copy=device.type == "cuda",
            )
        )
        fut: list[Any] = []
        d_async = work / "dcp_async"
        t0 = time.perf_counter()
        times, blocked = loop(
            args.steps,
            lambda: fut.append(
                dcp.async_save(
                    get_model_state_dict(model.unwrap()), checkpoint_id=str(d_async), async_stager=stager
                )
            ),
        )
        resp = fut[0]
        getattr(resp, "upload_completion", resp).result()
        stager.close()
        res["dcp"] = {
            "blocked_s": blocked,
            "committed_s": time.perf_counter() - t0,
            "first_step_s": times[0],
            "step_during_s": sum(times[1:]) / max(1, len(times) - 1),
        }
        for k in ("unickpt", "dcp"):
            res[k]["step_ratio"] = res[k]["step_during_s"] / res["step_s"]
        return res

    def pool_phase() -> dict[str, Any]:
        from unickpt.io.pinned import POOL

        io = booster.checkpoint_io
        io.wait()
        held: list[int] = []
        allocations: list[int] = []
        for i in range(2):
            before = POOL.allocations
            t0 = time.perf_counter()
            booster.save_model(
                model, str(work / f"pool_{i}"), shard=True, gather_dtensor=False, use_async=True
            )
            blocked = time.perf_counter() - t0
            io.wait()
            held.append(POOL.nbytes)
            allocations.append(POOL.allocations - before)
        staged = sum(s.nbytes for s in POOL.sets() if s.tag == "model")
        res: dict[str, Any] = {
            "state_bytes": nbytes,
            "held_bytes": held[-1],
            "model_set_bytes": staged,
            "held_ratio": staged / nbytes,
            "allocations_second_save": allocations[1],
            "blocked_second_save_s": blocked,
            "caching_host_allocator_bytes": _host_pinned_bytes(),
        }
        res["released_bytes"] = io.release_staging()
        res["held_after_release"] = POOL.nbytes
        return res

    try:
        _row(rows, "save", save)
        _row(rows, "load", load)
        _row(rows, "async", async_phase)
        _row(rows, "pool", pool_phase)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="CPU, gloo, a model of a few MB")
    ap.add_argument("--gb", type=float, default=None, help="fp32 parameter bytes, in GiB (6; 0.004 dry)")
    ap.add_argument("--width", type=int, default=None, help="layer width (8192; 128 dry)")
    ap.add_argument("--batch", type=int, default=None, help="rows per step (16; 8 dry)")
    ap.add_argument("--steps", type=int, default=8, help="timed training steps per loop")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--workdir", default=None, help="scratch directory (a fresh temporary one)")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoints")
    ap.add_argument("--json", default=None, help="write the report here")
    args = ap.parse_args(argv)
    if args.gb is None:
        args.gb = 0.004 if args.dry_run else 6.0
    if args.width is None:
        args.width = 128 if args.dry_run else 8192
    if args.batch is None:
        args.batch = 8 if args.dry_run else 16
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on CPU", file=sys.stderr)
        return 2
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 0 if all(r["status"] == "ok" for r in report["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
