"""Corruption of a committed checkpoint is found and named, never loaded silently.

Bit flips in data sections are found by ``verify`` and ``load_model(verify=True)``, each failure naming
the tensor and the file. Structural damage (truncation, a missing file, an edited header, an index
pointing at the wrong file) is also refused by ``load_model(verify=False)`` before any byte is copied.
"""

from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

import pytest
from _reliability import (
    Tiny,
    data_files,
    header_of,
    read_index,
    same_state,
    save_checkpoint,
    snapshot,
    write_index,
)

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import IntegrityError, UnickptError

# Positions inside each tensor's bytes where one bit is flipped (fractions of its length).
FLIP_AT = [0.0, 0.13, 0.5, 0.77, 1.0]


def _tensor_of_key(ck: Path) -> dict[tuple[str, str], str]:
    """(file, key) -> tensor name, from the index."""
    idx = read_index(ck)
    return {(s["file"], s["key"]): n for n, t in idx["unickpt"]["tensors"].items() for s in t["slices"]}


def _flip(path: Path, pos: int, bit: int) -> None:
    with open(path, "r+b") as f:
        f.seek(pos)
        b = f.read(1)[0]
        f.seek(pos)
        f.write(bytes([b ^ (1 << bit)]))


def _locations(ck: Path) -> list[tuple[str, str, int]]:
    """(file, key, absolute byte) for FLIP_AT positions of every tensor of every data file."""
    out = []
    for f in data_files(ck):
        h, start = header_of(ck / f)
        for key, e in h.items():
            if key == "__metadata__":
                continue
            b, end = e["data_offsets"]
            if end == b:
                continue
            for frac in FLIP_AT:
                out.append((f, key, start + b + min(end - b - 1, int(frac * (end - b)))))
    return out


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    ck = tmp_path_factory.mktemp("pristine") / "ck"
    save_checkpoint(ck)
    assert len(data_files(ck)) >= 3
    return ck


@pytest.fixture()
def ck(pristine: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "ck"
    dst.mkdir()
    for f in os.listdir(pristine):
        (dst / f).write_bytes((pristine / f).read_bytes())
    return dst


def test_every_single_bit_flip_is_found(ck: Path) -> None:
    """One flipped bit at several places of every tensor of every file: each found and named."""
    names = _tensor_of_key(ck)
    rng = random.Random(0)
    locs = _locations(ck)
    assert len(locs) >= 20
    io = GeneralCheckpointIO()
    for f, key, pos in locs:
        bit = rng.randrange(8)
        _flip(ck / f, pos, bit)
        try:
            failures = open_checkpoint(ck).verify()
            assert [(x.tensor, x.file) for x in failures] == [(names[(f, key)], f)], (f, key, pos)
            m = Tiny(9)
            snap = snapshot(m)
            with pytest.raises(IntegrityError) as ei:
                io.load_model(m, ck, verify=True)
            assert [(x.tensor, x.file) for x in ei.value.failures] == [(names[(f, key)], f)]
            assert names[(f, key)] in str(ei.value) and f in str(ei.value)
            assert same_state(m, snap), "model changed although verification failed"
        finally:
            _flip(ck / f, pos, bit)
    assert open_checkpoint(ck).verify() == []


def test_many_flips_all_reported_together(ck: Path) -> None:
    names = _tensor_of_key(ck)
    flipped = {}
    for f, key, pos in _locations(ck):
        if (f, key) not in flipped:
            _flip(ck / f, pos, 3)
            flipped[(f, key)] = names[(f, key)]
    failures = open_checkpoint(ck).verify()
    assert sorted((x.tensor, x.file) for x in failures) == sorted((n, f) for (f, _), n in flipped.items())
    with pytest.raises(IntegrityError) as ei:
        GeneralCheckpointIO().load_model(Tiny(3), ck, verify=True)
    assert len(ei.value.failures) == len(flipped)


def _structural_check(ck: Path, affected_file: str, expected_tensors: set[str]) -> None:
    """verify() names each tensor of the damaged file; load_model refuses before copying."""
    failures = open_checkpoint(ck).verify()
    assert {x.tensor for x in failures} == expected_tensors
    assert {x.file for x in failures} == {affected_file}
    for verify in (False, True):
        m = Tiny(9)
        snap = snapshot(m)
        with pytest.raises(UnickptError) as ei:
            GeneralCheckpointIO().load_model(m, ck, verify=verify)
        assert affected_file in str(ei.value)
        assert same_state(m, snap)


def _tensors_in(ck: Path, file: str) -> set[str]:
    return {n for (f, _), n in _tensor_of_key(ck).items() if f == file}


@pytest.mark.parametrize("where", ["zero", "mid_header", "end_of_header", "mid_data", "last_byte"])
def test_truncated_file(ck: Path, where: str) -> None:
    for f in data_files(ck):
        p = ck / f
        data = p.read_bytes()
        _, start = header_of(p)
        cut = {
            "zero": 0,
            "mid_header": start // 2,
            "end_of_header": start,
            "mid_data": (start + len(data)) // 2,
            "last_byte": len(data) - 1,
        }[where]
        p.write_bytes(data[:cut])
        _structural_check(ck, f, _tensors_in(ck, f))
        p.write_bytes(data)


def test_missing_shard_file(ck: Path) -> None:
    for f in data_files(ck):
        data = (ck / f).read_bytes()
        os.unlink(ck / f)
        _structural_check(ck, f, _tensors_in(ck, f))
        (ck / f).write_bytes(data)


def test_appended_garbage(ck: Path) -> None:
    f = data_files(ck)[0]
    with open(ck / f, "ab") as fh:
        fh.write(b"\0" * 4)
    _structural_check(ck, f, _tensors_in(ck, f))


def _rewrite_header(p: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Apply ``edit`` to the header JSON, keeping its length (padded with spaces) so the data stays put."""
    data = p.read_bytes()
    h, start = header_of(p)
    edit(h)
    raw = json.dumps(h, separators=(",", ":")).encode()
    assert len(raw) <= start - 8, "edited header grew"
    raw += b" " * (start - 8 - len(raw))
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + data[start:])


@pytest.mark.parametrize("edit", ["dtype", "shape", "rename_key", "metadata"])
def test_edited_header(ck: Path, edit: str) -> None:
    f = next(f for f in data_files(ck) if any(n == "a" for n in _tensors_in(ck, f)))
    (key,) = [k for (ff, k), n in _tensor_of_key(ck).items() if ff == f and n == "a"]

    def change(h: dict) -> None:  # type: ignore[type-arg]
        e = h[key]
        if edit == "dtype":
            e["dtype"] = "I32"  # same item size: the byte count still adds up
        elif edit == "shape":
            e["shape"] = list(reversed(e["shape"]))
        elif edit == "rename_key":
            h["b" * len(key)] = h.pop(key)
        else:
            h["__metadata__"] = {"format": "tf"}

    _rewrite_header(ck / f, change)
    if edit == "metadata":  # harmless: metadata is informational, the data is intact
        assert open_checkpoint(ck).verify() == []
        GeneralCheckpointIO().load_model(Tiny(9), ck, verify=True)
        return
    _structural_check(ck, f, {"a"})


def test_index_points_at_wrong_file(ck: Path) -> None:
    idx = read_index(ck)
    files = data_files(ck)
    t = idx["unickpt"]["tensors"]["b"]
    right = t["slices"][0]["file"]
    wrong = next(f for f in files if f != right)
    t["slices"][0]["file"] = wrong
    idx["weight_map"]["b"] = wrong
    write_index(ck, idx)
    failures = open_checkpoint(ck).verify()
    assert [(x.tensor, x.file) for x in failures] == [("b", wrong)]
    for verify in (False, True):
        m = Tiny(9)
        snap = snapshot(m)
        with pytest.raises(UnickptError, match=wrong):
            GeneralCheckpointIO().load_model(m, ck, verify=verify)
        assert same_state(m, snap)


def test_swapped_shard_files(ck: Path) -> None:
    f1, f2 = data_files(ck)[:2]
    os.rename(ck / f1, ck / "tmp.safetensors")
    os.rename(ck / f2, ck / f1)
    os.rename(ck / "tmp.safetensors", ck / f2)
    failures = open_checkpoint(ck).verify()
    assert {x.file for x in failures} == {f1, f2}
    m = Tiny(9)
    snap = snapshot(m)
    with pytest.raises(UnickptError):
        GeneralCheckpointIO().load_model(m, ck)
    assert same_state(m, snap)


def test_index_hash_edited(ck: Path) -> None:
    idx = read_index(ck)
    s = idx["unickpt"]["tensors"]["c"]["slices"][0]
    s["xxh3"] = "0123456789abcdef"
    write_index(ck, idx)
    failures = open_checkpoint(ck).verify()
    assert [(x.tensor, x.file) for x in failures] == [("c", s["file"])]
    with pytest.raises(IntegrityError):
        GeneralCheckpointIO().load_model(Tiny(9), ck, verify=True)


def test_single_file_checkpoint_bit_flips(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    GeneralCheckpointIO().save_model(Tiny(0), str(p))
    h, start = header_of(p)
    size = p.stat().st_size
    rng = random.Random(1)
    flips = 0
    for pos in [start, size - 1, *rng.sample(range(start, size), 20)]:
        owner = next(
            k
            for k, e in h.items()
            if k != "__metadata__" and start + e["data_offsets"][0] <= pos < start + e["data_offsets"][1]
        )
        _flip(p, pos, 0)
        failures = open_checkpoint(p).verify()
        assert [x.tensor for x in failures] == [owner]
        with pytest.raises(IntegrityError):
            GeneralCheckpointIO().load_model(Tiny(9), p, verify=True)
        _flip(p, pos, 0)
        flips += 1
    assert flips == 22 and open_checkpoint(p).verify() == []


def test_bit_flips_in_header_never_escape(ck: Path) -> None:
    """Flip every bit of the first header bytes and a sample of the rest: an error or a clean load, nothing else."""
    f = data_files(ck)[0]
    p = ck / f
    _, start = header_of(p)
    data = p.read_bytes()
    rng = random.Random(2)
    positions = list(range(0, 16)) + rng.sample(range(16, start), min(60, start - 16))
    for pos in positions:
        bit = rng.randrange(8)
        _flip(p, pos, bit)
        m = Tiny(9)
        snap = snapshot(m)
        try:
            GeneralCheckpointIO().load_model(m, ck, verify=True)
        except UnickptError:
            assert same_state(m, snap)
        p.write_bytes(data)
