"""The reader's access to data files through a Storage: headers, index and ranged reads.

Every checkpoint is read through ``store/storage.py``: a local directory through a
``LocalStorage`` (descriptors, ``pread``/``preadv`` straight into the caller's buffers), an
``s3://``, ``gs://``, ``memory://``... location through an ``FsspecStorage`` (exact ranged
requests, neighbouring ones coalesced and several in flight). The checks are the same (strict
header validation, save ids matched to the index, the same error classes), and every message
names the file or URL. No torch here.

A data file is opened once: its size is fixed at open, its header is read with one ranged
read (``HEADER_PROBE`` bytes; a second one when the header is longer), and its tensor bytes
through the same handle. On a store that fetches ahead (``Storage.fetch_ahead``), the ranges a
load will read are fetched first (:class:`Prefetched`) and the reads they cover are served from
memory (:class:`PrefetchedRead`).

Below the reader: nothing here builds a ``CheckpointReader``. Opening a checkpoint on a URL
(``reader.locate``, ``reader.open_located``) stands on :func:`fetch_index` and :func:`open_header`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from unickpt.ckpt.safetensors_io import SafetensorsHeader, header_from_bytes
from unickpt.errors import IndexFileError, UnsupportedError
from unickpt.spec.index import MAX_INDEX_BYTES
from unickpt.store.storage import MAX_REQUEST, STREAM_CHUNK, Buffers, ReadHandle, Storage, coalesce

__all__ = [
    "HEADER_PROBE",
    "open_header",
    "read_into",
    "iter_handle",
    "read_runs",
    "fetch_index",
    "Prefetched",
    "PrefetchedRead",
    "STREAM_CHUNK",
]

#: Bytes asked for when a data file is opened: the length prefix and (nearly always) the header.
HEADER_PROBE = 8 << 10
#: A prefetch bridges gaps between wanted ranges only while it fetches at most this fraction
#: more than it needs (gaps under ``storage.SMALL_GAP`` aside).
PREFETCH_WASTE = 1 / 16
#: A prefetch fetches each file's part of a window in about ``PREFETCH_SPLIT`` requests in flight
#: at once (one stream of an object store is slower than several), each between
#: ``PREFETCH_PIECE`` and ``MAX_REQUEST`` bytes (fewer, larger requests as windows grow: stores
#: cap the requests per second of a prefix).
PREFETCH_SPLIT = 4
PREFETCH_PIECE = 4 << 20


def open_header(storage: Storage, path: str) -> tuple[ReadHandle, SafetensorsHeader]:
    """Open a data file on ``storage`` and validate its header: ``(handle, header)`` of one version.

    ``IncompleteCheckpointError`` when it is missing; ``HeaderError`` naming ``path`` when the
    header is not a valid safetensors header of this file's size.
    """
    handle = storage.open_read(path)
    try:
        first = handle.pread(0, min(handle.size, HEADER_PROBE))
        h = header_from_bytes(first, handle.size, path, handle.pread)
    except BaseException:
        handle.close()
        raise
    return handle, h


def read_into(handle: ReadHandle, offset: int, length: int, out: memoryview | None = None) -> memoryview:
    """``length`` bytes at ``offset``, into ``out`` when given (``handle.readinto``: no copy locally)."""
    target = out if out is not None else memoryview(bytearray(length))
    if length:
        handle.readinto(offset, target[:length])
    return target[:length]


def read_runs(handle: ReadHandle, runs: Sequence[tuple[int, int]], out: memoryview) -> None:
    """Read the ``(offset, length)`` runs of a file, in order, back to back into ``out``, with one
    vectored read (``handle.readv``: locally a ``preadv`` per run of adjacent runs)."""
    keep = [(o, n) for o, n in runs if n]
    if not keep:
        return
    src = np.asarray([o for o, _ in keep], dtype=np.int64)
    size = np.asarray([n for _, n in keep], dtype=np.int64)
    dst = np.concatenate(([0], np.cumsum(size)[:-1])).astype(np.int64)
    order = np.argsort(src, kind="stable")
    buffers = Buffers([out])
    src, size, dst = src[order], size[order], dst[order]
    buf = np.zeros(len(src), dtype=np.int64)
    buffers.check(buf, dst, size)
    handle.readv(src, size, buf, dst, buffers)


def iter_handle(handle: ReadHandle, offset: int, length: int, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
    """Yield the bytes [offset, offset+length) of a file in chunks (one ranged request each)."""
    end = offset + length
    pos = offset
    while pos < end:
        n = min(chunk, end - pos)
        yield handle.pread(pos, n)
        pos += n


def fetch_index(storage: Storage, path: str) -> bytes:
    """The bytes of an index file on ``storage`` (``IndexFileError`` past ``MAX_INDEX_BYTES``)."""
    try:
        return storage.read_bytes(path, limit=MAX_INDEX_BYTES)
    except ValueError:
        raise IndexFileError(
            f"{path}: {storage.size(path)} bytes exceeds the {MAX_INDEX_BYTES}-byte limit for an index"
        ) from None


def no_path(url: str) -> UnsupportedError:
    return UnsupportedError(f"{url} is on an object store: it has no local path to open")


class PrefetchedRead:
    """A data file's handle whose reads are served from :class:`Prefetched` blocks where they
    cover them, from the file otherwise (the reader owns and closes the file's own handle)."""

    def __init__(self, handle: ReadHandle, blocks: Prefetched, name: str) -> None:
        self.handle, self.blocks, self.name = handle, blocks, name
        self.size, self.path = handle.size, handle.path

    def pread(self, offset: int, length: int) -> bytes:
        hit = self.blocks.get(self.name, offset, length)
        return bytes(hit) if hit is not None else self.handle.pread(offset, length)

    def pread_many(self, ranges: Sequence[tuple[int, int]], gap: int = -1) -> list[bytes]:
        return [self.pread(o, n) for o, n in ranges]

    def readinto(self, offset: int, out: memoryview) -> None:
        hit = self.blocks.get(self.name, offset, out.nbytes)
        if hit is None:
            self.handle.readinto(offset, out)
        else:
            out[:] = hit

    def readv(
        self, src: np.ndarray, size: np.ndarray, buf: np.ndarray, dst: np.ndarray, buffers: Buffers
    ) -> None:
        miss = np.ones(len(src), dtype=bool)
        for i, (o, n, k, d) in enumerate(
            zip(src.tolist(), size.tolist(), buf.tolist(), dst.tolist(), strict=True)
        ):
            hit = self.blocks.get(self.name, o, n)
            if hit is not None:
                buffers.piece(k, d, n)[:] = np.frombuffer(hit, dtype=np.uint8)
                miss[i] = False
        if miss.any():
            self.handle.readv(src[miss], size[miss], buf[miss], dst[miss], buffers)

    def descriptor(self) -> int | None:
        return self.handle.descriptor()

    def close(self) -> None:
        pass


class Prefetched:
    """Byte ranges of data files fetched ahead of their reads (coalesced, all in flight at once).

    A load on a URL knows every range it will read before it copies anything: fetching them in
    one batch per file turns hundreds of small per-tensor requests into a few large ones. Reads
    that a prefetched block covers are served from it; others go to the store as usual.
    """

    def __init__(self) -> None:
        self._blocks: dict[str, list[tuple[int, bytes]]] = {}

    def fetch(
        self, handles: dict[str, ReadHandle], wanted: dict[str, list[tuple[int, int]]], threads: int
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        def one(name: str) -> tuple[str, list[tuple[int, bytes]]]:
            reqs = [(a, b - a) for a, b, _ in coalesce(wanted[name], waste=PREFETCH_WASTE) if b > a]
            total = sum(n for _, n in reqs)
            step = min(MAX_REQUEST, max(PREFETCH_PIECE, -(-total // PREFETCH_SPLIT)))
            pieces = [(o + at, min(step, n - at)) for o, n in reqs for at in range(0, n, step)]
            got = handles[name].pread_many(pieces, gap=-1)  # grouped already: one request per piece
            return name, sorted(zip((o for o, _ in pieces), got, strict=True))

        # Ranges a block fetched earlier holds (a verified load's hashed slices) are not fetched again.
        wanted = {n: [r for r in rs if not self.covers(n, *r)] for n, rs in wanted.items()}
        names = [n for n in wanted if wanted[n]]
        with ThreadPoolExecutor(max(1, min(threads, len(names))), thread_name_prefix="unickpt-fetch") as pool:
            for name, blocks in pool.map(one, names):
                self._blocks.setdefault(name, []).extend(blocks)

    def get(self, name: str, offset: int, length: int) -> memoryview | None:
        """The prefetched bytes [offset, offset+length) of file ``name``, or None when not all fetched."""
        out: bytearray | None = None
        pos = offset
        end = offset + length
        for start, data in self._blocks.get(name, ()):
            if start <= pos < start + len(data):
                take = min(end, start + len(data)) - pos
                view = memoryview(data)[pos - start : pos - start + take]
                if pos == offset and take == length:
                    return view
                if out is None:
                    out = bytearray()
                out += view
                pos += take
                if pos >= end:
                    return memoryview(out)
        return None if length else memoryview(b"")

    def covers(self, name: str, offset: int, length: int) -> bool:
        """True when [offset, offset+length) of file ``name`` lies within one fetched block."""
        return length == 0 or any(
            start <= offset and offset + length <= start + len(data)
            for start, data in self._blocks.get(name, ())
        )

    def clear(self) -> None:
        self._blocks.clear()
