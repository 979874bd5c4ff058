"""Durable, atomic file operations: the only place that decides when bytes are committed.

A checkpoint directory is committed when its index is renamed into place, after every data
file and the directory itself are fsynced. A single-file checkpoint is committed by the
rename of its fully written, fsynced temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import threading
import uuid
from collections.abc import Callable, Iterator

from unickpt.errors import CheckpointBusyError

__all__ = [
    "fsync_dir",
    "atomic_write_bytes",
    "temp_name",
    "directory_lock",
    "start_writeback",
    "Writeback",
    "LOCK_NAME",
]

LOCK_NAME = ".unickpt.lock"


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and new entries in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def temp_name(final_path: str) -> str:
    """A hidden sibling name for staging ``final_path``; never matches a committed name."""
    d, base = os.path.split(final_path)
    return os.path.join(d, f".{base}.tmp-{uuid.uuid4().hex[:12]}")


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


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


def _busy(directory: str, path: str, own: bool = False) -> CheckpointBusyError:
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
                    raise _busy(directory, path, own=True)
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise _busy(directory, path) from None
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


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
_sync_file_range: Callable[[int, int, int, int], int] | None = None
_sync_file_range_loaded = False


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # pragma: no cover - every Linux libc has it
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` to disk, without waiting.

    A hint for long sequential writes (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``): the
    disk works while the rest of the file is produced, so the final ``fsync`` has less left to
    wait for. It never replaces that ``fsync``, which alone makes the data durable and reports
    write errors; where the call is unavailable or fails, nothing happens.
    """
    global _sync_file_range, _sync_file_range_loaded
    if not _sync_file_range_loaded:
        _sync_file_range = _load_sync_file_range()
        _sync_file_range_loaded = True
    if _sync_file_range is not None and length > 0:
        _sync_file_range(fd, offset, length, _SYNC_FILE_RANGE_WRITE)


class Writeback:
    """Write-behind bookkeeping for a file written front to back: once ``every`` bytes past the
    last hint have been written, :func:`start_writeback` is called for them. ``flush`` (for a
    buffered file object) runs first, so the hinted bytes have reached the kernel."""

    def __init__(self, fd: int, every: int, flush: Callable[[], object] | None = None) -> None:
        self.fd = fd
        self.every = every
        self._flush = flush
        self._hinted = 0

    def wrote(self, end: int) -> None:
        """The file now holds bytes up to ``end``."""
        if end - self._hinted >= self.every:
            if self._flush is not None:
                self._flush()
            start_writeback(self.fd, self._hinted, end - self._hinted)
            self._hinted = end
