"""merge's fast paths behave exactly like the general ones they short-cut.

- coverage is shown in O(slices) for contiguous layouts (``_merge_tensors.validate_runs``): same checks,
  order and errors as ``CheckpointReader.validate_structure`` on every layout, valid or not;
- output files ask the kernel to start writeback while they are written (``start_writeback``),
  which never replaces the fsync of every file and directory before the commit rename;
- the single file's header is the placeholder block's dump with the real hashes patched in;
- a read that fails mid-copy raises the reader's error and leaves no output.
"""

from __future__ import annotations

import itertools
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_merge import _check_merged, _flat, _rand, _rows, _tensor, hand_made_reference

from unickpt import merge_checkpoint
from unickpt.ckpt.reader import UNICKPT_METADATA_KEY, CheckpointReader, open_checkpoint
from unickpt.ckpt.safetensors_io import read_header
from unickpt.errors import IncompleteCheckpointError, IntegrityError
from unickpt.spec.index import SliceEntry, TensorEntry, UnickptBlock
from unickpt.store import storage as storage_mod
from unickpt.tools import _merge_tensors as merge_tensors
from unickpt.tools import merge as merge_mod
from unickpt.tools._write import SliceData, TensorData, write_checkpoint

Boxes = list[tuple[tuple[int, ...], tuple[int, ...]]]


# ---------------------------------------------------------------------------- coverage shortcut
def _unchecked_reader(directory: Path, tensors: dict[str, tuple[list[int], Boxes]]) -> CheckpointReader:
    """A reader over an index that skipped schema validation (to reach the coverage check with
    out-of-bounds boxes, wrong dimension counts... as a hostile or buggy index would)."""
    entries = {
        name: TensorEntry.model_construct(
            dtype="F32",
            shape=list(shape),
            fingerprint=None,
            slices=[
                SliceEntry.model_construct(
                    file="model-00001-of-00001.safetensors",
                    key=f"{name}@{k}",
                    offsets=list(o),
                    shape=list(s),
                    xxh3=None,
                )
                for k, (o, s) in enumerate(boxes)
            ],
            param=None,
            state=None,
        )
        for name, (shape, boxes) in tensors.items()
    }
    block = UnickptBlock.model_construct(
        format_version=5,
        kind="model",
        created_by="test",
        tensors=entries,
        aliases={},
        param_groups=None,
        param_state={},
    )
    return CheckpointReader(
        str(directory), "model", block, str(directory / "model.safetensors.index.json"), True
    )


def _outcome(fn: Any) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # the exact type and message are what is compared
        return type(e).__name__, str(e)
    return "ok", ""


LAYOUTS: dict[str, tuple[list[int], Boxes]] = {
    "rows": ([6, 4], [((0, 0), (2, 4)), ((2, 0), (4, 4))]),
    "rows_unsorted": ([6, 4], [((2, 0), (4, 4)), ((0, 0), (2, 4))]),
    "rows_gap": ([6, 4], [((0, 0), (2, 4)), ((3, 0), (3, 4))]),
    "rows_overlap": ([6, 4], [((0, 0), (4, 4)), ((2, 0), (4, 4))]),
    "rows_duplicate": ([6, 4], [((0, 0), (6, 4)), ((0, 0), (6, 4))]),
    "rows_past_end": ([4, 2], [((0, 0), (4, 2)), ((4, 0), (1, 2))]),
    # Tiles the flat range [0, 6) exactly, but the second box lies outside the tensor.
    "flat_tiling_out_of_bounds": ([2, 3], [((0, 0), (1, 3)), ((0, 3), (1, 3))]),
    "negative_offset": ([4], [((-1,), (2,)), ((1,), (3,))]),
    "wrong_ndim": ([4, 4], [((0,), (16,))]),
    "scalar": ([], [((), ())]),
    "scalar_twice": ([], [((), ()), ((), ())]),
    "scalar_missing": ([], []),
    "empty_tensor": ([0, 4], [((0, 0), (0, 4))]),
    "empty_slice_among_rows": ([3, 4], [((0, 0), (3, 4)), ((3, 0), (0, 4))]),
    "columns": ([6, 10], [((0, 0), (6, 3)), ((0, 3), (6, 7))]),
    "columns_overlap": ([6, 10], [((0, 0), (6, 4)), ((0, 3), (6, 7))]),
    "zero_flat": ([5, 3, 7], _flat((5, 3, 7), 4)),
    "zero_flat_missing_piece": ([5, 3, 7], _flat((5, 3, 7), 4)[:-1]),
    "missing_everything": ([3, 3], []),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_fast_coverage_same_outcome_as_validate_structure(tmp_path: Path, name: str) -> None:
    # A valid layout goes on to the header check, which fails the same way in both (no file).
    r = _unchecked_reader(tmp_path, {"a.ok": LAYOUTS["rows"], name: LAYOUTS[name]})
    assert _outcome(lambda: merge_mod.validate_runs(r)) == _outcome(r.validate_structure)


def test_fast_coverage_same_outcome_on_random_layouts(tmp_path: Path) -> None:
    """Row and flat partitions, then perturbed: shifted, dropped, duplicated, grown boxes."""
    rng = random.Random(7)
    for _ in range(400):
        shape = [rng.randint(1, 6) for _ in range(rng.randint(1, 3))]
        parts = rng.randint(1, 4)
        boxes: Boxes = (
            _flat(tuple(shape), parts)
            if rng.random() < 0.5
            else _rows(tuple(shape), sorted(rng.sample(range(1, shape[0]), min(parts, shape[0]) - 1)))
        )
        boxes = list(boxes)
        what = rng.choice(["none", "shift", "drop", "dup", "grow", "shrink"])
        if boxes and what != "none":
            i = rng.randrange(len(boxes))
            o, s = boxes[i]
            d = rng.randrange(len(shape))
            if what == "shift":
                o = tuple(x + (1 if k == d else 0) for k, x in enumerate(o))
                boxes[i] = (o, s)
            elif what == "drop":
                del boxes[i]
            elif what == "dup":
                boxes.append(boxes[i])
            elif what == "grow":
                boxes[i] = (o, tuple(x + (1 if k == d else 0) for k, x in enumerate(s)))
            else:
                boxes[i] = (o, tuple(max(0, x - (1 if k == d else 0)) for k, x in enumerate(s)))
        rng.shuffle(boxes)
        r = _unchecked_reader(tmp_path, {"t": (shape, boxes)})
        assert _outcome(lambda r=r: merge_mod.validate_runs(r)) == _outcome(r.validate_structure), (
            shape,
            boxes,
        )


def test_fast_coverage_returns_the_runs_the_copy_uses(tmp_path: Path) -> None:
    tensors, _ = hand_made_reference()
    write_checkpoint(str(tmp_path / "src"), tensors, sliced=True, files=2)
    r = open_checkpoint(tmp_path / "src")
    runs = merge_mod.validate_runs(r)
    # Row-sliced tensors' runs are built when asked (the bulk merge reads their order instead).
    assert {n: runs[n] for n in r.tensors} == {n: merge_tensors.flat_runs(t) for n, t in r.tensors.items()}
    assert "rows.uneven" in runs.rows and "col.weight" not in runs.rows
    assert runs["col.weight"] is None and runs["rows.uneven"] is not None
    r.close()


# ---------------------------------------------------------------------------- writeback and fsync
def _big_source(directory: Path, parts: int = 4) -> dict[str, tuple[str, np.ndarray]]:
    """A few MiB over row slices, so a small writeback step is crossed many times."""
    ref = {}
    tensors = {}
    for i, (dtype, shape) in enumerate([("F32", (256, 1024)), ("BF16", (300, 512)), ("F32", (7,))]):
        arr = _rand(dtype, shape)
        name = f"layer{i}.weight"
        ref[name] = (dtype, arr)
        cuts = [shape[0] * k // parts for k in range(1, parts)]
        tensors[name] = _tensor(dtype, arr, _rows(shape, cuts))
    write_checkpoint(str(directory), tensors, sliced=True, files=parts)
    return ref


def test_writeback_hints_cover_the_file_and_every_fsync_precedes_the_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _big_source(tmp_path / "src")
    events: list[tuple[str, str, int, int]] = []
    real_fsync, real_rename, real_wb = os.fsync, os.rename, storage_mod.start_writeback

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"), 0, 0))
        real_fsync(fd)

    def rename(a: str, b: str) -> None:
        events.append(("rename", os.fspath(a), 0, 0))
        real_rename(a, b)

    def wb(fd: int, off: int, n: int) -> None:
        events.append(("writeback", os.readlink(f"/proc/self/fd/{fd}"), off, n))
        real_wb(fd, off, n)

    monkeypatch.setattr(merge_tensors, "_WRITEBACK", 256 << 10)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(storage_mod, "start_writeback", wb)
    out = tmp_path / "out"
    merge_checkpoint(tmp_path / "src", out)
    monkeypatch.undo()
    _check_merged(out, ref)

    (tmp,) = [e[1] for e in events if e[0] == "rename"]
    commit = [e[0] for e in events].index("rename")
    data = os.path.join(tmp, "model.safetensors")
    # Writeback was started in order, over consecutive ranges, before the file's fsync.
    ranges = [(off, n) for kind, path, off, n in events if kind == "writeback"]
    assert all(path == data for kind, path, _, _ in events if kind == "writeback")
    assert len(ranges) >= 4  # 1.3 MB written, a hint every 256 KiB
    assert ranges[0][0] == 0 and all(a + n == b for (a, n), (b, _) in itertools.pairwise(ranges))
    assert all(n >= 256 << 10 for _, n in ranges)
    last_wb = max(i for i, e in enumerate(events) if e[0] == "writeback")
    # The data file and the staging directory are fsynced after the last write hint and before
    # the rename; the parent directory after it.
    synced_before = [e[1] for e in events[:commit] if e[0] == "fsync"]
    assert data in synced_before and tmp in synced_before
    assert events.index(("fsync", data, 0, 0)) > last_wb
    assert ("fsync", str(tmp_path), 0, 0) in events[commit:]
    assert sorted(os.listdir(out)) == ["model.safetensors"]


def test_sharded_output_every_file_fsynced_before_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _big_source(tmp_path / "src")
    synced: list[str] = []
    renamed: list[str] = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd: int) -> None:
        synced.append(os.path.basename(os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(a: str, b: str) -> None:
        renamed.append(os.fspath(a))
        real_rename(a, b)

    monkeypatch.setattr(merge_tensors, "_WRITEBACK", 64 << 10)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    out = tmp_path / "out"
    merge_checkpoint(tmp_path / "src", out, max_shard_size=600_000)
    monkeypatch.undo()
    _check_merged(out, ref)
    files = sorted(os.listdir(out))
    assert len([f for f in files if f.endswith(".safetensors")]) >= 2
    assert {f for f in files if f.endswith(".safetensors")} <= set(synced)
    # The index is written to a temporary name, fsynced, then renamed into place.
    assert any(f.startswith(".model.safetensors.index.json.tmp-") for f in synced)
    assert os.path.basename(renamed[-1]) in synced  # the staging directory


@pytest.mark.parametrize("mode", ["unavailable", "failing"])
def test_writeback_hint_unavailable_or_failing_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    ref = _big_source(tmp_path / "src")
    calls: list[int] = []

    def failing(fd: int, off: int, n: int, flags: int) -> int:
        calls.append(n)
        return -1  # as sync_file_range does with EIO/EINVAL: the fsync that follows decides

    monkeypatch.setattr(storage_mod, "_sync_file_range_loaded", True)
    monkeypatch.setattr(storage_mod, "_sync_file_range", None if mode == "unavailable" else failing)
    monkeypatch.setattr(merge_tensors, "_WRITEBACK", 128 << 10)
    merge_checkpoint(tmp_path / "src", tmp_path / "out")
    _check_merged(tmp_path / "out", ref)
    assert (len(calls) > 0) == (mode == "failing")


def test_start_writeback_on_a_bad_descriptor_does_not_raise(tmp_path: Path) -> None:
    p = tmp_path / "f"
    p.write_bytes(b"x" * 10)
    fd = os.open(p, os.O_RDONLY)
    os.close(fd)
    storage_mod.start_writeback(fd, 0, 10)  # EBADF: a hint only
    storage_mod.start_writeback(-1, 0, 0)


# ---------------------------------------------------------------------------- failing reads
def test_read_failing_mid_copy_raises_it_and_leaves_no_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _big_source(tmp_path / "src")
    real = os.preadv
    n = {"calls": 0}

    def flaky(*a: Any, **k: Any) -> int:  # every data read goes through preadv (runs or slices)
        n["calls"] += 1
        if n["calls"] == 3:
            raise OSError(5, "Input/output error")
        return real(*a, **k)

    monkeypatch.setattr(os, "preadv", flaky)
    monkeypatch.setattr(storage_mod, "_PREADV", None)  # the batch's runs through os.preadv too
    out = tmp_path / "out"
    with pytest.raises(OSError, match="Input/output error"):
        merge_checkpoint(tmp_path / "src", out)
    assert n["calls"] == 3
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out")] == []


@pytest.mark.parametrize("verify", [True, False])
def test_source_truncated_after_validation_fails_and_leaves_no_output(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, verify: bool
) -> None:
    _big_source(tmp_path / "src")
    victim = tmp_path / "src" / "model-00003-of-00004.safetensors"
    real = merge_mod.validate_runs

    def then_truncate(r: CheckpointReader) -> Any:
        runs = real(r)
        h = read_header(victim)
        os.truncate(victim, h.data_start + 100)  # headers were fine; the data is now short
        return runs

    monkeypatch.setattr(merge_mod, "validate_runs", then_truncate)
    out = tmp_path / "out"
    with pytest.raises((IncompleteCheckpointError, OSError), match="truncated"):
        merge_checkpoint(tmp_path / "src", out, verify=verify)
    assert not out.exists()
    assert [p for p in os.listdir(tmp_path) if p.startswith(".out")] == []


# ---------------------------------------------------------------------------- single-file header
@pytest.mark.parametrize("fingerprints,dtype", [(True, None), (False, None), (False, "bf16")])
def test_single_file_header_is_a_valid_block_dump_with_real_hashes(
    tmp_path: Path, fingerprints: bool, dtype: str | None
) -> None:
    tensors, _ = hand_made_reference()
    write_checkpoint(str(tmp_path / "src"), tensors, sliced=True, files=2, fingerprints=fingerprints)
    out = tmp_path / "out"
    merge_checkpoint(tmp_path / "src", out, dtype=dtype)
    h = read_header(out / "model.safetensors")
    raw = json.loads(h.metadata[UNICKPT_METADATA_KEY])
    block = UnickptBlock.model_validate(raw)
    assert block.model_dump(mode="json", exclude_none=True) == raw
    assert json.dumps(raw) == h.metadata[UNICKPT_METADATA_KEY]  # key order as model_dump's
    r = open_checkpoint(out)
    assert r.verify() == []
    for name, t in block.tensors.items():
        assert t.slices[0].xxh3 is not None and t.slices[0].xxh3 != merge_mod._PLACEHOLDER
        src_dtype = tensors[name].dtype
        cast = (
            dtype is not None and src_dtype in ("F32", "F16", "BF16") and src_dtype != merge_mod.DTYPES[dtype]
        )
        assert (t.fingerprint is not None) == (fingerprints or cast), name
    r.close()


def test_progress_bar_output_identical(tmp_path: Path) -> None:
    tensors, ref = hand_made_reference()
    write_checkpoint(str(tmp_path / "src"), tensors, sliced=True, files=2)
    merge_checkpoint(tmp_path / "src", tmp_path / "a", progress=True)
    merge_checkpoint(tmp_path / "src", tmp_path / "b", progress=False)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (
        tmp_path / "b" / "model.safetensors"
    ).read_bytes()
    _check_merged(tmp_path / "a", ref)


def test_gathered_whole_tensors_without_verify_use_the_kernel_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, ref = hand_made_reference()
    whole = {n: TensorData(d, a.shape, [SliceData((0,) * a.ndim, a.shape, a)]) for n, (d, a) in ref.items()}
    write_checkpoint(str(tmp_path / "src"), whole, sliced=False, files=2)
    kernel: list[int] = []
    real = merge_tensors.TensorMerger._copy_file_range

    def spy(store: Any, src_fd: int, src_off: int, dst: Any, dst_off: int, n: int) -> None:
        kernel.append(n)
        real(store, src_fd, src_off, dst, dst_off, n)

    monkeypatch.setattr(merge_tensors.TensorMerger, "_copy_file_range", staticmethod(spy))
    merge_checkpoint(tmp_path / "src", tmp_path / "out", verify=False)
    _check_merged(tmp_path / "out", ref)
    assert sum(kernel) == sum(a.nbytes for _, a in ref.values())


def test_whole_tensor_slice_one_hash_checks_and_records(tmp_path: Path) -> None:
    """A tensor stored whole is hashed once: that hash is both checked and recorded."""
    _, ref = hand_made_reference()
    whole = {n: TensorData(d, a.shape, [SliceData((0,) * a.ndim, a.shape, a)]) for n, (d, a) in ref.items()}
    write_checkpoint(str(tmp_path / "src"), whole, sliced=False, files=2)
    out = tmp_path / "ok"
    merge_checkpoint(tmp_path / "src", out)
    _check_merged(out, ref)
    src = open_checkpoint(tmp_path / "src")
    merged = open_checkpoint(out)
    for name, t in merged.tensors.items():
        assert t.slices[0].xxh3 == src.tensors[name].slices[0].xxh3, name
    s = src.tensors["rows.uneven"].slices[0]
    path, off, n = src.key_location(s.file, s.key)
    src.close()
    merged.close()
    with open(path, "r+b") as f:
        f.seek(off + n - 1)
        b = f.read(1)
        f.seek(off + n - 1)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(IntegrityError) as ei:
        merge_checkpoint(tmp_path / "src", tmp_path / "bad")
    assert ei.value.tensor == "rows.uneven" and ei.value.file == s.file
    assert not (tmp_path / "bad").exists()
