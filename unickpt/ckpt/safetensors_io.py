"""Strict reading and streaming writing of safetensors files, without torch.

The reader treats every file as hostile: the header length is capped before anything is
allocated, the JSON must be an object of well-formed entries, byte counts must equal
shape x item size, and the entries must tile the data section exactly (no gap, no overlap,
nothing past the end). Only then is any byte of tensor data trusted. The parser is
``safetensors_bulk.parse_header`` (every entry at once, naming the first at fault), re-exported
here.

The writer produces the same format as ``safetensors.torch.save_file`` but streams: the
header is computed from shapes and dtypes up front, then each tensor's bytes are appended
in order, so a file never needs all of its tensors in memory at once.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from unickpt.ckpt.foreign import foreign_file
from unickpt.errors import HeaderError
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.naming import shown
from unickpt.spec.safetensors_bulk import MAX_NDIM, HeaderEntries, parse_header
from unickpt.spec.untrusted import MAX_HEADER_BYTES as _MAX_HEADER_BYTES
from unickpt.store.storage import LocalStorage, Storage, Writeback, open_storage

__all__ = [
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "read_header",
    "parse_header",
    "header_from_bytes",
    "encode_header",
    "SafetensorsWriter",
]

# A header holds names, shapes and offsets: even 10^6 tensors fit in well under 100 MB.
# safetensors itself uses the same cap. Anything larger is refused before allocation.
MAX_HEADER_BYTES = _MAX_HEADER_BYTES  # spec/untrusted.py: what a data file can hold follows from it
# Shapes are bounded so that byte counts cannot overflow or request absurd allocations.
MAX_NDIM = MAX_NDIM  # (safetensors_bulk, the parser, checks it)


@dataclass(frozen=True)
class SafetensorsHeader:
    path: str
    entries: HeaderEntries
    metadata: dict[str, str]
    data_start: int  # absolute file offset of the data section
    file_size: int = field(default=0)

    def absolute(self, key: str) -> tuple[int, int]:
        e = self.entries[key]
        return self.data_start + e.begin, e.nbytes


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file ``path`` (a path or a URL). Reads only
    the header bytes.

    The file is opened as every read opens one (``Storage.open_read``; locally a missing file,
    a directory, a symbolic link loop or anything but a regular file refused with its messages).
    """
    p = os.fspath(path)
    storage, where = open_storage(p)
    handle = storage.open_read(where)
    try:
        return header_from_bytes(handle.pread(0, min(handle.size, 8)), handle.size, p, handle.pread)
    finally:
        handle.close()


def header_from_bytes(
    first: bytes, size: int, path: str, more: Callable[[int, int], bytes] | None = None
) -> SafetensorsHeader:
    """Validate a safetensors header from the first bytes of a file of ``size`` bytes.

    ``first`` holds the 8-byte length prefix and possibly more; when the header runs past it,
    ``more(offset, length)`` reads the rest (a ``pread`` on an fd, a ranged GET on a store).
    Every check applies before any allocation sized by the file: the length is capped, the
    header must lie inside the file, and the entries must tile the data section exactly.
    """
    if size < 8:
        raise HeaderError(f"{path}: {size} bytes is too short for a safetensors file (needs 8+)")
    (n,) = struct.unpack("<Q", first[:8])
    if n > MAX_HEADER_BYTES or 8 + n > size:
        other = foreign_file(first)  # another tool's file: name the command that reads it
        if other is not None:
            raise HeaderError(other.hint(path))
    if n > MAX_HEADER_BYTES:
        raise HeaderError(f"{path}: header length {n} exceeds the {MAX_HEADER_BYTES}-byte limit")
    if 8 + n > size:
        raise HeaderError(f"{path}: header length {n} runs past the end of the {size}-byte file")
    raw = bytes(first[8 : 8 + n])
    if len(raw) < n:
        if more is None:
            raise HeaderError(f"{path}: header of {n} bytes, only {len(raw)} were read")
        rest = more(8 + len(raw), n - len(raw))
        if len(rest) != n - len(raw):
            raise HeaderError(f"{path}: header of {n} bytes is cut short (the file shrank while read)")
        raw += rest
    entries, metadata = parse_header(raw, size - 8 - n, path)
    return SafetensorsHeader(path, entries, metadata, 8 + n, size)


def encode_header(
    specs: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str] | None
) -> tuple[bytes, list[tuple[int, int]]]:
    """Return (8-byte length + padded JSON header, [(begin, end)] per spec), in spec order."""
    obj: dict[str, Any] = {}
    if metadata:
        obj["__metadata__"] = dict(metadata)
    spans = []
    pos = 0
    for key, dtype, shape in specs:
        nbytes = math.prod(shape) * DTYPE_ITEMSIZE[dtype]
        obj[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        spans.append((pos, pos + nbytes))
        pos += nbytes
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    # Pad with spaces so that the data section starts 8-byte aligned, as safetensors does.
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw, spans


class SafetensorsWriter:
    """Writes one safetensors file, streaming tensor bytes in the order of ``specs``.

    Usage: ``w = SafetensorsWriter(path, specs, metadata); w.write(key, buf) ...; w.close()``.
    The file is opened through ``storage`` (a :class:`~unickpt.store.storage.LocalStorage` when
    None; an existing file is replaced) with ``Storage.open_write``. ``close`` makes it whole
    (``Storage.finish_write``: flushed and fsynced where the store's files are made durable by
    fsync, an upload completed on an object store); ``abort`` drops it. With ``writeback`` (for
    files that will be fsynced, on a store with ``durable_sync``) the kernel is asked to start
    writing every ``WRITEBACK_BYTES`` to disk as they are written, so the disk works while the rest
    of the file is produced and the final fsync has little left to wait for.
    """

    WRITEBACK_BYTES = 8 << 20

    def __init__(
        self,
        path: str,
        specs: list[tuple[str, str, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
        *,
        writeback: bool = False,
        storage: Storage | None = None,
    ) -> None:
        self.path = path
        header, spans = encode_header(specs, metadata)
        self._expected = [(k, e - b) for (k, _, _), (b, e) in zip(specs, spans, strict=True)]
        self._next = 0
        self._written = 0
        self._storage = storage if storage is not None else LocalStorage(os.path.dirname(path))
        # An upload (no fsync) takes no write-behind hints.
        writeback = writeback and self._storage.durable_sync
        self._f: BinaryIO | None = self._storage.open_write(path, overwrite=True)
        try:
            self._f.write(header)
        except BaseException:
            self.abort()  # the caller never gets a writer to abort: close and remove the file here
            raise
        self._pos = len(header)
        self._wb = Writeback(self._f.fileno(), self.WRITEBACK_BYTES, self._f.flush) if writeback else None

    def write(self, key: str, data: memoryview | bytes) -> None:
        if self._f is None:
            raise ValueError(f"{self.path}: writer is closed")
        if self._next >= len(self._expected):
            raise ValueError(f"{self.path}: unexpected extra tensor {shown(key)}")
        want_key, want_len = self._expected[self._next]
        mv = memoryview(data).cast("B")
        if key != want_key or mv.nbytes != want_len:
            raise ValueError(
                f"{self.path}: expected {want_len} bytes of {shown(want_key)}, got {mv.nbytes} bytes of {shown(key)}"
            )
        if self._wb is None:
            self._f.write(mv)
        else:
            for at in range(0, mv.nbytes, self._wb.every):
                piece = mv[at : at + self._wb.every]
                self._f.write(piece)
                self._pos += piece.nbytes
                self._wb.wrote(self._pos)
        self._next += 1

    def close(self, fsync: bool = True) -> None:
        if self._f is None:
            return
        f, self._f = self._f, None
        if self._next != len(self._expected):
            missing = [k for k, _ in self._expected[self._next :]]
            self._storage.abort(f)
            raise ValueError(f"{self.path}: closed before tensors {missing[:5]} were written")
        self._storage.finish_write(f, fsync=fsync)  # an upload completes: visible whole

    def abort(self) -> None:
        if self._f is not None:
            f, self._f = self._f, None
            self._storage.abort(f)
