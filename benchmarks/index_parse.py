"""Index parse + validate per slice: pydantic validation of the models against ``parse_index``, side by side.

Every loading rank parses and validates the whole ``*.safetensors.index.json`` before reading a
byte, so its cost per slice times the slice count (70B over 512 ranks: ~370,000 slices) is paid
by every rank. This script builds synthetic sliced indexes shaped like a real one (Llama-style
FQNs, every tensor cut ``--world`` ways along dim 0 with uneven splits, 4 to 5 files per rank,
keys, offsets, shapes, xxh3 and fingerprints) at a few slice counts, then times, in one process
and alternating within each repetition:

- old: ``strict_loads`` (``json.loads`` with the duplicate-key hook) + ``IndexFile.model_validate``
  (what ``parse_index`` did before it had a validator of its own; the models now only declare
  the schema, and this script is the one place that still validates an index through them);
- new: ``parse_index`` (plain ``json.loads``, exact duplicate-key count, the index validator of
  ``index.IndexParser`` and ``model_construct``-style building).

Both get the same bytes and must return equal indexes. Prints a markdown table with the median
us per slice of each and the ratio. Not part of ``make test``.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/index_parse.py
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/index_parse.py --sizes 10000,100000 --reps 3
    .venv/bin/python benchmarks/index_parse.py --memory --sizes 100000,500000   # peak RSS of load_index
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

from unickpt.errors import IndexFileError  # noqa: E402
from unickpt.spec.index import (  # noqa: E402
    IndexFile,
    hex_to_b64,
    index_to_json,
    parse_index,
)
from unickpt.spec.naming import SLICED_SENTINEL, shard_name, slice_key  # noqa: E402
from unickpt.spec.untrusted import strict_loads  # noqa: E402


def parse_index_validated(raw: bytes, path: str) -> IndexFile:
    """The pydantic models' validation of an index (the "old" column)."""
    return IndexFile.model_validate(strict_loads(raw.decode("utf-8"), IndexFileError, f"{path}: index"))


# Llama-2-70B-like shapes: (suffix, global shape). 80 layers x 9 tensors + embed, norm, lm_head.
_HIDDEN, _FFN, _KV, _VOCAB = 8192, 28672, 1024, 32000
_LAYER = [
    ("self_attn.q_proj.weight", [_HIDDEN, _HIDDEN]),
    ("self_attn.k_proj.weight", [_KV, _HIDDEN]),
    ("self_attn.v_proj.weight", [_KV, _HIDDEN]),
    ("self_attn.o_proj.weight", [_HIDDEN, _HIDDEN]),
    ("mlp.gate_proj.weight", [_FFN, _HIDDEN]),
    ("mlp.up_proj.weight", [_FFN, _HIDDEN]),
    ("mlp.down_proj.weight", [_HIDDEN, _FFN]),
    ("input_layernorm.weight", [_HIDDEN]),
    ("post_attention_layernorm.weight", [_HIDDEN]),
]


def tensor_specs(n: int) -> list[tuple[str, list[int]]]:
    """``n`` tensors with Llama-style FQNs and shapes (as many layers as needed)."""
    out: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [_VOCAB, _HIDDEN])]
    layer = 0
    while len(out) < n - 2:
        for suffix, shape in _LAYER:
            out.append((f"model.layers.{layer}.{suffix}", list(shape)))
        layer += 1
    out = out[: max(n - 2, 1)]
    out += [("model.norm.weight", [_HIDDEN]), ("lm_head.weight", [_VOCAB, _HIDDEN])]
    return out[:n]


def build_index(slices: int, world: int = 512, files_per_rank: int = 5, seed: int = 0) -> dict[str, Any]:
    """A sliced model index of about ``slices`` slices: every tensor cut ``world`` ways on dim 0."""
    rng = random.Random(seed)
    specs = tensor_specs(max(1, -(-slices // world)))
    nfiles = world * files_per_rank
    tensors: dict[str, Any] = {}
    total = 0
    for i, (name, shape) in enumerate(specs):
        rows = shape[0]
        # Uneven cut (like FSDP2's Shard(0) of a dim that is not a multiple of the world size).
        base, extra = divmod(rows, world)
        sl = []
        start = 0
        for r in range(world):
            n = base + (1 if r < extra else 0)
            f = r * files_per_rank + (i * files_per_rank) // len(specs)
            sl.append(
                {
                    "file": shard_name("model", f + 1, nfiles),
                    "key": slice_key(name, r),
                    "offsets": [start] + [0] * (len(shape) - 1),
                    "shape": [n, *shape[1:]],
                    "xxh3": f"{rng.getrandbits(64):016x}",
                }
            )
            start += n
        tensors[name] = {
            "dtype": "BF16",
            "shape": shape,
            "fingerprint": hex_to_b64(f"{rng.getrandbits(64):016x}"),
            "slices": sl,
        }
        count = 1
        for d in shape:
            count *= d
        total += 2 * count
    obj = {
        "metadata": {"total_size": total},
        "weight_map": {name: SLICED_SENTINEL for name in tensors},
        "unickpt": {
            "format_version": 5,
            "kind": "model",
            "created_by": "unickpt 0.1.0",
            "layout": {"plugin": "fsdp2", "world_size": world, "mesh": {"dp": world}, "gathered": False},
            "tensors": tensors,
            "aliases": {},
        },
    }
    return obj


def _time(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall, CPU) seconds of one call plus the collection of the young objects it leaves behind.

    ``gc.collect(1)`` walks whatever the call left in the young generations (what the next
    automatic collections would walk), so a parser that defers the collector's work does not
    look faster than it is. The result is freed after the clocks stop.
    """
    gc.collect()
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn()
    gc.collect(1)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    del result
    return dt, dc


# Peak RSS of one load_index in a fresh process: VmHWM after resetting it (clear_refs 5) once
# unickpt is imported, then VmRSS once the index is built (what the loading rank keeps).
_MEMORY_CHILD = """
import sys
from unickpt.spec.index import load_index
def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = kb("VmRSS")
index = load_index(sys.argv[1])
print(base, kb("VmHWM"), kb("VmRSS"))
"""


def memory(sizes: list[int], world: int) -> int:
    """Peak and retained RSS of ``load_index`` per slice count, as multiples of the file size."""
    import subprocess
    import tempfile

    print("| slices | index MB | peak above baseline MB | peak / size | kept MB | kept / size |")
    print("|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as d:
        for size in sizes:
            path = Path(d) / "model.safetensors.index.json"
            raw = (json.dumps(build_index(size, world=world), indent=2) + "\n").encode()
            path.write_bytes(raw)
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            out = subprocess.run(
                [sys.executable, "-c", _MEMORY_CHILD, str(path)],
                capture_output=True,
                text=True,
                check=True,
                env=env,
            ).stdout.split()
            base, peak, kept = (int(x) * 1024 for x in out)
            mb = 1 << 20
            print(
                f"| {size} | {len(raw) / mb:.1f} | {(peak - base) / mb:.1f} | {(peak - base) / len(raw):.1f}x "
                f"| {(kept - base) / mb:.1f} | {(kept - base) / len(raw):.1f}x |"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--memory",
        action="store_true",
        help="measure load_index's peak and kept RSS instead of timing (Linux)",
    )
    ap.add_argument("--sizes", default="10000,100000,400000", help="slice counts (comma-separated)")
    ap.add_argument("--world", type=int, default=512, help="slices per tensor")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per size (median reported)")
    ap.add_argument("--old-reps", type=int, default=0, help="repetitions of the old path (default: --reps)")
    args = ap.parse_args(argv)
    if args.memory:
        return memory([int(x) for x in args.sizes.split(",")], args.world)
    old_reps = args.old_reps or args.reps

    print(
        f"python {platform.python_version()}, {platform.machine()}, {os.cpu_count()} cpus, "
        f"load average {os.getloadavg()[0]:.1f}; median of {args.reps} (new) / {old_reps} (old) reps"
    )
    rows = []
    for size in (int(s) for s in args.sizes.split(",")):
        obj = build_index(size, world=args.world)
        raw = (json.dumps(obj, indent=2) + "\n").encode()
        nslices = sum(len(t["slices"]) for t in obj["unickpt"]["tensors"].values())
        del obj
        # Same answer from both paths (and a warm-up of each).
        a, b = parse_index_validated(raw, "bench"), parse_index(raw, "bench")
        assert a == b and index_to_json(a) == index_to_json(b), "fast and validated parse differ"
        del a, b
        old: list[tuple[float, float]] = []
        new: list[tuple[float, float]] = []
        for rep in range(max(args.reps, old_reps)):
            if rep < old_reps:
                old.append(_time(lambda raw=raw: parse_index_validated(raw, "bench")))
            if rep < args.reps:
                new.append(_time(lambda raw=raw: parse_index(raw, "bench")))
        o, n = statistics.median(w for w, _ in old), statistics.median(w for w, _ in new)
        oc, nc = statistics.median(c for _, c in old), statistics.median(c for _, c in new)
        rows.append((nslices, len(raw), o, n, oc, nc))
        print(f"  {nslices} slices: old {o:.3f} s, new {n:.3f} s", file=sys.stderr, flush=True)

    print()
    print(
        "| slices | index MB | old s | new s | old us/slice | new us/slice | old / new "
        "| old CPU us/slice | new CPU us/slice | old / new (CPU) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for nslices, nbytes, o, n, oc, nc in rows:
        us = 1e6 / nslices
        print(
            f"| {nslices} | {nbytes / 1e6:.1f} | {o:.3f} | {n:.3f} | {o * us:.1f} | {n * us:.2f} | {o / n:.1f}x "
            f"| {oc * us:.1f} | {nc * us:.2f} | {oc / nc:.1f}x |"
        )
    print(f"\nload average after: {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
