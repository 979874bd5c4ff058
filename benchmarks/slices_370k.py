"""The 370k-slice checkpoint of issue 18: per-slice costs of load_model, verify, inspect and merge.

Builds a sliced model checkpoint shaped like 70B under FSDP2 on 512 ranks at the metadata level
(723 tensors with Llama-2-70B names, each cut in 512 row slices: 370,176 slices, 512 data files),
with tiny tensors (512 x 2 BF16: one row per slice) so that the data is a few MB and every cost
measured is a per-slice cost. The index is written as format version 1 (listed slices, indented,
as unickpt wrote it then: ~69 MB) and as version 3 (compact) over the same data files. Then, per
version, each operation runs in a fresh process, timed (wall and CPU seconds: on a shared
machine the CPU time of the process moves far less with the load than its wall time) and with its
peak RSS, side by side with ``json.load`` of the same index in a fresh process:

- ``load_model``: ``GeneralCheckpointIO().load_model`` of a module holding the 723 tensors;
- ``verify``: ``verify_checkpoint`` (structure and every slice's hash);
- ``inspect``: ``inspect_checkpoint``;
- ``merge``: ``merge_checkpoint`` into one gathered file;
- ``plan``: the metadata side of ``load_model`` for one rank (the last): ``open_checkpoint``, the
  coverage of every tensor, and the stored slices its boxes need.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/slices_370k.py            # build once, measure
    .venv/bin/python benchmarks/slices_370k.py --world 64 --ops load,verify  # smaller, quicker
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

from benchmarks.index_parse import tensor_specs  # noqa: E402

ROWS_COLS = (2,)  # each slice: one row of 2 BF16


def build(directory: Path, world: int, tensors: int) -> None:
    """The data files (one per rank) and the version 1 and version 3 indexes beside them."""
    import numpy as np
    import xxhash

    from unickpt.ckpt.safetensors_io import encode_header
    from unickpt.ckpt.writer import build_block, build_index
    from unickpt.spec.index import LayoutInfo, index_to_json, parse_index
    from unickpt.spec.naming import SLICED_SENTINEL, shard_name, slice_key

    directory.mkdir(parents=True, exist_ok=True)
    names = [n for n, _ in tensor_specs(tensors)]
    rng = np.random.default_rng(0)
    data = {n: rng.integers(0, 1 << 16, size=(world, *ROWS_COLS), dtype=np.uint16) for n in names}
    meta = {"format": "unickpt-sliced"}
    slices: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for r in range(world):
        fname = shard_name("model", r + 1, world)
        specs = [(slice_key(n, r), "BF16", (1, *ROWS_COLS)) for n in names]
        header, _spans = encode_header(specs, meta)
        with open(directory / fname, "wb") as f:
            f.write(header)
            for n in names:
                row = data[n][r : r + 1].tobytes()
                f.write(row)
                slices[n].append(
                    {
                        "file": fname,
                        "key": slice_key(n, r),
                        "offsets": [r, 0],
                        "shape": [1, *ROWS_COLS],
                        "xxh3": xxhash.xxh3_64(row).hexdigest(),
                    }
                )
    block = {
        "format_version": 5,
        "kind": "model",
        "created_by": "benchmarks/slices_370k.py",
        "layout": {"plugin": "fsdp2", "world_size": world, "mesh": {"dp": world}, "gathered": False},
        "tensors": {n: {"dtype": "BF16", "shape": [world, *ROWS_COLS], "slices": slices[n]} for n in names},
        "aliases": {},
    }
    total = sum(2 * world * ROWS_COLS[0] for _ in names)
    v1 = {
        "metadata": {"total_size": total},
        "weight_map": dict.fromkeys(names, SLICED_SENTINEL),
        "unickpt": block,
    }
    (directory / "v1").mkdir(exist_ok=True)
    raw = (json.dumps(v1, indent=2) + "\n").encode()
    (directory / "v1" / "model.safetensors.index.json").write_bytes(raw)
    parsed = parse_index(raw, "v1").unickpt
    assert parsed is not None
    b3 = build_block(
        kind="model",
        created_by="benchmarks/slices_370k.py",
        layout=LayoutInfo(plugin="fsdp2", world_size=world, mesh={"dp": world}, gathered=False),
        tensors=dict(parsed.tensors),
        aliases={},
        save_id=None,
    )
    (directory / "v3").mkdir(exist_ok=True)
    (directory / "v3" / "model.safetensors.index.json").write_bytes(
        index_to_json(build_index(b3, sliced=True))
    )
    for v in ("v1", "v3"):
        for r in range(world):
            fname = shard_name("model", r + 1, world)
            dst = directory / v / fname
            if not dst.exists():
                os.link(directory / fname, dst)


_CHILD = r"""
import json, sys, time, os
def kb(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
op, ck, out = sys.argv[1], sys.argv[2], sys.argv[3]
if op != "json":
    import torch
    from unickpt import GeneralCheckpointIO, merge_checkpoint, verify_checkpoint
    from unickpt.tools.inspect import inspect_checkpoint
    if op == "load":
        idx = json.load(open(os.path.join(ck, "model.safetensors.index.json")))
        b = idx["unickpt"]
        shapes = {n: t["shape"] for n, t in b["tensors"].items()}
        del idx, b
        model = torch.nn.Module()
        for n, s in shapes.items():
            *path, leaf = n.split(".")
            mod = model
            for part in path:
                if not hasattr(mod, part):
                    mod.add_module(part, torch.nn.Module())
                mod = getattr(mod, part)
            mod.register_parameter(leaf, torch.nn.Parameter(torch.zeros(s, dtype=torch.bfloat16)))
        import gc; gc.collect()
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = kb("VmRSS")
t0 = time.perf_counter()
c0 = time.process_time()
if op == "json":
    obj = json.load(open(os.path.join(ck, "model.safetensors.index.json")))
elif op == "load":
    GeneralCheckpointIO().load_model(model, ck)
elif op == "verify":
    rep = verify_checkpoint(ck)
    assert not list(rep), rep.format() if hasattr(rep, "format") else rep
elif op == "inspect":
    inspect_checkpoint(ck)
elif op == "merge":
    merge_checkpoint(ck, out)
elif op == "plan":  # the metadata side of load_model for the last rank: open, coverage, plan
    from unickpt.ckpt.reader import open_checkpoint
    from unickpt.io.load import _needed_slices
    from unickpt.io.tensors import LocalSlice
    r = open_checkpoint(ck)
    r.check_coverage()
    for name, t in r.tensors.items():
        last = (t.shape[0] - 1, *[0] * (len(t.shape) - 1))
        _needed_slices(t, [LocalSlice(name, t.dtype, tuple(t.shape), last, (1, *t.shape[1:]), None)])
    r.close()
dt = time.perf_counter() - t0
print(json.dumps({"s": dt, "cpu": time.process_time() - c0, "extra_mb": (kb("VmHWM") - base) / 1024}))
"""


def run(op: str, ck: Path, out: Path) -> dict[str, float]:
    if out.exists():
        shutil.rmtree(out)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run(  # cwd: ``-c`` puts it first on sys.path, so it must be the tree measured
        [sys.executable, "-c", _CHILD, op, str(ck), str(out)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        cwd=REPO,
    )
    if p.returncode:
        raise RuntimeError(f"{op} on {ck} failed:\n{p.stderr[-3000:]}")
    res: dict[str, float] = json.loads(p.stdout.strip().splitlines()[-1])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=723)
    ap.add_argument("--ops", default="plan,load,verify,inspect,merge")
    ap.add_argument("--versions", default="v1,v3")
    ap.add_argument("--dir", default=None, help="where to build (kept); default a temporary directory")
    args = ap.parse_args()
    base = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="slices370k-"))
    if not (base / "v3" / "model.safetensors.index.json").exists():
        t0 = time.perf_counter()
        build(base, args.world, args.tensors)
        print(f"built {args.tensors} x {args.world} slices in {time.perf_counter() - t0:.1f} s under {base}")
    # Interleaved, so that both versions and their json.load see the same machine load: per op,
    # json.load of the version 1 index, then the op on version 1, then on version 3.
    versions = args.versions.split(",")
    sizes = {v: (base / v / "model.safetensors.index.json").stat().st_size for v in versions}
    print("index bytes: " + ", ".join(f"{v} {sizes[v]}" for v in versions))
    # Wall seconds and, as the machine may be shared, CPU seconds (user + system of the process),
    # each as a ratio to json.load's measured the same way just before.
    print(
        "| op | json.load of v1 s (CPU s) | "
        + " | ".join(f"{v} s (x json.load of v1) | {v} CPU s (x)" for v in versions)
        + " | "
        + " | ".join(f"{v} extra peak MB (x json.load of v1)" for v in versions)
        + " |"
    )
    print("|---|---:|" + "---:|" * (3 * len(versions)))
    for op in args.ops.split(","):
        ref = run("json", base / versions[0], base / "out")
        res = {v: run(op, base / v, base / "out") for v in versions}
        times = " | ".join(
            f"{res[v]['s']:.2f} ({res[v]['s'] / ref['s']:.1f}x) | {res[v]['cpu']:.2f} ({res[v]['cpu'] / ref['cpu']:.1f}x)"
            for v in versions
        )
        mems = " | ".join(
            f"{res[v]['extra_mb']:.0f} ({res[v]['extra_mb'] / max(ref['extra_mb'], 1):.2f}x)"
            for v in versions
        )
        head = f"{ref['s']:.2f} ({ref['cpu']:.2f}, peak +{ref['extra_mb']:.0f} MB)"
        print(f"| {op} | {head} | {times} | {mems} |", flush=True)
    if not args.dir:
        shutil.rmtree(base)


if __name__ == "__main__":
    main()
