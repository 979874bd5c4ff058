"""Reads of many stored slices from data files, coalesced per file (no torch).

A sliced checkpoint's data file holds one slice of every tensor its rank saved, back to back; a
load or a merge that needs many of them would issue one read per slice. A :class:`ReadBatch`
collects ``(file, absolute offset, destination buffer)`` reads, then per file sorts them by
offset, joins those adjacent in the file and in one buffer, and hands the file's pieces to its
read handle's vectored read (``ReadHandle.readv``, ``store/storage.py``): on a local
file one ``preadv`` per run of adjacent pieces straight into their destinations (up to
``IOV_MAX`` buffers a call), on an object store coalesced ranged requests. A file that ends
before a read is complete raises ``IncompleteCheckpointError`` naming the file and the bytes
missing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from unickpt.ckpt.slice_spans import FileNumbers, table_spans
from unickpt.store.storage import IOV_MAX, RUN_BYTES, Buffers, ReadHandle

__all__ = ["ReadBatch", "table_spans", "IOV_MAX", "RUN_BYTES"]


class ReadBatch:
    """Reads gathered first, done per file in runs of adjacent bytes (locally one ``preadv`` each).

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

    def run(self, handle_of: Callable[[str], ReadHandle]) -> None:
        """Do every read gathered, file by file, through ``handle_of(file)`` (a ``ReadHandle``:
        locally one ``preadv`` per run of adjacent pieces, on an object store coalesced ranged
        requests); the batch is empty afterwards."""
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
        buffers = Buffers(views)
        buffers.check(buf, dst, total)
        # The pieces of each file (sorted by offset) in one vectored read of its handle.
        cut = np.concatenate(([0], np.flatnonzero(f[1:] != f[:-1]) + 1, [len(f)])).tolist()
        for a, b in itertools.pairwise(cut):
            handle_of(names[int(f[a])]).readv(src[a:b], total[a:b], buf[a:b], dst[a:b], buffers)


class _One:
    """The file table of one read added alone (``ReadBatch.add``)."""

    __slots__ = ("files",)
    file_ids = np.zeros(1, dtype=np.int64)

    def __init__(self, file: str) -> None:
        self.files = [file]
