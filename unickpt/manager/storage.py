"""Where the manager's steps live: one small interface, a local directory or an fsspec URL.

Both stage a save in a local work directory ``.step-<N>.staging-<id>`` (``stage``). A local
directory stages in place and commits by renaming (``_stepdirs.commit_step``); a remote store
stages in a per-rank local cache, uploads file by file and commits with a ``COMMIT`` object
(``_remote_store.py``). The manager's logic calls the same methods for both.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from typing import Any

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt._remote_store import RemoteStore
from unickpt._stepdirs import (
    clean_work_dirs,
    commit_step,
    committed_step_dirs,
    make_work_dir,
    remove_step,
)
from unickpt.errors import ConfigError
from unickpt.format import run_layout
from unickpt.format.commit import directory_lock
from unickpt.format.run_layout import HF_DIR, LATEST_NAME, TRAIN_STATE_DIR

__all__ = ["Storage", "LocalStorage", "RemoteStorage", "open_storage"]


class Storage:
    """The operations the manager needs from where its steps are kept."""

    location: str  # the checkpoint directory or URL, as reported
    root: str  # the local directory holding this rank's work directories

    def committed_step_dirs(self) -> dict[int, str]:
        """{N: path or URL of committed step N}."""
        raise NotImplementedError

    def read_latest(self) -> int | None:
        raise NotImplementedError

    def step_dir(self, step: int) -> str:
        raise NotImplementedError

    def begin_save(self, step: int, stage: str, rank: int, lock: contextlib.ExitStack) -> str:
        """Make the work directory ``stage`` (its claims go on ``lock``); returns the upload target."""
        raise NotImplementedError

    def share_target(self, target: str, group: Any) -> str:
        """Collective: rank 0's upload target on every rank."""
        return target

    def upload(self, stage: str, target: str, done: set[str], group: Any, step: int) -> None:
        """Collective: put every file of ``stage`` not in ``done`` where the step is committed."""

    def fetch(self, target: str, sub: str, stage: str, done: set[str]) -> None:
        """Rank 0: make ``stage/<sub>/`` hold every rank's files of the step being saved."""

    def commit(self, step: int, stage: str, target: str, record: bytes) -> None:
        """Rank 0, once everything is written: commit the step, then record it as ``latest``."""
        raise NotImplementedError

    def remove_step(self, step: int) -> None:
        raise NotImplementedError

    def end_save(self, stage: str) -> None:
        """Every rank, the save committed or failed."""

    @contextlib.contextmanager
    def open_step(self, step: int, path: str, group: Any) -> Iterator[str]:
        """Collective: a local directory holding committed step ``step`` (at ``path``) while open."""
        yield path


class LocalStorage(Storage):
    """A local directory shared by the ranks: rank 0 stages in place and commits by renaming."""

    def __init__(self, directory: str) -> None:
        self.location = self.root = directory

    def committed_step_dirs(self) -> dict[int, str]:
        return committed_step_dirs(self.location)

    def read_latest(self) -> int | None:
        return run_layout.read_latest(self.location)

    def step_dir(self, step: int) -> str:
        return os.path.join(self.location, run_layout.step_name(step))

    def begin_save(self, step: int, stage: str, rank: int, lock: contextlib.ExitStack) -> str:
        if rank == 0:
            maybe_fail("manager.start")
            os.makedirs(self.location, exist_ok=True)
            lock.enter_context(directory_lock(self.location))
            clean_work_dirs(self.location)
            lock.callback(os.close, make_work_dir(stage))
            os.makedirs(os.path.join(stage, TRAIN_STATE_DIR))
        return ""

    def commit(self, step: int, stage: str, target: str, record: bytes) -> None:
        commit_step(self.location, stage, step, record)

    def remove_step(self, step: int) -> None:
        remove_step(self.location, step)


class RemoteStorage(Storage):
    """An fsspec URL: each rank stages in its own local cache and uploads; nothing is renamed."""

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None, cache_dir: str | None, rank: int
    ) -> None:
        self.store = RemoteStore(url, storage_options)
        self.location = self.store.url
        if cache_dir is None:
            base = tempfile.mkdtemp(prefix="unickpt-cache-")
            weakref.finalize(self, shutil.rmtree, base, True)
        else:
            base = os.path.abspath(cache_dir)
        # One directory per rank: ranks never share (or upload) each other's local files.
        self.root = os.path.join(base, f"rank-{rank:05d}")

    def committed_step_dirs(self) -> dict[int, str]:
        return {s: self.step_dir(s) for s in self.store.committed_steps()}

    def read_latest(self) -> int | None:
        return self.store.read_latest()

    def step_dir(self, step: int) -> str:
        return f"{self.location}/{run_layout.step_name(step)}"

    def begin_save(self, step: int, stage: str, rank: int, lock: contextlib.ExitStack) -> str:
        """Every rank: its local staging directory; rank 0 tidies the store and returns the upload prefix."""
        os.makedirs(self.root, exist_ok=True)
        clean_work_dirs(self.root)
        lock.callback(os.close, make_work_dir(stage))
        # Every rank writes into its own local copy of the stage, so every rank creates the
        # directories the writers expect (on a shared directory rank 0 alone creates them).
        for sub in (TRAIN_STATE_DIR, "model", "optimizer", HF_DIR):
            os.makedirs(os.path.join(stage, sub))
        return self.store.prepare(step) if rank == 0 else ""

    def share_target(self, target: str, group: Any) -> str:
        return str(_dist.broadcast_object(target, 0, group))

    def upload(self, stage: str, target: str, done: set[str], group: Any, step: int) -> None:
        err: BaseException | None = None
        try:
            self.store.upload_step(stage, target, done)
        except BaseException as e:
            err = e
        _dist.agree(err, f"uploading step {step} to {self.location}", group)

    def fetch(self, target: str, sub: str, stage: str, done: set[str]) -> None:
        self.store.fetch_missing(target, sub, stage, done)

    def commit(self, step: int, stage: str, target: str, record: bytes) -> None:
        self.store.commit(step, target, record)  # COMMIT last, then promoted
        self.store.put_bytes(LATEST_NAME, run_layout.latest_record(step))

    def remove_step(self, step: int) -> None:
        self.store.remove_step(step)

    def end_save(self, stage: str) -> None:
        shutil.rmtree(stage, ignore_errors=True)  # uploaded or failed: the local copy is not needed

    @contextlib.contextmanager
    def open_step(self, step: int, path: str, group: Any) -> Iterator[str]:
        d = os.path.join(self.root, run_layout.work_name(step, "download"))
        err = None
        owned: int | None = None
        try:
            os.makedirs(self.root, exist_ok=True)
            clean_work_dirs(self.root)
            owned = make_work_dir(d)
            self.store.download_step(step, d, _dist.rank(group))
        except BaseException as e:
            err = e
        try:
            _dist.agree(err, f"downloading {self.step_dir(step)}", group)
            yield d
        finally:
            shutil.rmtree(d, ignore_errors=True)
            if owned is not None:
                os.close(owned)


def open_storage(
    checkpoint_dir: str | os.PathLike[str],
    local_cache_dir: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None,
    rank: int,
) -> Storage:
    """A ``RemoteStorage`` for an fsspec URL other than ``file://``, else a ``LocalStorage``."""
    s = os.fspath(checkpoint_dir)
    if "://" in s and not s.startswith("file://"):
        cache = None if local_cache_dir is None else os.fspath(local_cache_dir)
        return RemoteStorage(s, storage_options, cache, rank)
    if local_cache_dir is not None or storage_options is not None:
        raise ConfigError(
            f"local_cache_dir and storage_options are for fsspec URLs; {s!r} is a local directory"
        )
    if s.startswith("file://"):  # file:// paths keep the rename-based commit
        s = s[len("file://") :]
    return LocalStorage(os.path.abspath(s))
