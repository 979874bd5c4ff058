"""Conditional requests on a store: writes and deletes that happen only while an object is the
version a writer saw, and reads of one whole version (body and ETag together).

S3 has them (``If-Match`` / ``If-None-Match`` on PUT, ``If-Match`` on DELETE:
``format/storage_s3.py``); every other store answers None ("cannot"), and the callers
(``format/store_lock.py``, ``format/commit_store.py``) fall back to reading back and checking.
No torch here.
"""

from __future__ import annotations

from unickpt.errors import IncompleteCheckpointError
from unickpt.format import storage_s3
from unickpt.format.storage import FsspecStorage, Storage

__all__ = ["write_if", "delete_if", "read_version"]


def _s3(storage: Storage) -> FsspecStorage | None:
    if isinstance(storage, FsspecStorage) and storage.protocol in ("s3", "s3a"):
        return storage
    return None


def write_if(storage: Storage, path: str, data: bytes, etag: str | None) -> tuple[bool, str | None] | None:
    """Write ``path`` only while it is the version ``etag`` (``If-Match``), or with ``etag=None``
    only while it does not exist (``If-None-Match: *``): ``(True, the new version's ETag)`` when
    written, ``(False, None)`` when the object changed, vanished or exists; None when the store
    has no conditional writes (nothing written)."""
    s3 = _s3(storage)
    return None if s3 is None else storage_s3.write_if(s3.fs, path, data, etag)


def delete_if(storage: Storage, path: str, etag: str) -> bool | None:
    """Delete ``path`` only while it is the version ``etag``: True when deleted, False when it
    changed or vanished, None when the store has no conditional deletes (nothing deleted)."""
    s3 = _s3(storage)
    return None if s3 is None else storage_s3.delete_if(s3.fs, path, etag)


def read_version(storage: Storage, path: str, limit: int) -> tuple[bytes, str | None] | None:
    """The bytes of the small object ``path`` and its ETag, of one version (one GET); None when
    it does not exist. The ETag is None where the store gives none."""
    s3 = _s3(storage)
    if s3 is not None:
        return storage_s3.read_version(s3.fs, path, limit)
    try:
        return storage.read_bytes(path, limit=limit), None
    except (FileNotFoundError, IncompleteCheckpointError):
        return None
