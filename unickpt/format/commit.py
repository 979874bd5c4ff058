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
    """Hold an exclusive lock file in ``directory`` for the duration of one save.

    Two saves into the same directory at once would interleave files; the second one is
    refused with ``CheckpointBusyError``. A lock left by a killed process names its pid and
    is taken over when that pid no longer runs on this host.
    """
    path = os.path.join(directory, LOCK_NAME)
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if _stale(path):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                continue
            raise CheckpointBusyError(
                f"{directory} is being written by another save (lock file {path}); "
                "wait for it to finish, or remove the lock file if no save is running"
            ) from None
        try:
            os.write(fd, f"{os.getpid()}\n".encode())
        finally:
            os.close(fd)
        break
    else:  # pragma: no cover - lost a race twice
        raise CheckpointBusyError(f"{directory}: could not take the save lock {path}")
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _stale(lock_path: str) -> bool:
    try:
        with open(lock_path) as f:
            pid = int(f.read().strip() or "0")
    except (OSError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


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
