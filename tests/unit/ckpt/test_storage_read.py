"""Checkpoints read from a real S3 API (moto's server, s3fs): the same checks and errors as local
files, naming the URL; loads fetch only the bytes of their blocks; hostile objects are refused."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import HEADER_PROBE, open_checkpoint
from unickpt.errors import (
    CheckpointChangedError,
    ConfigError,
    HeaderError,
    IncompleteCheckpointError,
    IndexFileError,
    IntegrityError,
    UnsupportedError,
)
from unickpt.io.load import _Files, read_box
from unickpt.spec.boxes import runs
from unickpt.store.storage import LocalStorage
from unickpt.tools._torch import full_tensors


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 80), nn.ReLU(), nn.Linear(80, 33))


def _save(tmp_path: Path, name: str, seed: int = 0) -> tuple[nn.Module, Path]:
    model = _model(seed)
    out = tmp_path / name
    # Small shards: several data files, so a load touches several objects.
    GeneralCheckpointIO().save_model(model, str(out), shard=True, size_per_shard=0.02)
    return model, out


def _fs(s3: Any) -> Any:
    import s3fs

    return s3fs.S3FileSystem(**s3.storage_options("uploader"))


def _upload(s3: Any, local: Path, name: str) -> str:
    fs = _fs(s3)
    fs.put(str(local), f"{s3.bucket}/{name}", recursive=True)
    return f"s3://{s3.bucket}/{name}"


def _data_files(local: Path) -> list[str]:
    return sorted(p.name for p in local.iterdir() if p.name.endswith(".safetensors"))


@pytest.fixture
def stored(s3, tmp_path) -> tuple[nn.Module, Path, str]:
    model, local = _save(tmp_path, "ckpt")
    assert len(_data_files(local)) >= 3
    return model, local, _upload(s3, local, "ckpt")


def test_runs_match_numpy_indexing() -> None:
    rng = np.random.default_rng(0)
    for _ in range(200):
        nd = int(rng.integers(1, 4))
        shape = tuple(int(x) for x in rng.integers(1, 6, nd))
        off = tuple(int(rng.integers(0, n)) for n in shape)
        sub = tuple(int(rng.integers(1, n - o + 1)) for n, o in zip(shape, off, strict=True))
        flat = np.arange(math.prod(shape)).reshape(shape)
        want = flat[tuple(slice(o, o + n) for o, n in zip(off, sub, strict=True))].reshape(-1)
        got = np.concatenate([np.arange(a, a + n) for a, n in runs(shape, off, sub)])
        assert got.tolist() == want.tolist()
        # Runs are maximal: neighbours never touch (they would have been one run).
        rs = runs(shape, off, sub)
        assert all(a + n < b for (a, n), (b, _) in itertools.pairwise(rs))
    assert runs((4, 6), (1, 0), (2, 6)) == [(6, 12)]
    assert runs((4, 6), (1, 2), (2, 3)) == [(8, 3), (14, 3)]
    assert runs((), (), ()) == [(0, 1)]
    assert runs((3, 0), (0, 0), (3, 0)) == []


def test_open_reads_and_verifies_like_local(s3, stored) -> None:
    _, local, url = stored
    with open_checkpoint(local) as lr, open_checkpoint(url, storage_options=s3.storage_options()) as rr:
        assert rr.index_path == f"{url}/model.safetensors.index.json"
        assert rr.block == lr.block
        rr.validate_structure()
        assert rr.verify() == []
        for t in lr.tensors.values():
            for s in t.slices:
                assert bytes(rr.read_key(s.file, s.key)) == bytes(lr.read_key(s.file, s.key))
                assert rr.hash_key(s.file, s.key) == s.xxh3
        with pytest.raises(Exception, match="has no local path"):
            rr.pinned_path(lr.files[0])


def test_file_url_is_a_local_path(stored) -> None:
    _, local, _ = stored
    with open_checkpoint(f"file://{local}") as r:
        assert isinstance(r.storage, LocalStorage) and r.index_path == str(
            local / "model.safetensors.index.json"
        )
    with pytest.raises(ConfigError, match="storage_options are for fsspec URLs"):
        open_checkpoint(local, storage_options={"anon": True})


@pytest.mark.parametrize(
    "spelling", ["sharded", "sharded/", "sharded/model.safetensors.index.json", "single"]
)
def test_a_relative_path_is_read_from_where_it_was_opened(tmp_path, monkeypatch, spelling) -> None:
    """Data files are opened when first read: a reader opened at a relative path keeps reading the
    same files after the process changes directory."""
    model, _ = _save(tmp_path, "sharded")
    GeneralCheckpointIO().save_model(model, str(tmp_path / "single"), shard=False)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    with open_checkpoint(spelling) as r:
        assert os.path.isabs(r.directory)
        monkeypatch.chdir(tmp_path / "elsewhere")
        got = full_tensors(r)
    want = model.state_dict()
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_opening_a_checkpoint_opens_its_store_once(tmp_path, s3, stored, monkeypatch) -> None:
    """open_checkpoint and a load's open make one Storage of the location, locally and on S3, and
    read through it; a store that cannot be made is refused by the load's open, naming the URL."""
    import unickpt.store.storage as storage_mod

    made: list[str] = []
    for cls in (storage_mod.LocalStorage, storage_mod.FsspecStorage):
        init = cls.__init__

        def counted(self, *a, _init=init, _name=cls.__name__, **kw):  # type: ignore[no-untyped-def]
            made.append(_name)
            _init(self, *a, **kw)

        monkeypatch.setattr(cls, "__init__", counted)
    model, local, url = stored
    opts = s3.storage_options("reader")
    for where, options, cls in ((str(local), None, "LocalStorage"), (url, opts, "FsspecStorage")):
        made.clear()
        with open_checkpoint(where, storage_options=options, pin=True) as r:
            full_tensors(r)
        assert made == [cls], (where, made)
        made.clear()
        target = _model(1)
        io = GeneralCheckpointIO()
        io.storage_options = options  # type: ignore[attr-defined]
        io.load_model(target, where, verify=True)
        assert made == [cls], (where, made)
        for (n, a), (_, b) in zip(model.state_dict().items(), target.state_dict().items(), strict=True):
            assert torch.equal(a, b), n
    with pytest.raises(
        UnsupportedError,
        match=r"^nosuchstore://b/ck: fsspec cannot open it \(Protocol not known: nosuchstore\)",
    ):
        GeneralCheckpointIO().load_model(_model(1), "nosuchstore://b/ck")


def test_load_model_from_s3_is_bit_exact_and_reads_each_byte_once(s3, stored) -> None:
    model, local, url = stored
    target = _model(1)
    io = GeneralCheckpointIO()
    io.storage_options = s3.storage_options("loader")  # type: ignore[attr-defined]
    s3.reset()
    report = io.load_model(target, url, verify=False)
    assert report.missing == [] and report.unexpected == []
    for (n, a), (_, b) in zip(model.state_dict().items(), target.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    data = sum(p.nbytes for p in model.state_dict().values())
    index = (local / "model.safetensors.index.json").stat().st_size
    headers = sum(min((local / f).stat().st_size, HEADER_PROBE) for f in _data_files(local))
    # Every tensor byte once, plus the index and one header probe per data file: nothing more.
    assert s3.served("GET", "loader") == data + index + headers


def test_column_blocks_fetch_their_runs_only(s3, stored) -> None:
    # A block that is a column range of stored rows is many runs: fetched as coalesced requests.
    _, local, url = stored
    with open_checkpoint(local) as lr, open_checkpoint(url, storage_options=s3.storage_options("col")) as rr:
        entry = lr.tensors["0.weight"]
        full = read_box(_Files(lr), entry, (0, 0), tuple(entry.shape))
        for off, shape in [((3, 5), (40, 7)), ((0, 63), (96, 1)), ((95, 0), (1, 64)), ((10, 0), (20, 64))]:
            rr.pin()
            got = read_box(_Files(rr), entry, off, shape)
            want = full[off[0] : off[0] + shape[0], off[1] : off[1] + shape[1]]
            assert torch.equal(got, want), (off, shape)


def test_lr_scheduler_from_s3(s3, tmp_path) -> None:
    model = _model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    for _ in range(4):
        opt.step()
        sched.step()
    io = GeneralCheckpointIO()
    io.save_lr_scheduler(sched, str(tmp_path / "run"))
    url = _upload(s3, tmp_path / "run", "run")
    io.storage_options = s3.storage_options()  # type: ignore[attr-defined]
    fresh = torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD(model.parameters(), lr=0.1), step_size=3, gamma=0.5
    )
    io.load_lr_scheduler(fresh, url)
    assert fresh.state_dict() == sched.state_dict()
    url = f"s3://{s3.bucket}/nope"
    want = f"no LR scheduler state at {url}: it is not a file and {url}/lr_scheduler.json does not exist"
    with pytest.raises(IncompleteCheckpointError, match=re.escape(want)):
        io.load_lr_scheduler(fresh, url)


def test_optimizer_from_s3_is_bit_exact(s3, tmp_path) -> None:
    model = _model(0)
    opt = torch.optim.AdamW(model.named_parameters(), lr=0.01)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    io = GeneralCheckpointIO()
    io.save_optimizer(opt, str(tmp_path / "opt"), shard=True, size_per_shard=0.02)
    url = _upload(s3, tmp_path / "opt", "opt")
    io.storage_options = s3.storage_options()  # type: ignore[attr-defined]
    model2 = _model(0)
    opt2 = torch.optim.AdamW(model2.named_parameters(), lr=0.5)
    io.load_optimizer(opt2, url, verify=True)
    a, b = opt.state_dict(), opt2.state_dict()
    assert a["param_groups"] == b["param_groups"]
    for k in a["state"]:
        for key, v in a["state"][k].items():
            assert torch.equal(v, b["state"][k][key]), (k, key)


# ------------------------------------------------------------------ hostile objects
def _structure_refused(s3: Any, url: str, error: type[Exception], match: str) -> None:
    with open_checkpoint(url, storage_options=s3.storage_options()) as r, pytest.raises(error, match=match):
        r.validate_structure()


def _put(s3: Any, url: str, data: bytes) -> None:
    _fs(s3).pipe_file(url, data)


def test_missing_checkpoint_names_the_url(s3, tmp_path: Path) -> None:
    """A URL is opened the way a local path is, and refused in the same words."""
    url = f"s3://{s3.bucket}/nothing"
    opts = s3.storage_options()
    with pytest.raises(IncompleteCheckpointError, match=f"^no checkpoint at {url}: the path does not exist$"):
        open_checkpoint(url, storage_options=opts)
    local = tmp_path / "nothing"
    with pytest.raises(
        IncompleteCheckpointError, match=f"^no checkpoint at {local}: the path does not exist$"
    ):
        open_checkpoint(local)
    # A prefix holding data files of an interrupted save, and a directory holding the same.
    _put(s3, f"{url}/model-00001-of-00002.safetensors", b"x")
    local.mkdir()
    (local / "model-00001-of-00002.safetensors").write_bytes(b"x")
    for where, kw in ((url, {"storage_options": opts}), (str(local), {})):
        with pytest.raises(IncompleteCheckpointError) as ei:
            open_checkpoint(where, **kw)
        assert str(ei.value) == (
            f"{where} holds no committed model checkpoint: neither model.safetensors.index.json nor "
            "model.safetensors is present (an interrupted save leaves data files without an index; such a "
            "directory is never loaded); it holds 1 other .safetensors file(s) ('model-00001-of-00002.safetensors'): "
            "to load a single-file checkpoint of another name, pass the path of the file itself"
        )


def test_missing_data_object(s3, stored) -> None:
    _, local, url = stored
    victim = _data_files(local)[1]
    _fs(s3).rm_file(f"{url}/{victim}")
    _structure_refused(
        s3,
        url,
        IncompleteCheckpointError,
        match=f"^{url}: data file '{victim}' named by the index is missing",
    )


def test_truncated_data_object(s3, stored) -> None:
    _, local, url = stored
    victim = _data_files(local)[0]
    data = (local / victim).read_bytes()
    _put(s3, f"{url}/{victim}", data[:-4])
    _structure_refused(
        s3,
        url,
        HeaderError,
        match=rf"^{url}/{victim}: tensor '[^']+': data_offsets \[\d+, \d+\] out of range",
    )
    # Cut inside the header: the length prefix runs past the object's end.
    _put(s3, f"{url}/{victim}", data[:20])
    _structure_refused(
        s3, url, HeaderError, match=rf"^{url}/{victim}: header length \d+ runs past the end of the 20-byte"
    )
    _put(s3, f"{url}/{victim}", data[:5])
    _structure_refused(s3, url, HeaderError, match=rf"^{url}/{victim}: 5 bytes is too short")


def test_wrong_size_object(s3, stored) -> None:
    # Bytes appended after the last tensor: the header no longer tiles the object.
    _, local, url = stored
    victim = _data_files(local)[-1]
    _put(s3, f"{url}/{victim}", (local / victim).read_bytes() + b"\0" * 8)
    _structure_refused(
        s3, url, HeaderError, match=rf"^{url}/{victim}: tensors cover (\d+) bytes but the data section holds"
    )


def test_header_of_another_save(s3, stored, tmp_path) -> None:
    _, local, url = stored
    _, other = _save(tmp_path, "other", seed=5)
    victim = _data_files(local)[0]
    assert _data_files(other)[0] == victim
    _put(s3, f"{url}/{victim}", (other / victim).read_bytes())
    io = GeneralCheckpointIO()
    io.storage_options = s3.storage_options()  # type: ignore[attr-defined]
    target = _model(1)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(
        CheckpointChangedError, match=rf"{url}/{victim}: written by save \w+, but the index {url}/"
    ):
        io.load_model(target, url)
    assert all(torch.equal(before[k], v) for k, v in target.state_dict().items())


def test_flipped_byte_fails_verify(s3, stored) -> None:
    _, local, url = stored
    victim = _data_files(local)[0]
    data = bytearray((local / victim).read_bytes())
    data[-1] ^= 0x40
    _put(s3, f"{url}/{victim}", bytes(data))
    io = GeneralCheckpointIO()
    io.storage_options = s3.storage_options()  # type: ignore[attr-defined]
    with pytest.raises(IntegrityError, match=url):
        io.load_model(_model(1), url, verify=True)


def test_hostile_index_object(s3, stored) -> None:
    _, local, url = stored
    idx = f"{url}/model.safetensors.index.json"
    _put(s3, idx, b'{"weight_map": {"w": "../escape.safetensors"}}')
    with pytest.raises(Exception, match=f"^{idx}: "):
        open_checkpoint(url, storage_options=s3.storage_options())
    obj = json.loads((local / "model.safetensors.index.json").read_bytes())
    obj["unickpt"]["kind"] = "optimizer"
    _put(s3, idx, json.dumps(obj).encode())
    with pytest.raises(IndexFileError, match=f"^{idx}: holds a optimizer checkpoint, expected a model"):
        open_checkpoint(url, storage_options=s3.storage_options())


def test_single_file_on_s3(s3, tmp_path) -> None:
    model = _model(0)
    GeneralCheckpointIO().save_model(model, str(tmp_path / "single"))
    url = _upload(s3, tmp_path / "single", "single")
    io = GeneralCheckpointIO()
    io.storage_options = s3.storage_options()  # type: ignore[attr-defined]
    for where in (url, f"{url}/model.safetensors"):
        target = _model(1)
        io.load_model(target, where, verify=True)
        assert all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), target.state_dict().values(), strict=True)
        )


def test_memory_url(tmp_path) -> None:
    import fsspec

    model, local = _save(tmp_path, "ckpt")
    fs = fsspec.filesystem("memory")
    fs.put(str(local), "/unickpt-test-mem", recursive=True)
    try:
        target = _model(1)
        GeneralCheckpointIO().load_model(target, "memory://unickpt-test-mem", verify=True)
        assert all(
            torch.equal(a, b)
            for a, b in zip(model.state_dict().values(), target.state_dict().values(), strict=True)
        )
    finally:
        fs.rm("/unickpt-test-mem", recursive=True)


def test_data_object_gone_after_open(tmp_path) -> None:
    """A data file deleted after the reader parsed the index: when a new save replaced the index
    meanwhile, CheckpointChangedError (load again); when the index is still the one read, the
    missing file's IncompleteCheckpointError stands."""
    import fsspec

    _, local = _save(tmp_path, "ckpt")
    _, other = _save(tmp_path, "other", seed=5)
    victim = _data_files(local)[0]
    fs = fsspec.filesystem("memory")
    name = f"unickpt-test-gone-{os.getpid()}"
    url = f"memory://{name}"
    index = "model.safetensors.index.json"
    assert (other / index).read_bytes() != (local / index).read_bytes()
    try:
        fs.put(str(local), f"/{name}", recursive=True)
        r = open_checkpoint(url)
        fs.rm_file(f"/{name}/{victim}")
        with pytest.raises(
            IncompleteCheckpointError, match=f"^{url}: data file '{victim}' named by the index is missing"
        ):
            r.header(victim)
        r.close()

        fs.put(str(local / victim), f"/{name}/{victim}")
        r = open_checkpoint(url)
        fs.pipe(f"/{name}/{index}", (other / index).read_bytes())
        fs.rm_file(f"/{name}/{victim}")
        with pytest.raises(
            CheckpointChangedError,
            match=f"^{url}/{index}: data file '{victim}' vanished while the checkpoint was read, and the "
            "index is no longer the one read",
        ):
            r.header(victim)
        r.close()
    finally:
        fs.rm(f"/{name}", recursive=True)


def test_coalesce_with_a_waste_budget() -> None:
    from unickpt.store.storage import SMALL_GAP, coalesce

    # One wanted row per 40 KB of a file: bridging the gaps would fetch 50x the bytes; not done.
    sparse = [(i * 40_000, 800) for i in range(10)]
    assert len(coalesce(sparse, waste=1 / 16)) == 10
    assert len(coalesce(sparse)) == 1  # without a budget, gaps under COALESCE_GAP are bridged
    # Small gaps are always bridged (column runs of a row-major slice).
    cols = [(i * 800, 400) for i in range(100)]
    assert coalesce(cols, waste=1 / 16) == [(0, 99 * 800 + 400, list(range(100)))]
    # A gap within the budget is bridged; the budget is of the whole request.
    big = [(0, 1 << 20), ((1 << 20) + SMALL_GAP + 1, 1 << 20), ((2 << 20) + 100_000, 10)]
    got = coalesce(big, waste=1 / 16)
    assert [m for _, _, m in got] == [[0, 1, 2]]
    got = coalesce(big, waste=1 / 64)
    assert [m for _, _, m in got] == [[0, 1], [2]]


def test_prefetched_blocks_serve_covered_reads_only() -> None:
    from unickpt.ckpt.reader import Prefetched

    data = bytes(range(256)) * 64

    class Handle:
        size = len(data)

        def __init__(self) -> None:
            self.calls: list[list[tuple[int, int]]] = []

        def pread_many(self, ranges: list[tuple[int, int]], gap: int = 0) -> list[bytes]:
            self.calls.append(list(ranges))
            return [data[o : o + n] for o, n in ranges]

    h = Handle()
    p = Prefetched()
    p.fetch({"f": h}, {"f": [(100, 50), (150, 30), (5000, 10)]}, threads=2)  # type: ignore[dict-item]
    assert h.calls == [[(100, 80), (5000, 10)]]
    got = p.get("f", 120, 40)
    assert got is not None and bytes(got) == data[120:160]
    assert p.get("f", 90, 20) is None  # starts before a block
    assert p.get("f", 170, 20) is None  # runs past the block's end
    assert p.get("g", 100, 1) is None
    assert bytes(p.get("f", 5000, 10) or b"") == data[5000:5010]


@pytest.mark.parametrize("hold", [True, False])
def test_verified_load_batches_its_hash_reads(s3, tmp_path, monkeypatch, hold: bool) -> None:
    # verify=True hashes every needed stored slice before anything is copied: the slices come in
    # a few coalesced requests per file (not one round trip per slice), and the load copies from
    # those same bytes (each byte fetched once); over URL_VERIFY_HOLD it fetches them again.
    import unickpt.io.load as load_mod

    if not hold:
        monkeypatch.setattr(load_mod, "URL_VERIFY_HOLD", 0)

    def many(seed: int) -> nn.Module:
        torch.manual_seed(seed)
        return nn.Sequential(*[nn.Linear(32, 32) for _ in range(12)])

    model = many(0)
    local = tmp_path / "many"
    GeneralCheckpointIO().save_model(model, str(local), shard=True, size_per_shard=0.01)
    url = _upload(s3, local, "many")
    io = GeneralCheckpointIO()
    io.storage_options = s3.storage_options("verifier")  # type: ignore[attr-defined]
    s3.reset()
    target = many(1)
    io.load_model(target, url, verify=True)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), target.state_dict().values(), strict=True)
    )
    data = sum(p.nbytes for p in model.state_dict().values())
    index = (local / "model.safetensors.index.json").stat().st_size
    files = _data_files(local)
    headers = sum(min((local / f).stat().st_size, HEADER_PROBE) for f in files)
    times = 1 if hold else 2
    assert s3.served("GET", "verifier") == times * data + index + headers
    gets = s3.requests[("GET", "verifier")]
    # index + per file: its header, its slices for the hashes (and without the hold, for the copy).
    assert gets == 1 + (1 + times) * len(files) < 24, (gets, len(files))
