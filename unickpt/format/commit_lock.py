"""The save lock of a local checkpoint directory (``flock``): one save into a directory at a time.

Split from ``format/commit.py``, which re-exports :func:`directory_lock` and :data:`LOCK_NAME`.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

from unickpt.errors import CheckpointBusyError

__all__ = ["LOCK_NAME", "directory_lock", "take_unheld_lock", "busy_error"]

LOCK_NAME = ".unickpt.lock"


@contextlib.contextmanager
def directory_lock(directory: str) -> Iterator[None]:
    """Hold the exclusive save lock of ``directory`` for the duration of one save.

    Two saves into the same directory at once would interleave files; the second one is
    refused with ``CheckpointBusyError``. The lock is a kernel advisory lock (``flock``) on the
    file ``.unickpt.lock``: it cannot be held twice (two processes, or two holders in one
    process), and the kernel releases it when its holder dies, so a killed save never blocks
    the next one and there is no "stale lock" to take over. The file is unlinked only by its
    holder, under the lock; a process that locked a file which was unlinked meanwhile sees
    that the path no longer names the inode it locked and tries again. The file holds the
    holder's pid for diagnostics only.
    """
    path = os.path.join(directory, LOCK_NAME)
    fd, key = _acquire_flock(path, directory)
    try:
        yield
    finally:
        _release_flock(path, fd, key)


# (st_dev, st_ino) of every save lock this process holds: ``flock`` already refuses a second
# open file description of the same file, this also covers filesystems that emulate ``flock``
# with per-process POSIX locks (NFS), where a process would otherwise not conflict with itself.
_HELD: set[tuple[int, int]] = set()
_HELD_GUARD = threading.Lock()


def busy_error(directory: str, path: str, own: bool = False) -> CheckpointBusyError:
    holder = f" (held by this process, pid {os.getpid()})" if own else ""
    if not own:  # (never open a lock file this process holds: see _HELD)
        with contextlib.suppress(OSError, ValueError, IndexError), open(path, "rb") as f:
            holder = f" (held by pid {int(f.read(32).split()[0])})"
    return CheckpointBusyError(
        f"{directory} is being written by another save: its lock {path} is held{holder}; "
        "wait for that save to finish (the lock is released when its process ends)"
    )


def _acquire_flock(path: str, directory: str) -> tuple[int, tuple[int, int]]:
    import fcntl

    with _HELD_GUARD:  # never open (then close) a second descriptor of a lock this process holds
        while True:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(path)
                if (st.st_dev, st.st_ino) in _HELD:
                    raise busy_error(directory, path, own=True)
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise busy_error(directory, path) from None
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_dev, now.st_ino) != key:
                    # Its holder unlinked this inode when releasing it: lock the file there now.
                    os.close(fd)
                    continue
                with contextlib.suppress(OSError):  # the pid is for diagnostics only
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                _HELD.add(key)
                return fd, key
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise


def _release_flock(path: str, fd: int, key: tuple[int, int]) -> None:
    """Unlink the lock file if it still is the one we locked (only the holder unlinks), then unlock."""
    with _HELD_GUARD:
        try:
            with contextlib.suppress(OSError):
                now = os.stat(path)
                if (now.st_dev, now.st_ino) == key:
                    os.unlink(path)
        finally:
            _HELD.discard(key)
            os.close(fd)


def take_unheld_lock(path: str, *, remove: bool) -> bool:
    """True when nobody holds the lock file at ``path`` (a dead save's leftover); with ``remove``,
    unlink it while holding it, as only a holder may."""
    try:
        fd, key = _acquire_flock(path, os.path.dirname(path))
    except CheckpointBusyError:
        return False
    if remove:
        _release_flock(path, fd, key)
    else:
        with _HELD_GUARD:
            _HELD.discard(key)
            os.close(fd)
    return True
