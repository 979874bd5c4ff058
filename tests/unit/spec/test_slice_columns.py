"""One form for slices: the columns writers build (``SliceColumns``), the table an entry holds
(``TensorEntry.of_table``), and the index parser's one vectorised pass, which names the first
slice at fault from its masks."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest

from unickpt.errors import IndexFileError
from unickpt.spec.index import SCHEMA_MISMATCH, ByteRange, SliceEntry, TensorEntry, parse_index
from unickpt.spec.naming import SLICED_SENTINEL
from unickpt.spec.slice_table import LazySlices, SliceColumns, SliceTable, compact_problem

F = "model-00001-of-00001.safetensors"


def _rows(n: int) -> list[dict[str, Any]]:
    return [
        {"file": F, "key": f"t@{k}", "offsets": [k, 0], "shape": [1, 3], "xxh3": f"{k:016x}"}
        for k in range(n)
    ]


def _raw(rows: list[Any], shape: list[int] | None = None, dtype: str = "F32") -> bytes:
    tensor = {"dtype": dtype, "shape": shape or [len(rows), 3], "slices": rows}
    obj = {
        "metadata": {"total_size": 0},
        "weight_map": {"t": SLICED_SENTINEL},
        "unickpt": {"kind": "model", "tensors": {"t": tensor}},
    }
    return json.dumps(obj).encode()


def _refusal(raw: bytes) -> str:
    with pytest.raises(IndexFileError) as e:
        parse_index(raw, "i")
    text = str(e.value)
    assert text.startswith(f"i: {SCHEMA_MISMATCH}: unickpt.tensors.t."), text
    return text.removeprefix(f"i: {SCHEMA_MISMATCH}: unickpt.tensors.t.")


def test_columns_build_the_table_the_entries_would() -> None:
    cols = SliceColumns("t", (4, 6))
    entries = []
    for k, (o, s) in enumerate([((0, 0), (4, 2)), ((0, 2), (4, 4))]):
        h = None if k else "0123456789abcdef"
        cols.add(f"f{k}.safetensors", f"t@{k}", o, s, h)
        entries.append(
            SliceEntry(file=f"f{k}.safetensors", key=f"t@{k}", offsets=list(o), shape=list(s), xxh3=h)
        )
    table = cols.table()
    ref = SliceTable.from_entries("t", (4, 6), entries)
    assert table.records() == ref.records()
    assert table.entries() == entries and table.hashes == "0123456789abcdef" + "-" * 16
    assert table.file_list() == ["f0.safetensors", "f1.safetensors"]
    with pytest.raises(ValueError, match="1-dim offsets"):
        cols.add(F, "t@2", [0], [4, 6])


def test_whole_and_ranges() -> None:
    rs = [ByteRange(start=0, end=8, xxh3="0" * 16), ByteRange(start=8, end=16, xxh3="1" * 16)]
    table = SliceTable.whole("t", [2, 2], F, ranges=rs)
    assert table.ranges(0) == rs and table.key(0) == "t" and table.box(0) == ([0, 0], [2, 2])
    entry = TensorEntry.of_table("F32", [2, 2], table)
    assert not entry.compact and isinstance(entry.__dict__["slices"], LazySlices)
    with pytest.raises(ValueError, match="ranges cover 16 of its 32 bytes"):
        TensorEntry.of_table("I64", [2, 2], table)


def test_an_entry_of_a_table_names_its_first_slice_past_the_end() -> None:
    n = 1000
    offs = np.arange(n, dtype=np.int64)[:, None].repeat(2, axis=1)
    shapes = np.ones((n, 2), dtype=np.int64)
    shapes[700, 1] = 400  # 700 + 400 > 1001 on dim 1
    shapes[900, 0] = 200
    table = SliceTable.from_columns(
        "t", [n + 1, n + 1], files=[F] * n, keys=[f"t@{k}" for k in range(n)], offsets=offs, shapes=shapes
    )
    with pytest.raises(
        ValueError, match=r"slice 't@700' in '.*' spans \[700, 1100\) on dim 1 of a tensor of size 1001"
    ):
        TensorEntry.of_table("F32", [n + 1, n + 1], table)


def test_the_first_slice_at_fault_is_named_whatever_the_column() -> None:
    rows = _rows(2000)
    rows[1500]["offsets"] = [1500, "0"]  # a type, late
    rows[1200]["xxh3"] = "0123"  # a hash, earlier
    rows[1700]["shape"] = [5, 3]  # past the end, later
    assert (
        _refusal(_raw(rows))
        == "slices.1200.xxh3: expected null or a string matching ^[0-9a-f]{16}$, found '0123'"
    )
    rows[900]["shape"] = [1, 4]
    assert _refusal(_raw(rows)) == (
        f"slices.900: slice 't@900' in '{F}' spans [0, 4) on dim 1 of a tensor of size 3"
    )
    rows[300] = {"key": "t@300", "file": F, "offsets": [300, 0], "shape": [1, 3], "size": 1}
    assert _refusal(_raw(rows)) == (
        "slices.300.size: unexpected key (the fields are file, key, offsets, shape, xxh3, ranges)"
    )
    rows[10] = [1]
    assert _refusal(_raw(rows)) == "slices.10: expected an object, found an array"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda r: r.update(ranges=[{"start": 0, "end": 4, "xxh3": "0" * 16}]),
            "ranges cover 4 of its 12 bytes",
        ),
        (
            lambda r: r.update(
                ranges=[{"end": 4, "start": 0, "xxh3": "0" * 16}, {"start": 5, "end": 12, "xxh3": "1" * 16}]
            ),
            "range [5, 12) does not continue at byte 4",
        ),
        (
            lambda r: r.update(ranges=[{"start": 0, "end": 12, "xxh3": "X" * 16}]),
            "ranges.0.xxh3: expected a string",
        ),
        (lambda r: r.update(ranges=[{"start": 0, "end": 12}]), "ranges.0.xxh3: missing (a required field)"),
        (
            lambda r: r.update(ranges=[{"start": 0, "end": 12.0, "xxh3": "0" * 16}]),
            "ranges.0.end: expected an integer",
        ),
        (lambda r: r.update(ranges={"start": 0}), "ranges: expected null or an array of range objects"),
        (lambda r: r.update(ranges=[[0, 12]]), "ranges.0: expected an object"),
    ],
)
def test_byte_ranges_are_checked_at_once(edit: Any, message: str) -> None:
    rows = _rows(50)
    for k in (3, 7):
        rows[k]["ranges"] = [
            {"start": 0, "end": 4, "xxh3": "2" * 16},
            {"xxh3": "3" * 16, "start": 4, "end": 12},
        ]
    edit(rows[20])
    text = _refusal(_raw(rows))
    assert text.startswith("slices.20") and message in text, text


def test_listed_slices_with_fields_left_out_keep_them_as_a_null_mask() -> None:
    rows: list[dict[str, Any]] = _rows(6)
    del rows[1]["xxh3"]
    rows[2]["xxh3"] = None
    rows[3] = {"shape": [1, 3], "offsets": [3, 0], "key": "t@3", "file": F}  # any key order
    rows[4]["ranges"] = [{"start": 0, "end": 12, "xxh3": "4" * 16}]
    rows[5]["ranges"] = None
    t = parse_index(_raw(rows), "i").unickpt.tensors["t"]  # type: ignore[union-attr]
    table = t.table
    assert [table.xxh3(k) for k in range(6)] == [f"{0:016x}", None, None, None, f"{4:016x}", f"{5:016x}"]
    assert table.ranges_count() == 1 and table.ranges(4) == [ByteRange(start=0, end=12, xxh3="4" * 16)]
    sets = [s.model_fields_set for s in t.slices]
    base = {"file", "key", "offsets", "shape"}
    assert sets == [
        base | {"xxh3"},
        base,
        base | {"xxh3"},
        base,
        base | {"xxh3", "ranges"},
        base | {"xxh3", "ranges"},
    ]
    assert [s.model_dump(exclude_unset=True) for s in t.slices] == [
        {k: r[k] for k in ("file", "key", "offsets", "shape", "xxh3", "ranges") if k in r} for r in rows
    ]


def test_compact_boxes_name_the_first_box_at_fault() -> None:
    boxes = [[k, 0, 1, 3] for k in range(500)]
    assert compact_problem([500, 3], None, boxes, 0, None, None) is None
    boxes[321] = [321, 1, 1, 3]
    boxes[400] = [400, 0, 1]
    assert compact_problem([500, 3], None, boxes, 0, None, None) == (
        "box 321 spans [1, 4) on dim 1 of a tensor of size 3"
    )
    boxes[100] = [100, 0, 1]
    assert compact_problem([500, 3], None, boxes, 0, None, None) == (
        "box 100 has 3 integers, expected 4 (offsets then shape)"
    )
