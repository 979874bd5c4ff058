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
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, BinaryIO

from unickpt.errors import OutputExistsError
from unickpt.format.storage import Storage, open_storage

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

    def _zeros(self, upto: int) -> None:
        while self.pos < upto:
            k = min(len(_ZEROS), upto - self.pos)
            self.f.write(_ZEROS[:k])
            self.pos += k

    def write(self, data: memoryview, pos: int) -> None:
        if pos < self.pos:
            raise RuntimeError(f"internal: {self.name} written at {pos}, before its end {self.pos}")
        self._zeros(pos)
        self.f.write(data)
        self.pos += data.nbytes

    def write_pieces(self, data: memoryview, pos: int) -> None:
        """A large buffer: the upload streams it in parts already."""
        self.write(data, pos)

    def wrote(self, end: int) -> None:
        """Local files hint writeback here; an upload needs no hint."""

    def finish(self, size: int) -> None:
        self._zeros(size)


class StoreOutput:
    """The output prefix ``url`` of one run (see the module docstring)."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None = None) -> None:
        self.url = url.rstrip("/")
        self.storage: Storage
        self.storage, self.root = self.check(self.url, storage_options)
        self.storage.makedirs(self.root)
        self._written: list[str] = []
        self._open: list[BinaryIO] = []
        self._commits: list[tuple[str, bytes | str]] = []

    @staticmethod
    def check(url: str, storage_options: dict[str, Any] | None = None) -> tuple[Storage, str]:
        """``(storage, root)`` of the output ``url``; ``OutputExistsError`` when it holds anything."""
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

    def commit_later(self, name: str, data: bytes | str) -> None:
        """A commit point (bytes, or the path of a local file), written by :meth:`commit`."""
        self._commits.append((name, data))

    def commit(self) -> None:
        """Write the commit points, after everything else: indexes with an exclusive PUT."""
        for name, data in self._commits:
            if isinstance(data, str):
                self.upload(name, data)
                continue
            self._written.append(self.path(name))
            if not self.storage.put(self.path(name), data, exclusive=True):
                self._written.pop()  # someone else's: never removed by this run
                raise OutputExistsError(
                    f"{self.url}/{name} was written by someone else while this run wrote; its output is discarded"
                )

    def abort(self) -> None:
        """Abort the open uploads and remove every object this run wrote."""
        for f in self._open:
            self.storage.abort(f)
        self._open.clear()
        self.storage.remove(self._written)
        self._written.clear()


@contextmanager
def store_output(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[StoreOutput]:
    """A :class:`StoreOutput` committed when the block ends, removed when it raises."""
    out = StoreOutput(url, storage_options)
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
