"""Offline tools writing to a URL: the output directory on an object store, committed last.

A store has no rename, so ``staged_output`` (a hidden directory renamed when complete) cannot
run there. :class:`StoreOutput` follows the object-store commit instead (docs/reliability.md,
"Object stores"): the output prefix must hold nothing; side files and data files are uploaded
under their final names first (each one streamed, visible whole when its upload completes);
the commit points (an index, a single-file checkpoint, DCP's ``.metadata``) are written last,
after every file they name; an index is one exclusive PUT where the store offers conditional
writes, so two runs writing the same output cannot both commit. On any failure every upload
still open is aborted and every object this run wrote is removed: a failed run leaves no
checkpoint at the URL.

:func:`store_output` holds the prefix's save lock (``format/store_lock.py``) while the run
writes: two runs that both found the prefix empty would upload under the same names, and the
one refused at its commit would remove the files the other's index names. The second run gets
``CheckpointBusyError`` before it writes anything. The lock is fenced as a save's: the commit
points are written only after a check that the lock is still this run's, and a run whose lock
was taken over removes nothing on failure (its names may be the new holder's).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO, cast

from unickpt._logging import get_logger
from unickpt.errors import OutputExistsError
from unickpt.format.commit import new_save_id
from unickpt.format.commit_fence import Fence
from unickpt.format.storage import Storage, open_storage
from unickpt.format.store_lock import store_lock

logger = get_logger(__name__)

__all__ = ["StoreOutput", "StoreFile", "store_output", "COMMIT_POINTS"]

#: Files a reader takes as the sign of a complete output: uploaded after everything else.
COMMIT_POINTS = (".metadata",)
_ZEROS = bytes(4 << 20)


def is_commit_point(name: str) -> bool:
    return (
        name.endswith(".index.json")
        or (name.endswith(".safetensors") and "-of-" not in name)
        or (name in COMMIT_POINTS)
    )


class StoreFile:
    """An output data file streamed to the store, written front to back at given positions.

    ``write(data, pos)`` accepts positions at or after the end written so far; a gap (a hole a
    sparse source left unwritten) is uploaded as zeros. ``finish(size)`` pads to ``size``.
    """

    def __init__(self, f: BinaryIO, name: str) -> None:
        self.f = f
        self.name = name
        self.pos = 0
        self.fd = -1  # no descriptor: merge never copies into it in the kernel

    def _put(self, data: memoryview) -> None:
        """Append ``data`` at the end of what was written."""
        self.f.write(data)

    def _zeros(self, upto: int) -> None:
        while self.pos < upto:
            k = min(len(_ZEROS), upto - self.pos)
            self._put(memoryview(_ZEROS)[:k])
            self.pos += k

    def write(self, data: memoryview, pos: int) -> None:
        if pos < self.pos:
            raise RuntimeError(f"internal: {self.name} written at {pos}, before its end {self.pos}")
        self._zeros(pos)
        self._put(data)
        self.pos += data.nbytes

    def write_pieces(self, data: memoryview, pos: int) -> None:
        """A large buffer: the upload streams it in parts already."""
        self.write(data, pos)

    def wrote(self, end: int) -> None:
        """Local files hint writeback here; an upload needs no hint."""

    def finish(self, size: int) -> None:
        self._zeros(size)


class HeadLastFile(StoreFile):
    """A file whose first bytes are known last (a single file's header holds the hashes of its
    data), streamed as an S3 multipart upload with its first part uploaded last.

    Part 1 (the first ``part`` bytes: the header and the data after it) is kept in memory while
    parts 2, 3, ... are uploaded as the data streams in; :meth:`complete` puts the final header
    over the placeholder of the same length, uploads part 1 and completes the upload, which makes
    the object appear whole. A file of one part is one PUT. Memory: two parts.
    """

    def __init__(self, fs: Any, path: str, name: str, size: int) -> None:
        from unickpt.format.storage_parts import SharedUpload, part_size_for

        super().__init__(cast(BinaryIO, _NoFile()), name)
        self.upload = SharedUpload(fs, path)
        self.size = size
        self.part = part_size_for(size)
        self.head = bytearray()
        self.tail = bytearray()
        self.etags: list[tuple[int, str]] = []

    def _put(self, data: memoryview) -> None:
        data = data.cast("B")
        while data.nbytes:
            if len(self.head) < self.part:
                k = min(self.part - len(self.head), data.nbytes)
                self.head += data[:k]
            else:
                k = min(self.part - len(self.tail), data.nbytes)
                self.tail += data[:k]
                if len(self.tail) == self.part:
                    self._upload_tail()
            data = data[k:]

    def _upload_tail(self) -> None:
        if self.upload.upload_id is None:
            self.upload.create()
        number = len(self.etags) + 2
        self.etags.append((number, self.upload.upload_part(number, self.tail)))
        self.tail = bytearray()

    def complete(self, header: bytes) -> None:
        """Put ``header`` (as long as the placeholder written first) in place and commit the file."""
        if self.pos != self.size:
            raise RuntimeError(f"internal: {self.name} is {self.pos} bytes, planned {self.size}")
        self.head[: len(header)] = header
        if not self.etags and not self.tail:  # one part: one PUT
            self.upload.put(self.head)
            return
        if self.tail:
            self._upload_tail()
        if self.upload.upload_id is None:
            self.upload.create()
        self.etags.append((1, self.upload.upload_part(1, self.head)))
        self.upload.complete(self.etags)
        self.upload.upload_id = None  # nothing left to abort: the object is removed like any other

    def abort(self) -> None:
        """Drop the parts uploaded so far (nothing appears)."""
        if self.upload.upload_id is not None:
            self.upload.abort()
            self.upload.upload_id = None


class _NoFile:
    def write(self, data: Any) -> int:  # pragma: no cover - HeadLastFile overrides _put
        raise RuntimeError("internal: a head-last file has no file object")

    def close(self) -> None:
        """Nothing to close."""


class StoreOutput:
    """The output prefix ``url`` of one run (see the module docstring)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage: Storage
        self.storage, self.root = self.check(self.url, storage_options)
        self.storage.makedirs(self.root)
        self._written: list[str] = []
        self._open: list[BinaryIO] = []
        self._commits: list[tuple[str, bytes | str | Callable[[], None]]] = []
        self._head_last: list[HeadLastFile] = []
        #: the prefix's save lock, held by :func:`store_output` (None: not locked)
        self.fence: Fence | None = None

    @staticmethod
    def check(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Storage, str]:
        """``(storage, root)`` of the output ``url``; ``OutputExistsError`` when it holds anything
        (a run's lock object included: that run is still writing, or was killed)."""
        storage, root = open_storage(url.rstrip("/"), storage_options)
        found = storage.listdir(root)
        if found:
            raise OutputExistsError(
                f"{url.rstrip('/')} already holds {len(found)} object(s) (e.g. {found[0]!r}); "
                "choose a new output URL"
            )
        return storage, root

    def path(self, name: str) -> str:
        return self.storage.join(self.root, name)

    def open(self, name: str) -> StoreFile:
        """A data file, streamed (a multipart upload on S3); ``close(sf)`` completes it."""
        f = self.storage.open_write(self.path(name))
        self._open.append(f)
        self._written.append(self.path(name))
        return StoreFile(f, name)

    def track(self, name: str) -> str:
        """The path of ``name``, which a writer of the caller's streams itself: removed by
        :meth:`abort` (a missing object is skipped)."""
        self._written.append(self.path(name))
        return self.path(name)

    def open_head_last(self, name: str, size: int) -> HeadLastFile | None:
        """A :class:`HeadLastFile` for the ``size``-byte commit point ``name``, or None when the
        store has no multipart uploads a process can address by part (S3 has)."""
        from unickpt.format.storage import FsspecStorage
        from unickpt.format.storage_parts import supports_shared_parts

        if not supports_shared_parts(self.storage) or not isinstance(self.storage, FsspecStorage):
            return None
        f = HeadLastFile(self.storage.fs, self.path(name), name, size)
        self._head_last.append(f)
        return f

    def close(self, sf: StoreFile) -> None:
        sf.f.close()
        self._open.remove(sf.f)

    def put(self, name: str, data: bytes) -> None:
        """A small file (``config.json``, ...) written now, whole."""
        self._written.append(self.path(name))
        self.storage.put(self.path(name), data)

    def upload(self, name: str, local: str) -> None:
        """Stream the local file ``local`` to ``name`` now."""
        sf = self.open(name)
        with open(local, "rb") as src:
            while chunk := src.read(16 << 20):
                sf.f.write(chunk)
        self.close(sf)

    def commit_later(self, name: str, data: bytes | str | Callable[[], None]) -> None:
        """A commit point (bytes, the path of a local file, or a function completing its
        upload: :meth:`HeadLastFile.complete`), written by :meth:`commit`."""
        self._commits.append((name, data))

    def commit(self) -> None:
        """Write the commit points, after everything else: indexes with an exclusive PUT; each
        only while the run's lock is still its own (``fence``)."""
        for name, data in self._commits:
            if self.fence is not None:
                self.fence.check(f"writing its commit point {self.url}/{name}")
            if isinstance(data, str):
                self.upload(name, data)
                continue
            if callable(data):
                self._written.append(self.path(name))
                data()
                continue
            self._written.append(self.path(name))
            if not self.storage.put(self.path(name), data, exclusive=True):
                self._written.pop()  # someone else's: never removed by this run
                raise OutputExistsError(
                    f"{self.url}/{name} was written by someone else while this run wrote; its output is discarded"
                )

    def abort(self) -> None:
        """Abort the open uploads and remove every object this run wrote (nothing once its lock
        was taken over: the names it wrote may be the new holder's)."""
        if self.fence is not None and (who := self.fence.holder()) != "this save":
            logger.warning("%s: lock now held by %s; this run's objects are left to it", self.url, who)
            self._written.clear()
        for f in self._open:
            self.storage.abort(f)
        self._open.clear()
        for h in self._head_last:
            h.abort()
        self._head_last.clear()
        self.storage.remove(self._written)
        self._written.clear()


@contextmanager
def store_output(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[StoreOutput]:
    """A :class:`StoreOutput` committed when the block ends, removed when it raises; the
    prefix's save lock is held meanwhile (module docstring)."""
    out = StoreOutput(url, storage_options)
    with store_lock(out.storage, out.root, new_save_id()) as held:
        out.fence = held
        try:
            yield out
            out.commit()
        except BaseException:
            out.abort()
            raise


def upload_tree(local: str, out: StoreOutput) -> None:
    """Upload the local directory ``local`` into ``out``: every file now, commit points last."""
    for dirpath, _dirs, files in sorted(os.walk(local)):
        rel = os.path.relpath(dirpath, local)
        for fname in sorted(files):
            name = fname if rel == "." else f"{rel}/{fname}".replace(os.sep, "/")
            src = os.path.join(dirpath, fname)
            if is_commit_point(fname):
                out.commit_later(name, src)
            else:
                out.upload(name, src)
