"""Saves written and committed through the storage layer on a real S3 API (moto's server).

Every checkpoint written to ``s3://`` is downloaded with ``fs.get`` and loaded with the local
code: what lands on the store must be bit-exact and committed by the object-store protocol
(store/publish.py): final names in a fresh directory, fresh names over a committed
checkpoint, the index last, superseded files removed, nothing uploaded twice.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from _reliability import MLP

from unickpt.booster import Booster
from unickpt.ckpt.reader import open_checkpoint
from unickpt.io import GeneralCheckpointIO
from unickpt.store.lock import LOCK_NAME
from unickpt.store.publish import is_store_data_file, store_file_name


def net(seed: int) -> MLP:
    """The shared MLP, seeded, with a buffer: its 33x17 weight spans several 2 KB shards."""
    return MLP(33, 17, 5, seed=seed, steps=True)


def fs_of(s3: Any, client: str = "check") -> Any:
    return fsspec.filesystem("s3", **s3.storage_options(client))


def objects(s3: Any, prefix: str) -> list[str]:
    fs = fs_of(s3)
    fs.invalidate_cache()
    base = f"{s3.bucket}/{prefix}"
    return sorted(str(p)[len(base) + 1 :] for p in fs.find(base))


def download(s3: Any, prefix: str, dest: Path) -> Path:
    fs = fs_of(s3)
    fs.invalidate_cache()
    fs.get(f"{s3.bucket}/{prefix}/", str(dest) + "/", recursive=True)
    return dest


def load_into(path: Path, seed: int = 99) -> MLP:
    m = net(seed)
    GeneralCheckpointIO().load_model(m, path, verify=True)
    return m


def same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _io(s3: Any, client: str = "w") -> GeneralCheckpointIO:
    return GeneralCheckpointIO(storage_options=s3.storage_options(client))


def test_sharded_save_on_s3_is_bit_exact_streamed_once_and_committed_by_its_index(s3, tmp_path) -> None:
    model = net(1)
    url = f"s3://{s3.bucket}/run/ckpt"
    io = _io(s3)
    assert io.save_model(model, url, shard=True, size_per_shard=0.002) == url
    names = objects(s3, "run/ckpt")
    data = [n for n in names if n.endswith(".safetensors")]
    assert len(data) >= 2  # 2 KB shards: several files
    # A fresh directory: standard names, nothing staged, nothing else.
    assert names == sorted([*data, "model.safetensors.index.json"])
    assert all(is_store_data_file("model", n) and "-of-" in n for n in data)
    local = download(s3, "run/ckpt", tmp_path / "dl")
    same(load_into(local), model)
    # Every file went up once: the bytes received are the bytes stored (plus nothing else).
    stored = sum(p.stat().st_size for p in local.iterdir())
    assert s3.received("PUT", "w") + s3.received("POST", "w") == stored
    with open_checkpoint(local, "model") as r:
        assert r.block.save_id is not None


def test_single_file_and_optimizer_and_scheduler_on_s3(s3, tmp_path) -> None:
    model = net(2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    booster = Booster(storage_options=s3.storage_options("b"))
    m, o, *_ = booster.boost(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2)
    m(torch.randn(4, 33)).sum().backward()
    o.step()
    sched.step()
    base = f"s3://{s3.bucket}/b"
    booster.save_model(m, f"{base}/model.safetensors")
    booster.save_optimizer(o, f"{base}/opt", shard=True)
    booster.save_lr_scheduler(sched, f"{base}/sched")
    names = objects(s3, "b")
    assert names[0] == "model.safetensors" and names[-1] == "sched/lr_scheduler.json"
    assert "opt/optimizer.safetensors.index.json" in names
    assert all(n.startswith("opt/optimizer-") for n in names[1:-2])
    local = download(s3, "b", tmp_path / "b")
    same(load_into(local / "model.safetensors"), model)
    # The single file's header carries real hashes: a verified load passed above; check one.
    with open_checkpoint(local / "model.safetensors", "model") as r:
        assert all(s.xxh3 and s.xxh3 != "0" * 16 for t in r.tensors.values() for s in t.slices)
    model2 = net(3)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=5.0)
    b2 = Booster()
    m2, o2, *_ = b2.boost(model2, opt2)
    b2.load_model(m2, local / "model.safetensors")
    b2.load_optimizer(o2, local / "opt")
    s_opt, s_opt2 = opt.state_dict(), opt2.state_dict()
    for pid, st in s_opt["state"].items():
        for k, v in st.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(s_opt2["state"][pid][k])), (pid, k)
    assert s_opt2["param_groups"][0]["lr"] == s_opt["param_groups"][0]["lr"]
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, 2)
    b2.load_lr_scheduler(sched2, local / "sched")
    assert sched2.state_dict() == sched.state_dict()


def test_resave_over_committed_uses_fresh_names_then_removes_the_old_files(s3, tmp_path) -> None:
    url = f"s3://{s3.bucket}/re"
    io = _io(s3)
    io.save_model(net(1), url, shard=True, size_per_shard=0.002)
    first = objects(s3, "re")
    idx1 = json.loads(fs_of(s3).cat_file(f"{s3.bucket}/re/model.safetensors.index.json"))
    new = net(2)
    io.save_model(new, url, shard=True, size_per_shard=0.002)
    second = objects(s3, "re")
    idx2 = json.loads(fs_of(s3).cat_file(f"{s3.bucket}/re/model.safetensors.index.json"))
    sid = idx2["unickpt"]["save_id"]
    files2 = set(idx2["weight_map"].values())
    # Every file of the new save carries its save id; none of the first save's is left.
    assert files2 == {store_file_name(f, sid) for f in idx1["weight_map"].values()}
    assert set(second) == files2 | {"model.safetensors.index.json"}
    assert not (set(first) - {"model.safetensors.index.json"}) & set(second)
    same(load_into(download(s3, "re", tmp_path / "re")), new)
    # A third save replaces the id-named files by others.
    io.save_model(net(3), url, shard=True, size_per_shard=0.002)
    idx3 = json.loads(fs_of(s3).cat_file(f"{s3.bucket}/re/model.safetensors.index.json"))
    assert not set(idx3["weight_map"].values()) & files2
    assert set(objects(s3, "re")) == set(idx3["weight_map"].values()) | {"model.safetensors.index.json"}


def test_single_file_over_sharded_and_back(s3, tmp_path) -> None:
    url = f"s3://{s3.bucket}/sw"
    io = _io(s3)
    io.save_model(net(1), url, shard=True, size_per_shard=0.002)
    io.save_model(net(2), url)  # a single file supersedes the index and its shards
    assert objects(s3, "sw") == ["model.safetensors"]
    same(load_into(download(s3, "sw", tmp_path / "a")), net(2))
    io.save_model(net(3), url, shard=True, size_per_shard=0.002)
    names = objects(s3, "sw")
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    same(load_into(download(s3, "sw", tmp_path / "b")), net(3))


@pytest.mark.parametrize("use_async", [False, True])
def test_file_url_saves_into_its_local_path(tmp_path, monkeypatch, use_async: bool) -> None:
    # file:///x is the local path /x for every save (sharded, single file, async), never a
    # directory named "file:" under the working directory.
    monkeypatch.chdir(tmp_path)
    target = tmp_path / "out"
    io = GeneralCheckpointIO()
    for shard in (True, False):
        url = f"file://{target}/{'sharded' if shard else 'single'}"
        io.save_model(net(5), url, shard=shard, use_async=use_async)
        io.wait()
        fresh = net(6)
        io.load_model(fresh, url)
        same(fresh, net(5))
    assert sorted(os.listdir(target)) == ["sharded", "single"]
    assert not (tmp_path / "file:").exists()


def test_io_storage_options_apply_to_urls_only(tmp_path) -> None:
    # The options an IO was given are for the URLs it saves to and loads from; a local path (a
    # run's local copy, a scratch save) ignores them. A single call on a local path with explicit
    # options is refused (test_storage_read.test_file_url_is_a_local_path).
    io = GeneralCheckpointIO(storage_options={"anon": True})
    io.save_model(net(1), tmp_path / "x", shard=True)
    fresh = net(2)
    io.load_model(fresh, tmp_path / "x")
    same(fresh, net(1))


def test_environment_credentials_without_storage_options(s3, tmp_path) -> None:
    url = f"s3://{s3.bucket}/env"
    GeneralCheckpointIO().save_model(net(4), url, shard=True)
    same(load_into(download(s3, "env", tmp_path / "e")), net(4))


# ------------------------------------------------------------------ killed saves
_CHILD = r"""
import os, signal, sys
sys.path.insert(0, {tests!r})
sys.path.insert(0, {unit!r})
from test_storage_write import net
from unickpt.store import storage as st
from unickpt.ckpt import safetensors_io as sio
from unickpt.io import GeneralCheckpointIO

point = {point!r}
def die():
    os.kill(os.getpid(), signal.SIGKILL)

real_put, real_remove, real_write = st.FsspecStorage.put, st.FsspecStorage.remove, sio.SafetensorsWriter.write
count = {{"w": 0}}
def put(self, path, data, **k):
    if point == "before-index" and path.endswith(".index.json"):
        die()
    out = real_put(self, path, data, **k)
    if point == "after-index" and path.endswith(".index.json"):
        die()
    return out
def remove(self, paths):
    paths = list(paths)
    if point == "mid-superseded" and paths:
        real_remove(self, paths[:1])
        die()
    return real_remove(self, paths)
def write(self, key, data):
    count["w"] += 1
    if point == "mid-upload" and count["w"] == 3:
        die()
    return real_write(self, key, data)
from unickpt.store import storage_s3
real_write_if = storage_s3.write_if
def write_if(fs, path, data, etag):  # the index PUT, conditional on the version under the lock
    if point == "before-index" and path.endswith(".index.json"):
        die()
    out = real_write_if(fs, path, data, etag)
    if point == "after-index" and path.endswith(".index.json"):
        die()
    return out
st.FsspecStorage.put, st.FsspecStorage.remove, sio.SafetensorsWriter.write = put, remove, write
storage_s3.write_if = write_if
# A gathered save on S3 uploads parts (store/storage_parts.py): one PUT per one-part file.
from unickpt.store import storage_parts as sp
real_part_put = sp.SharedUpload.put
parts = {{"n": 0}}
def part_put(self, body, when=None):
    parts["n"] += 1
    # sharded: the first file is up, the second is not; a single file: its only PUT
    if point == "mid-upload" and parts["n"] == (2 if {shard!r} else 1):
        die()
    return real_part_put(self, body, when)
sp.SharedUpload.put = part_put
GeneralCheckpointIO().save_model(net(2), {url!r}, shard={shard!r}, size_per_shard=0.002)
print("not killed")
"""


def _killed_save(s3: Any, url: str, point: str, shard: bool = True) -> None:
    import os
    import subprocess
    import sys

    code = _CHILD.format(
        tests=str(Path(__file__).parent),
        unit=str(Path(__file__).parent.parent),
        point=point,
        url=url,
        shard=shard,
    )
    env = {**os.environ, **s3.env(), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == -9, (p.returncode, p.stdout, p.stderr[-3000:])


@pytest.mark.parametrize("point", ["mid-upload", "before-index", "after-index", "mid-superseded"])
def test_resave_killed_at_every_step_leaves_old_or_new_then_cleans(
    s3, tmp_path, monkeypatch, point: str
) -> None:
    import time

    # The killed save leaves its lock object: stale after 1 s here (store/lock.py).
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "1")

    url = f"s3://{s3.bucket}/k"
    io = _io(s3)
    io.save_model(net(1), url, shard=True, size_per_shard=0.002)
    _killed_save(s3, url, point)
    got = load_into(download(s3, "k", tmp_path / "after-kill"))
    committed_new = point in ("after-index", "mid-superseded")
    same(got, net(2) if committed_new else net(1))
    # The next save finds the killed save's files (older than the commit it reads) and removes them.
    time.sleep(1.1)  # S3 times objects to the second: leftovers must be older than the commit
    io.save_model(net(3), url, shard=True, size_per_shard=0.002)
    idx = json.loads(fs_of(s3).cat_file(f"{s3.bucket}/k/model.safetensors.index.json"))
    assert set(objects(s3, "k")) == set(idx["weight_map"].values()) | {"model.safetensors.index.json"}
    same(load_into(download(s3, "k", tmp_path / "final")), net(3))


def test_killed_fresh_save_leaves_nothing_committed(s3, tmp_path) -> None:
    from unickpt.errors import IncompleteCheckpointError

    _killed_save(s3, f"s3://{s3.bucket}/f", "before-index")
    names = objects(s3, "f")
    assert LOCK_NAME in names  # the killed save's lock, taken over once stale
    names.remove(LOCK_NAME)
    assert names and all(n.endswith(".safetensors") for n in names)  # data, no index
    with pytest.raises(IncompleteCheckpointError, match="holds no committed model checkpoint"):
        load_into(download(s3, "f", tmp_path / "f"))


def test_killed_single_file_save_keeps_the_old_file_whole(s3, tmp_path) -> None:
    url = f"s3://{s3.bucket}/one/model.safetensors"
    _io(s3).save_model(net(1), url)
    _killed_save(s3, url, "mid-upload", shard=False)
    assert objects(s3, "one") == [LOCK_NAME, "model.safetensors"]  # the lock goes stale
    same(load_into(download(s3, "one", tmp_path / "one") / "model.safetensors"), net(1))


def test_dead_multipart_upload_is_aborted_by_the_next_save(s3, tmp_path) -> None:
    import time

    from unickpt.store.publish import clean_store_leftovers
    from unickpt.store.storage import open_storage

    fs = fs_of(s3)
    key = "mp/model-00001-of-00002.safetensors"
    up = fs.call_s3("create_multipart_upload", Bucket=s3.bucket, Key=key)
    fs.call_s3(
        "upload_part", Bucket=s3.bucket, Key=key, PartNumber=1, UploadId=up["UploadId"], Body=b"x" * (5 << 20)
    )
    other = fs.call_s3("create_multipart_upload", Bucket=s3.bucket, Key="elsewhere/x.bin")

    def uploads() -> set[str]:
        return {u["Key"] for u in fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads", [])}

    assert uploads() == {key, "elsewhere/x.bin"}
    time.sleep(1.1)
    store, root = open_storage(f"s3://{s3.bucket}/mp", s3.storage_options("c"))
    assert clean_store_leftovers(store, root) == []  # nothing committed yet: a save may be running
    _io(s3).save_model(net(1), f"s3://{s3.bucket}/mp", shard=True, size_per_shard=0.002)
    assert uploads() == {"elsewhere/x.bin"}  # only the dead upload below the checkpoint went
    fs.call_s3("abort_multipart_upload", Bucket=s3.bucket, Key="elsewhere/x.bin", UploadId=other["UploadId"])


def test_s3_upload_streams_parts_in_flight_and_aborts_cleanly(s3) -> None:
    import os

    from unickpt.store.storage import open_storage
    from unickpt.store.storage_s3 import S3Upload

    st, root = open_storage(f"s3://{s3.bucket}/up", s3.storage_options("up"))
    data = os.urandom((11 << 20) + 12345)
    f = S3Upload(st.fs, st.join(root, "big.bin"), part_size=5 << 20, in_flight=2)  # type: ignore[attr-defined]
    for at in range(0, len(data), 3 << 20):  # writes that straddle part boundaries
        f.write(memoryview(data)[at : at + (3 << 20)])
    assert not st.exists(st.join(root, "big.bin"))  # nothing visible before close
    f.close()
    assert st.read_bytes(st.join(root, "big.bin")) == data
    assert s3.received("PUT", "up") == len(data)  # two parts (5 MiB, then the rest), each sent once
    assert s3.requests[("PUT", "up")] == 2
    # Up to one part plus 5 MiB: a single PUT, no multipart upload (no create / complete POST).
    s3.reset()
    one = st.open_write(st.join(root, "one.bin"))
    one.write(b"z" * ((16 << 20) + (4 << 20)))
    one.close()
    assert s3.requests[("PUT", "up")] == 1 and s3.requests[("POST", "up")] == 0
    st.remove([st.join(root, "one.bin")])
    g = st.open_write(st.join(root, "gone.bin"))
    g.write(b"y" * (24 << 20))  # one full 16 MiB part already sent
    st.abort(g)
    assert st.listdir(root) == ["big.bin"]
    fs = fs_of(s3)
    assert not fs.call_s3("list_multipart_uploads", Bucket=s3.bucket).get("Uploads")


def test_async_save_to_s3_uploads_the_snapshot(s3, tmp_path) -> None:
    model = net(5)
    io = _io(s3, "async")
    url = f"s3://{s3.bucket}/as"
    assert io.save_model(model, url, shard=True, size_per_shard=0.002, use_async=True) == url
    with torch.no_grad():  # training goes on: the upload is of the snapshot taken at save time
        for p in model.parameters():
            p.add_(1.0)
    io.wait()
    same(load_into(download(s3, "as", tmp_path / "as")), net(5))
    assert not [p for p in tmp_path.rglob("*.tmp-*")]
