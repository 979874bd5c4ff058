"""CheckpointManager writing straight to a real S3 API (moto's server): no local staging,
every object uploaded once, COMMIT exclusive (two writers racing one step: one commits)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import fsspec
import pytest
import s3fs
import torch

from unickpt.errors import CheckpointBusyError
from unickpt.manager import CheckpointManager
from unickpt.store.publish import RemoteStore

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_manager import Counter, _setup, _train


def _fs(s3: Any) -> Any:
    fs = fsspec.filesystem("s3", **s3.storage_options("check"))
    fs.invalidate_cache()
    return fs


def _sizes(s3: Any, prefix: str) -> dict[str, int]:
    fs = _fs(s3)
    base = f"{s3.bucket}/{prefix}"
    return {str(p)[len(base) + 1 :]: int(i["size"]) for p, i in fs.find(base, detail=True).items()}


def _no_download(*a: Any, **k: Any) -> None:
    raise AssertionError("a resume from the store downloaded the step")


@pytest.mark.long
@pytest.mark.parametrize("async_save", [False, True])
def test_manager_on_s3_resumes_bit_exact_uploads_each_object_once(
    s3: Any, tmp_path: Path, async_save: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    ref = _train(None, 12)
    url = f"s3://{s3.bucket}/run"
    cache = tmp_path / "cache"
    opts = s3.storage_options("mgr")
    mgr = CheckpointManager(
        url, save_steps=5, keep_last=1, async_save=async_save, local_cache_dir=cache, storage_options=opts
    )
    first = _train(mgr, 5)  # one save: step 5
    assert mgr.all_steps() == [5]
    objs = _sizes(s3, "run")
    assert json.loads(_fs(s3).cat_file(f"{s3.bucket}/run/step-5/COMMIT"))["step"] == 5
    assert "step-5/model/model.safetensors.index.json" in objs
    assert "step-5/train_state/rank-00000.safetensors" in objs
    # Every object went up once: the request bodies the server received add up to what it holds.
    assert s3.received("PUT", "mgr") + s3.received("POST", "mgr") == sum(objs.values())
    # Nothing was staged on local disk: the cache directory is never even created by a save.
    assert not cache.exists() or [p for p in cache.rglob("*") if p.is_file()] == []
    counter = Counter()
    # The resume reads the step in place (ranged reads of what this rank loads): no object is
    # fetched whole into a local file.
    monkeypatch.setattr(s3fs.S3FileSystem, "_get_file", _no_download)
    mgr2 = CheckpointManager(url, save_steps=5, keep_last=1, local_cache_dir=cache, storage_options=opts)
    s3.reset()
    rest = _train(mgr2, 12, seed=77, counter=counter)
    assert not cache.exists() or [p for p in cache.rglob("*") if p.is_file()] == []
    assert first == {s: ref[s] for s in range(1, 6)}
    assert rest == {s: ref[s] for s in range(6, 13)}  # weights, optimizer, RNG, data order: bit for bit
    assert counter.n == 12
    assert mgr2.all_steps() == [10]  # retention deleted step 5 on the store
    assert {k.split("/")[0] for k in _sizes(s3, "run")} == {"latest", "step-10"}


@pytest.mark.long
def test_two_writers_racing_one_step_exactly_one_commits(s3: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Writer A has written step 3 and is about to commit when writer B saves step 3 whole: B's
    tidy-up removes A's uncommitted files, B commits, and A's exclusive COMMIT is refused."""
    url = f"s3://{s3.bucket}/race"
    opts = s3.storage_options("race")
    model_a, opt_a, _, _ = _setup(1)
    model_b, opt_b, _, _ = _setup(2)
    real_put = RemoteStore.put_bytes
    raced = {"done": False}

    def put(self: RemoteStore, rel: str, data: bytes, **k: Any) -> bool:
        if rel.endswith("/COMMIT") and not raced["done"]:
            raced["done"] = True
            CheckpointManager(url, save_steps=1, storage_options=opts).save(3, model_b, opt_b)
        return real_put(self, rel, data, **k)

    monkeypatch.setattr(RemoteStore, "put_bytes", put)
    with pytest.raises(CheckpointBusyError, match="another save committed step 3 first"):
        CheckpointManager(url, save_steps=1, storage_options=opts).save(3, model_a, opt_a)
    monkeypatch.undo()
    mgr = CheckpointManager(url, save_steps=1, storage_options=opts)
    assert mgr.all_steps() == [3]
    m, o, _, _ = _setup(9)
    assert mgr.load(m, o) == 3
    for (k, a), b in zip(model_b.state_dict().items(), m.state_dict().values(), strict=True):
        assert torch.equal(a, b), k
    # The next save cleans what the loser left (nothing of it is committed).
    mgr.save(4, m, o)
    assert {k.split("/")[0] for k in _sizes(s3, "race")} == {"latest", "step-3", "step-4"}
