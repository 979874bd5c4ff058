"""A local checkpoint and one on a store are read by the same code, through their Storage's handles.

Every read of a data file goes through ``Storage.open_read``'s handle (``store/storage.py``):
the handles are counted here, for a local directory and the same files on ``memory://`` and on
S3 (moto's server), and the bytes compared bit for bit.
"""

from __future__ import annotations

import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest
import torch
from _reliability import count_preadv
from torch import nn

from unickpt.ckpt.reader import open_checkpoint
from unickpt.ckpt.stored_slices import ReadBatch
from unickpt.errors import IncompleteCheckpointError
from unickpt.io import GeneralCheckpointIO
from unickpt.store import storage as storage_mod
from unickpt.store.storage import Buffers, LocalStorage, open_storage


class _Counting:
    """A read handle that counts the calls made of it (and forwards them)."""

    def __init__(self, inner: Any, calls: Counter[str]) -> None:
        self.inner, self.calls = inner, calls
        self.size, self.path = inner.size, inner.path

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.inner, name)

        def call(*a: Any, **k: Any) -> Any:
            self.calls[name] += 1
            return fn(*a, **k)

        return call


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    calls: Counter[str] = Counter()
    for cls in (storage_mod.LocalStorage, storage_mod.FsspecStorage):
        real = cls.open_read

        def open_read(self: Any, path: str, _real: Any = real) -> Any:
            if path.endswith(".safetensors"):  # a data file (an index is read whole, not counted)
                calls["open_read"] += 1
            return _Counting(_real(self, path), calls)

        monkeypatch.setattr(cls, "open_read", open_read)
    return calls


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(24, 40), nn.ReLU(), nn.Linear(40, 16))


def _saved(tmp_path: Path) -> tuple[nn.Module, Path, list[str]]:
    model = _model(0)
    out = tmp_path / "ck"
    GeneralCheckpointIO().save_model(model, str(out), shard=True, size_per_shard=0.002)
    files = sorted(p.name for p in out.iterdir() if p.name.endswith(".safetensors"))
    assert len(files) >= 3
    return model, out, files


def _to_memory(local: Path) -> str:
    url = f"memory://seam-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for p in local.iterdir():
        fs.pipe_file(f"{url}/{p.name}", p.read_bytes())
    return url


def _same(a: nn.Module, b: nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_local_and_a_memory_checkpoint_open_each_data_file_once_through_their_storage(
    tmp_path: Path, counted: Counter[str]
) -> None:
    model, local, files = _saved(tmp_path)
    url = _to_memory(local)
    seen: dict[str, Counter[str]] = {}
    for where in (str(local), url):
        counted.clear()
        target = _model(1)
        GeneralCheckpointIO().load_model(target, where)
        assert _same(target, model), where
        seen[where] = Counter(counted)
    for where, calls in seen.items():
        # One handle per data file (header and bytes through it), never a second open.
        assert calls["open_read"] == len(files), (where, calls)
    # The same ReadBatch of the same reads: locally it is one vectored read (preadv) per file;
    # on the store, each file's window was fetched ahead (one coalesced pread_many per file)
    # and the batch's vectored reads were all served from it.
    assert seen[str(local)]["readv"] == len(files) and seen[str(local)]["pread_many"] == 0
    assert seen[url]["pread_many"] == len(files) and seen[url]["readv"] == 0


def test_reader_reads_are_the_same_calls_on_a_local_path_and_a_store(
    tmp_path: Path, counted: Counter[str]
) -> None:
    _, local, files = _saved(tmp_path)
    url = _to_memory(local)
    got: dict[str, tuple[Counter[str], list[bytes]]] = {}
    for where in (str(local), url):
        counted.clear()
        with open_checkpoint(where) as r:
            slices = [s for t in r.tensors.values() for s in t.slices]
            data = [bytes(r.read_key(s.file, s.key)) for s in slices]
            batch = ReadBatch()
            outs = [bytearray(r.key_location(s.file, s.key)[2]) for s in slices]
            for s, out in zip(slices, outs, strict=True):
                batch.add(s.file, r.key_location(s.file, s.key)[1], memoryview(out))
            batch.run(r.read_handle)
            assert [bytes(o) for o in outs] == data
            assert r.verify() == []
        got[where] = (Counter(counted), data)
    (lc, ld), (uc, ud) = got[str(local)], got[url]
    assert ld == ud
    assert lc["open_read"] == uc["open_read"] == len(files)
    # Each slice read: one readinto; each file of the batch: one vectored read.
    assert lc["readinto"] == uc["readinto"] == len(ld)
    assert lc["readv"] == uc["readv"] == len(files)


def test_an_s3_checkpoint_loads_through_the_same_path_as_a_local_one(
    s3: Any, tmp_path: Path, counted: Counter[str]
) -> None:
    import s3fs

    model, local, files = _saved(tmp_path)
    fs = s3fs.S3FileSystem(**s3.storage_options("uploader"))
    fs.put(str(local), f"{s3.bucket}/seam", recursive=True)
    io = GeneralCheckpointIO()
    io.storage_options = s3.storage_options("loader")  # type: ignore[attr-defined]
    target = _model(2)
    io.load_model(target, f"s3://{s3.bucket}/seam", verify=True)
    assert _same(target, model)
    assert counted["open_read"] == len(files)
    # verify=True fetched every slice to hash it, and kept it for the batch's reads.
    assert counted["pread_many"] == len(files) and counted["readv"] == 0


def _pieces(offsets: list[int], sizes: list[int]) -> tuple[np.ndarray, ...]:
    src = np.asarray(offsets, dtype=np.int64)
    size = np.asarray(sizes, dtype=np.int64)
    dst = np.concatenate(([0], np.cumsum(size)[:-1])).astype(np.int64)
    return src, size, np.zeros(len(src), dtype=np.int64), dst


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_vectored_read_past_the_end_names_the_file_and_the_bytes_missing(
    tmp_path: Path, where: str
) -> None:
    data = bytes(range(256)) * 4  # 1024 bytes
    if where == "local":
        path = str(tmp_path / "short.bin")
        Path(path).write_bytes(data)
        store, _ = open_storage(str(tmp_path))
    else:
        path = f"memory://seam-{uuid.uuid4().hex}/short.bin"
        fsspec.filesystem("memory").pipe_file(path, data)
        store, _ = open_storage(path)
    h = store.open_read(path)
    try:
        out = bytearray(300)
        src, size, buf, dst = _pieces([100, 200, 950], [100, 100, 100])
        with pytest.raises(IncompleteCheckpointError) as ei:
            h.readv(src, size, buf, dst, Buffers([memoryview(out)]))
        text = str(ei.value)
        assert "short.bin" in text and "truncated" in text
        # the piece that runs past the end: 100 bytes wanted at 950, the file holds 1024
        assert "wanted 100 bytes at offset 950" in text, text
        assert (
            ("of a 1024-byte object" in text) if where == "memory" else ("the file ends after 74" in text)
        ), text
        good = bytearray(200)
        src, size, buf, dst = _pieces([0, 1000], [100, 24])
        h.readv(src, size, buf, dst, Buffers([memoryview(good)]))
        assert bytes(good[:124]) == data[:100] + data[1000:1024]
        one = bytearray(50)
        with pytest.raises(
            IncompleteCheckpointError, match=r"short\.bin: file is truncated|short\.bin is truncated"
        ):
            h.readinto(1000, memoryview(one))
    finally:
        h.close()


def test_local_reads_are_preadv_into_the_callers_buffer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # readinto is one preadv straight into the caller's buffer; readv one call per run of
    # adjacent pieces, none for a piece already joined to its neighbour.
    p = tmp_path / "f.bin"
    p.write_bytes(bytes(range(256)))
    calls = count_preadv(monkeypatch)
    monkeypatch.setattr(storage_mod, "_PREADV", None)  # the iovec path through os.preadv
    h = LocalStorage(str(tmp_path)).open_read(str(p))
    try:
        out = bytearray(16)
        h.readinto(32, memoryview(out))
        assert bytes(out) == bytes(range(32, 48)) and calls == [1]
        calls.clear()
        big = bytearray(40)
        src, size, buf, dst = _pieces([0, 10, 100], [10, 10, 20])
        h.readv(src, size, buf, dst, Buffers([memoryview(big)]))
        assert bytes(big) == bytes(range(0, 20)) + bytes(range(100, 120))
        assert calls == [2, 1]  # [0, 20) in one call of two buffers, [100, 120) in another
    finally:
        h.close()
