"""Single-process benchmark cases. Each runs in its own fresh subprocess (see run.py), so the
peak RSS it reports (VmHWM) belongs to that case alone.

A case returns a dict: status ("ok" | "skipped" | "error"), reason, bytes, times (seconds,
one per repetition), rss_base_mb (RSS after imports and state construction), rss_peak_mb
(VmHWM over the timed phase, reset just before it), extra (case-specific figures).

Every save time includes fsync of everything written (by the tool or, if the tool does not
fsync, by the harness right after the call), so all saves are compared at the same
durability. Every load starts with the files' pages evicted from the page cache
(posix_fadvise DONTNEED after fdatasync); see _common.drop_cache_tree.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import _common as C

CaseFn = Callable[[dict[str, Any]], dict[str, Any]]
CASES: dict[str, CaseFn] = {}


def case(name: str) -> Callable[[CaseFn], CaseFn]:
    def deco(fn: CaseFn) -> CaseFn:
        CASES[name] = fn
        return fn

    return deco


def skipped(reason: str) -> dict[str, Any]:
    return {"status": "skipped", "reason": reason}


Pair = tuple[Callable[[], Any], Callable[[], Any]]


def _measure(
    p: dict[str, Any],
    body: Callable[[], Any],
    before: Callable[[], Any] | None,
    nbytes: int,
    paired: Pair | None = None,
) -> dict[str, Any]:
    """Time ``body``; with ``paired`` = (raw_body, raw_before), run the raw-disk reference right
    before every timed repetition, so each tool time has a disk-limit time taken seconds apart
    (the machine drifts by 2x over minutes; pairs cancel most of it)."""
    base = C.rss_mb()
    C.reset_peak_rss()
    raw_times: list[float] = []
    if paired is None:
        times, first = C.timed_reps(int(p["reps"]), body, before, warmup=int(p.get("warmup", 1)))
    else:
        _, first = C.timed_reps(0, body, before, warmup=int(p.get("warmup", 1)))
        peak = C.peak_rss_mb()
        times = []
        for _ in range(int(p["reps"])):
            r, _ = C.timed_reps(1, paired[0], paired[1], warmup=0)
            # The reference's own buffers must not count toward the tool's peak RSS.
            C.reset_peak_rss()
            t, _ = C.timed_reps(1, body, before, warmup=0)
            peak = max(peak, C.peak_rss_mb())
            raw_times += r
            times += t
    out: dict[str, Any] = {
        "status": "ok",
        "bytes": nbytes,
        "times": times,
        "first_s": first,
        "rss_base_mb": round(base, 1),
        "rss_peak_mb": round(C.peak_rss_mb() if paired is None else peak, 1),
    }
    if raw_times:
        out["paired_raw_times"] = raw_times
        out["x_raw_paired"] = C.median([r / t for r, t in zip(raw_times, times, strict=True)])
    return out


def _pair_write(p: dict[str, Any], views: list[Any]) -> Pair:
    """Raw write + fsync of the same bytes (the disk's limit for this save)."""
    out = Path(p["workdir"]) / "paired_raw.bin"

    def body() -> None:
        with open(out, "wb", buffering=0) as f:
            for v in views:
                f.write(memoryview(v))
            os.fsync(f.fileno())
        C.fsync_tree(out.parent)

    return body, lambda: C.rm(out)


_READ_BUF: Any = None


def _pair_read(src: Path) -> Pair:
    """Raw read of the tool's own files, page cache dropped (the disk's limit for this load)."""
    import numpy as np

    global _READ_BUF
    if _READ_BUF is None:
        _READ_BUF = np.empty(64 * C.MiB, dtype=np.uint8)
    mv = memoryview(_READ_BUF)

    def body() -> None:
        for f in C.iter_files(src):
            with open(f, "rb", buffering=0) as fh:
                while fh.readinto(mv):
                    pass

    return body, lambda: C.drop_cache_tree(src)


def _source_state(p: dict[str, Any], fill: str = "random") -> tuple[Any, dict[str, Any], int]:
    specs = C.state_spec(float(p["size_mb"]))
    model = C.build_model(specs, fill=fill, seed=int(p.get("seed", 0)))
    return model, C.plain_state(model), C.spec_bytes(specs)


def _byte_view(t: Any) -> Any:
    import torch

    return t.detach().reshape(-1).view(torch.uint8).numpy()


# ------------------------------------------------------------------------------ raw disk limit


@case("raw_save")
def raw_save(p: dict[str, Any]) -> dict[str, Any]:
    _, state, nbytes = _source_state(p)
    out = Path(p["workdir"]) / "raw" / "state.bin"
    out.parent.mkdir(parents=True, exist_ok=True)
    views = [_byte_view(t) for t in state.values()]

    def body() -> None:
        with open(out, "wb", buffering=0) as f:
            for v in views:
                f.write(memoryview(v))
            os.fsync(f.fileno())
        C.fsync_tree(out.parent)

    return _measure(p, body, lambda: C.rm(out), nbytes)


@case("raw_load")
def raw_load(p: dict[str, Any]) -> dict[str, Any]:
    _, state, nbytes = _source_state(p, fill="zeros")
    src = Path(p["workdir"]) / "raw" / "state.bin"
    if not src.exists():
        return skipped("raw_save output missing")
    views = [_byte_view(t) for t in state.values()]

    def body() -> None:
        with open(src, "rb", buffering=0) as f:
            for v in views:
                mv = memoryview(v)
                got = 0
                while got < len(mv):
                    n = f.readinto(mv[got:])
                    if not n:
                        raise EOFError(src)
                    got += n

    return _measure(p, body, lambda: C.drop_cache_tree(src), nbytes)


def _copy_files(src: Path, out: Path) -> None:
    out.mkdir(parents=True)
    for f in C.iter_files(src):
        dst = out / f.relative_to(src)
        dst.parent.mkdir(parents=True, exist_ok=True)
        # In-kernel copy, as coreutils cp does (no user-space buffer): the best plain copy.
        with open(f, "rb", buffering=0) as fi, open(dst, "wb", buffering=0) as fo:
            left = f.stat().st_size
            while left > 0:
                n = os.copy_file_range(fi.fileno(), fo.fileno(), left)
                if n <= 0:
                    raise OSError(f"copy_file_range returned {n} copying {f}")
                left -= n
    C.fsync_tree(out)


@case("copy")
def copy_tree(p: dict[str, Any]) -> dict[str, Any]:
    """Plain copy of a checkpoint's files + fsync: the floor for merge (read + write)."""
    src, out = Path(p["src"]), Path(p["out"])
    if not src.exists():
        return skipped(f"source missing: {src.name}")
    nbytes = C.tree_bytes(src)

    def body() -> None:
        _copy_files(src, out)

    def before() -> None:
        C.rm(out)
        C.drop_cache_tree(src)

    return _measure(p, body, before, nbytes)


# ------------------------------------------------------------------------------ safetensors


@case("safetensors_save")
def st_save(p: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import save_file

    _, state, nbytes = _source_state(p)
    out = Path(p["workdir"]) / "safetensors" / "model.safetensors"
    out.parent.mkdir(parents=True, exist_ok=True)

    def body() -> None:
        save_file(state, str(out), metadata={"format": "pt"})
        C.fsync_tree(out.parent)

    views = [_byte_view(t) for t in state.values()]
    return _measure(p, body, lambda: C.rm(out), nbytes, _pair_write(p, views))


@case("safetensors_load")
def st_load(p: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    src = Path(p["workdir"]) / "safetensors" / "model.safetensors"
    if not src.exists():
        return skipped("safetensors_save output missing")
    model, _, nbytes = _source_state(p, fill="zeros")

    def body() -> None:
        # What users do: read the file, then copy into the model (load_file may hand back
        # lazily faulted pages; the copy makes every byte arrive).
        model.load_state_dict(load_file(str(src)), strict=True)

    return _measure(p, body, lambda: C.drop_cache_tree(src), nbytes, _pair_read(src))


# ------------------------------------------------------------------------------ torch.save


@case("torch_save")
def torch_save(p: dict[str, Any]) -> dict[str, Any]:
    import torch

    _, state, nbytes = _source_state(p)
    out = Path(p["workdir"]) / "torch" / "model.pt"
    out.parent.mkdir(parents=True, exist_ok=True)

    def body() -> None:
        torch.save(state, str(out))
        C.fsync_tree(out.parent)

    views = [_byte_view(t) for t in state.values()]
    return _measure(p, body, lambda: C.rm(out), nbytes, _pair_write(p, views))


@case("torch_load")
def torch_load(p: dict[str, Any]) -> dict[str, Any]:
    import torch

    src = Path(p["workdir"]) / "torch" / "model.pt"
    if not src.exists():
        return skipped("torch_save output missing")
    model, _, nbytes = _source_state(p, fill="zeros")

    def body() -> None:
        model.load_state_dict(torch.load(str(src), weights_only=True), strict=True)

    return _measure(p, body, lambda: C.drop_cache_tree(src), nbytes, _pair_read(src))


# ------------------------------------------------------------------------------ torch DCP


@case("dcp_save")
def dcp_save(p: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch.distributed.checkpoint as dcp

    _, state, nbytes = _source_state(p)
    out = Path(p["workdir"]) / "dcp"

    def body() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(state, checkpoint_id=str(out))
        C.fsync_tree(out)

    views = [_byte_view(t) for t in state.values()]
    return _measure(p, body, lambda: C.rm(out), nbytes, _pair_write(p, views))


@case("dcp_load")
def dcp_load(p: dict[str, Any]) -> dict[str, Any]:
    import warnings

    import torch.distributed.checkpoint as dcp

    _, state, nbytes = _source_state(p, fill="zeros")
    src = Path(p["workdir"]) / "dcp"
    if not src.exists():
        return skipped("dcp_save output missing")

    def body() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.load(state, checkpoint_id=str(src))

    return _measure(p, body, lambda: C.drop_cache_tree(src), nbytes, _pair_read(src))


# ------------------------------------------------------------------------------ unickpt


# ------------------------------------------------------------------------------ Colossal-AI (optional)


def _colossalai_io() -> tuple[Any, str]:
    """Colossal-AI's GeneralCheckpointIO when it is installed; never a dependency (it pins its own
    torch, so it lives in its own environment: run the suite from there to include it)."""
    try:
        from colossalai.checkpoint_io import GeneralCheckpointIO
    except Exception as e:  # ImportError, or an import-time failure of its CUDA extensions
        return None, f"not installed ({type(e).__name__}: {str(e)[:80]}); optional: pip install colossalai"
    return GeneralCheckpointIO, ""


def _supported(fn: Any, **kwargs: Any) -> dict[str, Any]:
    import inspect

    params = inspect.signature(fn).parameters
    return {k: v for k, v in kwargs.items() if k in params}


@case("colossalai_save")
def colossalai_save(p: dict[str, Any]) -> dict[str, Any]:
    io_cls, why = _colossalai_io()
    if io_cls is None:
        return skipped(why)
    model, _, nbytes = _source_state(p)
    out = Path(p["workdir"]) / "colossalai"
    io = io_cls()
    kw = _supported(io.save_model, shard=True, size_per_shard=int(p["shard_mb"]), use_safetensors=True)

    def body() -> None:
        io.save_model(model, str(out), **kw)
        C.fsync_tree(out)

    views = [_byte_view(t) for t in C.plain_state(model).values()]
    return _measure(p, body, lambda: C.rm(out), nbytes, _pair_write(p, views))


@case("colossalai_load")
def colossalai_load(p: dict[str, Any]) -> dict[str, Any]:
    io_cls, why = _colossalai_io()
    if io_cls is None:
        return skipped(why)
    src = Path(p["workdir"]) / "colossalai"
    index = next(iter(src.glob("*.index.json")), None) if src.exists() else None
    if index is None:
        return skipped("colossalai_save output missing")
    model, _, nbytes = _source_state(p, fill="zeros")
    io = io_cls()

    def body() -> None:
        io.load_model(model, str(index), **_supported(io.load_model, strict=True))

    return _measure(p, body, lambda: C.drop_cache_tree(src), nbytes, _pair_read(src))


def _unickpt_dir(p: dict[str, Any]) -> Path:
    return Path(p["workdir"]) / "unickpt"


@case("unickpt_save")
def unickpt_save(p: dict[str, Any]) -> dict[str, Any]:
    io_cls, why = C.probe_general_io()
    if io_cls is None:
        return skipped(f"not available: {why}")
    hashes, fps = bool(p.get("hashes", True)), bool(p.get("fingerprints", True))
    switch, why = C.probe_hash_switch(io_cls, hashes, fps)
    if switch is None:
        if hashes and fps:
            switch = {"ctor": {}, "save": {}}  # the default is what we want
        else:
            return skipped(f"not available: {why}")
    model, _, nbytes = _source_state(p)
    out = Path(p["workdir"]) / ("unickpt" if hashes and fps else f"unickpt_h{int(hashes)}f{int(fps)}")
    io = io_cls(**switch["ctor"])

    def body() -> None:
        io.save_model(model, str(out), shard=True, size_per_shard=int(p["shard_mb"]), **switch["save"])
        C.fsync_tree(out)

    views = [_byte_view(t) for t in C.plain_state(model).values()]
    r = _measure(p, body, lambda: C.rm(out), nbytes, _pair_write(p, views))
    r["extra"] = {"files": len(list(C.iter_files(out))), "disk_bytes": C.tree_bytes(out), "switch": switch}
    if not (hashes and fps):
        C.rm(out)
    return r


@case("unickpt_load")
def unickpt_load(p: dict[str, Any]) -> dict[str, Any]:
    io_cls, why = C.probe_general_io()
    if io_cls is None:
        return skipped(f"not available: {why}")
    src = _unickpt_dir(p)
    if not src.exists():
        return skipped("unickpt_save output missing")
    model, _, nbytes = _source_state(p, fill="zeros")
    io = io_cls()

    def body() -> None:
        io.load_model(model, str(src), strict=True, verify=bool(p.get("verify", False)))

    r = _measure(p, body, lambda: C.drop_cache_tree(src), nbytes, _pair_read(src))
    # Honesty check: the loaded values are the saved ones (same seed regenerates them).
    ref, _, _ = _source_state(p)
    import torch

    sd, rsd = model.state_dict(), ref.state_dict()
    r["extra"] = {"bit_exact": all(torch.equal(sd[k], rsd[k]) for k in rsd)}
    return r


# ------------------------------------------------------------------------------ hashing


@case("hash_xxh3")
def hash_xxh3(p: dict[str, Any]) -> dict[str, Any]:
    hashing, why = C.probe_hashing()
    if hashing is None:
        return skipped(f"not available: {why}")
    _, state, nbytes = _source_state(p)
    views = [_byte_view(t) for t in state.values()]

    def body() -> None:
        for v in views:
            hashing.slice_hash(memoryview(v))

    return _measure(p, body, None, nbytes)


@case("hash_fingerprint")
def hash_fingerprint(p: dict[str, Any]) -> dict[str, Any]:
    hashing, why = C.probe_hashing()
    if hashing is None:
        return skipped(f"not available: {why}")
    _, state, nbytes = _source_state(p)
    items = [
        (k, "F32" if str(t.dtype) == "torch.float32" else "BF16", _byte_view(t), tuple(t.shape))
        for k, t in state.items()
    ]

    def body() -> None:
        for name, dt, v, shape in items:
            hashing.fingerprint_of_array(name, dt, memoryview(v), shape)

    return _measure(p, body, None, nbytes)


#: (layout, dtype, item size) of the fingerprint kernel rows: the global shape and the block's
#: offsets and shape for ``mib`` MiB of data. "cols" is a column range (the middle half) of a
#: matrix twice as wide, as a tensor-parallel shard hashes it.
FP_KERNEL_LAYOUTS = {
    "2d": lambda n: ((n // 8192, 8192), (0, 0), (n // 8192, 8192)),
    "1d": lambda n: ((n,), (0,), (n,)),
    "cols": lambda n: ((n // 8192, 16384), (0, 4096), (n // 8192, 8192)),
}


@case("hash_fp_kernel")
def hash_fp_kernel(p: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint kernel alone (``hash_block(xxh3=False)``) on one in-memory block of
    ``mib`` MiB of random bits, one thread: ``version`` 2 (fingerprint v2), ``dtype``, ``layout``.
    ``version`` 0 is the memory-read reference: numpy's sum of the same bytes as uint64."""
    hashing, why = C.probe_hashing()
    if hashing is None or not hasattr(hashing, "hash_block"):
        return skipped(f"not available: {why or 'no fingerprint kernel'}")
    if int(p["version"]) not in (0, 2):
        return skipped("fingerprint v1 is no longer computed (format version 5 carries v2)")
    import numpy as np

    isz = {"F32": 4, "BF16": 2, "F64": 8}[p["dtype"]]
    nbytes = int(p["mib"]) * C.MiB
    gshape, off, shape = FP_KERNEL_LAYOUTS[p["layout"]](nbytes // isz)
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)

    def body() -> None:
        if int(p["version"]) == 0:
            data.view(np.uint64).sum()
        else:
            hashing.hash_block(data, isz, gshape, off, shape, xxh3=False)

    r = _measure(p, body, None, nbytes)
    r["extra"] = {"kernel": hashing.KERNEL}
    return r


# ------------------------------------------------------------------------------ async save


@case("async_save")
def async_save(p: dict[str, Any]) -> dict[str, Any]:
    """CheckpointManager(async_save=True): time save() blocks vs a sync save of the same state.

    Model state only (optimizer=None): the target compares blocking with writing the same bytes.
    (With a stateless optimizer such as plain SGD, every save would also run a fake zero-gradient
    step to materialise optimizer state; see docs/performance.md.) One warm-up save per mode.
    """
    got, why = C.probe_manager()
    if got is None:
        return skipped(f"not available: {why}")
    manager_cls, booster_cls = got
    import torch

    model, _, nbytes = _source_state(p)
    try:
        booster = booster_cls()
        bmodel, *_ = booster.boost(model, torch.optim.SGD(model.parameters(), lr=0.0))
    except Exception as e:
        return skipped(f"not available: Booster().boost failed: {type(e).__name__}: {e}"[:200])
    out: dict[str, Any] = {"status": "ok", "bytes": nbytes, "extra": {}}
    base = C.rss_mb()
    C.reset_peak_rss()
    for mode in ("sync", "async"):
        root = Path(p["workdir"]) / f"manager_{mode}"
        C.rm(root)
        mgr = manager_cls(str(root), booster=booster, save_steps=1, keep_last=1, async_save=(mode == "async"))
        blocked, total = [], []
        for step in range(1 + int(p["reps"])):
            t0 = time.perf_counter()
            mgr.save(step + 1, bmodel, None, force=True)
            t1 = time.perf_counter()
            mgr.wait()
            t2 = time.perf_counter()
            blocked.append(t1 - t0)
            total.append(t2 - t0)
        out["extra"][mode] = {"blocked": blocked[1:], "total": total[1:], "first_blocked": blocked[0]}
        C.rm(root)
    out["times"] = out["extra"]["async"]["blocked"]
    out["rss_base_mb"] = round(base, 1)
    out["rss_peak_mb"] = round(C.peak_rss_mb(), 1)
    return out


# ------------------------------------------------------------------------------ offline merge


def _merge_case(p: dict[str, Any], run: Callable[[Path, Path], None]) -> dict[str, Any]:
    src, out = Path(p["src"]), Path(p["out"])
    if not src.exists():
        return skipped(f"source checkpoint missing ({src.name}); its distributed save did not run")
    nbytes = int(p.get("bytes") or C.tree_bytes(src))

    def body() -> None:
        run(src, out)
        C.fsync_tree(out)

    def before() -> None:
        C.rm(out)
        C.drop_cache_tree(src)

    # Paired reference: a plain read+write copy of the same source files, run right before
    # each repetition (the floor for any merge of these bytes, measured seconds apart).
    pair_out = out.with_name(out.name + "_paircopy")

    def pair_body() -> None:
        _copy_files(src, pair_out)

    def pair_before() -> None:
        C.rm(pair_out)
        C.drop_cache_tree(src)

    r = _measure(p, body, before, nbytes, (pair_body, pair_before))
    C.rm(pair_out)
    r["extra"] = {"out_bytes": C.tree_bytes(out)}
    return r


@case("merge_unickpt")
def merge_unickpt(p: dict[str, Any]) -> dict[str, Any]:
    fn, why = C.probe_merge()
    if fn is None:
        return skipped(f"not available: {why}")
    return _merge_case(p, lambda s, o: fn(str(s), str(o)))


@case("merge_consolidate")
def merge_consolidate(p: dict[str, Any]) -> dict[str, Any]:
    fn, why = C.consolidate_fn()
    if fn is None:
        return skipped(f"not available in this torch: {why}")
    names = [t.name for t in C.state_spec(float(p["size_mb"]))]

    def run(s: Path, o: Path) -> None:
        o.mkdir(parents=True)
        fn(str(s), str(o), {n: 1 for n in names}, num_threads=1)

    return _merge_case(p, run)


# ------------------------------------------------------------------------------ async vs a Python loop
def _async_contention(p: dict[str, Any]) -> dict[str, Any]:
    from async_contention import async_contention

    return async_contention(p)


CASES["async_contention"] = _async_contention
