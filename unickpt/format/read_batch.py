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

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from unickpt.errors import HeaderError, IncompleteCheckpointError
from unickpt.format.safetensors_bulk import HeaderEntries
from unickpt.format.safetensors_io import SafetensorsHeader

__all__ = ["ReadBatch", "describe_key", "table_spans", "IOV_MAX"]


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


def table_spans(
    header_of: Callable[[str], SafetensorsHeader], table: Any, ks: list[int]
) -> tuple[list[str], list[int], list[int]]:
    """(file, absolute offset, byte length) of the stored slices ``ks`` of a ``SliceTable``.

    Raises ``HeaderError`` naming a key its file lacks.
    """
    fids = table.file_ids[np.asarray(ks, dtype=np.int64)].tolist()
    names: list[str] = [table.files[i] for i in fids]
    offs: list[int] = []
    lens: list[int] = []
    for file, k in zip(names, ks, strict=True):
        h = header_of(file)
        key = table.key(k)
        ents = h.entries
        got = ents.span(key) if isinstance(ents, HeaderEntries) else _dict_span(ents, key)
        if got is None:
            raise HeaderError(f"{h.path}: key {key!r} named by the index is not in the file")
        offs.append(h.data_start + got[0])
        lens.append(got[1] - got[0])
    return names, offs, lens


def describe_key(h: SafetensorsHeader, key: str) -> tuple[str, list[int]] | None:
    """(dtype, shape list) of ``key`` in a validated header, None when the file lacks it."""
    ents = h.entries
    if isinstance(ents, HeaderEntries):
        return ents.describe(key)
    e = ents.get(key)
    return None if e is None else (e.dtype, list(e.shape))


def _dict_span(ents: Any, key: str) -> tuple[int, int] | None:
    e = ents.get(key)
    return None if e is None else (e.begin, e.end)


class ReadBatch:
    """Local reads gathered first, done per file in runs of adjacent bytes (one ``preadv`` each)."""

    def __init__(self) -> None:
        self._reads: dict[str, list[tuple[int, memoryview]]] = {}

    def __len__(self) -> int:
        return sum(len(v) for v in self._reads.values())

    def add(self, file: str, offset: int, out: memoryview) -> None:
        """Read ``out.nbytes`` bytes of ``file`` at absolute ``offset`` into ``out`` (at :meth:`run`)."""
        if out.nbytes:
            self._reads.setdefault(file, []).append((offset, out))

    def run(self, fd_of: Callable[[str], int], path_of: Callable[[str], str]) -> None:
        """Do every read gathered, file by file; the batch is empty afterwards."""
        reads, self._reads = self._reads, {}
        for file, items in reads.items():
            items.sort(key=lambda x: x[0])
            fd = fd_of(file)
            for start, bufs in _runs(items):
                _preadv_all(fd, bufs, start, path_of(file))


def _runs(items: list[tuple[int, memoryview]]) -> list[tuple[int, list[memoryview]]]:
    """Sorted reads grouped into runs of adjacent byte ranges (bounded in buffers and bytes)."""
    out: list[tuple[int, list[memoryview]]] = []
    bufs: list[memoryview] = []
    start, end, size = -1, -1, 0
    for off, mv in items:
        if off != end or len(bufs) >= IOV_MAX or size >= RUN_BYTES:
            if bufs:
                out.append((start, bufs))
            start, bufs, size = off, [], 0
        bufs.append(mv)
        end = off + mv.nbytes
        size += mv.nbytes
    if bufs:
        out.append((start, bufs))
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
