"""The commit step of a save across ranks, on top of ``store.publish`` (docs/format.md, section 6)."""

from __future__ import annotations

import contextlib
from typing import Any

from unickpt import _dist
from unickpt._logging import get_logger
from unickpt.io.planner import SavePlan
from unickpt.store.lock import Fence
from unickpt.store.publish import (
    commit_and_clean,
    commit_directory,
    discard,
    finish_commit,
    place_staged,
    prepare_commit,
)
from unickpt.store.storage import Storage

__all__ = ["commit_collective", "settle"]

logger = get_logger(__name__)


def commit_collective(
    directory: str,
    kind: str,
    fsync: bool,
    plan: SavePlan,
    staged: dict[str, str],
    index: bytes,
    save_id: str,
    err: BaseException | None,
    group: Any,
    rank: int,
    world: int,
    store: Storage | None = None,
    lock: contextlib.ExitStack | None = None,
    *,
    clean: bool = True,
    fence: Fence | None = None,
) -> None:
    """Collective: commit a sharded or sliced save (``store.publish``), or raise on every rank.

    One process commits in one call. Several ranks each rename their own staged files (their
    directories may differ, as with node-local staging before an upload) between rank 0's
    un-commit of the previous checkpoint and its rename of the index. ``lock`` (rank 0's save
    lock) is released after a successful commit, before the last agreement (``settle``).
    ``clean=False`` (rank 0, a store): the directory held no data file when the save began, so the
    commit on the store skips the listing and cleanup after the index PUT (``commit_and_clean``).
    ``fence`` (rank 0, a store): its save lock, which fences the commit (``publish.put_commit_point``).
    """
    where = f"committing {directory}"
    if store is not None:
        _commit_on_store(store, directory, kind, plan, staged, index, err, group, rank, lock, clean, fence)
        return
    if world == 1:
        try:
            if err is None:
                commit_directory(directory, kind, staged, index, save_id=save_id, fsync=fsync)
        except BaseException as e:
            err = e
        settle(err, where, group, lock)
        return
    idx_tmp = ""
    if rank == 0 and err is None:
        try:
            idx_tmp = prepare_commit(directory, kind, index, save_id=save_id, fsync=fsync)
        except BaseException as e:
            err = e
    try:
        _dist.agree(err, where, group)
    except BaseException:
        discard(staged.values())
        raise
    try:
        place_staged(directory, staged, fsync=fsync)
    except BaseException as e:
        err = e
    try:
        _dist.agree(err, where, group)
    except BaseException:
        discard([idx_tmp] if idx_tmp else [])
        raise
    if rank == 0:
        try:
            finish_commit(directory, kind, idx_tmp, {f.name for f in plan.files}, fsync=fsync)
        except BaseException as e:
            err = e
    settle(err, where, group, lock)


def _commit_on_store(
    store: Storage,
    directory: str,
    kind: str,
    plan: SavePlan,
    staged: dict[str, str],
    index: bytes,
    err: BaseException | None,
    group: Any,
    rank: int,
    lock: contextlib.ExitStack | None,
    clean: bool,
    fence: Fence | None = None,
) -> None:
    """Collective, object stores: every data file is uploaded whole; rank 0 writes the index
    (one PUT: the commit), removes what it supersedes and the leftovers of killed saves (one
    listing for both, ``commit_and_clean``; a cleanup failure is only logged)."""
    if rank == 0 and err is None:
        try:
            commit_and_clean(
                store, directory, kind, index, {f.name for f in plan.files}, clean=clean, fence=fence
            )
        except BaseException as e:
            err = e
    try:
        settle(err, f"committing {store.url}", group, lock)
    except BaseException:
        store.remove(staged.values())  # never named by a committed index
        raise


def settle(err: BaseException | None, what: str, group: Any, lock: contextlib.ExitStack | None) -> None:
    """Collective, the last agreement of a save, after rank 0's commit (``err``: this rank's failure).

    A rank that did not fail releases ``lock`` first (rank 0's save lock; on other ranks an empty
    stack), so this agreement is also the save's final barrier: no rank returns before the
    checkpoint is committed and its lock released. A failed rank keeps the lock until it has
    removed its leftovers; a failure to release it fails the save on every rank.
    """
    if err is None and lock is not None:
        try:
            lock.close()
        except BaseException as e:
            err = e
    _dist.agree(err, what, group)
