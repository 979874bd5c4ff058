"""Vectored reads into callers' buffers: the local ``preadv`` path and an object store's ranged GETs.

A read handle (``store/storage.py``) fills many destinations at once from a list of *pieces*:
piece ``i`` is ``size[i]`` bytes at file offset ``src[i]``, written to
``buffers.arrays[buf[i]][dst[i]:dst[i] + size[i]]``, pieces sorted by ``src``. Locally each
run of pieces adjacent in the file is one ``preadv`` straight into the destinations (an iovec
array built with numpy, up to ``IOV_MAX`` buffers and about ``RUN_BYTES`` a call: no Python
object per piece); on an object store the pieces are fetched with coalesced ranged requests
(``storage.coalesce``) and copied in. A file that ends before the pieces do raises
``IncompleteCheckpointError`` naming the file, the bytes wanted and where the file ends.
No torch here.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unickpt.errors import IncompleteCheckpointError

__all__ = ["Buffers", "IOV_MAX", "RUN_BYTES", "preadv_pieces", "readinto_fd", "scatter"]


def _iov_max() -> int:
    try:
        n = os.sysconf("SC_IOV_MAX")
    except (AttributeError, ValueError, OSError):
        return 1024
    return n if n > 0 else 1024


#: Buffers per ``preadv`` call (the system's limit, 1024 on Linux).
IOV_MAX = _iov_max()
#: A run is cut at this many bytes: one preadv needs no more than that at a time.
RUN_BYTES = 64 << 20


class Buffers:
    """The destination buffers of a vectored read, as writable uint8 arrays (checked once)."""

    def __init__(self, views: Sequence[memoryview]) -> None:
        self.arrays = [np.frombuffer(v, dtype=np.uint8) for v in views]
        if not all(a.flags.writeable for a in self.arrays):
            raise ValueError("a destination buffer of the read is read-only")
        self.sizes = np.asarray([a.nbytes for a in self.arrays], dtype=np.int64)
        self._base: np.ndarray | None = None

    @property
    def base(self) -> np.ndarray:
        """Each buffer's address (for iovec arrays)."""
        if self._base is None:
            self._base = np.asarray([a.ctypes.data for a in self.arrays], dtype=np.uint64)
        return self._base

    def check(self, buf: np.ndarray, dst: np.ndarray, size: np.ndarray) -> None:
        """Every piece lies inside its buffer (raw addresses are written to: no overrun)."""
        if (dst < 0).any() or (dst + size > self.sizes[buf]).any():
            raise ValueError("a read falls outside its destination buffer")

    def piece(self, k: int, d: int, n: int) -> np.ndarray:
        return self.arrays[k][d : d + n]


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


def preadv_pieces(
    fd: int,
    path: str,
    src: np.ndarray,
    size: np.ndarray,
    buf: np.ndarray,
    dst: np.ndarray,
    buffers: Buffers,
) -> None:
    """The pieces (sorted by ``src``) of the local file open as ``fd``: one ``preadv`` per run of
    pieces adjacent in the file (cut at ``IOV_MAX`` buffers and about ``RUN_BYTES``)."""
    if not len(src):
        return
    adj = src[1:] == src[:-1] + size[:-1]
    starts = np.concatenate(([0], np.flatnonzero(~adj) + 1)).tolist()
    stops = [*starts[1:], len(src)]
    iov = np.empty((len(src), 2), dtype=np.uint64)  # struct iovec {void *base; size_t len} per piece
    iov[:, 0] = buffers.base[buf] + dst.astype(np.uint64)
    iov[:, 1] = size
    sl, tl = src.tolist(), size.tolist()
    for a, b in zip(starts, stops, strict=True):
        for i, j in _cuts(tl, a, b):
            if _PREADV is not None and _PREADV(fd, iov[i:j].ctypes.data, j - i, sl[i]) == sum(tl[i:j]):
                continue
            # No preadv in libc, an error or a short read: again with Python buffers, which
            # finishes a short read or says where the file ends.
            pieces = [
                buffers.piece(k, d, n).data
                for k, d, n in zip(buf[i:j].tolist(), dst[i:j].tolist(), tl[i:j], strict=True)
            ]
            _preadv_all(fd, pieces, sl[i], path)


def readinto_fd(fd: int, path: str, offset: int, out: memoryview) -> None:
    """Fill ``out`` from ``offset`` of the local file open as ``fd`` (``preadv``, again after a short read)."""
    length = out.nbytes
    got = 0
    while got < length:
        n = os.preadv(fd, [out[got:length]], offset + got)
        if n <= 0:
            raise IncompleteCheckpointError(
                f"{path}: file is truncated: wanted {length} bytes at offset {offset}, "
                f"the file ends after {got} of them"
            )
        got += n


def scatter(
    fetch: Callable[[list[tuple[int, int]]], list[bytes]],
    src: np.ndarray,
    size: np.ndarray,
    buf: np.ndarray,
    dst: np.ndarray,
    buffers: Buffers,
    chunk: int,
) -> None:
    """The pieces fetched with ``fetch`` (a handle's coalescing ``pread_many``; pieces longer than
    ``chunk`` split so that several requests are in flight) and copied into their buffers."""
    ranges: list[tuple[int, int]] = []
    places: list[tuple[int, int]] = []
    for o, n, k, d in zip(src.tolist(), size.tolist(), buf.tolist(), dst.tolist(), strict=True):
        for at in range(0, n, chunk):
            ranges.append((o + at, min(chunk, n - at)))
            places.append((k, d + at))
    for (k, d), data in zip(places, fetch(ranges), strict=True):
        buffers.arrays[k][d : d + len(data)] = np.frombuffer(data, dtype=np.uint8)


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
