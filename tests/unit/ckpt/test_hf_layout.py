"""The Hugging Face file layout of gathered saves, byte ranges and their hashes (issue 19), in one process.

Multi-rank writing is tested in tests/dist/test_hf_parallel.py; here: the layout equals the
rank-0 gathered save's files (the planner's grouping and ``format.writer.write_files``), box runs
and writer ranges on every kind of slice, the ``ranges`` field in both index parsers, and a
flipped byte pinpointed to its range by ``verify`` and ``load_model(verify=True)``.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
import xxhash

import unickpt
from unickpt.ckpt.hf_layout import box_runs, plan_hf_layout, writer_ranges
from unickpt.ckpt.reader import RangeFailure
from unickpt.ckpt.writer import data_file_metadata, write_files
from unickpt.errors import IndexFileError, IntegrityError
from unickpt.io.planner import plan_save
from unickpt.spec.index import IndexFile, index_to_json, load_index, parse_index
from unickpt.tools.verify import verify_checkpoint

SAVE_ID = "5a" * 16


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(33, 8), torch.nn.Linear(8, 35), torch.nn.LayerNorm(35))
    m.register_buffer("steps", torch.arange(5, dtype=torch.int64))
    m[2].weight.data = m[2].weight.data.to(torch.bfloat16)
    return m


def _old_gathered_files(sd: dict[str, torch.Tensor], size_mb: float, out: Path) -> dict[str, bytes]:
    """What the rank-0 gathered save wrote: the planner's files of whole tensors, streamed by write_files."""
    from unickpt.io.tensors import as_bytes, st_dtype

    metas = [(n, st_dtype(t.dtype), tuple(t.shape), (0,) * t.dim(), tuple(t.shape)) for n, t in sd.items()]
    plan = plan_save([metas], kind="model", size_per_shard_bytes=int(size_mb * 1024 * 1024), sliced=False)
    specs = [
        (f.name, [(ps.key, metas[0][1] and st_dtype(sd[ps.name].dtype), ps.shape) for ps in f.slices])
        for f in plan.files
    ]
    blocks = (
        (ps.key, as_bytes(sd[ps.name]), (ps.shape, ps.offsets, ps.shape))
        for f in plan.files
        for ps in f.slices
    )
    out.mkdir()
    write_files(str(out), specs, lambda _f: data_file_metadata(False, SAVE_ID), blocks, fsync=False)
    return {f.name: (out / f.name).read_bytes() for f in plan.files}


@pytest.mark.parametrize("size_mb", [0.001, 1024.0])
def test_gathered_files_are_the_rank0_save_bytes(tmp_path: Path, size_mb: float) -> None:
    m = _model()
    with mock.patch("unickpt.io.save.new_save_id", return_value=SAVE_ID):
        unickpt.GeneralCheckpointIO().save_model(m, tmp_path / "new", shard=True, size_per_shard=size_mb)
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    old = _old_gathered_files(sd, size_mb, tmp_path / "old")
    new = {
        f: (tmp_path / "new" / f).read_bytes()
        for f in os.listdir(tmp_path / "new")
        if f.endswith(".safetensors")
    }
    assert len(old) > (1 if size_mb < 1 else 0) and new == old
    idx = load_index(tmp_path / "new" / "model.safetensors.index.json")
    assert idx.unickpt is not None
    for name, t in idx.unickpt.tensors.items():  # one writer: the whole tensor's xxh3, as before
        (s,) = t.slices
        raw = sd[name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert s.ranges is None and s.xxh3 == xxhash.xxh3_64_hexdigest(raw)


def test_layout_places_every_tensor_after_its_header() -> None:
    descs = [("a", "F32", (3, 5)), ("b", "BF16", (7,)), ("c", "I64", ())]
    lay = plan_hf_layout(descs, kind="model", size_per_shard_bytes=64, metadata={"format": "pt"})
    assert [f.name for f in lay.files] == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    for f in lay.files:
        h = f.header({"format": "pt"})
        assert (len(h) == f.header_len and h[8:].decode().endswith(" ")) or (8 + len(h[8:])) % 8 == 0
        hdr = json.loads(h[8:])
        for key, _, _ in f.specs:
            b, e = hdr[key]["data_offsets"]
            assert lay.places[key].pos == f.header_len + b and lay.places[key].nbytes == e - b
        assert f.size == f.header_len + max(
            v["data_offsets"][1] for k, v in hdr.items() if k != "__metadata__"
        )
    one = plan_hf_layout(descs, kind="optimizer", size_per_shard_bytes=None, metadata={})
    assert [f.name for f in one.files] == ["optimizer.safetensors"]


def _brute_runs(
    gshape: tuple[int, ...], off: tuple[int, ...], shp: tuple[int, ...], isize: int
) -> list[tuple[int, int]]:
    """Every element's byte position, in the box's C order, merged into runs."""
    idx = np.arange(math.prod(gshape)).reshape(gshape)[
        tuple(slice(o, o + n) for o, n in zip(off, shp, strict=True))
    ]
    runs: list[tuple[int, int]] = []
    for e in idx.reshape(-1).tolist():
        if runs and runs[-1][1] == e * isize:
            runs[-1] = (runs[-1][0], (e + 1) * isize)
        else:
            runs.append((e * isize, (e + 1) * isize))
    return runs


@pytest.mark.parametrize(
    ("gshape", "off", "shp"),
    [
        ((10, 6), (3, 0), (4, 6)),  # row slice: one run
        ((10, 6), (0, 2), (10, 3)),  # column slice: one run per row
        ((10, 6), (4, 1), (3, 5)),  # a grid cell
        ((4, 5, 6), (1, 0, 0), (2, 5, 6)),
        ((4, 5, 6), (1, 2, 0), (2, 3, 6)),
        ((4, 5, 6), (0, 1, 3), (4, 4, 3)),
        ((7,), (2,), (4,)),
        ((), (), ()),
    ],
)
def test_box_runs_match_element_positions(
    gshape: tuple[int, ...], off: tuple[int, ...], shp: tuple[int, ...]
) -> None:
    for isize in (1, 2, 4):
        runs = box_runs(gshape, off, shp, isize)
        assert len({e - b for b, e in runs}) == 1  # equal runs: the box's bytes split evenly
        brute = _brute_runs(gshape, off, shp, isize)
        merged: list[tuple[int, int]] = []
        for b, e in runs:
            if merged and merged[-1][1] == b:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((b, e))
        assert merged == brute


def test_writer_ranges_merge_a_flat_range_and_split_columns() -> None:
    from unickpt.spec.boxes import flat_range_to_boxes

    # ZeRO: a flat range [7, 29) of a (5, 6) tensor is three boxes, one contiguous run of bytes.
    boxes = [(off, shp, 1) for (off, shp), _ in flat_range_to_boxes((5, 6), 7, 29)]
    rest = [(off, shp, 0) for (off, shp), _ in flat_range_to_boxes((5, 6), 0, 7)]
    rest += [(off, shp, 2) for (off, shp), _ in flat_range_to_boxes((5, 6), 29, 30)]
    assert len(boxes) == 3
    assert writer_ranges((5, 6), "F32", boxes + rest) == [(0, 28, 0), (28, 116, 1), (116, 120, 2)]
    # Column halves of a (3, 4) tensor: one range per row and writer.
    cols = [((0, 0), (3, 2), 0), ((0, 2), (3, 2), 1)]
    assert writer_ranges((3, 4), "F16", cols) == [
        (0, 4, 0),
        (4, 8, 1),
        (8, 12, 0),
        (12, 16, 1),
        (16, 20, 0),
        (20, 24, 1),
    ]
    # Rows of one writer next to each other merge.
    assert writer_ranges((4, 2), "I8", [((0, 0), (2, 2), 3), ((2, 0), (2, 2), 3)]) == [(0, 8, 3)]


def _with_ranges(src: Path, name: str, cuts: list[int]) -> Path:
    """Rewrite a gathered checkpoint's index so ``name`` records ranges (as a multi-rank save does)."""
    from unickpt.spec.index import as_listed

    raw = as_listed(json.loads((src / "model.safetensors.index.json").read_text()))
    t = raw["unickpt"]["tensors"][name]
    (s,) = t["slices"]
    from unickpt.ckpt.reader import open_checkpoint

    with open_checkpoint(src) as r:
        data = bytes(r.read_key(r.tensors[name].table.file(0), r.tensors[name].table.key(0)))
    bounds = [0, *cuts, len(data)]
    s.pop("xxh3")
    s["ranges"] = [
        {"start": b, "end": e, "xxh3": xxhash.xxh3_64_hexdigest(data[b:e])}
        for b, e in itertools.pairwise(bounds)
    ]
    (src / "model.safetensors.index.json").write_text(json.dumps(raw))
    return src


def test_ranges_parse_alike_and_bad_tilings_are_refused(tmp_path: Path) -> None:
    unickpt.GeneralCheckpointIO().save_model(_model(), tmp_path / "c", shard=True)
    _with_ranges(tmp_path / "c", "1.weight", [280, 560, 840])
    raw = (tmp_path / "c" / "model.safetensors.index.json").read_bytes()
    fast = parse_index(raw, "i")
    ref = IndexFile.model_validate(json.loads(raw))  # what the schema's models build from it
    assert fast == ref and index_to_json(fast) == index_to_json(ref)
    rs = fast.unickpt.tensors["1.weight"].slices[0].ranges  # type: ignore[union-attr]
    assert rs is not None and [(r.start, r.end) for r in rs] == [
        (0, 280),
        (280, 560),
        (560, 840),
        (840, 1120),
    ]
    obj = json.loads(raw)
    for bad, msg in [
        (
            [{"start": 0, "end": 280, "xxh3": "0" * 16}, {"start": 300, "end": 1120, "xxh3": "0" * 16}],
            "does not continue at byte 280",
        ),
        ([{"start": 0, "end": 1000, "xxh3": "0" * 16}], "ranges cover 1000 of its 1120 bytes"),
        ([{"start": 0, "end": 1120, "xxh3": "0" * 15}], "xxh3"),
        ([{"start": 0, "end": 1120}], "xxh3"),
        ([{"start": 0, "end": 1120, "xxh3": "0" * 16, "x": 1}], "x"),
    ]:
        obj["unickpt"]["tensors"]["1.weight"]["slices"][0]["ranges"] = bad
        data = json.dumps(obj).encode()
        with pytest.raises(IndexFileError, match=msg):
            parse_index(data, "i")


def test_a_flipped_byte_is_pinpointed_to_its_range(tmp_path: Path) -> None:
    m = _model()
    unickpt.GeneralCheckpointIO().save_model(m, tmp_path / "c", shard=True)
    d = _with_ranges(tmp_path / "c", "1.weight", [280, 560, 840])
    assert not verify_checkpoint(d)
    from unickpt.ckpt.safetensors_io import read_header

    fname = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]["1.weight"]
    h = read_header(str(d / fname))
    at = h.data_start + h.entries["1.weight"].begin + 600
    with open(d / fname, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x80]))
    report = verify_checkpoint(d)
    assert len(report) == 1 and isinstance(report[0], RangeFailure)
    assert (report[0].tensor, report[0].start, report[0].end) == ("1.weight", 560, 840)
    assert str(report[0]).startswith(
        f"tensor '1.weight' in file '{fname}' (stored as '1.weight'): bytes [560, 840) of the tensor"
    )
    from unickpt.ckpt.reader import open_checkpoint

    with open_checkpoint(d) as r:
        (f2,) = r.verify()
    assert isinstance(f2, RangeFailure) and (f2.start, f2.end) == (560, 840)
    with pytest.raises(IntegrityError, match=r"1\.weight.*bytes \[560, 840\)"):
        unickpt.GeneralCheckpointIO().load_model(_model(), d, verify=True)


def test_a_rank_that_cannot_see_the_files_says_the_directory_must_be_shared(tmp_path: Path) -> None:
    from unickpt.errors import UnsupportedError
    from unickpt.io.hf_save import _open_staged
    from unickpt.store.storage import LocalStorage

    missing = tmp_path / ".model-00001-of-00002.safetensors.tmp-0123456789ab"
    with pytest.raises(
        UnsupportedError,
        match=r"rank 3 cannot see the file rank 0 created.*must share the checkpoint directory",
    ):
        _open_staged(LocalStorage(str(tmp_path)), str(missing), 3)
