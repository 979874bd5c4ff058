"""The fence of a commit on an object store: its commit points written, and files removed, only
while the save still holds its lock (``format/store_lock.py``, "Fencing").

``commit_store`` calls these with the save's :class:`Fence` (a ``StoreLock``): the lock is read
back right before a commit point, the commit point's write is conditional on the version the
directory held when the lock was taken (S3: ``format/conditional.py``), and what a commit
removes afterwards is limited to objects listed then. No torch here.
"""

from __future__ import annotations

import posixpath
from typing import Protocol

from unickpt.errors import CheckpointBusyError
from unickpt.format import conditional
from unickpt.format.storage import Storage

__all__ = ["Fence", "put_commit_point", "commit_condition", "refused_commit", "removable"]


class Fence(Protocol):
    """The save lock that fences a commit on a store (``format.store_lock.StoreLock``)."""

    @property
    def versions(self) -> dict[str, str | None] | None:
        """Name -> ETag of every object the directory held once the lock was taken (None: not
        listed). Files another save may own are never among them (see :func:`put_commit_point`)."""
        ...

    def check(self, before: str) -> None:
        """Raise ``CheckpointBusyError`` unless the lock is still this save's."""
        ...

    def holder(self) -> str:
        """Who holds the lock now, as the store says (one look at it)."""
        ...


def put_commit_point(storage: Storage, path: str, data: bytes, fence: Fence | None) -> None:
    """Write the commit point ``path`` (an index) with one PUT; with ``fence``, only while this
    save still holds its lock: checked right before, and the PUT conditional on the version the
    directory held when the lock was taken (``If-Match`` its ETag, ``If-None-Match: *`` where
    there was none): a save that stalled past its lock's threshold while another took the lock
    over and committed is refused even when it resumes between its check and its PUT. Stores
    without conditional writes get the check alone."""
    if fence is None:
        storage.put(path, data)
        return
    fence.check(f"writing its commit point {path}")
    seen = fence.versions
    name = posixpath.basename(path)
    got = None
    if seen is not None and (name not in seen or seen[name] is not None):
        got = conditional.write_if(storage, path, data, seen.get(name))
    if got is None:
        storage.put(path, data)
    elif not got[0]:
        raise refused_commit(path, fence)


def commit_condition(fence: Fence | None, name: str) -> dict[str, str] | None:
    """The S3 request conditions (``IfMatch`` / ``IfNoneMatch``) that let commit point ``name``
    be written only while it is the version the directory held when ``fence`` was taken; None
    when there is nothing to condition on (no fence, not listed, no ETag)."""
    seen = None if fence is None else fence.versions
    if seen is None:
        return None
    if name not in seen:
        return {"IfNoneMatch": "*"}
    etag = seen[name]
    return None if etag is None else {"IfMatch": etag}


def refused_commit(path: str, fence: Fence) -> CheckpointBusyError:
    """The error of a commit point's conditional write refused by the store (:func:`commit_condition`)."""
    seen = fence.versions or {}
    name = posixpath.basename(path)
    was = f"version {seen[name]}" if name in seen else "no such object"
    return CheckpointBusyError(
        f"{path}: another save committed here after this save's lock was taken over (this save "
        f"found {was} when it took the lock; the lock is now held by {fence.holder()}); this save "
        "committed nothing and leaves that save's checkpoint as it is"
    )


def removable(fence: Fence | None, directory: str) -> dict[str, str | None] | None:
    """The objects a fenced save may remove after its commit: those listed when its lock was
    taken (a save that took the lock over since writes only under names of its own, and
    rewrites no listed object but the index). Without that listing, the lock is checked."""
    if fence is None:
        return None
    seen = fence.versions
    if seen is None:
        fence.check(f"removing the files {directory} no longer uses")
    return seen
