"""Reads of many stored slices from local data files, coalesced per file (no torch).

A sliced checkpoint's data file holds one slice of every tensor its rank saved, back to back; a
load or a merge that needs many of them would issue one ``pread`` per slice. A
:class:`ReadBatch` collects ``(file, absolute offset, destination buffer)`` reads, then per
file sorts them by offset and reads each run of adjacent ones with one ``preadv`` straight into
their destinations (up to ``IOV_MAX`` buffers a call), as the URL path coalesces its ranged
requests (``storage.coalesce``). A file that ends before a read is complete raises
``IncompleteCheckpointError`` naming the file and the bytes missing.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from unickpt.errors import IncompleteCheckpointError
from unickpt.format.slice_spans import FileNumbers, table_spans

__all__ = ["ReadBatch", "table_spans", "IOV_MAX"]


def _iov_max() -> int:
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 1024
    return n if n > 0 else 1024


#: Buffers per ``preadv`` call (the system's limit, 1024 on Linux).
IOV_MAX = _iov_max()
# A run is cut at this many bytes: one preadv needs no more than that at a time.
RUN_BYTES = 64 << 20


class ReadBatch:
    """Local reads gathered first, done per file in runs of adjacent bytes (one ``preadv`` each).

    Reads are kept as arrays (file numbers, offsets, destination ranges), added one at a time
    (:meth:`add`) or many into one destination buffer at once (:meth:`add_many`). At :meth:`run`
    they are sorted per file with numpy; pieces adjacent both in the file and in the same
    destination are joined into one buffer (a tensor's row slices stored back to back are read in
    one piece), and each run of adjacent pieces is one ``preadv``.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._files = FileNumbers()
        self._views: list[memoryview] = []
        self._cols: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, file: str, offset: int, out: memoryview) -> None:
        """Read ``out.nbytes`` bytes of ``file`` at absolute ``offset`` into ``out`` (at :meth:`run`)."""
        if out.nbytes:
            one = np.zeros(1, dtype=np.int64)
            self.add_many(_One(file), one, np.asarray([offset], dtype=np.int64), one, one + out.nbytes, out)

    def add_many(
        self,
        table: Any,
        ks: np.ndarray,
        offsets: np.ndarray,
        begin: np.ndarray,
        end: np.ndarray,
        out: memoryview,
    ) -> None:
        """Read, for each ``i``, ``out[begin[i]:end[i]]`` from the file of slice ``ks[i]`` of ``table``
        (a ``SliceTable``: its ``files`` and ``file_ids``) at absolute ``offsets[i]``."""
        keep = end > begin
        if not keep.all():
            ks, offsets, begin, end = ks[keep], offsets[keep], begin[keep], end[keep]
        if len(ks):
            self._cols.append((self._files.of(table, ks), offsets, begin, end - begin, len(self._views)))
            self._views.append(out)
            self._count += len(ks)

    def run(self, fd_of: Callable[[str], int], path_of: Callable[[str], str]) -> None:
        """Do every read gathered, file by file; the batch is empty afterwards."""
        cols, views, names = self._cols, self._views, self._files.names
        self._reset()
        if not cols:
            return
        f, src, dst, size = (np.concatenate([c[i] for c in cols]) for i in range(4))
        buf = np.concatenate([np.full(len(c[0]), c[4], dtype=np.int64) for c in cols])
        order = np.lexsort((src, f))
        f, src, dst, size, buf = f[order], src[order], dst[order], size[order], buf[order]
        # One piece per run adjacent in the file and in one destination buffer.
        join = (f[1:] == f[:-1]) & (src[1:] == src[:-1] + size[:-1])
        join &= (buf[1:] == buf[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
        first = np.concatenate(([0], np.flatnonzero(~join) + 1))
        total = np.add.reduceat(size, first)
        f, src, dst, buf = f[first], src[first], dst[first], buf[first]
        # Runs of adjacent pieces in a file, cut at IOV_MAX buffers and about RUN_BYTES.
        adj = (f[1:] == f[:-1]) & (src[1:] == src[:-1] + total[:-1])
        starts = np.concatenate(([0], np.flatnonzero(~adj) + 1)).tolist()
        stops = [*starts[1:], len(f)]
        arrays = [np.frombuffer(v, dtype=np.uint8) for v in views]
        if not all(a.flags.writeable for a in arrays):
            raise ValueError("ReadBatch: a destination buffer is read-only")
        sizes = np.asarray([a.nbytes for a in arrays], dtype=np.int64)
        if (dst < 0).any() or (dst + total > sizes[buf]).any():  # raw addresses below: no overrun
            raise ValueError("ReadBatch: a read falls outside its destination buffer")
        base = np.asarray([a.ctypes.data for a in arrays], dtype=np.uint64)
        iov = np.empty((len(f), 2), dtype=np.uint64)  # struct iovec {void *base; size_t len} per piece
        iov[:, 0] = base[buf] + dst.astype(np.uint64)
        iov[:, 1] = total
        fl, sl, tl = f.tolist(), src.tolist(), total.tolist()
        for a, b in zip(starts, stops, strict=True):
            name = names[fl[a]]
            fd = fd_of(name)
            for i, j in _cuts(tl, a, b):
                if _PREADV is not None and _PREADV(fd, iov[i:j].ctypes.data, j - i, sl[i]) == sum(tl[i:j]):
                    continue
                # No preadv in libc, an error or a short read: again with Python buffers, which
                # finishes a short read or says where the file ends.
                pieces = [
                    arrays[k][d : d + n]
                    for k, d, n in zip(buf[i:j].tolist(), dst[i:j].tolist(), tl[i:j], strict=True)
                ]
                _preadv_all(fd, pieces, sl[i], path_of(name))


def _libc_preadv() -> Any:
    """libc's ``preadv`` (fd, iovec array address, count, offset), None where there is none."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).preadv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int64]
    fn.restype = ctypes.c_ssize_t
    return fn


# ``preadv`` over an iovec array built with numpy: no Python object per piece read.
_PREADV = _libc_preadv() if sys.platform.startswith("linux") else None


class _One:
    """The file table of one read added alone (``ReadBatch.add``)."""

    __slots__ = ("files",)
    file_ids = np.zeros(1, dtype=np.int64)

    def __init__(self, file: str) -> None:
        self.files = [file]


def _cuts(sizes: list[int], a: int, b: int) -> list[tuple[int, int]]:
    """Pieces ``a:b`` of a run cut into calls of at most ``IOV_MAX`` buffers and about ``RUN_BYTES``."""
    if b - a <= IOV_MAX and sum(sizes[a:b]) <= RUN_BYTES:
        return [(a, b)]
    out: list[tuple[int, int]] = []
    i, size = a, 0
    for j in range(a, b):
        if j > i and (j - i >= IOV_MAX or size >= RUN_BYTES):
            out.append((i, j))
            i, size = j, 0
        size += sizes[j]
    out.append((i, b))
    return out


def _preadv_all(fd: int, bufs: list[memoryview], offset: int, path: str) -> None:
    """Fill ``bufs`` (in order) from ``offset``: one ``preadv``, more only after a short read."""
    total = sum(b.nbytes for b in bufs)
    got = os.preadv(fd, bufs, offset)
    if got == total:
        return
    done = 0
    for i, b in enumerate(bufs):  # a short read: finish buffer by buffer
        if done + b.nbytes <= got:
            done += b.nbytes
            continue
        have = max(0, got - done)
        while have < b.nbytes:
            n = os.preadv(fd, [b[have:]], offset + done + have)
            if n <= 0:
                raise IncompleteCheckpointError(
                    f"{path}: file is truncated: wanted {total} bytes at offset {offset} (a run of "
                    f"{len(bufs)} slice read(s)), the file ends after {done + have} of them "
                    f"(in read {i + 1})"
                )
            have += n
        done += b.nbytes
        got = max(got, done)
