"""Slices located in bulk (ckpt/stored_slices.py), read as arrays (ReadBatch, libc preadv) and
headers read in their compact form: each test hides one bad slice among thousands and checks
that load, verify and merge still raise the exact error of the slice-by-slice checks."""

from __future__ import annotations

import json
import os
import random
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from _reliability import count_preadv, row_sliced_checkpoint, row_sliced_model

from unickpt import GeneralCheckpointIO, merge_checkpoint
from unickpt.ckpt import stored_slices
from unickpt.ckpt.reader import CheckpointReader, open_checkpoint
from unickpt.ckpt.safetensors_io import encode_header, parse_header
from unickpt.ckpt.stored_slices import ReadBatch
from unickpt.errors import HeaderError, IncompleteCheckpointError, IntegrityError
from unickpt.spec import safetensors_bulk
from unickpt.spec.naming import shard_name, slice_key
from unickpt.store import storage as storage_mod
from unickpt.store.storage import LocalStorage
from unickpt.tools.verify import verify_checkpoint

WORLD, TENSORS, COLS = 32, 40, 3  # 1280 slices, 40 in each of 32 files


def _build(directory: Path, version: int) -> dict[str, np.ndarray]:
    """The index with listed slices (``version`` 1) or compact, as the writer writes it (3)."""
    return row_sliced_checkpoint(directory, WORLD, TENSORS, COLS, listed=version == 1)


def _edit_header(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Rewrite the header of ``path`` through ``edit``, keeping its length (spaces pad it)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    obj = json.loads(raw[8 : 8 + n])
    edit(obj)
    new = json.dumps(obj, separators=(",", ":")).encode()
    assert len(new) <= n
    path.write_bytes(raw[:8] + new + b" " * (n - len(new)) + raw[8 + n :])


# One entry of rank 29's file (the 30th of 32) for tensor 37 (the 38th of 40).
VICTIM, RANK = "layers.37.w", 29
KEY = slice_key(VICTIM, RANK)


def _victim_file(d: Path) -> Path:
    return d / shard_name("model", RANK + 1, WORLD)


@pytest.mark.parametrize("version", [1, 3])
@pytest.mark.parametrize(
    ("edit", "load_msg", "verify_msg"),
    [
        (  # the right byte count, another dtype
            lambda o: o[KEY].update(dtype="I32"),
            r"tensor 'layers.37.w' \(key 'layers.37.w@29'\): index says F32\[1, 3\], file holds I32\[1, 3\]",
            r"tensor 'layers.37.w' \(key 'layers.37.w@29'\): index says F32\[1, 3\], file holds I32\[1, 3\]",
        ),
        (  # the right byte count, another shape
            lambda o: o[KEY].update(shape=[3, 1]),
            r"tensor 'layers.37.w' \(key 'layers.37.w@29'\): index says F32\[1, 3\], file holds F32\[3, 1\]",
            r"tensor 'layers.37.w' \(key 'layers.37.w@29'\): index says F32\[1, 3\], file holds F32\[3, 1\]",
        ),
        (  # the key renamed (same length): the index's key is missing, the file has an extra one
            lambda o: o.__setitem__("layers.37.x@29", o.pop(KEY)),
            r"tensor 'layers.37.w' \(key 'layers.37.w@29'\): index says F32\[1, 3\], file holds nothing under that key",
            r"tensor 'layers.37.w' \(key 'layers.37.w@29'\): index says F32\[1, 3\], file holds nothing under that key",
        ),
    ],
    ids=["dtype", "shape", "missing-key"],
)
def test_one_bad_header_entry_among_thousands(
    tmp_path: Path, version: int, edit: Any, load_msg: str, verify_msg: str
) -> None:
    data = _build(tmp_path, version)
    _edit_header(_victim_file(tmp_path), edit)
    where = str(_victim_file(tmp_path))
    with pytest.raises(HeaderError, match=load_msg) as ei:
        GeneralCheckpointIO().load_model(row_sliced_model(data), tmp_path)
    assert where in str(ei.value)
    with pytest.raises(HeaderError, match=verify_msg) as ei:
        verify_checkpoint(tmp_path)
    assert where in str(ei.value)
    with pytest.raises(HeaderError, match=verify_msg):
        merge_checkpoint(tmp_path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("version", [1, 3])
def test_two_entries_with_swapped_offsets_among_thousands(tmp_path: Path, version: int) -> None:
    """A valid header whose two keys point at each other's bytes: located fine, caught by the hashes."""
    data = _build(tmp_path, version)
    other = slice_key("layers.12.w", RANK)

    def swap(o: dict[str, Any]) -> None:
        o[KEY]["data_offsets"], o[other]["data_offsets"] = o[other]["data_offsets"], o[KEY]["data_offsets"]

    _edit_header(_victim_file(tmp_path), swap)
    report = verify_checkpoint(tmp_path)
    assert [(f.tensor, f.key) for f in report] == [("layers.12.w", other), (VICTIM, KEY)]
    rows = {n: data[n][RANK : RANK + 1].tobytes() for n in ("layers.12.w", VICTIM)}
    assert report[1].expected == xxhash.xxh3_64(rows[VICTIM]).hexdigest()
    assert report[1].found == xxhash.xxh3_64(rows["layers.12.w"]).hexdigest()
    assert report.hashed == WORLD * TENSORS
    with pytest.raises(IntegrityError, match=r"layers\.12\.w"):
        merge_checkpoint(tmp_path, tmp_path / "out")
    with pytest.raises(IntegrityError):
        GeneralCheckpointIO().load_model(row_sliced_model(data), tmp_path, verify=True)
    model = row_sliced_model(data)  # without verify, the bytes the header names are what is read
    GeneralCheckpointIO().load_model(model, tmp_path)
    got = model.get_parameter(VICTIM).detach().numpy()
    assert np.array_equal(got[RANK], data["layers.12.w"][RANK])
    assert np.array_equal(np.delete(got, RANK, 0), np.delete(data[VICTIM], RANK, 0))


@pytest.mark.parametrize("version", [1, 3])
def test_load_verify_merge_are_bit_exact(tmp_path: Path, version: int) -> None:
    data = _build(tmp_path, version)
    model = row_sliced_model(data)
    GeneralCheckpointIO().load_model(model, tmp_path, verify=True)
    for n, want in data.items():
        assert np.array_equal(model.get_parameter(n).detach().numpy(), want), n
    report = verify_checkpoint(tmp_path)
    assert list(report) == [] and report.hashed == WORLD * TENSORS
    out = merge_checkpoint(tmp_path, tmp_path / "out")
    r = open_checkpoint(out)
    try:
        for n, want in data.items():
            t = r.tensors[n]
            (s,) = t.slices
            assert bytes(r.read_key(s.file, s.key)) == want.tobytes(), n
    finally:
        r.close()


def test_verify_of_a_file_truncated_after_validation_names_each_slice_cut(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _build(tmp_path, 3)
    victim = _victim_file(tmp_path)
    real = CheckpointReader.validate_structure

    def then_truncate(self: CheckpointReader) -> None:
        real(self)
        os.truncate(victim, victim.stat().st_size - 10 * 4 * COLS - 2)  # into the 11th-last row

    monkeypatch.setattr(CheckpointReader, "validate_structure", then_truncate)
    report = verify_checkpoint(tmp_path)
    assert [f.key for f in report] == [slice_key(f"layers.{i}.w", RANK) for i in range(TENSORS - 11, TENSORS)]
    assert all(
        f.found.startswith(f"unreadable ({victim}: file is truncated") and f.file == victim.name
        for f in report
    )
    assert report.hashed == WORLD * TENSORS


def test_read_batch_joins_pieces_adjacent_in_file_and_destination(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)) * 4)
    libc = storage_mod._PREADV
    calls = count_preadv(monkeypatch)
    fd = LocalStorage(str(tmp_path)).open_read(str(p))
    try:
        dst = np.zeros(64, dtype=np.uint8)
        other = np.zeros(16, dtype=np.uint8)
        batch = ReadBatch()
        table = type("T", (), {"files": ["f"], "file_ids": np.zeros(8, dtype=np.int64)})()
        ks = np.arange(8, dtype=np.int64)
        # eight 8-byte rows of one destination, added out of order: one piece
        order = np.asarray([3, 0, 7, 1, 2, 6, 5, 4])
        batch.add_many(table, ks, 100 + 8 * order, 8 * order, 8 * order + 8, memoryview(dst))
        batch.add("f", 164, memoryview(other))  # adjacent in the file, another buffer
        batch.run(lambda _f: fd)
        assert bytes(dst) == (bytes(range(256)) * 4)[100:164]
        assert bytes(other) == (bytes(range(256)) * 4)[164:180]
        if libc is not None:
            assert calls == [2]  # one call: the joined rows and the other buffer
    finally:
        fd.close()


def test_read_batch_falls_back_to_python_buffers_when_libc_preadv_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(200)))
    monkeypatch.setattr(storage_mod, "_PREADV", lambda *a: -1)
    fd = LocalStorage(str(tmp_path)).open_read(str(p))
    try:
        bufs = [bytearray(10) for _ in range(5)]
        batch = ReadBatch()
        for i, b in enumerate(bufs):
            batch.add("f", 50 + 10 * i, memoryview(b))
        batch.run(lambda _f: fd)
        assert b"".join(bufs) == bytes(range(50, 100))
        os.truncate(p, 75)
        for i, b in enumerate(bufs):
            batch.add("f", 50 + 10 * i, memoryview(b))
        with pytest.raises(
            IncompleteCheckpointError, match=r"f.bin: file is truncated: wanted 50 bytes at offset 50"
        ):
            batch.run(lambda _f: fd)
    finally:
        fd.close()


def test_read_batch_refuses_a_read_outside_its_buffer(tmp_path: Path) -> None:
    batch = ReadBatch()
    table = type("T", (), {"files": ["f"], "file_ids": np.zeros(1, dtype=np.int64)})()
    one = np.zeros(1, dtype=np.int64)
    batch.add_many(table, one, one, one + 4, one + 12, memoryview(bytearray(8)))
    with pytest.raises(ValueError, match="outside its destination buffer"):
        batch.run(lambda _f: None)  # type: ignore[arg-type,return-value]  # refused before any read


def _decoded(raw: bytes, n: int) -> Any:
    """What ``json`` itself reads in a header (entries as tuples, metadata): the oracle."""
    obj = json.loads(raw)
    meta = obj.pop("__metadata__", {})
    return {k: (v["dtype"], tuple(v["shape"]), *v["data_offsets"]) for k, v in obj.items()}, meta


def test_compact_header_form_agrees_with_json_under_mutation() -> None:
    """Random one-byte edits of a compact header: whatever the header parser accepts (in the
    compact reading or the JSON one) is what ``json`` reads in it; everything else is refused with
    a ``HeaderError`` naming the file."""
    header, _ = encode_header(
        [(f"t.{i}@{i % 3}", "BF16" if i % 2 else "F32", (1, 2 + i % 2)) for i in range(40)], {"format": "x"}
    )
    raw = header[8:]
    n = sum(2 * (2 + i % 2) * (1 if i % 2 else 2) for i in range(40))
    assert safetensors_bulk._parse_canonical(raw.decode(), n, "f") is not None
    rng = random.Random(7)
    alphabet = b'0123456789,:{}[]"\\ aF@.-'
    accepted = compact = refused = 0
    for _ in range(400):
        b = bytearray(raw)
        b[rng.randrange(len(b))] = rng.choice(alphabet)
        try:
            text = bytes(b).decode()
        except UnicodeDecodeError:
            continue
        try:
            fast = safetensors_bulk._parse_canonical(text, n, "f")
            entries, meta = parse_header(bytes(b), n, "f")
        except HeaderError as e:
            assert str(e).startswith("f: ")
            refused += 1
            continue
        accepted += 1
        compact += fast is not None
        got = {k: (e.dtype, e.shape, e.begin, e.end) for k, e in entries.items()}
        assert (got, meta) == _decoded(bytes(b), n)
    assert compact > 10 and refused > 100  # edits inside keys and the metadata keep the form


@pytest.mark.parametrize(
    "text",
    [
        '{"a":{"dtype":"F32","shape":[01],"data_offsets":[0,4]}}',  # a leading zero
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        '{"__metadata__":{"k":"v","k":"w"},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"__metadata__":{"dtype":"F32","shape":[1],'
        '"data_offsets":[0,4]}}',
        '{"a\\u0062":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',  # an escape
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}} x',  # trailing garbage
        '{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,12345678901234567890123]}}',  # 23 digits
    ],
)
def test_compact_header_form_leaves_the_unusual_to_the_json_path(text: str) -> None:
    assert safetensors_bulk._parse_canonical(text, 4, "f") is None


def _file(d: Path, rank: int) -> Path:
    return d / shard_name("model", rank + 1, WORLD)


def test_location_names_the_first_bad_slice_in_the_order_asked(tmp_path: Path) -> None:
    """Three bad slices in three files; whichever order the files are read in, the error is that
    of the first bad slice in the order asked (tensor by tensor, slice by slice)."""
    _build(tmp_path, 3)
    _edit_header(_file(tmp_path, 29), lambda o: o["layers.37.w@29"].update(dtype="I32"))
    _edit_header(_file(tmp_path, 3), lambda o: o.__setitem__("layers.38.x@3", o.pop("layers.38.w@3")))
    _edit_header(_file(tmp_path, 30), lambda o: o["layers.37.w@30"].update(shape=[3, 1]))
    with open_checkpoint(tmp_path) as r:
        with pytest.raises(
            HeaderError, match=r"tensor 'layers.37.w' \(key 'layers.37.w@29'\): .*holds I32\[1, 3\]"
        ):
            r.validate_structure()
        t37, t38 = r.tensors["layers.37.w"], r.tensors["layers.38.w"]
        later_first = [
            ("layers.38.w", "F32", t38.table, np.arange(WORLD, dtype=np.int64)),
            ("layers.37.w", "F32", t37.table, np.arange(WORLD, dtype=np.int64)),
        ]
        with pytest.raises(
            HeaderError,
            match=r"^\S+model-00004-of-00032.safetensors: tensor 'layers.38.w' \(key "
            r"'layers.38.w@3'\): index says F32\[1, 3\], file holds nothing under that key$",
        ):
            stored_slices.locate(r.header, later_first)
        backwards = [("layers.37.w", "F32", t37.table, np.asarray([31, 30, 29, 0], dtype=np.int64))]
        with pytest.raises(
            HeaderError,
            match=r"model-00031-of-00032.safetensors: .*'layers.37.w@30'\): index says "
            r"F32\[1, 3\], file holds F32\[3, 1\]$",
        ):
            stored_slices.locate(r.header, backwards)
        with pytest.raises(
            HeaderError, match=r"tensor 'layers.36.w' \(key 'layers.36.w@0'\): index says BF16"
        ):
            stored_slices.locate(
                r.header, [("layers.36.w", "BF16", r.tensors["layers.36.w"].table, np.arange(2))]
            )
        spans, matched = stored_slices.locate(r.header, [(*later_first[0][:3], np.asarray([5, 4]))])
        assert spans[0][1].tolist() == [12, 12] and spans[0][0][0] - spans[0][0][1] == 0  # (each file's 39th)
        assert matched == {shard_name("model", 6, WORLD): 1, shard_name("model", 5, WORLD): 1}
        # The byte ranges alone: the first key missing in the order asked is named.
        with pytest.raises(
            HeaderError, match=r"model-00004-of-00032.safetensors: key 'layers.38.w@3' named by"
        ):
            stored_slices.table_spans(r.header, t38.table, [31, 3, 0])
        names, offs, lens = stored_slices.table_spans(r.header, t37.table, [2, 1])
        assert names == [shard_name("model", 3, WORLD), shard_name("model", 2, WORLD)] and lens == [12, 12]
        assert offs == [
            r.header(names[0]).absolute("layers.37.w@2")[0],
            r.header(names[1]).absolute("layers.37.w@1")[0],
        ]
