"""A save whose store lock was taken over never commits, nor touches its successor's files.

A holder stalled past the stale threshold (SIGSTOP here: a long GC or VM pause, a partition) is
taken over by a second save, which commits; when the first resumes, its next fenced step
raises ``CheckpointBusyError`` and the second save's checkpoint stays whole (store/lock.py,
"Fencing"). Real processes on moto's S3 server: writer A runs in a child process and stops
itself with SIGSTOP at a named step of its save; writer B (this process, with
``UNICKPT_STORE_LOCK_STALE=0``: A's lock is stale at once) takes it over and commits; then A
gets SIGCONT. One child runs every stall point in turn (one torch import).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from test_storage_write import download, fs_of, net, objects

from unickpt.errors import CheckpointBusyError
from unickpt.io import GeneralCheckpointIO
from unickpt.store.lock import LOCK_NAME, read_version, store_lock
from unickpt.store.publish import referenced_files
from unickpt.store.storage import open_storage
from unickpt.tools.verify import verify_checkpoint

# Each stall point: (name, save_model's keyword arguments, a committed checkpoint there first).
_PARTS = {"shard": True, "size_per_shard": 0.002}  # a gathered save: S3 multipart parts (io/parts_save.py)
_SLICED = {"shard": True, "size_per_shard": 0.002, "gather_dtensor": False}  # ckpt/writer.py uploads
_SINGLE = {"shard": False}  # one model.safetensors: its completion is the commit
POINTS: list[tuple[str, dict[str, Any], bool]] = [
    ("after-lock", _PARTS, False),  # the lock is taken, nothing uploaded yet
    ("mid-uploads", _PARTS, False),  # one data file uploaded, the next not
    ("before-commit", _PARTS, False),  # every file uploaded, the commit next (save.commit)
    ("before-index", _PARTS, False),  # the check passed, the index PUT next
    ("before-index-over", _PARTS, True),  # the same over a committed checkpoint (save-id names)
    ("after-index-over", _PARTS, True),  # committed; B commits before A's cleanup
    ("sliced-mid-uploads", _SLICED, False),
    ("sliced-before-index", _SLICED, False),
    ("single-before-commit", _SINGLE, False),  # a single file: all uploaded but its one PUT
    ("single-before-put", _SINGLE, False),  # the check passed, the file's PUT (its commit) next
    ("before-release", _PARTS, False),  # committed; B takes the lock before A releases it
]

_CHILD = r"""
import json, os, signal, sys, traceback
sys.path.insert(0, {tests!r})
sys.path.insert(0, {unit!r})
from test_storage_write import net
from unickpt.errors import CheckpointBusyError
from unickpt.store.publish import referenced_files
from unickpt.store.lock import read_version
from unickpt.store import storage as st, storage_parts as sp, storage_s3
from unickpt.store import lock as sl
import importlib
from unickpt.io import GeneralCheckpointIO
parts_save = importlib.import_module("unickpt.io.parts_save")
save = importlib.import_module("unickpt.io.save")

points, url, gates = json.loads({points!r}), {url!r}, {gates!r}
state = {{"point": None, "uploads": 0}}

def stop(at):
    # tell the test where this save stands, then stall (a pause nothing in the process sees)
    with open(os.path.join(gates, at + ".tmp"), "w") as f:
        f.write(at)
    os.rename(os.path.join(gates, at + ".tmp"), os.path.join(gates, at))
    state["point"] = None
    os.kill(os.getpid(), signal.SIGSTOP)

def armed(*names):
    p = state["point"]
    return p is not None and any(p.endswith(n) for n in names)

def upload_begins():
    state["uploads"] += 1
    if armed("after-lock") and state["uploads"] == 1:
        stop(state["point"])
    elif armed("mid-uploads") and state["uploads"] == 2:
        stop(state["point"])

def wrap(cls, name, before):
    real = getattr(cls, name)
    def f(self, *a, **k):
        before(self, *a, **k)
        return real(self, *a, **k)
    setattr(cls, name, f)

def wrap_fn(module, name, before):
    real = getattr(module, name)
    def f(*a, **k):
        before(*a, **k)
        return real(*a, **k)
    setattr(module, name, f)

wrap(st.FsspecStorage, "open_write", lambda self, path: upload_begins())
wrap(sp.SharedUpload, "put", lambda self, body, when=None: upload_begins())
def before_commit(stage):
    if stage == "save.commit" and armed("before-commit"):
        stop(state["point"])
wrap_fn(parts_save, "maybe_fail", before_commit)
wrap_fn(save, "maybe_fail", before_commit)
def index_put(path):  # however the index is written (a conditional PUT, or a plain one)
    if path.endswith(".index.json") and armed("before-index", "before-index-over"):
        stop(state["point"])
wrap_fn(storage_s3, "write_if", lambda fs, path, data, etag: index_put(path))
real_write_if = storage_s3.write_if
def write_if_then(fs, path, data, etag):  # A's index is in: stall before the cleanup after it
    out = real_write_if(fs, path, data, etag)
    if path.endswith(".index.json") and armed("after-index-over"):
        stop(state["point"])
    return out
storage_s3.write_if = write_if_then
wrap(st.FsspecStorage, "put", lambda self, path, data, **k: index_put(path))
wrap(sp.SharedUpload, "put", lambda self, body, when=None: (
    self.path.endswith("/model.safetensors") and armed("single-before-put") and stop(state["point"])))
wrap(sl.StoreLock, "release", lambda self: armed("before-release") and stop(state["point"]))

io = GeneralCheckpointIO()
out = {{}}
for name, kwargs, over in points:
    target = f"{{url}}/{{name}}"
    if over:
        io.save_model(net(5), target, **kwargs)  # the committed checkpoint A and B save over
    state["point"], state["uploads"] = name, 0
    try:
        io.save_model(net(1), target, **kwargs)
        out[name] = "ok"
    except CheckpointBusyError as e:
        out[name] = "busy: " + str(e)
    except BaseException as e:
        out[name] = "other: " + "".join(traceback.format_exception(e))
    if state["point"] is not None:
        out[name] = "never stalled: " + out[name]
    with open(os.path.join(gates, name + ".done"), "w") as f:
        f.write(out[name])
print(json.dumps(out))
"""


def _wait(path: Path, proc: subprocess.Popen[str], what: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"writer A exited ({proc.returncode}) before {what}: {out} {err[-3000:]}")
        if time.monotonic() > end:
            raise AssertionError(f"writer A never reached {what}")
        time.sleep(0.02)


def _stopped(pid: int) -> None:
    """Wait until the process is stopped (SIGSTOP taken: state T in /proc)."""
    end = time.monotonic() + 30
    while time.monotonic() < end:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} never stopped")


def _same(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _intact(s3: Any, prefix: str, tmp: Path, kwargs: dict[str, Any], seed: int = 2) -> None:
    """The prefix holds one checkpoint (of ``net(seed)``) and nothing else: bit-exact, verified
    clean, no stray object, no lock."""
    names = objects(s3, prefix)
    assert LOCK_NAME not in names, names
    if kwargs.get("shard"):
        idx = fs_of(s3).cat_file(f"{s3.bucket}/{prefix}/model.safetensors.index.json")
        # nothing but the index and files it names (a sliced index's weight_map names a
        # placeholder file for HF loaders; the load below needs every file it names)
        assert "model.safetensors.index.json" in names and set(names) - {
            "model.safetensors.index.json"
        } <= referenced_files(idx), names
    else:
        assert names == ["model.safetensors"], names
    local = download(s3, prefix, tmp)
    report = verify_checkpoint(local)
    assert list(report) == [] and report.tensors > 0, report.summary()
    m = net(99)
    GeneralCheckpointIO().load_model(m, local, verify=True)
    _same(m, net(seed))


# The quick set (one of each kind of step); the sweep takes every stall point.
QUICK = (
    "after-lock",
    "before-index",
    "after-index-over",
)  # release: test_a_lost_lock_is_left_to_its_new_holder


def test_a_writer_stalled_past_its_lock_never_commits(s3, tmp_path, monkeypatch) -> None:
    _stall_at(s3, tmp_path, monkeypatch, [p for p in POINTS if p[0] in QUICK])


@pytest.mark.slow  # every stall point: about a minute on two busy cores
def test_a_writer_stalled_past_its_lock_at_every_step_never_commits(s3, tmp_path, monkeypatch) -> None:
    _stall_at(s3, tmp_path, monkeypatch, POINTS)


def _stall_at(
    s3: Any, tmp_path: Path, monkeypatch: Any, points: list[tuple[str, dict[str, Any], bool]]
) -> None:
    url = f"s3://{s3.bucket}/fence"
    gates = tmp_path / "gates"
    gates.mkdir()
    spec = json.dumps([[n, k, o] for n, k, o in points])
    code = _CHILD.format(
        tests=str(Path(__file__).parent),
        unit=str(Path(__file__).parents[1]),
        points=spec,
        url=url,
        gates=str(gates),
    )
    # A beats every 0.1 s while it runs (none while stopped); B judges any lock stale at once.
    env = {**os.environ, **s3.env(), "OMP_NUM_THREADS": "1", "UNICKPT_STORE_LOCK_STALE": "0.4"}
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "0")
    io_b = GeneralCheckpointIO(storage_options=s3.storage_options("b"))
    proc = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        for name, kwargs, _over in points:
            _wait(gates / name, proc, name)
            _stopped(proc.pid)
            target = f"{url}/{name}"
            if name == "before-release":  # B holds the lock while A, committed, releases its own
                store, root = open_storage(target, s3.storage_options("b"))
                with store_lock(store, root, "b" * 32) as held:
                    os.kill(proc.pid, signal.SIGCONT)
                    _wait(gates / f"{name}.done", proc, f"the end of {name}")
                    held.check("the test's look")  # A's release left B's lock alone
                    got = read_version(store, store.join(root, LOCK_NAME), 1 << 16)  # B beats meanwhile
                    assert got is not None and json.loads(got[0])["save_id"] == "b" * 32
                continue
            io_b.save_model(net(2), target, **kwargs)  # takes A's lock over and commits
            os.kill(proc.pid, signal.SIGCONT)
            _wait(gates / f"{name}.done", proc, f"the end of {name}")
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    got = json.loads(out.strip().splitlines()[-1])
    assert list(got) == [p[0] for p in points]
    for name, kwargs, _over in points:
        prefix = f"fence/{name}"
        if name == "after-index-over":
            # A committed, then B took over and committed: A's cleanup after its commit removed
            # only what A's own listing held (the first checkpoint's files), none of B's
            assert got[name] == "ok"
            _intact(s3, prefix, tmp_path / name, kwargs)
            continue
        if name == "before-release":
            assert got[name] == "ok"  # A committed while it held its lock: its save succeeded
            assert objects(s3, prefix).count(LOCK_NAME) == 0  # B released its own lock
            _intact(s3, prefix, tmp_path / name, kwargs, seed=1)  # A's checkpoint, whole
            continue
        assert got[name].startswith("busy: "), (name, got[name])
        msg = got[name]
        assert f"{s3.bucket}/{prefix}" in msg, msg  # the URL
        if name in ("before-index", "before-index-over", "sliced-before-index", "single-before-put"):
            # past its check when it stalled: the index PUT, conditional on the version under
            # A's lock, is refused by the store
            assert "another save committed here after this save's lock was taken over" in msg, msg
        else:
            assert "lost its lock before" in msg, msg
        _intact(s3, prefix, tmp_path / name, kwargs)


def test_check_names_the_new_holder_and_a_lost_lock_is_never_written(s3, monkeypatch) -> None:
    """In one process: A holds the lock, B takes it over as stale; A's check raises naming the URL
    and B, A's heartbeat writes nothing (no PUT from A's client), A's release leaves B's lock."""
    store, root = open_storage(f"s3://{s3.bucket}/held", s3.storage_options("a"))
    store_b, _ = open_storage(f"s3://{s3.bucket}/held", s3.storage_options("b"))
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
    with store_lock(store, root, "a" * 32) as a:
        a.check("a look")  # held: passes
        a.beat()  # a heartbeat on its own version: still held
        a.check("a second look")
        monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "0")
        with store_lock(store_b, root, "b" * 32) as b:
            monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
            busy = rf"s3://{s3.bucket}/held/\{LOCK_NAME}: this save \(save a{{32}}\) lost its lock before "
            with pytest.raises(
                CheckpointBusyError, match=busy + "the commit: it is now held by save b{32} on "
            ):
                a.check("the commit")
            puts, deletes = s3.requests[("PUT", "a")], s3.requests[("DELETE", "a")]
            a.beat()
            a.beat()
            b.check("B's look")
        assert (s3.requests[("PUT", "a")], s3.requests[("DELETE", "a")]) == (puts, deletes)  # A wrote nothing
        assert store.listdir(root) == []  # B released its own lock
    assert s3.requests[("DELETE", "a")] == deletes  # A's release deleted nothing: it had lost the lock
    assert store.listdir(root) == []


def test_a_lost_lock_is_left_to_its_new_holder(s3, monkeypatch) -> None:
    store, root = open_storage(f"s3://{s3.bucket}/left", s3.storage_options())
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
    with store_lock(store, root, "a" * 32) as a:
        monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "0")
        b_cm = store_lock(store, root, "b" * 32)
        b = b_cm.__enter__()
        monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
    # A's release (the block's end) left B's lock in place
    got = read_version(store, store.join(root, LOCK_NAME), 1 << 16)  # one GET: B beats meanwhile
    assert got is not None and json.loads(got[0])["save_id"] == "b" * 32
    b.check("B's look")
    b_cm.__exit__(None, None, None)
    assert store.listdir(root) == []
    with pytest.raises(
        CheckpointBusyError, match=r"lost its lock before the commit: it is now held by save b{32}"
    ):
        a.check("the commit")  # lost for good: remembered, never taken back


def test_memory_store_fences_by_reading_the_lock_back(monkeypatch) -> None:
    """memory:// has no conditional overwrites: the check reads the lock's save id back."""
    import uuid

    store, root = open_storage(f"memory://fence-{uuid.uuid4().hex[:8]}/ckpt")
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
    with store_lock(store, root, "a" * 32) as a:
        a.check("a look")
        a.beat()  # read back, then rewritten: still A's
        a.check("a second look")
        monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "0")
        time.sleep(0.05)
        with store_lock(store, root, "b" * 32) as b:
            with pytest.raises(CheckpointBusyError, match=r"it is now held by save b{32}"):
                a.check("the commit")
            a.beat()  # reads B's lock back: writes nothing
            b.check("B's look")
            monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
        assert LOCK_NAME not in store.listdir(root)


def test_a_tool_run_whose_lock_was_taken_over_commits_and_removes_nothing(s3, monkeypatch) -> None:
    """A tool writing to a URL (merge, convert, export: store/publish.py) holds the prefix's
    lock: taken over while it wrote, its commit point is never written and its abort removes
    nothing (the names it wrote may be the new holder's)."""
    from unickpt.store.publish import store_output

    url = f"s3://{s3.bucket}/tool-out"
    monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
    taken: list[Any] = []
    with (
        pytest.raises(
            CheckpointBusyError, match=r"lost its lock before writing its commit point .*index\.json"
        ),
        store_output(url, s3.storage_options()) as out,
    ):
        out.put("model-00001-of-00001.safetensors", b"shared name")
        out.commit_later("model.safetensors.index.json", b"{}")
        monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "0")
        b = store_lock(out.storage, out.root, "b" * 32)  # the run stalled: B takes its lock over
        taken.append((b, b.__enter__()))
        monkeypatch.setenv("UNICKPT_STORE_LOCK_STALE", "100")
    names = objects(s3, "tool-out")
    assert names == [LOCK_NAME, "model-00001-of-00001.safetensors"], names  # no index; nothing removed
    ((b, held),) = taken
    held.check("B's look")
    b.__exit__(None, None, None)
    assert objects(s3, "tool-out") == ["model-00001-of-00001.safetensors"]
