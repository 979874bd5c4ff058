"""Committing the manager's step directories on a local file system: the renames.

Every rename of a checkpoint's files happens in ``format/commit.py`` and here (the step
directories of a ``CheckpointManager``; ``_stepdirs.py`` keeps their listing and cleanup). A
step N is committed when ``step-<N>/COMMIT`` exists, or when ``step-<N>`` has none and a
replaced copy ``.step-<N>.old-<id>/COMMIT`` does (the recovery rule of
``_stepdirs.committed_step_dirs``). A stage is put in place by :func:`install_step`: swapped
with a replaced ``step-<N>`` in one ``renameat2(RENAME_EXCHANGE)``, or, where the file system
cannot swap, the old copy renamed aside to ``.step-<N>.old-<id>`` first.
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import Any

from unickpt.format.commit import atomic_write_bytes, fsync_dir
from unickpt.format.run_layout import COMMIT_NAME, LATEST_NAME, latest_record, step_name, work_name

__all__ = ["commit_step", "exchange", "install_step", "rename_aside", "restore_step"]


def rename_aside(directory: str, path: str, step: int, kind: str) -> str:
    dst = os.path.join(directory, work_name(step, kind))
    os.rename(path, dst)
    return dst


def install_step(directory: str, stage: str, final: str, step: int) -> str | None:
    """Rank 0, under the lock: make the committed ``stage`` the directory ``final`` (``step-<N>``).

    Returns the path now holding the copy it replaced (to delete once ``latest`` is written), or
    ``None``. At every instant a committed copy of step N exists: a replaced ``step-<N>`` is
    swapped atomically with the stage (``renameat2(RENAME_EXCHANGE)``: the old copy ends up
    under the staging name, never loaded), or, where the kernel or filesystem cannot swap,
    renamed to ``.step-<N>.old-<id>`` (still committed: see ``_stepdirs.committed_step_dirs``)
    before the stage is renamed into place.
    """
    if not os.path.lexists(final):
        os.rename(stage, final)
        fsync_dir(directory)
        return None
    if exchange(stage, final):
        fsync_dir(directory)
        return stage
    old = rename_aside(directory, final, step, "old")
    fsync_dir(directory)
    os.rename(stage, final)
    fsync_dir(directory)
    return old


def commit_step(directory: str, stage: str, step: int, record: bytes, discard: Callable[[str], None]) -> str:
    """Commit the fully written (and fsynced) ``stage`` as step ``step`` of ``directory``; returns ``step-<N>``.

    ``COMMIT`` (``record``) is written last into the stage, which is then put in place
    (:func:`install_step`); only then is ``latest`` replaced and a replaced copy deleted.
    The manager's saves (rank 0, under the lock) and ``unickpt convert --to run`` commit here.
    """
    atomic_write_bytes(os.path.join(stage, COMMIT_NAME), record)
    fsync_dir(stage)
    final = os.path.join(directory, step_name(step))
    replaced = install_step(directory, stage, final, step)
    atomic_write_bytes(os.path.join(directory, LATEST_NAME), latest_record(step))
    if replaced is not None:  # the new step-<N> is committed: the replaced copy may go
        discard(replaced)
    return final


_RENAME_EXCHANGE = 2  # <linux/fs.h>
_AT_FDCWD = -100
_renameat2: Any = None
_renameat2_loaded = False


def exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``).

    False (nothing changed) where the call is missing or the filesystem refuses it.
    """
    global _renameat2, _renameat2_loaded
    if not _renameat2_loaded:
        _renameat2_loaded = True
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                fn = ctypes.CDLL(None, use_errno=True).renameat2
            except (OSError, AttributeError):  # glibc < 2.28
                fn = None
            if fn is not None:
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _renameat2 = fn
    if _renameat2 is None:
        return False
    import ctypes

    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def restore_step(directory: str, path: str, final: str, step: int, discard: Callable[[str], None]) -> None:
    """Move the replaced copy ``path`` (the only committed copy of ``step``) back to ``final``."""
    if os.path.lexists(final):  # an uncommitted leftover in the way
        discard(rename_aside(directory, final, step, "deleting"))
    os.rename(path, final)
    fsync_dir(directory)
