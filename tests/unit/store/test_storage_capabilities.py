"""Writes choose their strategy from what the store says it can do (``store/storage.py``).

A store with ``range_write`` gets the in-place strategies (a single file's header rewritten at
offset 0 once hashed, a gathered save's ranks ``pwrite``-ing their bytes); one without gets the
hashed-first single file and the funnelled gathered save, whatever its location. Every strategy
writes the same bytes, locally and on S3 (moto's server).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch

from unickpt.ckpt.reader import open_checkpoint
from unickpt.ckpt.writer import build_block, tensor_entry, write_single_file
from unickpt.errors import IncompleteCheckpointError, UnsupportedError
from unickpt.io import save as save_mod
from unickpt.io.save import SaveOptions, save_tensors
from unickpt.io.tensors import local_slices
from unickpt.spec.index import LayoutInfo
from unickpt.spec.slice_table import SliceTable
from unickpt.store.storage import FsspecStorage, LocalRange, LocalStorage, Location, RangeFile, open_storage
from unickpt.tools.merge import merge_checkpoint

SAVE_ID = "0123456789abcdef" * 2


class CountingLocal(LocalStorage):
    """Local files; counts the range writes asked of it."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.pwrites = 0
        self.opened: list[str] = []

    def open_range(self, path: str, *, size: int | None = None, header: bytes = b"") -> RangeFile:
        f = super().open_range(path, size=size, header=header)
        self.opened.append(os.path.basename(path))
        store = self
        inner = f.pwrite

        def pwrite(data: memoryview | bytes, offset: int) -> None:
            store.pwrites += 1
            inner(data, offset)

        f.pwrite = pwrite  # type: ignore[method-assign]
        return f


class StreamOnlyLocal(CountingLocal):
    """Local files on a store that says it cannot write at offsets."""

    range_write = False

    def open_range(self, path: str, *, size: int | None = None, header: bytes = b"") -> RangeFile:
        raise AssertionError(f"open_range({path}) asked of a store without range_write")


class CountingFsspec(FsspecStorage):
    """An fsspec store (memory://) that records any range write asked of it."""

    asked: list[str]

    def open_range(self, path: str, *, size: int | None = None, header: bytes = b"") -> RangeFile:
        self.asked.append(path)
        return super().open_range(path, size=size, header=header)


def _blocks(specs: list[tuple[str, str, tuple[int, ...]]], arrays: dict[str, np.ndarray]) -> Any:
    for key, _dtype, shape in specs:
        yield key, arrays[key].view(np.uint8).reshape(-1), (shape, (0,) * len(shape), shape)


def _single(store: Any, path: str) -> dict[str, Any]:
    g = np.random.default_rng(3)
    arrays = {"a": g.standard_normal((64, 33)).astype(np.float32), "b": np.arange(10, dtype=np.int64)}
    specs = [("a", "F32", (64, 33)), ("b", "I64", (10,))]

    def make_block(written: Any, placeholder: bool) -> Any:
        dt = {"a": "F32", "b": "I64"}
        tensors = {
            k: tensor_entry(
                k,
                dt[k],
                arrays[k].shape,
                SliceTable.from_entries(k, arrays[k].shape, [_slice(k, arrays[k].shape, written[k][0])]),
                [written[k][1]],
                placeholder=placeholder,
            )
            for k in arrays
        }
        return build_block(
            kind="model",
            created_by="test",
            layout=LayoutInfo(),
            tensors=tensors,
            aliases=None,
            save_id=SAVE_ID,
        )

    return write_single_file(
        path, specs, _blocks(specs, arrays), make_block, kind="model", save_id=SAVE_ID, storage=store
    )


def _slice(key: str, shape: tuple[int, ...], xxh: str | None) -> Any:
    from unickpt.spec.index import SliceEntry

    return SliceEntry(
        file="model.safetensors", key=key, offsets=[0] * len(shape), shape=list(shape), xxh3=xxh
    )


def test_capabilities_are_what_each_store_can_do(tmp_path: Path) -> None:
    local, root = open_storage(str(tmp_path))
    assert isinstance(local, LocalStorage) and root == str(tmp_path)
    assert (local.range_write, local.atomic_rename, local.exclusive_put) == (True, True, True)
    assert (local.durable_sync, local.kernel_copy) == (True, True)
    mem = FsspecStorage(fsspec.filesystem("memory"), "memory://caps")
    assert (mem.range_write, mem.atomic_rename, mem.exclusive_put) == (False, False, False)
    assert (mem.durable_sync, mem.kernel_copy) == (False, False)
    with pytest.raises(
        UnsupportedError, match=r"memory://caps: this storage cannot write a file at an offset"
    ):
        mem.open_range("/caps/x")
    with pytest.raises(UnsupportedError, match=r"memory://caps: this storage has no copy between its files"):
        mem.copy_range(0, 0, LocalRange("x", -1), 0, 1)


def test_local_range_file_is_created_sized_refuses_an_existing_file_and_copies(tmp_path: Path) -> None:
    store = LocalStorage(str(tmp_path))
    p = str(tmp_path / "f")
    f = store.open_range(p, size=100, header=b"HEAD")
    f.pwrite(b"xy", 98)
    f.sync()
    f.close()
    data = (tmp_path / "f").read_bytes()
    assert len(data) == 100 and data[:4] == b"HEAD" and data[98:] == b"xy" and data[4:98] == bytes(94)
    with pytest.raises(FileExistsError):
        store.open_range(p, size=10)
    with pytest.raises(FileNotFoundError):
        store.open_range(str(tmp_path / "missing"))
    # copy_range: the kernel's copy between two files of the store, exact bytes at the offsets
    src = tmp_path / "src"
    src.write_bytes(bytes(range(256)) * 64)
    dst = store.open_range(str(tmp_path / "dst"), size=20000)
    fd = os.open(src, os.O_RDONLY)
    try:
        store.copy_range(fd, 1000, dst, 7, 9000)
        with pytest.raises(
            IncompleteCheckpointError, match=r"copying to .*dst: the source is truncated at byte 16384"
        ):
            store.copy_range(fd, 16000, dst, 15000, 1000)
    finally:
        os.close(fd)
        dst.close()
    got = (tmp_path / "dst").read_bytes()
    assert got[7 : 7 + 9000] == src.read_bytes()[1000:10000] and got[:7] == bytes(7)


def test_a_store_that_range_writes_rewrites_the_single_files_header_in_place(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    ranged = CountingLocal(str(tmp_path / "a"))
    r1 = _single(ranged, str(tmp_path / "a" / "model.safetensors"))
    # The placeholder header is rewritten once, at offset 0, in the staged file
    assert (
        ranged.pwrites == 1
        and len(ranged.opened) == 1
        and ranged.opened[0].startswith(".model.safetensors.tmp")
    )
    streamed = StreamOnlyLocal(str(tmp_path / "b"))
    r2 = _single(streamed, str(tmp_path / "b" / "model.safetensors"))
    assert streamed.pwrites == 0 and r1 == r2
    a, b = (
        (tmp_path / "a" / "model.safetensors").read_bytes(),
        (tmp_path / "b" / "model.safetensors").read_bytes(),
    )
    assert a == b
    assert sorted(os.listdir(tmp_path / "b")) == ["model.safetensors"]  # staged, then renamed
    with open_checkpoint(tmp_path / "b" / "model.safetensors", "model") as r:
        assert all(s.xxh3 and s.xxh3 != "0" * 16 for t in r.tensors.values() for s in t.slices)
        assert r.verify() == []
    # An fsspec store cannot: hashed first, uploaded once, the same bytes
    mem = CountingFsspec(fsspec.filesystem("memory"), "memory://single")
    mem.asked = []
    r3 = _single(mem, "/single/model.safetensors")
    assert mem.asked == [] and r3 == r1
    assert bytes(mem.fs.cat_file("/single/model.safetensors")) == a


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "w1": torch.randn(40, 30, generator=g),
        "w2": torch.randn(70, generator=g).to(torch.bfloat16),
        "n": torch.arange(12, dtype=torch.int64),
    }


def _save(monkeypatch: pytest.MonkeyPatch, where: str, store: Any, **kw: Any) -> str:
    monkeypatch.setattr(save_mod, "new_save_id", lambda: SAVE_ID)
    if store is not None:
        monkeypatch.setattr(
            save_mod, "open_location", lambda path, _o: Location(store, os.path.abspath(path), path)
        )
    opts = SaveOptions(layout=LayoutInfo(), **kw)
    return save_tensors(_state(), where, opts, local_slices)


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir()) if not p.name.startswith(".")}


@pytest.mark.parametrize("shard", [True, False])
def test_a_gathered_save_is_written_in_place_only_where_the_store_range_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard: bool
) -> None:
    kw = {"kind": "model", "shard": shard, "gather": True, "size_per_shard_mb": 0.004}
    ranged = CountingLocal(str(tmp_path / "a"))
    _save(monkeypatch, str(tmp_path / "a"), ranged, **kw)
    assert ranged.pwrites >= 3  # every tensor's bytes written in place (and a single file's header)
    streamed = StreamOnlyLocal(str(tmp_path / "b"))
    _save(monkeypatch, str(tmp_path / "b"), streamed, **kw)  # funnelled: rank 0 streams every file
    assert streamed.pwrites == 0
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert list(a) == list(b) and len(a) == (3 if shard else 1)
    for name in a:
        assert a[name] == b[name], name


@pytest.mark.parametrize(
    ("shard", "gather"), [(True, False), (False, True), (True, True)], ids=["sliced", "single", "gathered"]
)
def test_saves_to_local_files_and_to_s3_are_bit_identical(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shard: bool, gather: bool
) -> None:
    kw = {"kind": "model", "shard": shard, "gather": gather, "size_per_shard_mb": 0.004}
    local = tmp_path / "local"
    _save(monkeypatch, str(local), None, **kw)
    url = f"s3://{s3.bucket}/run"
    assert _save(monkeypatch, url, None, storage_options=s3.storage_options("w"), **kw) == url
    fs = fsspec.filesystem("s3", **s3.storage_options("check"))
    fs.invalidate_cache()
    fs.get(f"{s3.bucket}/run/", str(tmp_path / "dl") + "/", recursive=True)
    a, b = _files(local), _files(tmp_path / "dl")
    b.pop("unickpt.lock", None)
    assert sorted(a) == sorted(b) and len(a) >= (2 if shard else 1)
    for name in a:
        assert a[name] == b[name], name


def test_merges_to_local_files_and_to_s3_are_bit_identical(
    s3: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bit-identical but for a sharded merge's save id: a local merge derives it from the merged
    block once written (headers rewritten in place), a merge to a URL fixes it up front from the
    source block (its files stream out with their final headers)."""
    src = tmp_path / "src"
    _save(monkeypatch, str(src), None, kind="model", shard=True, gather=False, size_per_shard_mb=0.004)
    for shard_size, name in ((4000, "sharded"), ("5GB", "single")):
        out = tmp_path / name
        merge_checkpoint(src, out, max_shard_size=shard_size)
        url = f"s3://{s3.bucket}/{name}"
        merge_checkpoint(src, url, max_shard_size=shard_size, storage_options=s3.storage_options("m"))
        fs = fsspec.filesystem("s3", **s3.storage_options("check"))
        fs.invalidate_cache()
        fs.get(f"{s3.bucket}/{name}/", str(tmp_path / f"dl-{name}") + "/", recursive=True)
        a, b = _files(out), _files(tmp_path / f"dl-{name}")
        assert sorted(a) == sorted(b) and len(a) == (3 if name == "sharded" else 1), (name, sorted(a))
        if name == "sharded":
            ids = []
            for d in (out, tmp_path / f"dl-{name}"):
                with open_checkpoint(d, "model") as r:
                    ids.append(r.block.save_id)
                    assert r.verify() == []
            assert ids[0] != ids[1]
            b = {f: v.replace(ids[1].encode(), ids[0].encode()) for f, v in b.items()}
        for f in a:
            assert a[f] == b[f], (name, f)
