"""The bulk data-file paths of issue 18: headers validated in bulk, local reads coalesced per file,
verify rehashing runs of adjacent slices. Each test tries to slip something past the bulk path."""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from _reliability import count_preadv, row_sliced_checkpoint, row_sliced_model

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.ckpt.safetensors_io import parse_header
from unickpt.ckpt.stored_slices import ReadBatch, table_spans
from unickpt.errors import HeaderError, IncompleteCheckpointError
from unickpt.spec.naming import SLICED_SENTINEL, shard_name
from unickpt.spec.safetensors_bulk import HeaderEntries
from unickpt.store.storage import LocalStorage
from unickpt.tools import verify
from unickpt.tools.verify import verify_checkpoint

WORLD, TENSORS, COLS = 4, 30, 3


def _header(n: int) -> tuple[dict[str, Any], int]:
    """A header object of ``n`` F32 entries of 2 elements, back to back; and its data length."""
    obj: dict[str, Any] = {"__metadata__": {"format": "unickpt-sliced"}}
    for i in range(n):
        obj[f"t.{i}@0"] = {"dtype": "F32", "shape": [1, 2], "data_offsets": [8 * i, 8 * i + 8]}
    return obj, 8 * n


def _raw(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


@pytest.mark.parametrize("compact", [True, False])
def test_header_of_10k_entries_is_read_into_arrays(compact: bool) -> None:
    obj, n = _header(10_000)
    raw = _raw(obj) if compact else json.dumps(obj).encode()  # the compact form, and JSON's default
    entries, meta = parse_header(raw, n, "f")
    assert isinstance(entries, HeaderEntries)
    assert meta == {"format": "unickpt-sliced"} and len(entries) == 10_000
    e = entries["t.4321@0"]
    assert (e.dtype, e.shape, e.begin, e.end) == ("F32", (1, 2), 8 * 4321, 8 * 4322)
    assert "t.10000@0" not in entries and entries.get("nope") is None


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # one bad offset among 10k good ones: past the data section
        (
            lambda o: o["t.5000@0"].update(data_offsets=[40000, 80008]),
            r"tensor 't.5000@0': data_offsets \[40000, 80008\] out of range",
        ),
        # two entries overlap (the same bytes twice)
        (
            lambda o: o["t.7000@0"].update(data_offsets=[8 * 6999, 8 * 7000]),
            r"tensor 't.7000@0' at byte 55992 overlaps the previous tensor \(expected byte 56000\)",
        ),
        # a byte count that disagrees with dtype x shape
        (
            lambda o: o["t.3@0"].update(shape=[1, 3]),
            r"tensor 't.3@0': F32\[1, 3\] needs 12 bytes but data_offsets span 8",
        ),
        # a bool where an integer belongs (JSON true is not an int)
        (lambda o: o["t.9999@0"].update(shape=[True, 2]), r"tensor 't.9999@0': shape must be a list"),
        (lambda o: o["t.2@0"].update(dtype="F33"), r"tensor 't.2@0': unknown or unsupported dtype 'F33'"),
        (
            lambda o: o["t.2@0"].update(extra=1),
            r"tensor 't.2@0': entry must have exactly dtype, shape and data_offsets",
        ),
    ],
)
@pytest.mark.parametrize("compact", [True, False])
def test_header_names_the_one_bad_entry_among_10k(edit: Any, message: str, compact: bool) -> None:
    obj, n = _header(10_000)
    edit(obj)
    raw = _raw(obj) if compact else json.dumps(obj, indent=1).encode()
    with pytest.raises(HeaderError, match="^f: " + message):
        parse_header(raw, n, "f")


def test_header_finds_a_duplicate_key_among_10k() -> None:
    obj, n = _header(10_000)
    raw = _raw(obj)
    # The last entry's key repeated (its bytes then covered twice by a kept entry): a duplicate.
    dup = raw[:-1] + b',"t.0@0":{"dtype":"F32","shape":[1,2],"data_offsets":[0,8]}}'
    with pytest.raises(HeaderError, match=r"^f: safetensors header has a duplicate key 't.0@0'"):
        parse_header(dup, n, "f")
    # A colon inside a key is no member separator: the count still balances.
    obj2, n2 = _header(3)
    obj2["a:b"] = obj2.pop("t.2@0")
    got, _ = parse_header(_raw(obj2), n2, "f")
    assert "a:b" in got and got["a:b"].begin == 16


def _sliced(directory: Path) -> dict[str, np.ndarray]:
    return row_sliced_checkpoint(directory, WORLD, TENSORS, COLS)


def test_load_reads_each_file_in_one_preadv_and_is_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = _sliced(tmp_path)
    calls = count_preadv(monkeypatch)
    model = row_sliced_model(data)
    GeneralCheckpointIO().load_model(model, tmp_path)
    for n, want in data.items():
        assert np.array_equal(model.get_parameter(n).detach().numpy(), want), n
    # One run per file: the TENSORS slices of each rank's file are adjacent.
    assert calls == [TENSORS] * WORLD


@pytest.mark.parametrize("atomic", [False, True])
def test_a_file_truncated_in_the_middle_of_a_coalesced_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic: bool
) -> None:
    data = _sliced(tmp_path)
    victim = tmp_path / shard_name("model", 3, WORLD)
    real_run = ReadBatch.run

    def truncate_then_run(self: ReadBatch, *a: Any) -> None:  # after the headers were checked
        os.truncate(victim, victim.stat().st_size - 5 * 4 * COLS - 2)
        real_run(self, *a)

    monkeypatch.setattr(ReadBatch, "run", truncate_then_run)
    with pytest.raises(IncompleteCheckpointError) as ei:
        GeneralCheckpointIO(atomic_load=atomic).load_model(row_sliced_model(data), tmp_path)
    text = str(ei.value) + str(ei.value.__cause__)
    assert str(victim) in text and "truncated" in text


def test_read_batch_short_read_names_the_file(tmp_path: Path) -> None:
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(100)) * 10)
    fd = LocalStorage(str(tmp_path)).open_read(str(p))
    try:
        bufs = [memoryview(bytearray(100)) for _ in range(10)]
        batch = ReadBatch()
        for i in reversed(range(10)):  # added in any order, read in file order
            batch.add("f", 100 * i, bufs[i])
        os.truncate(p, 550)
        with pytest.raises(
            IncompleteCheckpointError,
            match=r"f.bin: file is truncated: wanted 1000 bytes at offset 0 .* ends after 550",
        ):
            batch.run(lambda _f: fd)
        assert bytes(bufs[4]) == bytes(range(100)) and bytes(bufs[5][:50]) == bytes(range(50))
    finally:
        fd.close()


def test_an_index_slice_whose_key_is_missing_from_the_header(tmp_path: Path) -> None:
    data = _sliced(tmp_path)
    f = tmp_path / shard_name("model", 2, WORLD)
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    # Same length: offsets stay valid, the header still tiles its data; one key renamed.
    header = raw[8 : 8 + n].replace(b'"layers.17.w@1"', b'"layers.17.x@1"')
    f.write_bytes(raw[:8] + header + raw[8 + n :])
    r = open_checkpoint(tmp_path)
    try:
        t = r.tensors["layers.17.w"]
        with pytest.raises(HeaderError, match=r"key 'layers.17.w@1' named by the index is not in the file"):
            table_spans(r.header, t.table, [0, 1, 2, 3])
    finally:
        r.close()
    with pytest.raises(
        HeaderError,
        match=r"tensor 'layers.17.w' \(key 'layers.17.w@1'\): index says F32\[1, 3\], file holds nothing under that key",
    ):
        GeneralCheckpointIO().load_model(row_sliced_model(data), tmp_path)
    with pytest.raises(
        HeaderError,
        match=r"tensor 'layers.17.w' \(key 'layers.17.w@1'\): index says F32\[1, 3\], file holds nothing under that key",
    ):
        verify_checkpoint(tmp_path)


def test_verify_in_runs_names_exactly_the_damaged_and_the_cut_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _sliced(tmp_path)
    assert not list(verify_checkpoint(tmp_path))
    f = tmp_path / shard_name("model", 1, WORLD)
    raw = bytearray(f.read_bytes())
    row = 4 * COLS
    raw[len(raw) - 10 * row + 1] ^= 0x40  # one bit of tensor 20's row 0
    f.write_bytes(bytes(raw))
    rep = verify_checkpoint(tmp_path)
    assert [(x.tensor, x.key) for x in rep] == [("layers.20.w", "layers.20.w@0")]
    assert rep.hashed == WORLD * TENSORS
    # Cut rank 3's file after the headers were read: its last two slices are unreadable.
    victim = tmp_path / shard_name("model", 4, WORLD)
    real = verify.verify_bulk

    def cut_then_verify(*a: Any) -> Any:
        os.truncate(victim, victim.stat().st_size - row - 2)
        return real(*a)

    monkeypatch.setattr(verify, "verify_bulk", cut_then_verify)
    rep = verify_checkpoint(tmp_path)
    got = [(x.tensor, x.key, x.found.startswith("unreadable")) for x in rep]
    assert got == [
        ("layers.20.w", "layers.20.w@0", False),
        ("layers.28.w", "layers.28.w@3", True),
        ("layers.29.w", "layers.29.w@3", True),
    ], got


def test_merge_copies_runs_bit_exact_and_names_a_damaged_slice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from safetensors.numpy import load_file

    from unickpt import merge_checkpoint
    from unickpt.errors import IntegrityError

    src = tmp_path / "src"
    src.mkdir()
    data = _sliced(src)
    calls = count_preadv(monkeypatch)
    merge_checkpoint(src, tmp_path / "out")
    monkeypatch.undo()
    assert calls == [TENSORS] * WORLD  # one read per file: every tensor's rows in one group
    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert set(merged) == set(data)
    for n, want in data.items():
        assert np.array_equal(merged[n], want), n
    f = src / shard_name("model", 2, WORLD)
    raw = bytearray(f.read_bytes())
    raw[len(raw) - 4 * COLS * 3] ^= 1  # tensor 27's row 1
    f.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError) as ei:
        merge_checkpoint(src, tmp_path / "out2")
    assert [(x.tensor, x.key) for x in ei.value.failures] == [("layers.27.w", "layers.27.w@1")]
    assert not (tmp_path / "out2").exists()


def test_only_the_sentinel_is_a_sentinel(tmp_path: Path) -> None:
    """The longer sentinel of the drafts 1 to 3 is a file name like any other at version 5 (``unickpt
    upgrade`` replaces it); a real file name among sentinels is refused as a mix."""
    from unickpt.errors import IndexFileError

    data = _sliced(tmp_path)
    ix = tmp_path / "model.safetensors.index.json"
    raw = ix.read_bytes()
    model = row_sliced_model(data)
    GeneralCheckpointIO().load_model(model, tmp_path)
    for n, want in data.items():
        assert np.array_equal(model.get_parameter(n).detach().numpy(), want), n
    old = "unickpt-sliced-checkpoint--run-unickpt-merge-to-load-with-huggingface.safetensors"
    ix.write_bytes(raw.replace(SLICED_SENTINEL.encode(), old.encode()))
    with pytest.raises(
        IndexFileError, match=r"weight_map describes a gathered checkpoint but unickpt\.layout\.gathered"
    ):
        open_checkpoint(tmp_path)
    obj = json.loads(raw)
    obj["weight_map"]["layers.0.w"] = shard_name("model", 1, WORLD)
    ix.write_text(json.dumps(obj))
    with pytest.raises(IndexFileError, match="weight_map mixes the sliced-checkpoint sentinel"):
        open_checkpoint(tmp_path)
