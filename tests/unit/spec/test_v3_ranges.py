"""Byte-range hashes in a version 3 index: the tensor that carries them stays listed, the others
go compact, and both parsers give the ranges back exactly."""

from __future__ import annotations

import json

from unickpt.ckpt.writer import build_block, build_index, tensor_entry
from unickpt.spec.index import ByteRange, LayoutInfo, SliceEntry, hex_to_b64, parse_index
from unickpt.spec.slice_table import SliceTable


def _index() -> bytes:
    ranged = SliceEntry(
        file="model-00001-of-00001.safetensors",
        key="a",
        offsets=[0, 0],
        shape=[4, 4],
        ranges=[ByteRange(start=0, end=32, xxh3="0" * 16), ByteRange(start=32, end=64, xxh3="1" * 16)],
    )
    plain = SliceEntry(
        file="model-00001-of-00001.safetensors", key="b", offsets=[0], shape=[3], xxh3="2" * 16
    )
    tensors = {
        "a": tensor_entry("a", "F32", [4, 4], SliceTable.from_entries("a", [4, 4], [ranged]), None),
        "b": tensor_entry("b", "F32", [3], SliceTable.from_entries("b", [3], [plain]), None),
    }
    block = build_block(
        kind="model", created_by="t", layout=LayoutInfo(), tensors=tensors, aliases=None, save_id=None
    )
    return build_index(block, sliced=False).model_dump_json(exclude_none=True).encode()


def test_ranged_tensor_stays_listed_and_round_trips() -> None:
    raw = _index()
    obj = json.loads(raw)
    assert obj["unickpt"]["format_version"] == 5
    a, b = obj["unickpt"]["tensors"]["a"], obj["unickpt"]["tensors"]["b"]
    assert [r["end"] for r in a["slices"][0]["ranges"]] == [32, 64]
    # version 5: the compact xxh3 in base64url, listed slices and ranges keep hex digits
    assert all(len(r["xxh3"]) == 16 for r in a["slices"][0]["ranges"])
    assert "slices" not in b and b["xxh3"] == hex_to_b64("2" * 16) == "IiIiIiIiIiI"  # compact
    for parse in (parse_index,):
        idx = parse(raw, "x.json")
        assert idx.unickpt is not None
        ta, tb = idx.unickpt.tensors["a"], idx.unickpt.tensors["b"]
        assert ta.table.ranges(0) == [
            ByteRange(start=0, end=32, xxh3="0" * 16),
            ByteRange(start=32, end=64, xxh3="1" * 16),
        ]
        assert ta.table.hashed_count() == 1 and ta.table.hashed_mask() == [True]
        assert ta.table.entry(0).ranges == ta.table.ranges(0)
        assert tb.table.ranges(0) is None and tb.table.hashed_count() == 1
