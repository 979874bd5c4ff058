"""Where the manager's steps live: one small interface, a local directory or an fsspec URL.

A local directory stages a save in a work directory ``.step-<N>.staging-<id>`` and commits it
by renaming (``store.publish.commit_step``). On a store every rank writes its files straight into
the step's prefix (``step-<N>/``, or a replacement copy) through the storage layer, nothing on
local disk, and rank 0 commits with an exclusive ``COMMIT`` (``store/publish.py``). The
manager's logic calls the same methods for both.
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
from unickpt.ckpt import run_layout
from unickpt.ckpt.run_layout import LATEST_NAME, TRAIN_STATE_DIR
from unickpt.errors import ConfigError, IncompleteCheckpointError
from unickpt.store.lock import directory_lock
from unickpt.store.publish import (
    RemoteStore,
    clean_work_dirs,
    commit_step,
    committed_step_dirs,
    make_work_dir,
    makedirs_durable,
    remove_step,
)
from unickpt.store.storage import open_storage as open_location_storage
from unickpt.store.storage import url_options

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
        """Collective: rank 0's write target on every rank."""
        return target

    def write_root(self, stage: str, target: str) -> str:
        """Where the ranks write the step's files: the local ``stage``, or the target's URL."""
        return stage

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
            makedirs_durable(self.location)
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
    """An fsspec URL: every rank writes straight to the store; nothing is renamed or staged locally."""

    def __init__(
        self, url: str, storage_options: dict[str, Any] | None, cache_dir: str | None, rank: int
    ) -> None:
        self.store = RemoteStore(url, storage_options)
        self.location = self.store.url
        self.storage_options = storage_options
        if cache_dir is None:
            base = tempfile.mkdtemp(prefix="unickpt-cache-")
            weakref.finalize(self, shutil.rmtree, base, True)
        else:
            base = os.path.abspath(cache_dir)
        # Loads download into one directory per rank (ranks never share local files).
        self.root = os.path.join(base, f"rank-{rank:05d}")

    def committed_step_dirs(self) -> dict[int, str]:
        return {s: self.step_dir(s) for s in self.store.committed_steps()}

    def read_latest(self) -> int | None:
        return self.store.read_latest()

    def step_dir(self, step: int) -> str:
        return f"{self.location}/{run_layout.step_name(step)}"

    def begin_save(self, step: int, stage: str, rank: int, lock: contextlib.ExitStack) -> str:
        """Rank 0 tidies the store and returns the prefix every rank writes into."""
        if rank != 0:
            return ""
        maybe_fail("manager.start")
        return self.store.prepare(step)

    def share_target(self, target: str, group: Any) -> str:
        return str(_dist.broadcast_object(target, 0, group))

    def write_root(self, stage: str, target: str) -> str:
        return self.store.url_of(target)

    def commit(self, step: int, stage: str, target: str, record: bytes) -> None:
        self.store.commit(step, target, record)  # COMMIT last (exclusive), then promoted
        self.store.put_bytes(LATEST_NAME, run_layout.latest_record(step))

    def remove_step(self, step: int) -> None:
        self.store.remove_step(step)

    @contextlib.contextmanager
    def open_step(self, step: int, path: str, group: Any) -> Iterator[str]:
        """The step's URL itself: every load reads in place, each rank only its byte ranges
        (the index fetched once and broadcast), nothing copied to local disk."""
        del path
        err: BaseException | None = None
        url = ""
        if _dist.rank(group) == 0:
            try:
                prefix = self.store.committed_prefixes().get(step)
                if prefix is None:  # deleted by retention or a replacing save since it was listed
                    raise IncompleteCheckpointError(f"{self.store.url}/step-{step} is no longer committed")
                url = self.store.url_of(prefix)
            except BaseException as e:
                err = e
        _dist.agree(err, f"opening {self.step_dir(step)}", group)
        yield _dist.broadcast_object(url, 0, group)


def open_storage(
    checkpoint_dir: str | os.PathLike[str],
    local_cache_dir: str | os.PathLike[str] | None,
    storage_options: dict[str, Any] | None,
    rank: int,
) -> Storage:
    """A ``LocalStorage`` where the store renames (a local directory, ``file://`` URLs too: the
    rename-based commit), else a ``RemoteStorage`` (an object store: a marker commits)."""
    s = os.fspath(checkpoint_dir)
    store, root = open_location_storage(s, url_options(s, storage_options))
    if not store.atomic_rename:
        cache = None if local_cache_dir is None else os.fspath(local_cache_dir)
        return RemoteStorage(s, storage_options, cache, rank)
    if local_cache_dir is not None or storage_options is not None:
        raise ConfigError(
            f"local_cache_dir and storage_options are for fsspec URLs; {s!r} is a local directory"
        )
    return LocalStorage(root)
