"""``unickpt inspect``: what a checkpoint holds, from its index (and headers) alone. No torch."""

from __future__ import annotations

import math
import os
from typing import Any

from unickpt.spec.dtypes import itemsize
from unickpt.store.storage import shown_location
from unickpt.tools._common import human_bytes, open_auto

__all__ = ["inspect_checkpoint", "format_report"]


def inspect_checkpoint(
    path: str | os.PathLike[str], kind: str | None = None, *, slices: bool = False
) -> dict[str, Any]:
    """A plain-data description of the checkpoint at ``path``: every tensor, totals, layout.

    Each tensor's entry lists its first slices (``slice_preview``, at most 4); with ``slices``
    every slice (``slices``: a dict each, which at 370k slices costs more than the rest).
    Reads the index (for a plain Hugging Face checkpoint, also the data-file headers); never
    tensor data. Raises ``UnickptError`` subclasses (or ``OSError``) for unusable input.
    """
    with open_auto(path, kind) as r:
        # No header is read here: the files' sizes bound the slices the index declares before
        # any per-slice array is built (a damaged file's bytes are verify's to report).
        r.check_capacity(r.file_size, with_bytes=False)
        b = r.block
        tensors: dict[str, Any] = {}
        total_bytes = 0
        total_elems = 0
        n_slices = 0
        hashed = 0
        for name, t in b.tensors.items():
            numel = math.prod(t.shape)
            nbytes = numel * itemsize(t.dtype)
            total_bytes += nbytes
            total_elems += numel
            table = t.table  # the slice table: records built in bulk, no per-slice model
            n_slices += len(table)
            hashed += table.hashed_count()
            entry: dict[str, Any] = {
                "dtype": t.dtype,
                "shape": list(t.shape),
                "numel": numel,
                "bytes": nbytes,
                "fingerprint": t.fingerprint,
                "files": table.distinct_files(),
                "num_slices": len(table),
            }
            if slices:
                entry["slices"] = table.records()
            else:
                entry["slice_preview"] = [_record(table, k) for k in range(min(4, len(table)))]
            if t.param is not None:
                entry["param"] = t.param
                entry["state"] = t.state
            tensors[name] = entry
        out: dict[str, Any] = {
            "path": shown_location(path),
            "index": r.index_path,
            "kind": b.kind,
            # A plain Hugging Face / safetensors checkpoint has no unickpt block: nothing says
            # who wrote it or from which layout, so nothing is claimed.
            "format_version": b.format_version if r.has_unickpt_block else None,
            "created_by": b.created_by if r.has_unickpt_block else None,
            "unickpt_block": r.has_unickpt_block,
            "layout": b.layout.model_dump() if r.has_unickpt_block else None,
            "files": r.files,
            "totals": {
                "tensors": len(b.tensors),
                "slices": n_slices,
                "elements": total_elems,
                "bytes": total_bytes,
                "hashed_slices": hashed,
                "fingerprinted_tensors": sum(1 for t in b.tensors.values() if t.fingerprint),
            },
            "aliases": dict(b.aliases),
            "tensors": tensors,
        }
        if b.param_groups is not None:
            out["param_groups"] = b.param_groups
        if b.param_state:
            out["param_state"] = b.param_state
        return out


def _record(table: Any, k: int) -> dict[str, Any]:
    """Slice ``k`` of a slice table as ``SliceTable.records`` gives it."""
    offsets, shape = table.box(k)  # a grid's cell from its specification: no per-slice array
    return {
        "file": table.file(k),
        "key": table.key(k),
        "offsets": offsets,
        "shape": shape,
        "xxh3": table.xxh3(k),
        "ranges": table.ranges(k),
    }


def _fmt_slices(entry: dict[str, Any], shape: list[int]) -> str:
    slices = entry["slices"] if "slices" in entry else entry["slice_preview"]
    count = entry["num_slices"]
    if count == 1 and slices[0]["shape"] == shape:
        return "whole"
    parts = []
    for s in slices[:4]:
        parts.append(
            "[" + ",".join(f"{o}:{o + n}" for o, n in zip(s["offsets"], s["shape"], strict=True)) + "]"
        )
    more = f" +{count - 4}" if count > 4 else ""
    return f"{count}: " + " ".join(parts) + more


def printable(text: object) -> str:
    """A name from a checkpoint as printed: as it is when printable, else escaped (a newline, an
    ANSI escape or a right-to-left mark in a tensor name must not break the table or drive the
    terminal)."""
    s = str(text)
    return s if s.isprintable() else ascii(s)[1:-1]


def format_report(info: dict[str, Any], verbose: bool = False) -> str:
    """A readable table of :func:`inspect_checkpoint`'s result (names escaped by :func:`shown`)."""
    lay = info["layout"]
    tot = info["totals"]
    lines = [f"checkpoint : {printable(info['path'])}"]
    if lay is None:
        plain = "Hugging Face sharded safetensors" if info["index"] else "safetensors file"
        lines += [
            f"kind       : {info['kind']}   plain {plain} checkpoint: no unickpt block "
            "(not written by unickpt; no hashes or fingerprints)",
            "layout     : whole tensors (HF-loadable); no parallel layout recorded",
        ]
    else:
        mesh = " x ".join(f"{k}={v}" for k, v in lay.get("mesh", {}).items()) or "-"
        lines += [
            f"kind       : {info['kind']}   format v{info['format_version']}   created by {printable(info['created_by'])}",
            f"layout     : plugin={printable(lay['plugin'])} world_size={lay['world_size']} mesh={mesh} "
            f"{'gathered (HF-loadable)' if lay.get('gathered', True) else 'sliced (run `unickpt merge` for HF)'}",
        ]
    lines += [
        f"files      : {len(info['files'])}"
        + (
            f"  ({', '.join(printable(f) for f in info['files'][:3])}{' ...' if len(info['files']) > 3 else ''})"
            if info["files"]
            else ""
        ),
        f"totals     : {tot['tensors']} tensors, {tot['slices']} slices, {tot['elements']:,} elements, "
        f"{human_bytes(tot['bytes'])} ({tot['bytes']:,} bytes); hashed slices {tot['hashed_slices']}, "
        f"fingerprints {tot['fingerprinted_tensors']}",
    ]
    if info["aliases"]:
        lines.append(
            "aliases    : "
            + ", ".join(f"{printable(a)} -> {printable(t)}" for a, t in info["aliases"].items())
        )
    rows = [("tensor", "dtype", "shape", "bytes", "slices", "files", "fingerprint")]
    names = list(info["tensors"])
    for name in names:
        e = info["tensors"][name]
        files = e["files"]
        rows.append(
            (
                printable(name),
                e["dtype"],
                "[" + ",".join(str(d) for d in e["shape"]) + "]",
                human_bytes(e["bytes"]),
                _fmt_slices(e, e["shape"]),
                printable(files[0]) if len(files) == 1 else f"{len(files)} files",
                e["fingerprint"] or "-",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    widths[0] = min(widths[0], 60)
    lines.append("")
    for i, r in enumerate(rows):
        lines.append(
            "  ".join(
                c.ljust(w) if j < len(r) - 1 else c for j, (c, w) in enumerate(zip(r, widths, strict=True))
            ).rstrip()
        )
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
        if verbose and i > 0:
            e = info["tensors"][names[i - 1]]
            for s in e["slices"] if "slices" in e else e["slice_preview"]:
                lines.append(
                    f"      {printable(s['key'])} in {printable(s['file'])} offsets={s['offsets']} shape={s['shape']} xxh3={s['xxh3'] or '-'}"
                )
    if info.get("param_groups") is not None:
        lines.append("")
        for i, g in enumerate(info["param_groups"]):
            hp = ", ".join(f"{printable(k)}={printable(v)}" for k, v in g.items() if k != "params")
            lines.append(f"param_group {i}: {len(g.get('params', []))} params; {hp}")
    return "\n".join(lines)
