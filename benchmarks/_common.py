"""Shared pieces of the benchmark suite: synthetic state, timing, page cache, peak RSS, probes.

Everything here is used both by the orchestrator (benchmarks/run.py) and by the case
subprocesses it starts (single-process cases and the ranks of distributed worlds), so
imports of torch and unickpt stay inside functions where they are optional.
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Benchmark the working tree's unickpt even when it is not pip-installed.
REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

MiB = 1 << 20
GiB = 1 << 30
RESULT_PREFIX = "BENCHRESULT "


# --------------------------------------------------------------------------------------------
# Synthetic state: a transformer-like stack of blocks, each block one dtype (FSDP2 wants one
# dtype per parameter group), fp32 and bf16 alternating, sizes from a few KB to ~1/8 of total.
# Some dims are odd so 4-way and 2-way Shard(0) splits are uneven.
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str  # FQN relative to the root module, e.g. "layers.3.mlp_up.weight"
    shape: tuple[int, ...]
    dtype: str  # "float32" | "bfloat16"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * (4 if self.dtype == "float32" else 2)


def state_spec(size_mb: float) -> list[TensorSpec]:
    """Tensors summing to about ``size_mb`` MiB (never less than one layer)."""
    target = int(size_mb * MiB)
    hidden = 1024 if size_mb >= 512 else (512 if size_mb >= 48 else 256)
    ffn = 4 * hidden + 3  # odd on purpose: uneven shards
    vocab = max(1001, (target // 8) // (hidden * 4)) | 1  # embedding ~1/8 of the bytes, fp32
    specs = [TensorSpec("embed.weight", (vocab, hidden), "float32")]
    used = specs[0].nbytes
    i = 0
    while used < target:
        if used > 0.9 * target and i > 0:
            break
        dt = "float32" if i % 2 == 0 else "bfloat16"
        p = f"layers.{i}."
        layer = [
            TensorSpec(p + "norm1.weight", (hidden,), dt),
            TensorSpec(p + "qkv.weight", (3 * hidden, hidden), dt),
            TensorSpec(p + "qkv.bias", (3 * hidden,), dt),
            TensorSpec(p + "proj.weight", (hidden, hidden), dt),
            TensorSpec(p + "norm2.weight", (hidden,), dt),
            TensorSpec(p + "mlp_up.weight", (ffn, hidden), dt),
            TensorSpec(p + "mlp_up.bias", (ffn,), dt),
            TensorSpec(p + "mlp_down.weight", (hidden, ffn), dt),
        ]
        specs.extend(layer)
        used += sum(t.nbytes for t in layer)
        i += 1
    return specs


def spec_bytes(specs: list[TensorSpec]) -> int:
    return sum(t.nbytes for t in specs)


def build_model(specs: list[TensorSpec], device: str = "cpu", fill: str = "random", seed: int = 0) -> Any:
    """An ``nn.Module`` whose state_dict is exactly ``specs``.

    ``fill``: "random" (seeded uniform values; real bit patterns for hashing), "zeros"
    (touched pages, for load destinations), "none" (``device="meta"`` or uninitialised).
    Top-level children are "embed" and "layers.<i>", each of one dtype.
    """
    import torch
    from torch import nn

    root = nn.Module()
    layers = nn.ModuleList()
    root.add_module("layers", layers)
    groups: dict[str, nn.Module] = {}
    for t in specs:
        parts = t.name.split(".")
        if parts[0] == "layers":
            idx = int(parts[1])
            while len(layers) <= idx:
                layers.append(nn.Module())
            owner: nn.Module = layers[idx]
            rest = parts[2:]
        else:
            if parts[0] not in groups:
                groups[parts[0]] = nn.Module()
                root.add_module(parts[0], groups[parts[0]])
            owner = groups[parts[0]]
            rest = parts[1:]
        for sub in rest[:-1]:
            if not hasattr(owner, sub):
                owner.add_module(sub, nn.Module())
            owner = getattr(owner, sub)
        dtype = torch.float32 if t.dtype == "float32" else torch.bfloat16
        p = nn.Parameter(torch.empty(t.shape, dtype=dtype, device=device), requires_grad=True)
        owner.register_parameter(rest[-1], p)
    if device != "meta":
        fill_model(root, fill, seed)
    return root


def fill_model(model: Any, fill: str, seed: int = 0) -> None:
    """Fill every parameter (or its local shard, for DTensors) in place."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            if fill == "random":
                if local.dtype == torch.float32:
                    local.uniform_(-1.0, 1.0, generator=gen)
                else:
                    local.copy_(torch.empty(local.shape).uniform_(-1.0, 1.0, generator=gen))
            elif fill == "zeros":
                local.fill_(0)


def plain_state(model: Any) -> dict[str, Any]:
    """Detached tensors of the model's state_dict (what non-model-aware tools save)."""
    return {k: v.detach() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------------------------
# Files: fsync, page cache, sizes
# --------------------------------------------------------------------------------------------


def iter_files(path: str | Path) -> Iterator[Path]:
    p = Path(path)
    if p.is_file():
        yield p
    elif p.is_dir():
        for q in sorted(p.rglob("*")):
            if q.is_file():
                yield q


def tree_bytes(path: str | Path) -> int:
    return sum(f.stat().st_size for f in iter_files(path))


def fsync_tree(path: str | Path) -> None:
    """fsync every file below ``path`` and the directories (cheap if the tool already did)."""
    p = Path(path)
    for f in iter_files(p):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    dirs = [p] if p.is_dir() else [p.parent]
    if p.is_dir():
        dirs += [d for d in p.rglob("*") if d.is_dir()]
    for d in dirs:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def drop_cache_tree(path: str | Path) -> None:
    """Evict the files' clean pages from this kernel's page cache (posix_fadvise DONTNEED).

    /proc/sys/vm/drop_caches is not writable in this container; DONTNEED after fsync is the
    per-file equivalent. A hypervisor may still cache the virtual disk below us.
    """
    for f in iter_files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rm(path: str | Path) -> None:
    p = Path(path)
    if p.is_dir():
        shutil.rmtree(p, ignore_errors=True)
    elif p.exists():
        p.unlink()


# --------------------------------------------------------------------------------------------
# Memory: peak RSS of this process, resettable per phase (Linux >= 4.0, /proc/self/clear_refs)
# --------------------------------------------------------------------------------------------


def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def rss_mb() -> float:
    return _status_kb("VmRSS") / 1024


def peak_rss_mb() -> float:
    return _status_kb("VmHWM") / 1024


def reset_peak_rss() -> None:
    """Set VmHWM back to the current RSS so the next phase's peak is its own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def timed_reps(
    reps: int, body: Callable[[], Any], before: Callable[[], Any] | None = None, warmup: int = 1
) -> tuple[list[float], list[float]]:
    """Run ``before`` (untimed) then ``body`` (timed), ``warmup`` + ``reps`` times.

    Returns (times of the counted reps, times of the warm-up reps). The warm-up absorbs
    one-time costs (lazy imports, allocator growth) that every tool pays once per process;
    it is reported separately as the "first call" time, never hidden.
    """
    times: list[float] = []
    for _ in range(warmup + reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        body()
        times.append(time.perf_counter() - t0)
    return times[warmup:], times[:warmup]


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def gib_s(nbytes: int, seconds: float) -> float:
    return nbytes / GiB / seconds if seconds > 0 else float("nan")


def emit(result: dict[str, Any]) -> None:
    """Hand a case's result to the orchestrator (one line on stdout)."""
    print(RESULT_PREFIX + json.dumps(result), flush=True)


# --------------------------------------------------------------------------------------------
# Probes: which unickpt features exist yet. Each returns (thing or None, reason).
# --------------------------------------------------------------------------------------------


def _try(fn: Callable[[], Any]) -> tuple[Any, str]:
    try:
        return fn(), ""
    except Exception as e:
        return None, f"{type(e).__name__}: {e}".splitlines()[0][:160]


def probe_general_io() -> tuple[Any, str]:
    def get() -> Any:
        from unickpt import GeneralCheckpointIO

        return GeneralCheckpointIO

    return _try(get)


HASH_KW_CANDIDATES = ("hashes", "hash", "compute_hashes", "with_hashes", "checksums", "hashing")
FP_KW_CANDIDATES = ("fingerprints", "fingerprint", "compute_fingerprints")


def probe_hash_switch(io_cls: Any, hashes: bool, fingerprints: bool) -> tuple[dict[str, Any] | None, str]:
    """How to turn hashes/fingerprints on or off: {"ctor": {...}, "save": {...}} keyword arguments.

    Looks at the CheckpointIO constructor first, then at save_model. Returns None and a reason
    if there is no such switch.
    """
    where: dict[str, dict[str, Any]] = {"ctor": {}, "save": {}}
    for slot, fn in (("ctor", io_cls.__init__), ("save", io_cls.save_model)):
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            continue
        for cands, val in ((HASH_KW_CANDIDATES, hashes), (FP_KW_CANDIDATES, fingerprints)):
            for name in cands:
                if name in params and not any(name in d for d in where.values()):
                    where[slot][name] = val
                    break
    found = {k for d in where.values() for k in d}
    if not found & set(HASH_KW_CANDIDATES):
        return None, "no hashes on/off keyword on the CheckpointIO constructor or save_model"
    if not fingerprints and not found & set(FP_KW_CANDIDATES):
        return None, "no fingerprints on/off keyword on the CheckpointIO constructor or save_model"
    return where, ""


def probe_fsdp2_io() -> tuple[Any, str]:
    def get() -> Any:
        try:
            from unickpt.plugins.fsdp2 import FSDP2CheckpointIO
        except ImportError:
            from unickpt.plugins import FSDP2CheckpointIO  # type: ignore[no-redef]
        return FSDP2CheckpointIO

    return _try(get)


def probe_merge() -> tuple[Any, str]:
    def get() -> Any:
        from unickpt import merge_checkpoint

        return merge_checkpoint

    return _try(get)


def probe_manager() -> tuple[Any, str]:
    def get() -> Any:
        from unickpt import Booster, CheckpointManager

        return CheckpointManager, Booster

    return _try(get)


def probe_hashing() -> tuple[Any, str]:
    def get() -> Any:
        from unickpt.spec import hashing

        for name in ("slice_hash", "fingerprint_of_array"):
            if not hasattr(hashing, name):
                raise AttributeError(f"unickpt.spec.hashing has no {name}")
        return hashing

    return _try(get)


def consolidate_fn() -> tuple[Any, str]:
    def get() -> Any:
        from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files

        return consolidate_safetensors_files

    return _try(get)


# --------------------------------------------------------------------------------------------
# Machine description
# --------------------------------------------------------------------------------------------


def machine_info(workdir: str) -> dict[str, Any]:
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem_gb = 0.0
    try:
        with open("/proc/meminfo") as f:
            mem_gb = int(f.readline().split()[1]) / 1024 / 1024
    except OSError:
        pass
    fs = ""
    try:
        st = os.statvfs(workdir)
        fs = f"{st.f_bavail * st.f_frsize / GiB:.0f} GiB free"
        with open("/proc/mounts") as f:
            best = ""
            for line in f:
                dev, mnt, typ = line.split()[:3]
                if os.path.realpath(workdir).startswith(mnt) and len(mnt) >= len(best):
                    best, fs = mnt, f"{dev} ({typ}) on {mnt}, " + fs
    except OSError:
        pass
    versions: dict[str, str] = {}
    for mod in ("torch", "safetensors", "xxhash", "numpy"):
        try:
            versions[mod] = __import__(mod).__version__
        except Exception:
            versions[mod] = "missing"
    with contextlib.suppress(Exception):
        versions["xxhash"] = __import__("xxhash").VERSION
    with contextlib.suppress(Exception):
        versions["unickpt fingerprint kernel"] = __import__(
            "unickpt.spec.hashing", fromlist=["KERNEL"]
        ).KERNEL
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "mem_gib": round(mem_gb, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "disk": fs,
        "versions": versions,
    }
