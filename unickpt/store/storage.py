"""Where checkpoint files live: one interface for a local directory and an fsspec URL.

Everything that touches checkpoint bytes (the reader, the writer, the commit, listing and
cleanup) goes through a :class:`Storage`. Two implementations:

- :class:`LocalStorage`: POSIX files. Ranged reads are ``pread`` on one descriptor, and vectored
  reads one ``preadv`` per run of adjacent pieces straight into the caller's buffers; writes are
  streamed into staged files or ``pwrite``n into preallocated ones (:meth:`Storage.open_range`),
  with write-behind hints for long sequential writes (:class:`Writeback`); commits are atomic
  renames (``store/publish.py``).
- :class:`FsspecStorage`: any fsspec file system (``s3://``, ``gs://``, ``az://``,
  ``memory://``...). Ranged reads are exact ranged GETs, neighbouring ranges coalesced and
  several in flight at once (``cat_ranges``); writes stream as multipart uploads; there is no
  rename, so a checkpoint is committed by an object written last, with a conditional write
  (``put(..., exclusive=True)``) where the store offers one.

Writers choose how to write from what the store says it can do, never from the location:

- ``range_write``: a file can be created at its final size and written at any offset
  (:meth:`Storage.open_range`): headers rewritten in place once the data is hashed, every rank
  writing its own bytes of a shared file. Local files yes, object stores no (an upload is
  written front to back, once).
- ``atomic_rename``: files are staged under hidden names and renamed into place (the commit of
  ``store/publish.py``); without it each file is written under its final name and the index,
  written last, is the commit (``store/publish.py``).
- ``exclusive_put``: ``put(..., exclusive=True)`` refuses to overwrite atomically.
- ``conditional_put``: writes and deletes conditional on an object's version (ETag), which the
  fenced lock of ``store/lock.py`` needs.
- ``durable_sync``: files are made durable by ``fsync`` (and take write-behind hints); an
  upload is durable once complete.
- ``kernel_copy``: :meth:`Storage.copy_range` copies between two files of the store in the kernel
  (``copy_file_range``), the bytes never entering the process.

Locations are strings: a local path, or a URL. :func:`open_storage` maps what a user passed
(``"s3://bucket/run"``, ``"file:///x"``, ``"/x"``, a ``PathLike``) to ``(storage, root)``,
where ``root`` is the location inside that storage; :meth:`Storage.join` builds locations
below it. Credentials and endpoints come the way each ecosystem expects (``AWS_ENDPOINT_URL``,
profiles, ...) or from ``storage_options``, passed to fsspec as is. No torch here.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import importlib
import os
import posixpath
import shutil
import stat
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, BinaryIO, Protocol

import numpy as np

from unickpt.errors import ConfigError, HeaderError, IncompleteCheckpointError, UnsupportedError
from unickpt.store.storage_guard import fs_from_url, guarded, shown_url

__all__ = [
    "Storage",
    "Tree",
    "compared_location",
    "shown_location",
    "process_reachable",
    "list_location",
    "is_file_location",
    "is_dir_location",
    "open_file_location",
    "confined_location",
    "parent_location",
    "LocalStorage",
    "FsspecStorage",
    "ReadHandle",
    "Buffers",
    "RangeFile",
    "open_storage",
    "open_location",
    "Location",
    "url_options",
    "join_location",
    "side_file",
    "is_local_file",
    "is_url",
    "coalesce",
    "IOV_MAX",
    "RUN_BYTES",
    "Writeback",
    "start_writeback",
    "EXTRAS",
]

#: The pip extra that installs each protocol's fsspec backend.
EXTRAS: dict[str, str] = {
    "s3": "s3",
    "s3a": "s3",
    "gs": "gcs",
    "gcs": "gcs",
    "az": "azure",
    "abfs": "azure",
    "abfss": "azure",
}
#: Two wanted ranges closer than this are fetched as one request (the gap is read and dropped).
COALESCE_GAP = 1 << 20
#: A coalesced request is never made larger than this (several stay in flight instead).
MAX_REQUEST = 64 << 20
#: Gaps this small are always bridged (a request's own overhead is about this many bytes).
SMALL_GAP = 4 << 10
#: Largest single request of a read into a caller's buffer on an object store (longer reads are
#: split so that several requests are in flight at once).
STREAM_CHUNK = 16 << 20


def is_url(location: str | os.PathLike[str]) -> bool:
    """True for ``proto://...`` locations other than ``file://`` (which is a local path)."""
    s = os.fspath(location)
    return "://" in s and not s.startswith("file://")


def url_options(
    location: str | os.PathLike[str], storage_options: dict[str, Any] | None
) -> dict[str, Any] | None:
    """The storage options that apply to ``location``: a URL's go to fsspec, a local path takes
    none (an IO's options are for the URLs it saves to and loads from; one set given with several
    locations, a tool's source and output, any of which may be local): :func:`open_storage`
    refuses options given for a local path alone."""
    return storage_options if is_url(location) else None


def coalesce(
    ranges: Sequence[tuple[int, int]],
    gap: int = COALESCE_GAP,
    most: int = MAX_REQUEST,
    waste: float | None = None,
) -> list[tuple[int, int, list[int]]]:
    """Group ``(offset, length)`` ranges into requests ``(start, end, [indexes of ranges])``.

    Ranges are sorted; one joins the current request when it starts within ``gap`` bytes of its
    end and the request stays within ``most`` bytes (a single larger range is one request).
    With ``waste``, a gap larger than ``SMALL_GAP`` is bridged only while the request's unwanted
    bytes stay within ``waste`` times its wanted bytes (so a load fetches at most about
    ``1 + waste`` times what it needs, plus small gaps).
    """
    order = sorted(range(len(ranges)), key=lambda i: ranges[i][0])
    out: list[tuple[int, int, list[int]]] = []
    useful = wasted = 0
    for i in order:
        off, n = ranges[i]
        if out:
            start, end, members = out[-1]
            hole = max(0, off - end)
            fits = off <= end + gap and max(end, off + n) - start <= most
            if fits and waste is not None and hole > SMALL_GAP:
                fits = wasted + hole <= waste * (useful + n)
            if fits:
                out[-1] = (start, max(end, off + n), [*members, i])
                useful += n
                wasted += hole
                continue
        out.append((off, off + n, [i]))
        useful, wasted = n, 0
    return out


# ----------------------------------------------------------------------------- vectored reads
# A read handle fills many destinations at once from a list of *pieces*: piece ``i`` is
# ``size[i]`` bytes at file offset ``src[i]``, written to
# ``buffers.arrays[buf[i]][dst[i]:dst[i] + size[i]]``, pieces sorted by ``src``. Locally each run
# of pieces adjacent in the file is one ``preadv`` straight into the destinations (an iovec array
# built with numpy, up to ``IOV_MAX`` buffers and about ``RUN_BYTES`` a call: no Python object per
# piece); on an object store the pieces are fetched with coalesced ranged requests (:func:`coalesce`)
# and copied in. A file that ends before the pieces do raises ``IncompleteCheckpointError`` naming
# the file, the bytes wanted and where the file ends.


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


class ReadHandle(Protocol):
    """An open file to read ranges of: ``size`` is fixed at open (one version of the file).

    Every read either returns exactly the bytes asked for or raises ``IncompleteCheckpointError``
    naming ``path``, the bytes wanted and how many the file holds. ``readinto`` and ``readv`` read
    into the caller's buffers: on a local file they are ``preadv`` straight into them (no copy).
    """

    size: int
    path: str

    def pread(self, offset: int, length: int) -> bytes: ...

    def pread_many(self, ranges: Sequence[tuple[int, int]], gap: int = COALESCE_GAP) -> list[bytes]: ...

    def readinto(self, offset: int, out: memoryview) -> None:
        """Fill ``out`` (a byte view) with the ``out.nbytes`` bytes at ``offset``."""
        ...

    def readv(
        self, src: np.ndarray, size: np.ndarray, buf: np.ndarray, dst: np.ndarray, buffers: Buffers
    ) -> None:
        """Read, for each ``i`` (sorted by ``src``), ``size[i]`` bytes at ``src[i]`` into
        ``buffers.arrays[buf[i]][dst[i]:]`` (the vectored reads below): locally one ``preadv``
        per run of adjacent pieces, on an object store coalesced ranged requests."""
        ...

    def descriptor(self) -> int | None:
        """The OS descriptor of this very file (for ``copy_file_range``, ``/proc/self/fd``, or a
        sparse-file check), kept open by the handle; None where the file has none (an object)."""
        ...

    def close(self) -> None: ...


class RangeFile(Protocol):
    """A file open for writes at any offset (:meth:`Storage.open_range`)."""

    path: str

    def pwrite(self, data: memoryview | bytes, offset: int) -> None:
        """Write all of ``data`` at ``offset``."""
        ...

    def writeback(self, offset: int, length: int) -> None:
        """Ask for ``length`` bytes at ``offset`` to start reaching the disk, without waiting
        (a hint; never a substitute for :meth:`sync`)."""
        ...

    def sync(self) -> None:
        """Make what was written durable."""
        ...

    def close(self) -> None: ...


class Storage:
    """The operations on checkpoint files; locations are paths or URLs below ``root``.

    The class attributes below say what the store can do (the module's docstring); writers pick
    their strategy from them."""

    #: True when files can be renamed atomically (POSIX); object stores commit by a marker.
    atomic_rename: bool = False
    #: True when ``put(..., exclusive=True)`` refuses to overwrite on this store.
    exclusive_put: bool = False
    #: True when :meth:`open_range` gives a file written at any offset (``pwrite``).
    range_write: bool = False
    #: True when written files are made durable by ``fsync`` (:meth:`finish_write`'s ``fsync``).
    durable_sync: bool = False
    #: True when :meth:`copy_range` copies in the kernel, between two files of this store.
    kernel_copy: bool = False
    #: How users named this storage's root (for messages).
    url: str = ""
    #: True when every read is a request to a remote store: a load fetches the byte ranges it will
    #: read ahead, in windows of coalesced requests in flight together, and opens files in parallel.
    fetch_ahead: bool = False

    def local_path(self, path: str) -> str | None:
        """The OS path of ``path`` for libraries that open files by name, None where there is none."""
        return None

    def join(self, *parts: str) -> str:
        raise NotImplementedError

    def open_read(self, path: str) -> ReadHandle:
        """Open ``path`` for ranged reads; ``IncompleteCheckpointError`` when it does not exist."""
        raise NotImplementedError

    def read_bytes(self, path: str, limit: int | None = None) -> bytes:
        """The whole file (refused unread past ``limit`` bytes with ``IncompleteCheckpointError``
        for a missing file, ``ValueError`` for a larger one)."""
        h = self.open_read(path)
        try:
            if limit is not None and h.size > limit:
                raise ValueError(f"{path} is {h.size} bytes, more than the {limit} allowed")
            return h.pread(0, h.size) if h.size else b""
        finally:
            h.close()

    def open_write(self, path: str, *, overwrite: bool = False) -> BinaryIO:
        """A new file written front to back; :meth:`finish_write` (or ``close()``) makes it
        whole, ``abort(f)`` drops it. ``overwrite``: an existing file is replaced (else, on a
        store that can tell, ``FileExistsError``)."""
        raise NotImplementedError

    def finish_write(self, f: BinaryIO, *, fsync: bool = True) -> None:
        """Make a file opened by :meth:`open_write` whole (durable with ``fsync``, where
        ``durable_sync``) and close it; on failure it is dropped as by :meth:`abort`."""
        try:
            f.close()
        except BaseException:
            self.abort(f)
            raise

    def abort(self, f: BinaryIO) -> None:
        """Drop a file opened by :meth:`open_write` without leaving it behind."""
        raise NotImplementedError

    def open_range(self, path: str, *, size: int | None = None, header: bytes = b"") -> RangeFile:
        """``path`` open for writes at any offset (only where ``range_write``). With ``size``
        the file is created (refused with ``FileExistsError`` when it exists), ``header`` at
        its start and ``size`` bytes long; without, an existing file is opened
        (``FileNotFoundError`` when missing)."""
        raise UnsupportedError(f"{self.url}: this storage cannot write a file at an offset")

    def copy_range(self, src_fd: int, src_off: int, dst: RangeFile, dst_off: int, n: int) -> None:
        """Copy ``n`` bytes at ``src_off`` of the open file ``src_fd`` (a file of this store, as
        its reader holds it) to ``dst_off`` of ``dst`` (only where ``kernel_copy``)."""
        raise UnsupportedError(f"{self.url}: this storage has no copy between its files")

    def put(self, path: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Write a small file whole. With ``exclusive``, return False (and write nothing) when
        it already exists; atomic where ``exclusive_put`` is True."""
        raise NotImplementedError

    def exists(self, path: str) -> bool:
        raise NotImplementedError

    def is_file(self, path: str) -> bool:
        """True when ``path`` is a file (an object), not a directory (a prefix) or nothing."""
        raise NotImplementedError

    def what(self, path: str) -> str | None:
        """What stands at ``path``: ``"file"`` (an object), ``"directory"`` (a prefix holding
        objects), None for nothing, else what it is instead, for messages ("a FIFO", "a dangling
        symbolic link"...)."""
        if self.is_file(path):
            return "file"
        return "directory" if self.listdir(path) else None

    def open_file(self, path: str) -> BinaryIO:
        """``path`` as a seekable binary file object, for libraries that read from one
        (``torch.load``); ranged reads on a store, no local copy. ``IncompleteCheckpointError``
        when it is missing."""
        raise NotImplementedError

    def size(self, path: str) -> int:
        raise NotImplementedError

    def known_size(self, path: str) -> int | None:
        """The size of the regular file at ``path`` where the store knows it without a request
        (a local ``stat``); None otherwise, and where no regular file stands there."""
        return None

    def listdir(self, path: str) -> list[str]:
        """Names (not paths) directly below ``path``; [] when it does not exist."""
        raise NotImplementedError

    def confined(self, base: str, name: str, where: str, entry: str) -> str:
        """``base``/``name`` for a ``name`` read from a file (``spec/untrusted.py``'s plain-name
        rule: no separator, ``..`` or hidden name), which names an entry of ``base`` and nothing
        else; ``UnsafePathError`` naming ``where`` and ``entry`` otherwise."""
        from unickpt.spec.untrusted import plain_name

        return self.join(base, plain_name(name, where, entry))

    def remove(self, paths: Iterable[str]) -> None:
        """Remove files; missing ones are not an error."""
        raise NotImplementedError

    def remove_tree(self, path: str) -> None:
        """Remove ``path`` and everything below it (a file, a directory, a prefix; a symbolic link
        itself, never what it points to); a missing one is not an error."""
        raise NotImplementedError

    def key(self, path: str) -> str:
        """``path`` (as this storage or its user names it: a path, or a URL) as :meth:`tree` keys it."""
        raise NotImplementedError

    def tree(self, path: str) -> Tree:
        """Everything below ``path``, listed at once (``path`` itself when it is a file): each
        file's size and modification time, and the directories (on a store: the prefixes that
        hold objects), keyed by :meth:`key`."""
        raise NotImplementedError

    def rename(self, src: str, dst: str) -> None:
        """Atomic rename (only where ``atomic_rename``)."""
        raise UnsupportedError(f"{self.url}: this storage has no atomic rename")

    def makedirs(self, path: str) -> None:
        """Create a directory (a no-op on object stores, which have only prefixes)."""

    @property
    def conditional_put(self) -> bool:
        """True when writes and deletes can be conditional on an object's ETag (``If-Match`` /
        ``If-None-Match``: ``store/lock.py``'s fencing); elsewhere the callers read back and check."""
        return False


class Tree:
    """What :meth:`Storage.tree` lists: ``files`` (key -> (size, modification time or None)) and
    ``dirs`` (keys)."""

    def __init__(self) -> None:
        self.files: dict[str, tuple[int, float | None]] = {}
        self.dirs: set[str] = set()


def _info_mtime(info: dict[str, Any]) -> float | None:
    """An fsspec listing entry's modification time (seconds since the epoch), None when unknown."""
    import datetime

    raw = info.get("LastModified") or info.get("mtime") or info.get("last_modified") or info.get("created")
    if isinstance(raw, (int, float)):
        return float(raw)
    if isinstance(raw, datetime.datetime):
        return (raw if raw.tzinfo else raw.replace(tzinfo=datetime.timezone.utc)).timestamp()
    return None


class _LocalRead:
    """A local file open for reads: its descriptor, its size at open; reads are ``pread``/``preadv``."""

    def __init__(self, path: str) -> None:
        try:
            # O_NONBLOCK: a FIFO planted under a file's name must not block the open forever.
            self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        except FileNotFoundError as e:
            raise IncompleteCheckpointError(f"{path} is missing") from e
        except IsADirectoryError as e:
            raise HeaderError(f"{path} is a directory, not a file") from e
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise HeaderError(f"{path} is a symbolic link loop, not a file") from e
            raise
        try:
            st = os.fstat(self.fd)
            if stat.S_ISDIR(st.st_mode):
                raise HeaderError(f"{path} is a directory, not a file")
            if not stat.S_ISREG(st.st_mode):
                raise HeaderError(f"{path} is not a regular file")
        except BaseException:
            os.close(self.fd)
            raise
        self.path = path
        self.size = st.st_size

    def pread(self, offset: int, length: int) -> bytes:
        data = os.pread(self.fd, length, offset)
        if len(data) != length:
            raise IncompleteCheckpointError(
                f"{self.path}: file is truncated: wanted {length} bytes at offset {offset}, got {len(data)}"
            )
        return data

    def pread_many(self, ranges: Sequence[tuple[int, int]], gap: int = COALESCE_GAP) -> list[bytes]:
        return [self.pread(o, n) for o, n in ranges]

    def readinto(self, offset: int, out: memoryview) -> None:
        readinto_fd(self.fd, self.path, offset, out)

    def readv(
        self, src: np.ndarray, size: np.ndarray, buf: np.ndarray, dst: np.ndarray, buffers: Buffers
    ) -> None:
        preadv_pieces(self.fd, self.path, src, size, buf, dst, buffers)

    def descriptor(self) -> int | None:
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


#: Bytes copied per read/write when the kernel cannot copy between two files (another device).
_COPY_CHUNK = 4 << 20


def pwrite_all(fd: int, data: memoryview | bytes, pos: int) -> None:
    """``pwrite`` all of ``data`` at ``pos`` (``pwrite`` may write less than asked)."""
    mv = memoryview(data).cast("B")
    done = 0
    n = mv.nbytes
    while done < n:
        done += os.pwrite(fd, mv[done:], pos + done)


# ----------------------------------------------------------------------------- write-behind hints
# Hints for long sequential writes of local files, no effect on what is durable: ``fsync`` alone
# makes data durable, ``store/publish.py`` decides when bytes are committed.


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


_sync_file_range: Callable[[int, int, int, int], int] | None = None


_sync_file_range_loaded = False


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
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


class LocalRange:
    """A local file open for writes at any offset; ``fd`` is its descriptor (``O_WRONLY``)."""

    def __init__(self, path: str, fd: int) -> None:
        self.path, self.fd = path, fd

    def pwrite(self, data: memoryview | bytes, offset: int) -> None:
        pwrite_all(self.fd, data, offset)

    def writeback(self, offset: int, length: int) -> None:
        start_writeback(self.fd, offset, length)

    def sync(self) -> None:
        os.fsync(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


class LocalStorage(Storage):
    """POSIX files below a directory."""

    atomic_rename = True
    exclusive_put = True
    range_write = True
    durable_sync = True
    kernel_copy = True

    def __init__(self, root: str) -> None:
        self.url = root

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    def local_path(self, path: str) -> str | None:
        return path

    def open_read(self, path: str) -> ReadHandle:
        return _LocalRead(path)

    def open_write(self, path: str, *, overwrite: bool = False) -> BinaryIO:
        return open(path, "wb" if overwrite else "xb")

    def finish_write(self, f: BinaryIO, *, fsync: bool = True) -> None:
        try:
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        except BaseException:
            self.abort(f)
            raise
        f.close()

    def abort(self, f: BinaryIO) -> None:
        f.close()
        self.remove([f.name])  # type: ignore[list-item]

    def open_range(self, path: str, *, size: int | None = None, header: bytes = b"") -> RangeFile:
        if size is None:
            return LocalRange(path, os.open(path, os.O_WRONLY))
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            if header:
                pwrite_all(fd, header, 0)
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            self.remove([path])
            raise
        return LocalRange(path, fd)

    def copy_range(self, src_fd: int, src_off: int, dst: RangeFile, dst_off: int, n: int) -> None:
        """``copy_file_range`` (a copy-on-write clone where the file system makes one); across
        devices, or where the kernel refuses, read and written in chunks."""
        dst_fd = dst.fd if isinstance(dst, LocalRange) else -1
        done = 0
        if dst_fd >= 0:
            try:
                while done < n:
                    k = os.copy_file_range(src_fd, dst_fd, n - done, src_off + done, dst_off + done)
                    if k <= 0:
                        break
                    done += k
            except OSError:
                pass  # cross-device or unsupported file system: read and write below
        while done < n:
            data = os.pread(src_fd, min(_COPY_CHUNK, n - done), src_off + done)
            if not data:
                raise IncompleteCheckpointError(
                    f"copying to {dst.path}: the source is truncated at byte {src_off + done}"
                )
            dst.pwrite(data, dst_off + done)
            done += len(data)

    def put(self, path: str, data: bytes, *, exclusive: bool = False) -> bool:
        try:
            with open(path, "xb" if exclusive else "wb") as f:
                f.write(data)
        except FileExistsError:
            return False
        return True

    def confined(self, base: str, name: str, where: str, entry: str) -> str:
        """As :meth:`Storage.confined`, and a symbolic link resolving outside ``base`` is refused."""
        from unickpt.spec.untrusted import confined_path

        return confined_path(base, name, where, entry)

    def exists(self, path: str) -> bool:
        return os.path.lexists(path)

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def what(self, path: str) -> str | None:
        try:
            st = os.stat(path)
        except (FileNotFoundError, NotADirectoryError):
            return "a dangling symbolic link" if os.path.islink(path) else None
        except OSError as e:
            return "a symbolic link loop" if e.errno == errno.ELOOP else f"unreadable ({e.strerror})"
        if stat.S_ISREG(st.st_mode):
            return "file"
        if stat.S_ISDIR(st.st_mode):
            return "directory"
        if stat.S_ISFIFO(st.st_mode):
            return "a FIFO"
        if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            return "a device"
        if stat.S_ISSOCK(st.st_mode):
            return "a socket"
        return "not a regular file"

    def open_file(self, path: str) -> BinaryIO:
        try:
            return open(path, "rb")
        except (FileNotFoundError, NotADirectoryError):
            raise IncompleteCheckpointError(f"{path} is missing") from None

    def size(self, path: str) -> int:
        return os.stat(path).st_size

    def known_size(self, path: str) -> int | None:
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            return None
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []

    def remove(self, paths: Iterable[str]) -> None:
        for p in paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)

    def remove_tree(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            self.remove([path])

    def key(self, path: str) -> str:
        return os.path.normpath(os.path.abspath(path.removeprefix("file://")))

    def tree(self, path: str) -> Tree:
        out = Tree()
        base = self.key(path)
        if os.path.isfile(base):
            st = os.stat(base)
            out.files[base] = (st.st_size, st.st_mtime)
            return out
        for dirpath, dirnames, filenames in os.walk(base):
            out.dirs.add(os.path.normpath(dirpath))
            # a symbolic link to a directory is listed as one (not walked into)
            out.dirs.update(
                os.path.join(dirpath, d) for d in dirnames if os.path.islink(os.path.join(dirpath, d))
            )
            for f in filenames:
                p = os.path.join(dirpath, f)
                try:
                    st = os.stat(p)
                except OSError:  # a dangling link, or gone meanwhile
                    continue
                out.files[p] = (st.st_size, st.st_mtime)
        return out

    def rename(self, src: str, dst: str) -> None:
        os.replace(src, dst)

    def makedirs(self, path: str) -> None:
        os.makedirs(path, exist_ok=True)


class _FsspecRead:
    def __init__(self, fs: Any, path: str, size: int) -> None:
        self.fs, self.path, self.size = fs, path, size

    def _check(self, offset: int, length: int) -> None:
        if offset + length > self.size:
            raise IncompleteCheckpointError(
                f"{self.path} is truncated: wanted {length} bytes at offset {offset} of a "
                f"{self.size}-byte object"
            )

    def pread(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        if length == 0:
            return b""
        data = bytes(self.fs.cat_file(self.path, start=offset, end=offset + length))
        if len(data) != length:
            raise IncompleteCheckpointError(
                f"{self.path}: wanted {length} bytes at offset {offset}, the store returned {len(data)}"
            )
        return data

    def pread_many(self, ranges: Sequence[tuple[int, int]], gap: int = COALESCE_GAP) -> list[bytes]:
        """Fetch the ranges with coalesced requests (ranges less than ``gap`` apart share one;
        ``gap=-1`` keeps even adjacent ranges apart), all in flight at once (fsspec's ``cat_ranges``)."""
        for o, n in ranges:
            self._check(o, n)
        reqs = [r for r in coalesce(ranges, gap) if r[1] > r[0]]
        got = self.fs.cat_ranges([self.path] * len(reqs), [r[0] for r in reqs], [r[1] for r in reqs])
        out: list[bytes] = [b""] * len(ranges)
        for (start, end, members), data in zip(reqs, got, strict=True):
            if isinstance(data, BaseException):
                raise IncompleteCheckpointError(f"{self.path}: reading [{start}, {end}) failed: {data}")
            if len(data) != end - start:
                raise IncompleteCheckpointError(
                    f"{self.path}: wanted {end - start} bytes at offset {start}, the store returned {len(data)}"
                )
            view = memoryview(data)
            for i in members:
                o, n = ranges[i]
                out[i] = bytes(view[o - start : o - start + n])
        return out

    def readinto(self, offset: int, out: memoryview) -> None:
        one = np.zeros(1, dtype=np.int64)
        n = np.asarray([out.nbytes], dtype=np.int64)
        self.readv(one + offset, n, one, one, Buffers([out]))

    def readv(
        self, src: np.ndarray, size: np.ndarray, buf: np.ndarray, dst: np.ndarray, buffers: Buffers
    ) -> None:
        scatter(self.pread_many, src, size, buf, dst, buffers, STREAM_CHUNK)

    def descriptor(self) -> int | None:
        return None

    def close(self) -> None:
        pass


class FsspecStorage(Storage):
    """Files on an fsspec file system (object stores have no rename: commits write a marker).

    ``fs`` is kept guarded (``store/storage_guard.py``): every call into the store's client has a
    deadline of ``timeout`` seconds (0: none; None: ``$UNICKPT_STORE_TIMEOUT``, else 120) and its
    errors raised as ``StorageError``, credentials (``options``'s, the URL's) never in a message.

    What it can do: an object is written front to back once (an upload, durable when complete),
    so no ``range_write``, ``durable_sync`` nor ``kernel_copy``; no ``atomic_rename``;
    ``exclusive_put`` and ``conditional_put`` on S3 (``If-None-Match: *``, ``If-Match``).
    """

    fetch_ahead = True
    range_write = False
    durable_sync = False
    kernel_copy = False

    def __init__(self, fs: Any, url: str, *, timeout: float | None = None, options: Any = None) -> None:
        self.fs = guarded(fs, url, timeout, options)
        self.url = shown_url(url)
        protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
        self.protocol = str(protocol)
        # s3fs sends If-None-Match: * for mode="create"; other stores get a check-then-write.
        self.exclusive_put = self.protocol in ("s3", "s3a")
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        # An async save's writer process gets the storage: the file system pickles by its
        # arguments; the lock serialises this process's check-then-write only, so it stays here.
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def join(self, *parts: str) -> str:
        return posixpath.join(*parts)

    def open_read(self, path: str) -> ReadHandle:
        try:
            size = int(self.fs.size(path))
        except FileNotFoundError as e:
            shown = path if "://" in path else f"{self.protocol}://{path}"
            raise IncompleteCheckpointError(f"{shown} is missing") from e
        return _FsspecRead(self.fs, path, size)

    def open_write(self, path: str, *, overwrite: bool = False) -> BinaryIO:
        if self.protocol in ("s3", "s3a"):  # several parts in flight (store/storage_s3.py)
            from typing import cast

            from unickpt.store.storage_s3 import S3Upload

            return cast(BinaryIO, S3Upload(self.fs, path))
        f: BinaryIO = self.fs.open(path, "wb")
        return f

    def abort(self, f: BinaryIO) -> None:
        discard = getattr(f, "discard", None)
        if discard is not None:  # s3fs: abort the multipart upload, nothing becomes visible
            discard()
            with contextlib.suppress(AttributeError):  # a memory:// file is a BytesIO: closed is read-only
                f.closed = True  # type: ignore[misc]  # fsspec files would flush again when collected
            return
        path = getattr(f, "path", None)
        f.close()
        if path is not None:
            self.remove([path])

    def put(self, path: str, data: bytes, *, exclusive: bool = False) -> bool:
        if not exclusive:
            self.fs.pipe_file(path, data)
            return True
        if self.exclusive_put:
            try:
                self.fs.pipe_file(path, data, mode="create")
            except (FileExistsError, OSError) as e:
                if isinstance(e, FileExistsError) or "PreconditionFailed" in str(e) or "412" in str(e):
                    return False
                raise
            return True
        with self._lock:  # best effort on stores without conditional writes
            if self.fs.exists(path):
                return False
            self.fs.pipe_file(path, data)
            return True

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def is_file(self, path: str) -> bool:
        return bool(self.fs.isfile(path))

    def open_file(self, path: str) -> BinaryIO:
        try:
            f: BinaryIO = self.fs.open(path, "rb")
        except FileNotFoundError:
            shown = path if "://" in path else f"{self.protocol}://{path}"
            raise IncompleteCheckpointError(f"{shown} is missing") from None
        return f

    def size(self, path: str) -> int:
        return int(self.fs.size(path))

    def listdir(self, path: str) -> list[str]:
        try:
            entries = self.fs.ls(path, detail=False, refresh=True)
        except FileNotFoundError:
            return []
        base = path.rstrip("/")
        return sorted(posixpath.basename(str(e).rstrip("/")) for e in entries if str(e).rstrip("/") != base)

    def remove(self, paths: Iterable[str]) -> None:
        todo = [p for p in paths]
        if not todo:
            return
        try:
            self.fs.rm(todo)
        except FileNotFoundError:
            for p in todo:
                with contextlib.suppress(FileNotFoundError):
                    self.fs.rm_file(p)

    def remove_tree(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def key(self, path: str) -> str:
        return str(self.fs._strip_protocol(path)).rstrip("/")

    def tree(self, path: str) -> Tree:
        """One recursive listing (a few LIST requests however deep the tree)."""
        # What is asked for is the store now: no listing fsspec cached earlier may hide an object.
        self.fs.invalidate_cache()
        base = self.key(path)
        try:
            found = self.fs.find(base, detail=True)
        except FileNotFoundError:
            found = {}
        out = Tree()
        for k, info in found.items():
            if info.get("type") == "directory":
                continue
            key = str(k).rstrip("/")
            out.files[key] = (int(info.get("size") or 0), _info_mtime(info))
            parent = posixpath.dirname(key)
            while parent and parent not in out.dirs and len(parent) >= len(base):
                out.dirs.add(parent)
                parent = posixpath.dirname(parent)
        return out

    # ---------------------------------------------------------------- writes
    def makedirs(self, path: str) -> None:
        """Object stores have prefixes only; fsspec's local-like file systems need the directory
        before a file is opened in it. On S3, s3fs checks the bucket (one HEAD) and creates a
        missing one: done once per endpoint and bucket in a process (every save calls this on
        every rank, before its first upload)."""
        if self.protocol in ("s3", "s3a"):
            bucket = path.split("://", 1)[-1].split("/", 1)[0]
            key = (str(getattr(self.fs, "endpoint_url", None)), bucket)
            if key in _BUCKETS:
                return
            self.fs.makedirs(path, exist_ok=True)
            _BUCKETS.add(key)
            return
        self.fs.makedirs(path, exist_ok=True)

    @property
    def conditional_put(self) -> bool:
        return self.protocol in ("s3", "s3a")


#: (endpoint, bucket) pairs known to exist in this process (``FsspecStorage.makedirs``).
_BUCKETS: set[tuple[str, str]] = set()


def process_reachable(path: str | os.PathLike[str]) -> bool:
    """Whether another process (a writer process) can reach ``path``: a local path, or a store
    every process can open.

    ``memory://`` lives in this process only, and a protocol this process registered at run
    time (``fsspec.register_implementation`` with a class) is unknown to a fresh process.
    """
    s = os.fspath(path)
    if not is_url(s):
        return True
    protocol = s.split("://", 1)[0]
    try:
        import fsspec
        from fsspec.implementations.memory import MemoryFileSystem
        from fsspec.registry import known_implementations

        cls = fsspec.get_filesystem_class(protocol)
    except Exception:  # the save reports an unknown protocol itself, in a thread
        return False
    if issubclass(cls, MemoryFileSystem):
        return False
    known = known_implementations.get(protocol)
    if known is None:
        return False
    module, _, name = str(known.get("class", "")).rpartition(".")
    try:  # the class a fresh process would get for this protocol is the one this process uses
        return getattr(importlib.import_module(module), name, None) is cls
    except ImportError:
        return False


def shown_location(location: str | os.PathLike[str]) -> str:
    """A location as unickpt names it back (reports, run commands, ranks comparing arguments):
    a local path absolute (the same directory whatever the spelling), a URL as given without a
    trailing ``/``."""
    p = os.fspath(location)
    if isinstance(p, bytes):
        p = os.fsdecode(p)
    if is_url(p):
        return p.rstrip("/")
    return os.path.abspath(p.removeprefix("file://"))


def compared_location(checkpoint: Any) -> str:
    """A checkpoint location as ranks compare it (their arguments must agree):
    :func:`shown_location`, anything but a path or a URL its repr."""
    if isinstance(checkpoint, (str, os.PathLike)):
        return shown_location(checkpoint)
    return repr(checkpoint)


def list_location(location: str | os.PathLike[str]) -> list[str]:
    """The names directly below the directory ``location`` (a path or a URL), sorted;
    ``IncompleteCheckpointError`` naming it when it does not exist or is not a directory."""
    s = os.fspath(location)
    storage, path = open_storage(s)
    names = storage.listdir(path)
    if not names:
        if storage.is_file(path):
            raise IncompleteCheckpointError(f"{s} is not a directory")
        if not storage.exists(path):
            raise IncompleteCheckpointError(f"{s} does not exist")
    return names


def is_file_location(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` (a path or a URL) is a file (an object)."""
    storage, path = open_storage(location)
    return storage.is_file(path)


def is_dir_location(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` (a path or a URL) is a directory (on a store: a prefix with objects)."""
    storage, path = open_storage(location)
    return bool(storage.listdir(path)) or (storage.exists(path) and not storage.is_file(path))


def open_file_location(location: str | os.PathLike[str]) -> BinaryIO:
    """``location`` (a path or a URL) as a seekable binary file object (:meth:`Storage.open_file`)."""
    storage, path = open_storage(location)
    return storage.open_file(path)


def confined_location(base: str | os.PathLike[str], name: str, where: str, entry: str) -> str:
    """The location of ``name``, read from a file (``where``'s ``entry``), below the directory
    ``base`` (a path or a URL), and nothing else (:meth:`Storage.confined`: a plain name; locally
    no symbolic link out of ``base`` either); ``UnsafePathError`` otherwise."""
    s = os.fspath(base)
    storage, root = open_storage(s)
    path = storage.confined(root, name, where, entry)
    return (
        path
        if storage.local_path(path) is not None
        else join_location(s.rstrip("/"), posixpath.basename(path))
    )


def parent_location(location: str | os.PathLike[str]) -> str:
    """The directory holding ``location``: a URL's parent prefix, a local path's absolute parent."""
    s = os.fspath(location)
    return (
        posixpath.dirname(s.rstrip("/"))
        if is_url(s)
        else os.path.dirname(os.path.abspath(s.removeprefix("file://")))
    )


def join_location(location: str | os.PathLike[str], name: str) -> str:
    """``name`` below ``location`` as given: joined with ``/`` on a URL, the OS separator on a
    local path."""
    s = os.fspath(location)
    return posixpath.join(s, name) if is_url(s) else os.path.join(s, name)


def side_file(location: str | os.PathLike[str], name: str, suffix: str) -> str:
    """The file a location of a side file names (a scheduler's JSON): the location itself when it
    names a file (ends with ``suffix``, or is an existing local file) and no local directory, else
    ``name`` below it."""
    s = os.fspath(location)
    local = s.removeprefix("file://")
    if not os.path.isdir(local) and (s.endswith(suffix) or is_local_file(s)):
        return s
    return join_location(s, name)


def is_local_file(location: str | os.PathLike[str]) -> bool:
    """Whether ``location`` is an existing local file (an object store is never asked)."""
    s = os.fspath(location)
    return not is_url(s) and os.path.isfile(s.removeprefix("file://"))


class Location:
    """A location a save was given, opened (:func:`open_location`): its storage, its path there,
    and how the save names it back."""

    def __init__(self, storage: Storage, path: str, given: str) -> None:
        self.storage, self.path = storage, path
        self.given = given.removeprefix("file://")  # as given; a local path without ``file://``
        self._local = not is_url(given)

    @property
    def is_file(self) -> bool:
        """Whether it names one file: a ``.safetensors`` name, or an existing local file."""
        return self.path.endswith(".safetensors") or (self._local and os.path.isfile(self.path))

    @property
    def shown(self) -> str:
        """The location as a save returns it: a URL as given, a local path absolute."""
        return self.path if self._local else self.given

    def shown_file(self, name: str) -> str:
        """A single file saved here, as returned: a URL as given; locally the file given, or
        ``name`` below the path given."""
        if not self._local or self.is_file:
            return self.given
        return os.path.join(self.given, name)


def open_location(location: str | os.PathLike[str], storage_options: dict[str, Any] | None) -> Location:
    """The :class:`Location` of ``location`` (:func:`open_storage`, with the options that apply
    there: :func:`url_options`)."""
    storage, path = open_storage(location, url_options(location, storage_options))
    return Location(storage, path, os.fspath(location))


def open_storage(
    location: str | os.PathLike[str], storage_options: dict[str, Any] | None = None
) -> tuple[Storage, str]:
    """``(storage, root)`` for a local path, a ``file://`` URL or an fsspec URL.

    A missing fsspec backend raises ``UnsupportedError`` naming the extra that installs it
    (``pip install unickpt[s3]``); ``storage_options`` on a local path is a ``ConfigError``;
    a file system that cannot be made from them (an option it does not take...) a ``StorageError``.
    The storage option ``unickpt_timeout`` (seconds, 0 for none) is the deadline of every operation
    on the store (:class:`FsspecStorage`); without it, ``$UNICKPT_STORE_TIMEOUT``, else 120 s.
    """
    s = os.fspath(location)
    if not is_url(s):
        if storage_options:
            raise ConfigError(f"storage_options are for fsspec URLs; {s!r} is a local path")
        if s.startswith("file://"):
            s = s[len("file://") :]
        root = os.path.abspath(s)
        return LocalStorage(root), root
    protocol = s.split("://", 1)[0]
    try:
        fs, root, timeout, options = fs_from_url(s, storage_options)
    except ImportError as e:
        extra = EXTRAS.get(protocol)
        hint = f"pip install 'unickpt[{extra}]'" if extra else f"install the fsspec backend for {protocol}://"
        raise UnsupportedError(f"{s}: no file system for {protocol}:// is installed ({e}); {hint}") from e
    return FsspecStorage(fs, s.rstrip("/"), timeout=timeout, options=options), str(root).rstrip("/")
