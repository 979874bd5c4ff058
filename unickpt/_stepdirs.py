"""The step directories of a local ``CheckpointManager`` directory: commit, recovery, cleanup.

A step N is committed when ``step-<N>/COMMIT`` exists, or (recovery rule) when ``step-<N>`` has
no ``COMMIT`` and a replaced copy ``.step-<N>.old-<id>/COMMIT`` does (a save replacing step N
was killed between its two renames). Hidden ``.step-<N>.<kind>-<id>`` work directories (a save
in progress, a replaced copy, a step being deleted, a remote step being downloaded) are never
loaded; a cleanup removes them unless a live process owns them (``flock`` on the directory).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil

from unickpt._logging import get_logger
from unickpt.format.commit import fsync_dir, parse_temp_name
from unickpt.format.commit_steps import commit_step as _commit_step
from unickpt.format.commit_steps import exchange, install_step, rename_aside, restore_step
from unickpt.format.run_layout import (
    COMMIT_NAME,
    LATEST_NAME,
    STEP_RE,
    WORK_RE,
    read_latest,
    step_name,
)

__all__ = [
    "COMMIT_NAME",
    "LATEST_NAME",
    "STEP_RE",
    "WORK_RE",
    "clean_work_dirs",
    "committed_step_dirs",
    "commit_step",
    "committed_steps",
    "discard",
    "exchange",
    "install_step",
    "make_work_dir",
    "read_latest",
    "remove_step",
]

logger = get_logger("unickpt.manager")


def committed_steps(directory: str) -> list[int]:
    return sorted(committed_step_dirs(directory))


def committed_step_dirs(directory: str) -> dict[int, str]:
    """{N: directory holding committed step N}: ``step-<N>`` with ``COMMIT``, else a replaced copy.

    Recovery rule: a save replacing step N without ``renameat2(RENAME_EXCHANGE)`` moves the old
    ``step-<N>`` (committed) to ``.step-<N>.old-<id>``, then the new one into place. Killed in
    between, the old copy is the committed step N: it is found here, loaded, kept by retention,
    and moved back to ``step-<N>`` by the next save (``clean_work_dirs``).
    """
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return {}
    out: dict[int, str] = {}
    replaced: dict[int, str] = {}
    for n in names:
        m = STEP_RE.match(n)
        w = WORK_RE.match(n)
        if m and os.path.isfile(os.path.join(directory, n, COMMIT_NAME)):
            out[int(m.group(1))] = os.path.join(directory, n)
        elif w and w.group(2) == "old" and os.path.isfile(os.path.join(directory, n, COMMIT_NAME)):
            replaced.setdefault(int(w.group(1)), os.path.join(directory, n))
    for step, path in replaced.items():
        out.setdefault(step, path)
    return out


def clean_work_dirs(directory: str) -> None:
    """Remove staging/old/deleting/download directories left by killed saves and loads.

    A directory whose owner still runs (it holds the ``flock`` taken by :func:`make_work_dir`)
    is left alone, so a cleanup never deletes another live writer's (or reader's) directory. A
    replaced copy ``.step-<N>.old-<id>`` that is the only committed copy of step N (see
    :func:`committed_step_dirs`) is moved back to ``step-<N>`` instead of being deleted.
    Local checkpoint directories: rank 0, under the save lock.
    """
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return
    recovered = committed_step_dirs(directory)
    for n in names:
        m = WORK_RE.match(n)
        if not m:
            # the temporary file of an interrupted replacement of ``latest`` (atomic_write_bytes)
            if (parsed := parse_temp_name(n)) is not None and parsed[0] == LATEST_NAME:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, n))
            continue
        path = os.path.join(directory, n)
        step = int(m.group(1))
        if m.group(2) == "old" and recovered.get(step) == path:
            final = os.path.join(directory, step_name(step))
            logger.warning(
                "step %s: restoring its committed copy %s to %s (a save replacing it was interrupted)",
                step,
                path,
                final,
            )
            restore_step(directory, path, final, step, discard)
            continue
        if not os.path.isdir(path) or os.path.islink(path):
            discard(path)
            continue
        fd = _try_own(path)
        if fd is None:
            logger.info("leaving %s: its owner is still running", path)
            continue
        try:
            logger.info("removing %s left by an interrupted save", path)
            discard(path)
        finally:
            os.close(fd)


def make_work_dir(path: str) -> int:
    """Create the work directory ``path`` and lock it (``flock`` on the directory): returns the fd.

    The lock marks the directory as owned by a live process (``clean_work_dirs`` skips it);
    the kernel drops it when the process dies. Close the fd to release it.
    """
    import fcntl

    os.makedirs(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a cleaner holds it only while deleting
        except OSError as e:
            if isinstance(e, InterruptedError) or e.errno not in _NO_DIR_LOCK:
                raise
            # Some network filesystems (NFS: flock emulated by POSIX locks, which need a file
            # open for writing) cannot lock a directory. The save lock of the checkpoint
            # directory still serialises its writers and cleanups; only a local_cache_dir shared
            # by several managers loses this protection there.
            logger.debug("%s: cannot lock the work directory (%s)", path, e)
            return fd
        if os.fstat(fd).st_nlink == 0:  # a cleaner removed it between mkdir and flock
            raise FileNotFoundError(errno.ENOENT, "work directory removed by a concurrent cleanup", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


_NO_DIR_LOCK = {errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def _try_own(path: str) -> int | None:
    """A locked fd of the work directory ``path`` if no live process owns it, else ``None``."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # gone already (another cleanup)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as e:  # no directory locks on this filesystem (see make_work_dir)
        if e.errno not in _NO_DIR_LOCK:
            os.close(fd)
            raise
    return fd


def discard(path: str) -> None:
    """Delete a directory that is no longer (or never was) the committed copy: ``COMMIT`` first."""
    if not os.path.isdir(path) or os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, COMMIT_NAME))  # a half-deleted copy is never committed
    shutil.rmtree(path, ignore_errors=True)


def commit_step(directory: str, stage: str, step: int, record: bytes) -> str:
    """Commit the fully written ``stage`` as step ``step`` (``format.commit_steps.commit_step``)."""
    return _commit_step(directory, stage, step, record, discard)


def remove_step(directory: str, step: int) -> None:
    """Rank 0, under the lock: un-commit every copy of ``step`` (atomic renames, each made durable
    by an fsync of ``directory`` before the copy's files are deleted), then delete them.

    Replaced copies (``.step-<N>.old-<id>``) go first: a kill part way never leaves one of them
    to be taken for step N once ``step-<N>`` is gone.
    """
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return
    copies = [n for n in names if (m := WORK_RE.match(n)) and m.group(2) == "old" and int(m.group(1)) == step]
    if step_name(step) in names:
        copies.append(step_name(step))
    for n in copies:
        try:
            dst = rename_aside(directory, os.path.join(directory, n), step, "deleting")
        except FileNotFoundError:
            continue
        # The un-commit is made durable before any of the copy's files goes: otherwise a power
        # loss could keep the name (and COMMIT) of a copy whose data files are already gone.
        fsync_dir(directory)
        discard(dst)
    if copies:
        logger.info("removed %s (keep_last)", os.path.join(directory, step_name(step)))
