"""``make bench-scale``: checkpoint metadata at thousands of ranks, unickpt's index against DCP's ``.metadata``.

No tensor data: the metadata of a model saved under a parallel layout is synthesised (every
rank's slices of every tensor, with torch.chunk's uneven and empty parts), then, per layout,
each step runs in a fresh process (its time and its extra peak RSS, VmHWM after the inputs are
built) for unickpt and for DCP:

- **rank-0 build**: unickpt: ``plan_save`` over every rank's slice list (what rank 0 gathers),
  the slice tables of the plan (hashes and fingerprints filled with random digests), the block
  (format version 3) and its JSON. DCP: the ``Metadata`` of the same chunks (one
  ``TensorStorageMetadata`` with a ``ChunkStorageMetadata`` per chunk, and a ``_StorageInfo`` per
  chunk in ``storage_data``, as ``FileSystemWriter.finish`` stores them), ``pickle.dump``-ed.
- **one rank's parse + plan** (the last rank): unickpt: ``open_checkpoint`` (index parsed and
  checked: schema, unique keys, weight_map), the coverage of every tensor, and the stored slices
  each of the rank's boxes needs (``io.load._needed_slices``). DCP: ``pickle.load`` of
  ``.metadata`` (``FileSystemReader.read_metadata``) and, per tensor the rank holds,
  ``create_read_items_for_chunk_list`` (what ``create_default_local_load_plan`` calls).

Layouts: 70B (Llama-2-70B shapes) FSDP on 512 ranks; 405B (Llama-3.1-405B shapes) FSDP on 2048
ranks; 405B under TP8 x PP16 x DP16 (Megatron-style column/row parallel linears, vocab-parallel
embedding and head, norms replicated over TP, FSDP over the data-parallel ranks on dim 0).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/scale.py                  # all three
    .venv/bin/python benchmarks/scale.py --layouts 70b-fsdp512 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(1, str(REPO))

# (hidden, ffn, kv, vocab, layers)
MODELS = {"70b": (8192, 28672, 1024, 32000, 80), "405b": (16384, 53248, 1024, 128256, 126)}
LAYOUTS = {
    "70b-fsdp512": ("70b", {"dp": 512}),
    "405b-fsdp2048": ("405b", {"dp": 2048}),
    "405b-tp8pp16dp16": ("405b", {"tp": 8, "pp": 16, "dp": 16}),
}
Box = tuple[tuple[int, ...], tuple[int, ...]]


def tensors(model: str) -> list[tuple[str, tuple[int, ...], str, int]]:
    """(name, shape, TP split: 'col' | 'row' | 'rep' | 'vocab', layer or -1) of the model."""
    hidden, ffn, kv, vocab, layers = MODELS[model]
    out = [("model.embed_tokens.weight", (vocab, hidden), "vocab", -1)]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (hidden, hidden), "col", i),
            (p + "self_attn.k_proj.weight", (kv, hidden), "col", i),
            (p + "self_attn.v_proj.weight", (kv, hidden), "col", i),
            (p + "self_attn.o_proj.weight", (hidden, hidden), "row", i),
            (p + "mlp.gate_proj.weight", (ffn, hidden), "col", i),
            (p + "mlp.up_proj.weight", (ffn, hidden), "col", i),
            (p + "mlp.down_proj.weight", (hidden, ffn), "row", i),
            (p + "input_layernorm.weight", (hidden,), "rep", i),
            (p + "post_attention_layernorm.weight", (hidden,), "rep", i),
        ]
    out += [
        ("model.norm.weight", (hidden,), "rep", layers),
        ("lm_head.weight", (vocab, hidden), "vocab", layers),
    ]
    return out


def _chunks(g: int, k: int) -> list[tuple[int, int]]:
    """torch.chunk-style (offset, extent) of ``k`` parts of ``g`` (empty trailing parts at ``g``)."""
    c = -(-g // k)
    return [(min(i * c, g), min(c, max(0, g - i * c))) for i in range(k)]


def rank_boxes(layout: str) -> list[list[tuple[str, tuple[int, ...], Box]]]:
    """Every rank's (name, global shape, box) list, in rank order."""
    model, mesh = LAYOUTS[layout]
    specs = tensors(model)
    if set(mesh) == {"dp"}:
        w = mesh["dp"]
        per: list[list[tuple[str, tuple[int, ...], Box]]] = [[] for _ in range(w)]
        for name, shape, _, _ in specs:
            for r, (o, n) in enumerate(_chunks(shape[0], w)):
                per[r].append((name, shape, ((o, *[0] * (len(shape) - 1)), (n, *shape[1:]))))
        return per
    tp, pp, dp = mesh["tp"], mesh["pp"], mesh["dp"]
    layers = MODELS[model][4]
    stage_of = {i: min(pp - 1, i * pp // layers) for i in range(-1, layers + 1)}
    stage_of[-1], stage_of[layers] = 0, pp - 1
    per = [[] for _ in range(tp * pp * dp)]
    for name, shape, split, layer in specs:
        stage = stage_of[layer]
        for t in range(tp):
            if split in ("col", "vocab"):  # Shard(0) on tp, then FSDP Shard(0) on dp inside it
                to, tn = _chunks(shape[0], tp)[t]
                parts = [((to + o, 0), (n, shape[1])) for o, n in _chunks(tn, dp)]
            elif split == "row":  # Shard(1) on tp, FSDP Shard(0) on dp
                co, cn = _chunks(shape[1], tp)[t]
                parts = [((o, co), (n, cn)) for o, n in _chunks(shape[0], dp)]
            else:  # replicated over tp, FSDP Shard(0) on dp
                parts = [((o,), (n,)) for o, n in _chunks(shape[0], dp)]
            for d, (off, shp) in enumerate(parts):
                rank = (d * pp + stage) * tp + t
                per[rank].append((name, shape, (tuple(off), tuple(shp))))
    return per


# ------------------------------------------------------------------------------------------ steps
def build_unickpt(layout: str, out: str) -> dict[str, Any]:
    import random

    from unickpt.io.planner import plan_save, plan_tables
    from unickpt.spec.index import LayoutInfo, index_to_json

    per = rank_boxes(layout)
    metas = [[(n, "BF16", g, o, s) for n, g, (o, s) in boxes] for boxes in per]
    del per
    rng = random.Random(0)

    def measured() -> int:
        from unickpt.ckpt.writer import build_block, build_index, tensor_entry

        plan = plan_save(metas, kind="model", size_per_shard_bytes=None, sliced=True)
        counts = {n: len(sl) for n, sl in plan.slices.items()}
        hashes = {n: "".join(f"{rng.getrandbits(64):016x}" for _ in range(c)) for n, c in counts.items()}
        tables = plan_tables(plan, hashes)
        entries = {}
        for name, (dtype, gshape) in plan.tensors.items():
            e = tensor_entry(name, dtype, gshape, tables[name], None)
            entries[name] = e.model_copy(update={"fingerprint": f"{rng.getrandbits(64):016x}"})
        _, mesh = LAYOUTS[layout]
        world = len(metas)
        block = build_block(
            kind="model",
            created_by="benchmarks/scale.py",
            layout=LayoutInfo(plugin="fsdp2", world_size=world, mesh=mesh, gathered=False),
            tensors=entries,
            aliases={},
            save_id=f"{rng.getrandbits(128):032x}",
        )
        raw = index_to_json(build_index(block, sliced=True))
        with open(out, "wb") as f:
            f.write(raw)
        return sum(counts.values())

    return _measure(measured)


def build_dcp(layout: str, out: str) -> dict[str, Any]:
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    per = rank_boxes(layout)

    def measured() -> int:
        # DCP's global plan keeps one writer per chunk (dedup_save_plans), then finish() pickles.
        chunks: dict[str, list[ChunkStorageMetadata]] = {}
        sizes: dict[str, tuple[int, ...]] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        seen: set[tuple[str, tuple[int, ...]]] = set()
        for r, boxes in enumerate(per):
            pos = 0
            for name, gshape, (off, shp) in boxes:
                if (name, off) in seen:
                    continue
                seen.add((name, off))
                sizes[name] = gshape
                lst = chunks.setdefault(name, [])
                idx = MetadataIndex(name, torch.Size(off), len(lst))
                lst.append(ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(shp)))
                n = 2
                for x in shp:
                    n *= x
                storage[idx] = _StorageInfo(f"__{r}_0.distcp", pos, n)
                pos += n
        props = TensorProperties(dtype=torch.bfloat16)
        md = Metadata(
            state_dict_metadata={
                n: TensorStorageMetadata(properties=props, size=torch.Size(sizes[n]), chunks=c)
                for n, c in chunks.items()
            },
            storage_data=storage,
        )
        with open(out, "wb") as f:
            pickle.dump(md, f)
        return len(storage)

    return _measure(measured)


def rank_unickpt(layout: str, index: str) -> dict[str, Any]:
    from unickpt.ckpt.reader import open_checkpoint
    from unickpt.io.load import _needed_slices
    from unickpt.io.tensors import LocalSlice

    mine = rank_boxes(layout)[-1]

    def measured() -> int:
        r = open_checkpoint(index)
        r.check_coverage()
        n = 0
        for name, g, (off, shp) in mine:
            n += len(_needed_slices(r.tensors[name], [LocalSlice(name, "BF16", g, off, shp, None)]))  # type: ignore[arg-type]
        r.close()
        return n

    return _measure(measured)


def rank_dcp(layout: str, path: str) -> dict[str, Any]:
    import pickle

    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    mine = rank_boxes(layout)[-1]

    def measured() -> int:
        with open(path, "rb") as f:
            md = pickle.load(f)
        n = 0
        for name, _g, (off, shp) in mine:
            local = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=torch.Size(shp))]
            n += len(create_read_items_for_chunk_list(name, md.state_dict_metadata[name], local))
        return n

    return _measure(measured)


def _measure(fn: Any) -> dict[str, Any]:
    import gc
    import time

    from benchmarks._common import peak_rss_mb, reset_peak_rss, rss_mb

    gc.collect()
    reset_peak_rss()
    base = rss_mb()
    t0 = time.perf_counter()
    count = fn()
    dt = time.perf_counter() - t0
    return {"s": dt, "extra_mb": peak_rss_mb() - base, "count": count}


STEPS = {
    "build_unickpt": build_unickpt,
    "build_dcp": build_dcp,
    "rank_unickpt": rank_unickpt,
    "rank_dcp": rank_dcp,
}


def _child(step: str, layout: str, path: str) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    code = (
        "import json, sys; from benchmarks.scale import STEPS; "
        "print(json.dumps(STEPS[sys.argv[1]](sys.argv[2], sys.argv[3])))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, step, layout, path], capture_output=True, text=True, env=env, check=False
    )
    if p.returncode:
        raise RuntimeError(f"{step} {layout} failed:\n{p.stderr[-3000:]}")
    res: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    rows = []
    print(
        "| layout | slices | unickpt index MB | DCP .metadata MB | rank-0 build s (unickpt / DCP) | "
        "rank-0 build extra MB (unickpt / DCP) | one rank parse+plan s (unickpt / DCP) | "
        "one rank parse+plan extra MB (unickpt / DCP) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as tmp:
        for layout in args.layouts.split(","):
            d = Path(tmp) / layout
            d.mkdir()
            index = str(d / "model.safetensors.index.json")
            meta = str(d / ".metadata")
            bu = _child("build_unickpt", layout, index)
            bd = _child("build_dcp", layout, meta)
            ru = _child("rank_unickpt", layout, index)
            rd = _child("rank_dcp", layout, meta)
            row = {
                "layout": layout,
                "slices": bu["count"],
                "dcp_chunks": bd["count"],
                "index_bytes": os.path.getsize(index),
                "metadata_bytes": os.path.getsize(meta),
                "build": [bu, bd],
                "rank": [ru, rd],
            }
            rows.append(row)
            print(
                f"| {layout} | {bu['count']} | {row['index_bytes'] / 1e6:.1f} | {row['metadata_bytes'] / 1e6:.1f} | "
                f"{bu['s']:.2f} / {bd['s']:.2f} | {bu['extra_mb']:.0f} / {bd['extra_mb']:.0f} | "
                f"{ru['s']:.3f} / {rd['s']:.3f} | {ru['extra_mb']:.0f} / {rd['extra_mb']:.0f} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
