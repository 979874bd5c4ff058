"""Format versions 3 to 5: the compact slice encoding, its tables, and the versions before it."""

from __future__ import annotations

import json
import random
from typing import Any

import numpy as np
import pytest

from unickpt.ckpt.writer import build_block, build_index, tensor_entry
from unickpt.errors import IndexFileError
from unickpt.spec.index import (
    FORMAT_VERSION,
    IndexFile,
    LayoutInfo,
    SliceEntry,
    index_to_json,
    parse_index,
)
from unickpt.spec.naming import shard_name, slice_key
from unickpt.spec.slice_table import SliceTable, chunk_extents, compact_fields


def _slices(name: str, boxes: list[tuple[list[int], list[int]]], files: list[str]) -> list[SliceEntry]:
    rng = random.Random(name)
    return [
        SliceEntry(file=f, key=slice_key(name, k), offsets=o, shape=s, xxh3=f"{rng.getrandbits(64):016x}")
        for k, ((o, s), f) in enumerate(zip(boxes, files, strict=True))
    ]


def _rows(extents: list[int], cols: int) -> list[tuple[list[int], list[int]]]:
    out, start = [], 0
    for e in extents:
        out.append(([start, 0], [e, cols]))
        start += e
    return out


FILES = [shard_name("model", i + 1, 4) for i in range(4)]
CASES: dict[str, tuple[list[int], list[tuple[list[int], list[int]]], Any]] = {
    # FSDP2 Shard(0), torch.chunk semantics: 33 rows over 4 -> 9, 9, 9, 6
    "fsdp_uneven": ([33, 8], _rows([9, 9, 9, 6], 8), {"grid": [4, 1]}),
    # empty trailing ranks: 3 rows over 4 -> 1, 1, 1, 0
    "fsdp_empty_rank": ([3, 5], _rows([1, 1, 1, 0], 5), {"grid": [4, 1]}),
    # _StridedShard of 10 rows on a 2x2 mesh: rows 0-2, 3-4, 5-7, 8-9 in position order
    "strided": ([10, 4], _rows([3, 2, 3, 2], 4), {"grid": [[3, 2, 3, 2], 1]}),
    # TP Shard(1)
    "tp_columns": ([4, 10], [([0, 0], [4, 5]), ([0, 5], [4, 5])], {"grid": [1, 2]}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_regular_slicings_are_a_grid_and_round_trip(case: str) -> None:
    gshape, boxes, expect = CASES[case]
    files = (FILES * 4)[: len(boxes)]
    sl = _slices(case, boxes, files)
    table = SliceTable.from_entries(case, gshape, sl)
    fields = compact_fields(table, {f: i for i, f in enumerate(FILES)})
    for k, v in expect.items():
        assert fields[k] == v
    assert "boxes" not in fields and "keys" not in fields  # keys follow NAME@K
    assert fields["xxh3"] == "".join(s.xxh3 or "" for s in sl)
    back = SliceTable.from_compact(
        case,
        gshape,
        FILES,
        grid=fields["grid"],
        boxes=None,
        file=fields.get("file"),
        keys=None,
        xxh3=fields["xxh3"],
    )
    assert back.entries() == sl
    assert back.coverage_problem() is None


def test_2d_grid_and_irregular_boxes() -> None:
    # Shard(0) x Shard(1) on a 2x2 mesh, in C order of the grid.
    boxes = [([0, 0], [3, 2]), ([0, 2], [3, 3]), ([3, 0], [2, 2]), ([3, 2], [2, 3])]
    sl = _slices("w", boxes, FILES)
    fields = compact_fields(SliceTable.from_entries("w", [5, 5], sl), {f: i for i, f in enumerate(FILES)})
    assert fields["grid"] == [2, [2, 3]] and "file" not in fields  # slice K in files[K]
    # A ZeRO flat range cut into boxes is no grid: explicit boxes.
    zero = [([0, 0], [1, 5]), ([1, 0], [1, 2]), ([1, 2], [1, 3]), ([2, 0], [3, 5])]
    sl = _slices("z", zero, FILES)
    fields = compact_fields(SliceTable.from_entries("z", [5, 5], sl), {f: i for i, f in enumerate(FILES)})
    assert fields["boxes"] == [o + s for o, s in zero]
    # Keys that break NAME@K are written out; one file for all slices is one integer.
    sl = [s.model_copy(update={"key": f"x{k}", "file": FILES[2]}) for k, s in enumerate(sl)]
    fields = compact_fields(SliceTable.from_entries("z", [5, 5], sl), {f: i for i, f in enumerate(FILES)})
    assert fields["keys"] == ["x0", "x1", "x2", "x3"] and fields["file"] == 2


def test_chunk_extents_follow_torch_chunk() -> None:
    import torch

    for g in range(0, 40):
        for k in range(1, 9):
            parts = [len(c) for c in torch.arange(g).chunk(k)] if g else []
            want = parts + [0] * (k - len(parts))
            assert chunk_extents(g, k) == want, (g, k)


def test_grid_search_matches_brute_force() -> None:
    rng = random.Random(0)
    for trial in range(200):
        nd = rng.randint(1, 3)
        gshape = [rng.randint(1, 12) for _ in range(nd)]
        grid: list[int | list[int]] = [rng.randint(1, 5) for _ in range(nd)]
        t = SliceTable.from_compact("t", gshape, FILES, grid=grid, boxes=None, file=0, keys=None, xxh3=None)
        o = [rng.randint(0, g - 1) for g in gshape]
        s = [rng.randint(0, g - oo) for oo, g in zip(o, gshape, strict=True)]
        ends = t.offsets + t.shapes
        want = [
            k
            for k in range(len(t))
            if all(t.shapes[k] > 0)
            and all(n > 0 for n in s)
            and all(t.offsets[k][d] < o[d] + s[d] and ends[k][d] > o[d] for d in range(nd))
        ]
        assert t.overlapping(o, s) == want, (trial, gshape, grid, o, s)
        explicit = SliceTable(
            "t", gshape, t.offsets, t.shapes, t.file_ids, FILES, None, None
        )  # the same boxes without a grid: the vectorised path
        assert explicit.overlapping(o, s) == want


def _index(listed: bool = False) -> bytes:
    tensors = {}
    for name, (gshape, boxes, _) in CASES.items():
        sl = _slices(name, boxes, (FILES * 4)[: len(boxes)])
        tensors[name] = tensor_entry(name, "F32", gshape, SliceTable.from_entries(name, gshape, sl), [1, 2])
    block = build_block(
        kind="model",
        created_by="test",
        layout=LayoutInfo(plugin="fsdp2", world_size=4, mesh={"dp": 4}, gathered=False),
        tensors=tensors,
        aliases={},
        save_id=None,
    )
    raw = index_to_json(build_index(block, sliced=True))
    if listed:  # the same slices, listed (as a tensor with byte-range hashes is written)
        from unickpt.spec.index import as_listed

        raw = json.dumps(as_listed(json.loads(raw))).encode()
    return raw


def test_a_sliced_index_names_the_sentinel_and_nothing_else() -> None:
    """Every entry of a sliced weight_map is the sentinel; any other name beside it is refused
    (the longer sentinel of the drafts 1 to 3 is such a name: ``unickpt upgrade`` replaces it)."""
    from unickpt.ckpt.reader import check_weight_map
    from unickpt.spec.naming import SLICED_SENTINEL
    from unickpt.tools.upgrade import LONG_SLICED_SENTINEL

    raw = _index()
    assert set(json.loads(raw)["weight_map"].values()) == {SLICED_SENTINEL}
    block = parse_index(raw, "i.json").unickpt
    assert block is not None and set(block.tensors) == set(CASES)
    mixed = json.loads(raw)["weight_map"]
    mixed[next(iter(mixed))] = LONG_SLICED_SENTINEL
    with pytest.raises(IndexFileError, match="weight_map mixes the sliced-checkpoint sentinel"):
        check_weight_map("i.json", mixed, block)


def test_compact_index_parses_to_what_the_schema_builds() -> None:
    raw = _index()
    obj = json.loads(raw)
    assert obj["unickpt"]["format_version"] == FORMAT_VERSION and obj["unickpt"]["files"] == FILES
    assert all("slices" not in t for t in obj["unickpt"]["tensors"].values())
    fast = parse_index(raw, "i.json")
    assert fast == IndexFile.model_validate(obj)
    listed = parse_index(_index(listed=True), "listed.json")  # the same slices, listed
    assert listed.unickpt is not None and fast.unickpt is not None
    for name, t in listed.unickpt.tensors.items():
        assert not t.compact
        assert fast.unickpt.tensors[name].slices == t.slices
        assert fast.unickpt.tensors[name].table.hashes == t.table.hashes
    # Written again, a parsed index gives the same bytes.
    assert index_to_json(fast) == raw


def _broken(edit: Any) -> bytes:
    obj = json.loads(_index())
    edit(obj["unickpt"])
    return json.dumps(obj).encode()


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda b: b["tensors"]["strided"].update(grid=[[3, 2, 3], 1]),
            "do not add up to the tensor's size 10",
        ),
        (lambda b: b["tensors"]["tp_columns"].update(file=[0, 9]), "file index 9 is past the 4 files"),
        (lambda b: b["tensors"]["tp_columns"].update(file=[0]), "'file' lists 1 file(s) for 2 slice(s)"),
        (lambda b: b["tensors"]["tp_columns"].update(xxh3="ab" * 8), "holds 16 characters for 2 slice(s)"),
        (
            lambda b: b["tensors"]["tp_columns"].update(boxes=[[0, 0, 4, 11]], grid=None),
            "spans [0, 11) on dim 1",
        ),
        (
            lambda b: b["tensors"]["tp_columns"].update(slices=[]),
            "has both 'slices' and the compact field(s)",
        ),
        (lambda b: b.pop("files"), "the block has no 'files' table"),
        (lambda b: b["tensors"]["tp_columns"].update(xxh3="g" * 32), "holds 32 characters for 2 slice(s)"),
        (
            lambda b: b["tensors"]["tp_columns"].update(fingerprint="ab" * 8),
            "holds 16 characters, not the 11",
        ),
        (lambda b: b.update(files=["../x.safetensors", *FILES[1:]]), "refusing data file name"),
    ],
)
def test_bad_compact_fields_are_refused_by_both_paths(edit: Any, message: str) -> None:
    raw = _broken(edit)
    for parse in (parse_index,):
        with pytest.raises(IndexFileError if "refusing" not in message else Exception) as e:
            parse(raw, "bad.index.json")
        assert message in str(e.value) and "bad.index.json" in str(e.value), str(e.value)


def test_listed_slices_parse_the_same_on_both_paths() -> None:
    """An index may list any tensor's slices (a hand-written one, a tool's edit)."""
    raw = _index(listed=True)
    assert parse_index(raw, "i.json") == IndexFile.model_validate(json.loads(raw))


def test_lazy_slices_build_nothing_until_read() -> None:
    idx = parse_index(_index(), "i.json")
    assert idx.unickpt is not None
    sl = idx.unickpt.tensors["fsdp_uneven"].slices
    assert len(sl) == 4 and list.__len__(sl) == 0  # no SliceEntry built yet
    assert sl[1].offsets == [9, 0] and sl[1].key == "fsdp_uneven@1" and list.__len__(sl) == 0
    assert [s.shape for s in sl] == [[9, 8], [9, 8], [9, 8], [6, 8]]
    assert np.array_equal(idx.unickpt.tensors["fsdp_uneven"].table.shapes[:, 0], [9, 9, 9, 6])


def _block_with(extra: dict[str, Any]) -> dict[str, Any]:
    obj = json.loads(_index())
    obj["unickpt"]["tensors"]["extra"] = extra
    obj["weight_map"]["extra"] = obj["weight_map"]["tp_columns"]
    return obj


def test_a_written_key_equal_to_a_ruled_key_is_a_duplicate(tmp_path: Any) -> None:
    """``tp_columns@1`` in file 1 is the ruled key of tp_columns' slice 1: naming it again is refused."""
    from unickpt.ckpt.reader import open_checkpoint

    base = {"dtype": "F32", "shape": [2], "file": 1, "grid": [1]}
    for key, ok in [("tp_columns@1", False), ("tp_columns@01", True), ("tp_columns@²", True), ("x@1", True)]:
        d = tmp_path / f"k{len(key)}{ok}{key.encode().hex()}"
        d.mkdir()
        (d / "model.safetensors.index.json").write_text(json.dumps(_block_with({**base, "keys": [key]})))
        if ok:
            with pytest.raises(Exception) as e:  # the data files are absent; the index itself is fine
                open_checkpoint(d).validate_structure()
            assert "named by two slices" not in str(e.value)
        else:
            with pytest.raises(IndexFileError, match=r"'tp_columns@1' of file .* is named by two slices"):
                open_checkpoint(d)


def _four_row_blocks(tmp_path: Any, full: Any) -> Any:
    """A checkpoint of ``w`` stored as 4 row blocks in torch.chunk sizes (as FSDP2 x4 saves it)."""
    from unickpt.io.save import SaveOptions, save_tensors
    from unickpt.io.tensors import LocalSlice

    def boxes(name: str, t: Any) -> list[LocalSlice]:
        out, start = [], 0
        for part in full.chunk(4):
            n = part.shape[0]
            out.append(LocalSlice(name, "F32", tuple(full.shape), (start, 0), (n, full.shape[1]), part))
            start += n
        return out

    d = tmp_path / "ckpt"
    save_tensors({"w": full}, str(d), SaveOptions("model", True, False, 1024, LayoutInfo()), boxes)
    return d


def test_compact_checkpoint_loads_verifies_and_merges_bit_exact(tmp_path: Any) -> None:
    import torch

    from unickpt import GeneralCheckpointIO, merge_checkpoint, verify_checkpoint
    from unickpt.ckpt.reader import open_checkpoint

    torch.manual_seed(5)
    full = torch.randn(33, 5)
    d = _four_row_blocks(tmp_path, full)
    obj = json.loads((d / "model.safetensors.index.json").read_text())
    assert obj["unickpt"]["format_version"] == 5 and obj["unickpt"]["tensors"]["w"]["grid"] == [4, 1]
    m = torch.nn.Module()
    m.w = torch.nn.Parameter(torch.zeros(33, 5))
    GeneralCheckpointIO().load_model(m, d, verify=True)
    assert torch.equal(m.w.detach(), full)
    report = verify_checkpoint(d)
    assert not list(report) and report.hashed == 4 and report.fingerprints == 1, report.summary()
    out = tmp_path / "merged"
    merge_checkpoint(d, out)
    with open_checkpoint(out) as r:  # one gathered file: the block is in its header
        assert r.block.format_version == 5 and r.block.tensors["w"].compact
    m2 = torch.nn.Module()
    m2.w = torch.nn.Parameter(torch.zeros(33, 5))
    GeneralCheckpointIO().load_model(m2, out, verify=True)
    assert torch.equal(m2.w.detach(), full)


def test_lazy_slices_copy_and_pickle_as_plain_lists() -> None:
    import copy
    import pickle

    idx = parse_index(_index(), "i.json")
    assert idx.unickpt is not None
    sl = idx.unickpt.tensors["strided"].slices
    plain = [SliceEntry.model_validate(s.model_dump()) for s in sl]
    assert copy.copy(sl) == plain and copy.deepcopy(sl) == plain and type(copy.copy(sl)) is list
    assert pickle.loads(pickle.dumps(sl)) == plain and list.__len__(pickle.loads(pickle.dumps(sl))) == 0
    again = pickle.loads(pickle.dumps(idx))
    assert again == idx and again.unickpt is not None
    assert again.unickpt.tensors["strided"].table.grid == [[3, 2, 3, 2], [4]]


def test_files_named_again_after_others_keep_their_ids() -> None:
    """ZeRO: a rank's file holds several boxes of one tensor, between other ranks' files."""
    files = [FILES[0], FILES[0], FILES[1], FILES[0], FILES[2], FILES[1]]
    boxes = [([i, 0], [1, 5]) for i in range(6)]
    sl = _slices("z", boxes, files)
    table = SliceTable.from_entries("z", [6, 5], sl)
    assert table.file_list() == files and table.entries() == sl
    fields = compact_fields(table, {f: i for i, f in enumerate(FILES)})
    assert fields["file"] == [0, 0, 1, 0, 2, 1] and fields["grid"] == [6, 1]
