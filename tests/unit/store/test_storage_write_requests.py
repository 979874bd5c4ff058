"""The requests a sliced save makes on a real S3 API (moto's server), and what it cleans.

A sliced save into a prefix holding no data file commits with the index PUT alone: rank 0's
requests are the lock's PUT, one LIST, its data file's PUT, the GET of the lock that checks it
is still this save's (store/lock.py, fencing), the index PUT and the lock's DELETE
(store/publish.py ``needs_cleanup``). Whatever a cleanup could act on (a stray data file,
a killed save's stale lock and so its multipart uploads) brings the full cleanup back.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Any

import pytest
import torch
from test_storage_write import download, fs_of, load_into, net, objects, same

from unickpt.io import GeneralCheckpointIO
from unickpt.store.lock import LOCK_NAME


def _save(s3: Any, model: torch.nn.Module, prefix: str, client: str) -> None:
    io = GeneralCheckpointIO(storage_options=s3.storage_options(client))
    io.save_model(model, f"s3://{s3.bucket}/{prefix}", shard=True, gather_dtensor=False)


def _requests(s3: Any, client: str) -> dict[str, int]:
    return {m: n for (m, c), n in s3.requests.items() if c == client}


def _uploads(s3: Any) -> set[str]:
    out = fs_of(s3).call_s3("list_multipart_uploads", Bucket=s3.bucket)
    return {u["Key"] for u in out.get("Uploads", []) or []}


def test_sliced_save_in_a_fresh_prefix_is_six_requests_and_a_resave_cleans(s3, tmp_path) -> None:
    _save(s3, net(1), "warm", "warm")  # the bucket's HEAD (s3fs makedirs) is paid once per process
    _save(s3, net(1), "r", "fresh")
    # lock PUT, LIST, data PUT, lock GET, index PUT, lock DELETE: no listing, upload listing nor
    # delete after
    assert _requests(s3, "fresh") == {"PUT": 3, "GET": 2, "DELETE": 1}
    assert objects(s3, "r") == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    same(load_into(download(s3, "r", tmp_path / "one")), net(1))

    _save(s3, net(2), "r", "over")
    # over a committed checkpoint: the listing after the index PUT, the batch delete of the
    # superseded file and the upload listing come back
    assert _requests(s3, "over") == {"PUT": 3, "GET": 4, "POST": 1, "DELETE": 1}
    data, index = objects(s3, "r")  # the superseded file is gone
    assert index == "model.safetensors.index.json"
    assert re.fullmatch(r"model-00001-of-00001\.[0-9a-f]{12}\.safetensors", data)  # a re-save's name
    same(load_into(download(s3, "r", tmp_path / "two")), net(2))


def test_a_stray_data_file_in_the_prefix_brings_the_cleanup_back(s3, tmp_path) -> None:
    fs = fs_of(s3)
    stray = "model-00002-of-00002.safetensors"  # a killed save's, its lock deleted by hand
    fs.pipe_file(f"{s3.bucket}/s/{stray}", b"not a checkpoint")
    time.sleep(1.1)  # S3 times objects to the second: the stray file must be older than the commit
    _save(s3, net(3), "s", "stray")
    assert objects(s3, "s") == ["model-00001-of-00001.safetensors", "model.safetensors.index.json"]
    same(load_into(download(s3, "s", tmp_path / "s")), net(3))


_KILLED = r"""
import os, signal, sys
import torch
from unickpt.store import storage as st
from unickpt.store import storage_s3 as s3m
from unickpt.io import GeneralCheckpointIO

# parts of 5 MiB: a 12 MiB file is a multipart upload; die once its first part is stored
st.FsspecStorage.open_write = lambda self, path: s3m.S3Upload(self.fs, path, part_size=5 << 20)
real = s3m.S3Upload._put_part
def put_part(self, number, body):
    out = real(self, number, body)
    os.kill(os.getpid(), signal.SIGKILL)
    return out
s3m.S3Upload._put_part = put_part
big = torch.nn.Linear(1750, 1750, bias=False)
GeneralCheckpointIO().save_model(big, {url!r}, shard=True, gather_dtensor=False)
print("not killed")
"""


@pytest.mark.slow  # a child process importing torch, killed mid-upload
def test_dead_upload_of_a_killed_save_in_a_fresh_prefix_is_aborted_by_the_next_save(
    s3, tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "1")
    url = f"s3://{s3.bucket}/k"
    env = {**os.environ, **s3.env(), "OMP_NUM_THREADS": "1"}
    p = subprocess.run(
        [sys.executable, "-c", _KILLED.format(url=url)], env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == -9, (p.returncode, p.stdout, p.stderr[-3000:])
    # The killed save left its lock and an upload no listing of objects shows: the prefix looks empty.
    assert objects(s3, "k") == [LOCK_NAME]
    assert _uploads(s3) == {"k/model-00001-of-00001.safetensors"}
    time.sleep(1.1)  # the lock goes stale; the upload is older than the next commit
    _save(s3, net(4), "k", "next")
    # The next save took over the stale lock, so it ran the cleanup: the dead upload is aborted.
    # Its file has a save-id name: the lock's holder may only have stalled (store/lock.py).
    assert _uploads(s3) == set()
    data, index = objects(s3, "k")
    assert index == "model.safetensors.index.json"
    assert re.fullmatch(r"model-00001-of-00001\.[0-9a-f]{12}\.safetensors", data)
    same(load_into(download(s3, "k", tmp_path / "k")), net(4))
    # the upload's abort (a DELETE) and its own lock's DELETE (the stale lock is replaced by a
    # PUT conditional on its ETag, not deleted first)
    assert _requests(s3, "next").get("DELETE") == 2
