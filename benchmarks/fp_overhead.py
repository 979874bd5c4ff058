"""Fingerprint cost side by side, in one process (the machine drifts: only ratios within a run).

    python benchmarks/fp_overhead.py                 # 256 MiB, 7 rounds
    python benchmarks/fp_overhead.py --size-mb 473 --rounds 9 --kernel-mib 128

Part 1, the kernel alone on ``--kernel-mib`` MiB of random bits (fp32, a whole 2-D block, in
memory): every SIMD level this CPU has (each in a fresh interpreter, ``UNICKPT_FP_SIMD``), the
numpy fallback, and a plain memory read (``np.add.reduce`` of the bytes as uint64) and copy.
Part 2, end to end: ``GeneralCheckpointIO.save_model(shard=True)`` of the benchmark state with
hashes and fingerprints on, hashes only, and both off, the three interleaved in every round
(each save fsynced and removed). Prints medians, GiB/s and the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MiB = 1 << 20


def _kernel_rows(mib: int, rounds: int, numpy_too: bool) -> dict[str, float]:
    """Medians (seconds) of the kernel at the level this interpreter runs, and the references."""
    import numpy as np

    from unickpt.spec import hashing

    n = mib * MiB
    data = np.random.default_rng(0).integers(0, 256, n, dtype=np.uint8)
    dst = np.empty_like(data)
    gs = (n // 4 // 8192, 8192)
    off = (0, 0)
    rows: dict[str, Any] = {
        f"kernel {hashing.KERNEL}": lambda: hashing.hash_block(data, 4, gs, off, gs, xxh3=False),
        f"kernel {hashing.KERNEL} + xxh3": lambda: hashing.hash_block(data, 4, gs, off, gs),
        "xxh3 alone": lambda: hashing.slice_hash(memoryview(data)),
        "memory read (np.add.reduce u64)": lambda: np.add.reduce(data.view(np.uint64)),
        "memory copy (np.copyto)": lambda: np.copyto(dst, data),
    }
    if numpy_too:
        rows["numpy fallback"] = lambda: hashing.partial_numpy(memoryview(data), 4, gs, off, gs)
    times: dict[str, list[float]] = {k: [] for k in rows}
    cpu: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(rounds):
        for k, f in rows.items():
            c0, t0 = time.thread_time(), time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
            cpu[k].append(time.thread_time() - c0)
    out = {k: statistics.median(v) for k, v in times.items()}
    out.update({f"{k} [cpu]": statistics.median(v) for k, v in cpu.items()})
    return out


def kernel_part(mib: int, rounds: int) -> None:
    from unickpt.spec import hashing

    best = hashing.KERNEL
    levels = [lv for lv in ("scalar", "neon", "avx2", "avx512", "avx512-ifma") if best != "numpy"]
    levels = [lv for lv in levels if lv != ("avx2" if best == "neon" else "neon")]
    levels = levels[: levels.index(best) + 1] if best in levels else []
    medians: dict[str, float] = {}
    for i, lv in enumerate(levels):
        env = dict(os.environ, UNICKPT_FP_SIMD=lv)
        code = (
            f"import json, sys; sys.path.insert(0, {str(HERE)!r}); import fp_overhead as f; "
            f"print(json.dumps(f._kernel_rows({mib}, {rounds}, {i == 0})))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        got = json.loads(out.stdout.strip().splitlines()[-1])
        for k, v in got.items():
            if k.startswith("kernel") or k not in medians or k.startswith("numpy"):
                medians[k] = v
            else:
                medians[k] = min(medians[k], v)  # the same reference measured per level: best
    ref = medians["memory read (np.add.reduce u64)"]
    cref = medians["memory read (np.add.reduce u64) [cpu]"]
    print(f"\n## kernel, fp32 2-D block of {mib} MiB in memory, one thread, median of {rounds}\n")
    print("wall: elapsed time; cpu: the thread's CPU time (steadier where other work shares the cores)\n")
    print("| row | wall ms | wall GiB/s | x memory read | cpu ms | cpu GiB/s | x memory read |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for k, v in medians.items():
        if k.endswith("[cpu]"):
            continue
        c = medians[f"{k} [cpu]"]
        print(
            f"| {k} | {v * 1e3:.1f} | {mib / 1024 / v:.2f} | {ref / v:.2f} "
            f"| {c * 1e3:.1f} | {mib / 1024 / c:.2f} | {cref / c:.2f} |"
        )


def save_part(size_mb: float, rounds: int, shard_mb: int, where: str | None) -> None:
    import _common as C

    from unickpt import GeneralCheckpointIO

    specs = C.state_spec(size_mb)
    model = C.build_model(specs, fill="random", seed=0)
    nbytes = C.spec_bytes(specs)
    root = Path(tempfile.mkdtemp(prefix="unickpt-fpbench-", dir=where))
    modes = {
        "hashes + fingerprints": GeneralCheckpointIO(),
        "hashes, no fingerprints": GeneralCheckpointIO(fingerprints=False),
        "no hashes, no fingerprints": GeneralCheckpointIO(hashes=False, fingerprints=False),
    }
    times: dict[str, list[float]] = {k: [] for k in modes}
    cpus: dict[str, list[float]] = {k: [] for k in modes}
    try:
        for r in range(rounds + 1):  # round 0 warms up
            for k, io in modes.items():
                out = root / "ckpt"
                c0, t0 = _cpu(), time.perf_counter()
                io.save_model(model, str(out), shard=True, size_per_shard=shard_mb)
                C.fsync_tree(out)
                t, c = time.perf_counter() - t0, _cpu() - c0
                shutil.rmtree(out)
                if r:
                    times[k].append(t)
                    cpus[k].append(c)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    cmed = {k: statistics.median(v) for k, v in cpus.items()}
    off, coff = med["no hashes, no fingerprints"], cmed["no hashes, no fingerprints"]
    from unickpt.spec import hashing

    print(
        f"\n## save_model(shard=True), {nbytes / MiB:.0f} MiB in {root.parent}, median of {rounds} "
        f"interleaved rounds (kernel {hashing.KERNEL}, FP_THREADS {getattr(hashing, 'FP_THREADS', 1)})\n"
    )
    print("wall: elapsed; cpu: the process's CPU time (user + system, all threads)\n")
    print("| mode | wall s | GiB/s | / no hashes | cpu s | / no hashes |")
    print("|---|---:|---:|---:|---:|---:|")
    for k, v in med.items():
        print(
            f"| {k} | {v:.3f} | {nbytes / v / 2**30:.2f} | {v / off:.3f} | {cmed[k]:.3f} | {cmed[k] / coff:.3f} |"
        )
    on, con = med["hashes + fingerprints"], cmed["hashes + fingerprints"]
    mid, cmid = med["hashes, no fingerprints"], cmed["hashes, no fingerprints"]
    print(
        f"\nfingerprint overhead (on vs off, end to end): {(on - off) / on * 100:.1f}% of the save's wall time"
    )
    print(
        f"fingerprints alone (vs hashes only): {(on - mid) / on * 100:.1f}% wall, {(con - cmid) / con * 100:.1f}% cpu"
    )
    print(f"hashes + fingerprints (vs neither): {(con - coff) / con * 100:.1f}% of the save's CPU time")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mb", type=float, default=256)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--kernel-mib", type=int, default=128)
    ap.add_argument("--shard-mb", type=int, default=256)
    ap.add_argument("--dir", default=None, help="where to save (default: the temp dir; /dev/shm: no disk)")
    ap.add_argument("--skip-kernel", action="store_true")
    ap.add_argument("--skip-save", action="store_true")
    args = ap.parse_args()
    if not args.skip_kernel:
        kernel_part(args.kernel_mib, args.rounds)
    if not args.skip_save:
        save_part(args.size_mb, args.rounds, args.shard_mb, args.dir)


if __name__ == "__main__":
    main()
