"""Checkpoints of the largest runs' shapes, saved, loaded, verified, inspected and merged.

``benchmarks/scale.py`` measures the metadata of 70B on 512 ranks (FSDP), 405B on 2048 ranks
(FSDP) and 405B under TP8 x PP16 x DP16 from the ranks' slice lists alone. Here the same slice
lists become real checkpoints on disk: every dim of every tensor is shrunk by coordinate
compression (each interval between two cut points of the layout becomes one element), so each
stored slice keeps its place in its tensor's grid, its file and its neighbours but holds a few
BF16 values, and every cost measured is a per-slice cost at the layout's true slice count. One
data file per rank (2048 for the 405B layouts), slices stored once (replicas and empty trailing
chunks of the same box deduplicated, as a save does), the index built by the writer's code
(``build_block`` / ``build_index``, the current format version). Then each operation runs in a
fresh process (``slices_370k.py``'s child), timed, with its extra peak memory:

    .venv/bin/python benchmarks/scale_ops.py --layouts 405b-tp8pp16dp16,405b-fsdp2048 --dir /tmp/scale-ops
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

from benchmarks.scale import LAYOUTS, rank_boxes  # noqa: E402
from benchmarks.slices_370k import run as run_op  # noqa: E402

Box = tuple[tuple[int, ...], tuple[int, ...]]


def compressed(
    per: list[list[tuple[str, tuple[int, ...], Box]]],
) -> tuple[dict[str, tuple[int, ...]], list[list[tuple[str, Box]]]]:
    """Each tensor's shape and every rank's boxes with each dim's cut intervals as single elements."""
    cuts: dict[str, list[set[int]]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for boxes in per:
        for name, g, (o, s) in boxes:
            shapes[name] = g
            c = cuts.setdefault(name, [{0, d} for d in g])
            for d, (a, n) in enumerate(zip(o, s, strict=True)):
                c[d].update((a, a + n))
    points = {n: [sorted(c) for c in cs] for n, cs in cuts.items()}
    tiny = {n: tuple(len(p) - 1 for p in ps) for n, ps in points.items()}
    out: list[list[tuple[str, Box]]] = []
    for boxes in per:
        mine = []
        for name, _g, (o, s) in boxes:
            ps = points[name]
            lo = [bisect.bisect_left(p, a) for p, a in zip(ps, o, strict=True)]
            hi = [bisect.bisect_left(p, a + n) for p, a, n in zip(ps, o, s, strict=True)]
            mine.append((name, (tuple(lo), tuple(h - a for a, h in zip(lo, hi, strict=True)))))
        out.append(mine)
    return tiny, out


def build(directory: Path, layout: str) -> dict[str, Any]:
    import numpy as np
    import xxhash

    from unickpt.ckpt.safetensors_io import encode_header
    from unickpt.ckpt.writer import build_block, build_index
    from unickpt.spec.index import LayoutInfo, index_to_json, parse_index
    from unickpt.spec.naming import SLICED_SENTINEL, shard_name, slice_key

    t0 = time.perf_counter()
    shapes, per = compressed(rank_boxes(layout))
    world = len(per)
    seen: dict[str, dict[Box, int]] = {n: {} for n in shapes}  # box -> slice number (stored once)
    slices: dict[str, list[dict[str, Any]]] = {n: [] for n in shapes}
    rng = np.random.default_rng(0)
    directory.mkdir(parents=True, exist_ok=True)
    for r, boxes in enumerate(per):
        fname = shard_name("model", r + 1, world)
        specs, datas = [], []
        for name, box in boxes:
            if box in seen[name]:
                continue
            k = seen[name][box] = len(slices[name])
            o, s = box
            raw = rng.integers(0, 1 << 16, size=s, dtype=np.uint16).tobytes()
            specs.append((slice_key(name, k), "BF16", s))
            datas.append(raw)
            slices[name].append(
                {
                    "file": fname,
                    "key": slice_key(name, k),
                    "offsets": list(o),
                    "shape": list(s),
                    "xxh3": xxhash.xxh3_64(raw).hexdigest(),
                }
            )
        header, _ = encode_header(specs, {"format": "unickpt-sliced"})
        with open(directory / fname, "wb") as f:
            f.write(header)
            for raw in datas:
                f.write(raw)
    listed = {
        "weight_map": dict.fromkeys(shapes, SLICED_SENTINEL),
        "unickpt": {
            "format_version": 5,
            "kind": "model",
            "created_by": "benchmarks/scale_ops.py",
            "layout": {"plugin": "fsdp2", "world_size": world, "mesh": LAYOUTS[layout][1], "gathered": False},
            "tensors": {n: {"dtype": "BF16", "shape": list(shapes[n]), "slices": slices[n]} for n in shapes},
            "aliases": {},
        },
    }
    parsed = parse_index(json.dumps(listed).encode(), layout).unickpt
    assert parsed is not None
    del listed
    block = build_block(
        kind="model",
        created_by="benchmarks/scale_ops.py",
        layout=LayoutInfo(plugin="fsdp2", world_size=world, mesh=LAYOUTS[layout][1], gathered=False),
        tensors=dict(parsed.tensors),
        aliases={},
        save_id=None,
    )
    raw = index_to_json(build_index(block, sliced=True))
    (directory / "model.safetensors.index.json").write_bytes(raw)
    n = sum(len(v) for v in slices.values())
    return {
        "slices": n,
        "files": world,
        "tensors": len(shapes),
        "index_bytes": len(raw),
        "build_s": time.perf_counter() - t0,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="405b-tp8pp16dp16,405b-fsdp2048")
    ap.add_argument("--ops", default="load,verify,inspect,merge")
    ap.add_argument("--dir", default="/tmp/unickpt-scale-ops")
    args = ap.parse_args()
    print("| layout | slices | data files | index MB | op | s | CPU s | extra peak MB |")
    print("|---|---:|---:|---:|---|---:|---:|---:|")
    for layout in args.layouts.split(","):
        d = Path(args.dir) / layout
        info_path = d / "built.json"
        if not info_path.exists():
            info = build(d, layout)
            info_path.write_text(json.dumps(info))
        info = json.loads(info_path.read_text())
        head = f"| {layout} | {info['slices']:,} | {info['files']} | {info['index_bytes'] / 1e6:.1f}"
        print(f"{head} | build (write files + index) | {info['build_s']:.1f} | | |", flush=True)
        for op in args.ops.split(","):
            res = run_op(op, d, Path(args.dir) / "out")
            print(f"{head} | {op} | {res['s']:.1f} | {res['cpu']:.1f} | {res['extra_mb']:.0f} |", flush=True)
        os.sync()


if __name__ == "__main__":
    main()
