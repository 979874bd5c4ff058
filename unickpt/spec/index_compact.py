"""Writing the compact encoding: every tensor's slices turned into the compact fields of docs/format.md 3.1.

Writers hand over tensors whose slices are a list of ``SliceEntry`` (or, without any per-slice
object, a ``LazySlices`` over a ``SliceTable``); :func:`compact_tensors` builds the block's file
table and each tensor's ``grid`` (or ``boxes``), ``file``, ``keys`` and ``xxh3`` from the tables,
in bulk: O(S) numpy work plus O(S log S) for the grid detection, no per-slice model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from unickpt.spec.digest_text import block_from_json, block_to_json
from unickpt.spec.index_models import TensorEntry
from unickpt.spec.slice_table import SliceTable, compact_fields

__all__ = ["compact_tensors", "named_table", "as_listed"]


def named_table(name: str, t: TensorEntry) -> SliceTable:
    """``t``'s slice table, with the tensor's name (the ``NAME@K`` key rule needs it)."""
    return t.table.renamed(name)


def compact_tensors(tensors: Mapping[str, TensorEntry]) -> tuple[dict[str, TensorEntry], list[str]]:
    """(the tensors in their compact form, the block's ``files`` table: sorted distinct names)."""
    tables = {name: named_table(name, t) for name, t in tensors.items()}
    # Tables often share one file list (a plan's): each distinct list is read once.
    tables_files = {id(table.files): table.files for table in tables.values()}
    files = sorted({f for names in tables_files.values() for f in names})
    index = {f: i for i, f in enumerate(files)}
    remaps = {k: np.asarray([index[f] for f in names], dtype=np.int64) for k, names in tables_files.items()}
    out: dict[str, TensorEntry] = {}
    for name, t in tensors.items():
        if t.table.ranges_count():
            out[name] = t  # byte-range hashes have no compact form: listed
            continue
        fields = compact_fields(tables[name], index, remaps[id(tables[name].files)])
        common = {k: v for k in ("fingerprint", "param", "state") if (v := getattr(t, k)) is not None}
        out[name] = TensorEntry(dtype=t.dtype, shape=list(t.shape), **common, **fields)
    return out, files


def as_listed(obj: dict[str, Any]) -> dict[str, Any]:
    """A parsed index JSON object (``json.loads``) with every compact tensor's slices listed
    (``slices``, as a tensor with byte-range hashes is written; readers take either form): tools
    and tests that edit slice objects. Changed in place, returned."""
    given = obj.get("unickpt")
    if not isinstance(given, dict):
        return obj
    block = obj["unickpt"] = block_from_json(given)[0]
    files = block.pop("files", None)
    for name, t in block["tensors"].items():
        if "slices" in t:
            continue
        fields = {k: t.pop(k, None) for k in ("grid", "boxes", "file", "keys", "xxh3")}
        table = SliceTable.from_compact(name, t["shape"], files or [], **fields)
        t["slices"] = [s.model_dump(exclude_none=True) for s in table.entries()]
    block_to_json(block)
    return obj
