"""Crash safety: a save SIGKILLed at any point never damages the previous checkpoint and never leaves a
directory that loads as a mix of old and new.

A forked child saves with fsync; test-only hooks count the file-system events of the save (each data
write: before, half written and flushed, after; each fsync, rename and unlink: before and after) and the
child SIGKILLs itself at the k-th one. The test runs every k from the first event to past the last.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from _reliability import Tiny, data_files, run_child, same_state, save_checkpoint, snapshot

import unickpt.io.save as save_mod
from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import CheckpointBusyError, IncompleteCheckpointError
from unickpt.store.lock import LOCK_NAME, directory_lock

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
OLD_SEED, NEW_SEED = 1, 2


def _count_events(fn: Callable[[], None], tmp: Path) -> list[str]:
    log_path = tmp / "events.json"
    assert run_child(0, fn, log_path) == 0
    events: list[str] = json.loads(log_path.read_text())
    return events


def _assert_committed_as(path: Path, seed: int) -> None:
    r = open_checkpoint(path)
    r.validate_structure()
    assert r.verify() == []
    m = Tiny(99)
    GeneralCheckpointIO().load_model(m, path, verify=True)
    assert same_state(m, snapshot(Tiny(seed)))


def _assert_refused(path: Path) -> None:
    with pytest.raises(IncompleteCheckpointError):
        open_checkpoint(path)
    m = Tiny(99)
    snap = snapshot(m)
    with pytest.raises(IncompleteCheckpointError):
        GeneralCheckpointIO().load_model(m, path)
    assert same_state(m, snap)


def _save_new(path: Path) -> Callable[[], None]:
    def fn() -> None:
        torch.set_num_threads(1)
        save_checkpoint(path, NEW_SEED, io=GeneralCheckpointIO(fsync=True))

    return fn


def test_kill_at_every_event_of_a_fresh_save(tmp_path: Path) -> None:
    """Checkpoint-manager style: step-1 is committed, step-2 is being saved when the process dies."""
    old = tmp_path / "step-1"
    save_checkpoint(old, OLD_SEED)
    events = _count_events(_save_new(tmp_path / "probe"), tmp_path)
    assert sum(e.startswith("write-half") for e in events) >= 5
    assert any("index.json" in e for e in events)
    outcomes = {"refused": 0, "committed": 0, "absent": 0}
    for k in range(1, len(events) + 1):
        new = tmp_path / f"step-2-k{k}"
        sig = run_child(k, _save_new(new), tmp_path / "log.json")
        assert sig == signal.SIGKILL, f"child was not killed at event {k} ({events[k - 1]})"
        _assert_committed_as(old, OLD_SEED)  # the previous checkpoint is never touched
        if not new.exists():
            outcomes["absent"] += 1
        elif os.path.exists(new / "model.safetensors.index.json"):
            _assert_committed_as(new, NEW_SEED)  # a committed index means the whole new checkpoint
            outcomes["committed"] += 1
        else:
            _assert_refused(new)
            outcomes["refused"] += 1
        # A later save into the killed directory works: the dead save's lock is taken over.
        if k % 7 == 0:
            save_checkpoint(new, 3)
            _assert_committed_as(new, 3)
            assert not os.path.exists(new / LOCK_NAME)
            # ... and removes what the dead save left (partial files, staging names).
            assert sorted(os.listdir(new)) == sorted(os.listdir(tmp_path / "step-1"))
    assert outcomes["refused"] >= len(events) - 6
    assert outcomes["committed"] >= 1  # killed after the index rename: the commit survived


def test_kill_during_in_place_overwrite_is_never_a_mix(tmp_path: Path) -> None:
    """Saving over a committed directory first un-commits it: a kill leaves old, new, or refused."""
    events = _count_events(_save_new(tmp_path / "probe"), tmp_path)
    outcomes = {"old": 0, "new": 0, "refused": 0}
    for k in range(1, len(events) + 1, 2):
        ck = tmp_path / f"ck-{k}"
        save_checkpoint(ck, OLD_SEED)
        assert run_child(k, _save_new(ck), tmp_path / "log.json") == signal.SIGKILL
        if not os.path.exists(ck / "model.safetensors.index.json"):
            _assert_refused(ck)
            outcomes["refused"] += 1
            continue
        r = open_checkpoint(ck)
        assert r.verify() == []
        m = Tiny(99)
        GeneralCheckpointIO().load_model(m, ck, verify=True)
        if same_state(m, snapshot(Tiny(OLD_SEED))):
            outcomes["old"] += 1
        else:
            assert same_state(m, snapshot(Tiny(NEW_SEED)))
            outcomes["new"] += 1
    assert outcomes["refused"] > 0 and outcomes["new"] > 0


def test_kill_during_single_file_save_keeps_old_file(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    GeneralCheckpointIO().save_model(Tiny(OLD_SEED), str(p))

    def fn() -> None:
        GeneralCheckpointIO(fsync=True).save_model(Tiny(NEW_SEED), str(p))

    events = _count_events(fn, tmp_path)
    GeneralCheckpointIO().save_model(Tiny(OLD_SEED), str(p))
    seen = set()
    for k in range(1, len(events) + 1):
        assert run_child(k, fn, tmp_path / "log.json") == signal.SIGKILL
        m = Tiny(99)
        GeneralCheckpointIO().load_model(m, p, verify=True)
        seed = OLD_SEED if same_state(m, snapshot(Tiny(OLD_SEED))) else NEW_SEED
        assert same_state(m, snapshot(Tiny(seed)))
        seen.add(seed)
        if seed == NEW_SEED:
            GeneralCheckpointIO().save_model(Tiny(OLD_SEED), str(p))
    assert seen == {OLD_SEED, NEW_SEED}


def test_data_files_without_index_are_refused(make_checkpoint: Callable[..., Path]) -> None:
    ck = make_checkpoint()
    os.unlink(ck / "model.safetensors.index.json")
    assert data_files(ck)
    _assert_refused(ck)
    with pytest.raises(IncompleteCheckpointError, match="interrupted save"):
        open_checkpoint(ck)


def test_lock_of_a_live_process_refuses_a_second_save(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    save_checkpoint(ck, OLD_SEED)
    held_r, held_w = os.pipe()  # child -> parent: the lock is held
    done_r, done_w = os.pipe()  # parent -> child: release it (two pipes: neither reads its own byte)
    pid = os.fork()
    if pid == 0:  # a live process holds the lock
        with directory_lock(str(ck)):
            os.write(held_w, b"x")
            os.read(done_r, 1)
        os._exit(0)
    try:
        assert os.read(held_r, 1) == b"x"
        with pytest.raises(CheckpointBusyError, match=f"held by pid {pid}"):
            save_checkpoint(ck, NEW_SEED)
    finally:
        os.write(done_w, b"x")
        os.waitpid(pid, 0)
        for fd in (held_r, held_w, done_r, done_w):
            os.close(fd)
    _assert_committed_as(ck, OLD_SEED)
    # A lock file left with a live pid in it but not held (a killed holder's pid reused): not a lock.
    (ck / LOCK_NAME).write_text(f"{os.getppid()}\n")
    save_checkpoint(ck, NEW_SEED)
    _assert_committed_as(ck, NEW_SEED)


def test_save_module_has_no_test_hooks() -> None:
    """The kill points are injected by monkeypatching in the child; the library carries no hook."""
    src = Path(save_mod.__file__).read_text()
    assert "SIGKILL" not in src and "UNICKPT_TEST" not in src
