"""Write-behind hints for long sequential writes (no effect on what is durable: ``fsync`` alone
makes data durable, ``store/publish.py`` decides when bytes are committed). No torch here."""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["start_writeback", "Writeback"]


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
