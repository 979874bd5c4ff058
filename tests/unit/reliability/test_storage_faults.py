"""Storage faults: a failing write, fsync, rename or open ends the save with the OS error, removes the
save's temporary files and leaves earlier checkpoints intact; concurrent saves never interleave.

Faults are injected by monkeypatching (test-only): the ``open`` the writer uses returns a file whose
``write`` raises after a byte budget (disk full), ``os.fsync``/``os.replace`` raise, ``open`` raises EACCES.
"""

from __future__ import annotations

import errno
import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _reliability import Tiny, same_state, save_checkpoint, snapshot

import unickpt.store.publish as commit_mod
import unickpt.store.storage as storage_mod
from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import CheckpointBusyError, IncompleteCheckpointError
from unickpt.store.lock import LOCK_NAME, directory_lock


class _FullDisk(io.BufferedWriter):
    budget = 0

    def write(self, b: Any) -> int:
        n = memoryview(b).nbytes
        if n > _FullDisk.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _FullDisk.budget -= n
        return super().write(b)


def _full_disk_open(budget: int):  # type: ignore[no-untyped-def]
    _FullDisk.budget = budget  # bytes left on the "disk", over all files of the save

    def fake_open(path: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        if "w" in mode:
            return _FullDisk(io.FileIO(path, "w"), buffer_size=1)
        return open(path, mode, *a, **k)

    return fake_open


def _full_disk(monkeypatch: pytest.MonkeyPatch, budget: int) -> None:
    """A disk with ``budget`` bytes left for every write of a save: streamed files (sliced saves),
    and the headers and in-place ``pwrite``s of gathered saves (``io/hf_save.py``)."""
    fake = _full_disk_open(budget)
    monkeypatch.setattr(storage_mod, "open", fake, raising=False)  # LocalStorage.open_write
    real = os.pwrite

    def pwrite(fd: int, data: Any, pos: int) -> int:
        n = memoryview(data).nbytes
        if n > _FullDisk.budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        _FullDisk.budget -= n
        return real(fd, data, pos)

    monkeypatch.setattr(os, "pwrite", pwrite)


def _committed_ok(path: Path, seed: int) -> None:
    assert open_checkpoint(path).verify() == []
    m = Tiny(99)
    GeneralCheckpointIO().load_model(m, path, verify=True)
    assert same_state(m, snapshot(Tiny(seed)))


@pytest.fixture()
def old(make_checkpoint: Callable[..., Path]) -> Path:
    return make_checkpoint("step-1", 1)


def _only(path: Path) -> list[str]:
    return sorted(os.listdir(path)) if path.exists() else []


@pytest.mark.parametrize("budget", [0, 8, 200, 400, 700, 1000])
def test_disk_full_during_data_writes(
    budget: int, old: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _full_disk(monkeypatch, budget)
    new = tmp_path / "step-2"
    with pytest.raises(OSError) as ei:
        save_checkpoint(new, 2)
    assert ei.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert _only(new) == [], f"save left files behind: {_only(new)}"
    _committed_ok(old, 1)
    save_checkpoint(new, 2)  # the directory is usable again
    _committed_ok(new, 2)


@pytest.mark.parametrize("nth", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("err", [errno.ENOSPC, errno.EIO])
def test_fsync_fails(nth: int, err: int, old: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = os.fsync
    calls = {"n": 0}

    def fsync(fd: int) -> None:
        calls["n"] += 1
        if calls["n"] == nth:
            raise OSError(err, os.strerror(err))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    new = tmp_path / "step-2"
    with pytest.raises(OSError) as ei:
        save_checkpoint(new, 2)
    assert ei.value.errno == err
    monkeypatch.undo()
    leftovers = _only(new)
    assert LOCK_NAME not in leftovers and not any(".tmp-" in f for f in leftovers)
    if "model.safetensors.index.json" not in leftovers and leftovers:
        # data files of a save that failed at its commit: never loadable as a checkpoint
        with pytest.raises(IncompleteCheckpointError):
            open_checkpoint(new)
    _committed_ok(old, 1)


def test_index_rename_denied(old: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def replace(a: Any, b: Any) -> None:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(b))

    monkeypatch.setattr(commit_mod.os, "replace", replace)
    new = tmp_path / "step-2"
    with pytest.raises(PermissionError):
        save_checkpoint(new, 2)
    monkeypatch.undo()
    left = _only(new)
    assert not any(".tmp-" in f for f in left) and LOCK_NAME not in left
    with pytest.raises(IncompleteCheckpointError):
        open_checkpoint(new)
    _committed_ok(old, 1)


def test_permission_denied_opening_data_file(
    old: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fake_open(path: Any, mode: str = "r", *a: Any, **k: Any) -> Any:
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(storage_mod, "open", fake_open, raising=False)  # LocalStorage.open_write
    create = storage_mod.LocalStorage.open_range

    def open_range(self: Any, path: str, *, size: int | None = None, header: bytes = b"") -> Any:
        if size is not None:  # a gathered save's files, created sized (io/hf_save.py)
            fake_open(path, "wb")
        return create(self, path, size=size, header=header)

    monkeypatch.setattr(storage_mod.LocalStorage, "open_range", open_range)
    new = tmp_path / "step-2"
    with pytest.raises(PermissionError) as ei:
        save_checkpoint(new, 2)
    assert "model-0000" in str(ei.value)  # names the file it could not create
    monkeypatch.undo()
    assert _only(new) == []
    _committed_ok(old, 1)


@pytest.mark.parametrize("budget", [0, 100, 400])
def test_disk_full_single_file_keeps_old_file(
    budget: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    p = tmp_path / "model.safetensors"
    GeneralCheckpointIO().save_model(Tiny(1), str(p))
    _full_disk(monkeypatch, budget)
    with pytest.raises(OSError):
        GeneralCheckpointIO().save_model(Tiny(2), str(p))
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]
    _committed_ok(p, 1)


def test_save_refused_while_lock_held(old: Path) -> None:
    with directory_lock(str(old)):
        with pytest.raises(CheckpointBusyError, match="another save"):
            save_checkpoint(old, 2)
        _committed_ok(old, 1)
    save_checkpoint(old, 2)
    _committed_ok(old, 2)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_concurrent_saves_never_interleave(tmp_path: Path, make_checkpoint: Callable[..., Path]) -> None:
    """Two processes save different models into one directory at once, many times: each save either
    commits whole or is refused with CheckpointBusyError; the final directory is one of the two models."""
    ck = make_checkpoint(seed=1)
    start = time.time() + 0.5
    pids = []
    for seed in (2, 3):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                import unickpt.ckpt.safetensors_io as m

                orig = m.SafetensorsWriter.write

                def slow(self: Any, key: str, data: Any, orig: Any = orig) -> None:
                    time.sleep(0.002)  # widen the window in which the saves overlap
                    orig(self, key, data)

                m.SafetensorsWriter.write = slow  # type: ignore[method-assign]
                while time.time() < start:
                    time.sleep(0.001)
                ok = busy = 0
                for _ in range(12):
                    try:
                        save_checkpoint(ck, seed)
                        ok += 1
                    except CheckpointBusyError:
                        busy += 1
                with open(tmp_path / f"r{seed}", "w") as f:
                    f.write(f"{ok} {busy}")
            except BaseException:
                code = 1
            os._exit(code)
        pids.append(pid)
    for pid in pids:
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    results = [tuple(map(int, (tmp_path / f"r{s}").read_text().split())) for s in (2, 3)]
    assert sum(ok for ok, _ in results) >= 2 and sum(ok + b for ok, b in results) == 24
    assert sum(b for _, b in results) >= 1, "the saves never overlapped; the test proved nothing"
    m = Tiny(99)
    GeneralCheckpointIO().load_model(m, ck, verify=True)
    assert same_state(m, snapshot(Tiny(2))) or same_state(m, snapshot(Tiny(3)))
    assert LOCK_NAME not in os.listdir(ck)
