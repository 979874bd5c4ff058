"""Writers racing on a real S3 API (moto's server): two saves into one URL (a lock object makes the
second fail cleanly, never a mixed checkpoint), and a reader holding the old index while a new
save commits (the old data or CheckpointChangedError, never a mix)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import CheckpointBusyError, CheckpointChangedError
from unickpt.store.lock import LOCK_NAME, store_lock
from unickpt.store.storage import open_storage


def _model(seed: int, width: int = 64) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.Linear(width, 5))


def _io(s3: Any) -> GeneralCheckpointIO:
    io = GeneralCheckpointIO()
    io.storage_options = s3.storage_options()  # type: ignore[attr-defined]
    return io


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(
        torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True)
    )


def test_a_held_lock_refuses_a_second_save(s3) -> None:
    url = f"s3://{s3.bucket}/ckpt"
    store, root = open_storage(url, s3.storage_options())
    with store_lock(store, root, "a" * 32):
        with pytest.raises(CheckpointBusyError, match=f"{LOCK_NAME}: another save is writing .*save a{{32}}"):
            _io(s3).save_model(_model(0), url, shard=True, size_per_shard=0.01)
        assert store.listdir(root) == [LOCK_NAME]  # the refused save wrote nothing
    assert store.listdir(root) == []  # released
    _io(s3).save_model(_model(0), url, shard=True, size_per_shard=0.01)
    assert LOCK_NAME not in store.listdir(root)  # a save releases its lock
    target = _model(1)
    _io(s3).load_model(target, url)
    assert _same(target, _model(0))


@pytest.mark.slow
def test_a_stale_lock_is_taken_over(s3, monkeypatch, caplog) -> None:
    url = f"s3://{s3.bucket}/ckpt"
    store, root = open_storage(url, s3.storage_options())
    store.put(store.join(root, LOCK_NAME), b'{"save_id": "dead"}')  # a killed save's lock
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "1")
    import time

    time.sleep(2.1)  # LastModified has a 1 s resolution
    _io(s3).save_model(_model(0), url, shard=True, size_per_shard=0.01)
    assert "removing the stale lock of save dead" in caplog.text
    assert LOCK_NAME not in store.listdir(root)


def test_two_saves_taking_over_one_stale_lock_cannot_both_hold_it(s3, monkeypatch) -> None:
    """Saves A and B both judge the same lock stale (B's look comes before A's takeover): A
    replaces it on the version it saw (If-Match its ETag); B's replacement on that same version
    is refused by the store, so B finds A's fresh lock and raises. (With a delete then an
    exclusive PUT, B's delete would remove A's lock and both would proceed.)"""
    from unickpt.store import lock as sl

    store, root = open_storage(f"s3://{s3.bucket}/stale", s3.storage_options())
    path = store.join(root, LOCK_NAME)
    store.put(path, b'{"save_id": "dead"}')  # a killed save's lock
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "0")
    seen = sl._holder(store, path)  # what B saw before A moved
    assert seen[2] is not None and seen[1] is not None
    assert sl._acquire(store, path, b'{"save_id": "A"}')[0] is True  # A took it over
    real = sl._holder
    calls = {"n": 0}

    def stale_view(storage: Any, p: str) -> Any:
        calls["n"] += 1
        return seen if calls["n"] == 1 else real(storage, p)

    monkeypatch.setattr(sl, "_holder", stale_view)
    with pytest.raises(CheckpointBusyError, match="save A"):
        sl._acquire(store, path, b'{"save_id": "B"}')
    assert json.loads(store.read_bytes(path))["save_id"] == "A"


_RACER = textwrap.dedent(
    """
    import json, sys, time
    import torch
    from torch import nn
    from unickpt import GeneralCheckpointIO
    from unickpt.errors import CheckpointBusyError, CheckpointChangedError

    seed, url, start, rounds = int(sys.argv[1]), sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 5))
    io = GeneralCheckpointIO()
    time.sleep(max(0.0, start - time.time()))
    out = {"ok": 0, "busy": 0}
    for _ in range(rounds):
        try:
            io.save_model(model, url, shard=True, size_per_shard=0.1)
            out["ok"] += 1
        except CheckpointBusyError:
            out["busy"] += 1
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_two_processes_saving_into_one_url(s3, tmp_path) -> None:
    url = f"s3://{s3.bucket}/raced"
    script = tmp_path / "racer.py"
    script.write_text(_RACER)
    import time

    start = time.time() + 4  # both past their imports
    env = {**os.environ, **s3.env()}
    rounds = 4
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(seed), url, str(start), str(rounds)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in (10, 20)
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert all(r["ok"] + r["busy"] == rounds for r in results) and sum(r["ok"] for r in results) >= 1
    # Whatever the interleaving, the checkpoint is one writer's, whole, and nothing else is left.
    models = {}
    for seed in (10, 20):
        torch.manual_seed(seed)
        models[seed] = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 5))
    torch.manual_seed(0)
    target = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256), nn.Linear(256, 5))
    _io(s3).load_model(target, url, verify=True)
    assert _same(target, models[10]) or _same(target, models[20])
    store, root = open_storage(url, s3.storage_options())
    with open_checkpoint(url, "model", storage_options=s3.storage_options()) as r:
        named = set(r.files)
    left = set(store.listdir(root)) - named - {"model.safetensors.index.json"}
    assert left == set(), left
    print("racing saves:", results)


@pytest.mark.parametrize("pinned", [False, True])
def test_reader_holding_the_old_index_while_a_resave_commits(s3, pinned: bool) -> None:
    url = f"s3://{s3.bucket}/ckpt"
    old, new = _model(0), _model(1)
    _io(s3).save_model(old, url, shard=True, size_per_shard=0.005)
    ref = {k: v.clone() for k, v in old.state_dict().items()}
    reader = open_checkpoint(url, "model", pin=pinned, storage_options=s3.storage_options())
    try:
        names = list(reader.block.tensors)
        # Read one tensor now, then a re-save commits (new files, index replaced, old files deleted).
        before = _read_all(reader, names[:1])
        _io(s3).save_model(new, url, shard=True, size_per_shard=0.005)
        outcome = "old"
        try:
            after = _read_all(reader, names[1:])
        except CheckpointChangedError as e:
            outcome = "changed"
            assert url.removeprefix("s3://") in str(e)
            after = {}
    finally:
        reader.close()
    # Whatever was read is the old checkpoint's bytes, never the new one's.
    for name, data in {**before, **after}.items():
        assert data == ref[name].numpy().tobytes(), name
    assert outcome == "changed" or len(after) == len(names) - 1
    # A reader opened now gets the new checkpoint, whole.
    target = _model(2)
    _io(s3).load_model(target, url, verify=True)
    assert _same(target, new)


def _read_all(reader: Any, names: list[str]) -> dict[str, bytes]:
    out = {}
    for n in names:
        (s,) = reader.block.tensors[n].slices
        out[n] = bytes(reader.read_key(s.file, s.key))
    return out


def test_referenced_files_reads_the_parsed_index(tmp_path) -> None:
    from unickpt.store.publish import referenced_files

    GeneralCheckpointIO().save_model(_model(0), str(tmp_path / "c"), shard=True, size_per_shard=0.01)
    raw = (tmp_path / "c" / "model.safetensors.index.json").read_bytes()
    files = {p.name for p in (tmp_path / "c").glob("model-*.safetensors")}
    assert len(files) > 1 and referenced_files(raw) == files
    assert referenced_files(b"not json") == set()
    assert referenced_files(b'{"weight_map": 3}') == set()  # not an index: names nothing
