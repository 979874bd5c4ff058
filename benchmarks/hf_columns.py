"""Column slices in a gathered save: one pwrite per row (what io/hf_save.py does) vs row slices.

A gathered save writes every rank's slices straight into the Hugging Face file. A row slice
(``Shard(0)``) is one contiguous run; a column slice (``Shard(1)``, TP's row-parallel weights)
is one run per row. This times, in one process and side by side, writing the same matrix as
``world`` column slices (per-row ``pwrite`` of each slice's runs, as the ranks do) and as
``world`` row slices (one ``pwrite`` each), both followed by fsync, plus the xxh3 hashing of
the ranges each way (one range per row and slice, against one per slice)::

    .venv/bin/python benchmarks/hf_columns.py [--rows 4096] [--cols 4096] [--world 4] [--reps 5]

``--dist SIZE_MB`` instead runs a world of ``--world`` ranks (gloo, CPU) holding the synthetic
state of ``_common.py`` with every matrix ``Shard(1)`` (TP's row-parallel weights) and times,
side by side in one world, the sliced save, the gathered save with the column slices moved to
row slices before they are written (``io/hf_rows.py``, what unickpt does) and the gathered save
writing them row by row (``hf_rows.ROW_MOVES = False``, what it did before)::

    .venv/bin/python benchmarks/hf_columns.py --dist 64 --reps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import xxhash

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from unickpt.ckpt.hf_layout import box_runs
from unickpt.ckpt.writer import write_all


def _write(path: str, pieces: list[tuple[int, np.ndarray]], total: int) -> tuple[float, int]:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, total)
        t0 = time.perf_counter()
        hashes = 0
        for pos, arr in pieces:
            write_all(fd, memoryview(arr), pos)  # type: ignore[arg-type]
            xxhash.xxh3_64_hexdigest(memoryview(arr))  # type: ignore[arg-type]
            hashes += 1
        os.fsync(fd)
        return time.perf_counter() - t0, hashes
    finally:
        os.close(fd)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dist", type=float, default=None, metavar="SIZE_MB")
    a = ap.parse_args()
    if a.dist is not None:
        _dist_main(a.dist, a.world, a.reps)
        return
    rng = np.random.default_rng(0)
    full = rng.standard_normal((a.rows, a.cols), dtype=np.float32)
    g = (a.rows, a.cols)
    total = full.nbytes
    w = a.world

    def pieces(by_cols: bool) -> list[tuple[int, np.ndarray]]:
        out = []
        for r in range(w):
            if by_cols:
                c0, c1 = r * a.cols // w, (r + 1) * a.cols // w
                local = np.ascontiguousarray(full[:, c0:c1])
                off, shp = (0, c0), (a.rows, c1 - c0)
            else:
                r0, r1 = r * a.rows // w, (r + 1) * a.rows // w
                local = np.ascontiguousarray(full[r0:r1])
                off, shp = (r0, 0), (r1 - r0, a.cols)
            flat = local.reshape(-1).view(np.uint8)
            runs = box_runs(g, off, shp, 4)
            n = runs[0][1] - runs[0][0]
            out.extend((b, flat[j * n : (j + 1) * n]) for j, (b, _) in enumerate(runs))
        return out

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        res: dict[str, list[float]] = {"cols": [], "rows": []}
        counts = {}
        for _ in range(a.reps + 1):
            for kind in ("rows", "cols"):
                t, k = _write(os.path.join(d, kind), pieces(kind == "cols"), total)
                res[kind].append(t)
                counts[kind] = k
        with open(os.path.join(d, "rows"), "rb") as f1, open(os.path.join(d, "cols"), "rb") as f2:
            assert f1.read() == f2.read() == full.tobytes()
    mib = total / 2**20
    for kind in ("rows", "cols"):
        med = statistics.median(res[kind][1:])
        print(
            f"{kind:4s}: {mib:.0f} MiB as {w} {kind[:-1]} slices, {counts[kind]} pwrites+hashes: {med:.3f} s, {mib / 1024 / med:.2f} GiB/s"
        )
    print(
        f"column slices / row slices: {statistics.median(res['cols'][1:]) / statistics.median(res['rows'][1:]):.2f}x time"
    )


def _dist_main(size_mb: float, world: int, reps: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import run

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR")) as d:
        p = {"size_mb": size_mb, "reps": reps, "shard_mb": max(8, int(size_mb) // 4), "seed": 0, "workdir": d}
        out = run.run_world("cols", world, p, 1800)
    if out.get("error"):
        print("error:", out["error"])
    ranks = [r for r in out.get("ranks", []) if r]
    if not ranks:
        return
    meds = {}
    for case, r0 in ranks[0].items():
        if not isinstance(r0, dict) or r0.get("status") != "ok":
            print(f"{case}: {r0}")
            continue
        meds[case] = statistics.median(r0["times"])
        rss = max(r[case]["rss_peak_mb"] - r[case]["rss_base_mb"] for r in ranks)
        times = ", ".join(f"{t:.3f}" for t in r0["times"])
        print(
            f"{case:26s} median {meds[case]:.3f} s ({times}); peak RSS over base, max over ranks +{rss:.0f} MB"
        )
    if {"cols_gathered_row_moves", "cols_gathered_per_row"} <= meds.keys():
        ratio = meds["cols_gathered_per_row"] / meds["cols_gathered_row_moves"]
        print(f"row by row / moved to rows: {ratio:.2f}x time")


if __name__ == "__main__":
    main()
