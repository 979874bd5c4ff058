"""One writer per checkpoint directory on an object store: an exclusive lock object.

A store has no ``flock``. Two saves into one URL would otherwise upload data files under the
same names and each clean up the other's files, leaving a checkpoint that neither wrote whole
(the save ids in the headers refuse it at load, but it is lost). So rank 0 of a save takes
``<directory>/.unickpt-save.lock`` before anything is uploaded: one PUT with ``If-None-Match: *``
(``Storage.put(exclusive=True)``; atomic on S3, check-then-write elsewhere). A second save into
the directory finds it and raises ``CheckpointBusyError`` naming the holder; the lock is deleted
when the save commits or fails.

**Stale locks.** While held, the lock is rewritten every quarter of the stale threshold (a
heartbeat from a daemon thread). A lock the store says was last written more than the
threshold ago (``UNICKPT_STORE_LOCK_STALE`` seconds, default 120) belongs to a killed
save: the next save removes it (with a warning naming it) and takes its place. The age is the
store's ``LastModified`` against this machine's clock, so clocks skewed by more than that
threshold misjudge it. On S3 a stale lock is replaced with one PUT conditional on the version
judged stale (``If-Match`` its ETag): of two saves taking it over at the same instant one gets
it, the other finds a fresh lock and raises ``CheckpointBusyError``. Stores without conditional
overwrites delete it, then take it with the exclusive PUT (two saves racing there can both
proceed; rare: raise the threshold rather than lower it). Deleting the lock object by hand
releases it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import posixpath
import socket
import threading
import time
from collections.abc import Iterator

from unickpt._logging import get_logger
from unickpt.errors import CheckpointBusyError
from unickpt.format.commit_store import listing_times, object_version
from unickpt.format.storage import FsspecStorage, Storage

__all__ = ["LOCK_NAME", "Listed", "store_lock", "stale_after"]

logger = get_logger(__name__)
LOCK_NAME = ".unickpt-save.lock"


def stale_after() -> float:
    """Seconds after its last heartbeat when a lock is a killed save's (``UNICKPT_STORE_LOCK_STALE``)."""
    raw = os.environ.get("UNICKPT_STORE_LOCK_STALE", "")
    try:
        return float(raw) if raw else 120.0
    except ValueError:
        from unickpt.errors import ConfigError

        raise ConfigError(f"UNICKPT_STORE_LOCK_STALE={raw!r}: expected a number of seconds") from None


def _body(save_id: str) -> bytes:
    return json.dumps(
        {"save_id": save_id, "host": socket.gethostname(), "pid": os.getpid(), "time": time.time()}
    ).encode()


def _holder(storage: Storage, path: str) -> tuple[str, float | None, str | None]:
    """(who holds the lock, seconds since it was last written, the version seen: its ETag where
    the store gives one), as far as the store says."""
    try:
        info = json.loads(storage.read_bytes(path, limit=1 << 16))
        who = f"save {info.get('save_id')} on {info.get('host')} (pid {info.get('pid')})"
    except (OSError, ValueError, AttributeError):
        who = "an unknown save"
    t, etag = object_version(storage, path, fresh=True)
    return who, (None if t is None else time.time() - t), etag


@dataclasses.dataclass(frozen=True)
class Listed:
    """The lock's directory as listed once the lock was taken (``store_lock(listed=True)``)."""

    #: name -> last modification of every object in the directory but the lock
    times: dict[str, float | None]
    #: True when a killed save's stale lock was removed to take this one (its leftovers may be
    #: multipart uploads, which no listing of objects shows)
    took_over: bool


def _acquire(storage: Storage, path: str, body: bytes) -> bool:
    """Take the lock; True when a stale lock was taken over (replaced, or removed first)."""
    limit = stale_after()
    for attempt in (0, 1):
        try:
            took = storage.put(path, body, exclusive=True)
        except FileNotFoundError:  # a file-like store wants the directory first (object stores never)
            storage.makedirs(posixpath.dirname(path))
            took = storage.put(path, body, exclusive=True)
        if took:
            return attempt == 1
        who, age, etag = _holder(storage, path)
        if attempt == 0 and age is not None and age > limit:
            logger.warning(
                "%s: removing the stale lock of %s (last written %.0f s ago, more than %.0f s)",
                path,
                who,
                age,
                limit,
            )
            # Replaced only while still the version judged stale (If-Match on S3): of two saves
            # taking over the same stale lock at once, one gets it and the other finds it fresh.
            replaced = storage.replace_if(path, body, etag) if etag else None
            if replaced:
                return True
            if replaced is None:  # a store without conditional overwrites: delete, then exclusive
                _delete(storage, path)
            continue
        shown = "" if age is None else f", last written {age:.0f} s ago"
        raise CheckpointBusyError(
            f"{path}: another save is writing this checkpoint directory ({who}{shown}); one writer per "
            f"URL. A lock not rewritten for {limit:.0f} s (UNICKPT_STORE_LOCK_STALE) is a killed save's "
            "and is taken over; delete the lock object if you know no save is running"
        )
    raise RuntimeError(f"{path}: the lock was neither taken nor refused")  # never: the loop decides


def _times(storage: Storage, directory: str) -> dict[str, float | None]:
    if isinstance(storage, FsspecStorage):
        return {n: t for n, t in listing_times(storage, directory).items() if n != LOCK_NAME}
    return {n: None for n in storage.listdir(directory) if n != LOCK_NAME}


@contextlib.contextmanager
def store_lock(
    storage: Storage, directory: str, save_id: str, *, listed: bool = False
) -> Iterator[Listed | None]:
    """Hold the directory's save lock (see the module docstring) while the block runs.

    With ``listed``, the block gets the directory's objects (:class:`Listed`), listed once the
    lock is taken: no other save can commit there after that listing until this one releases
    the lock. (The LIST is not sent beside the lock's PUT: served before it, it could miss a
    checkpoint another save commits in between.) Else None.
    """
    path = storage.join(directory, LOCK_NAME)
    took_over = _acquire(storage, path, _body(save_id))
    found = Listed(_times(storage, directory), took_over) if listed else None
    stop = threading.Event()
    every = max(stale_after() / 4, 0.05)

    def beat() -> None:
        while not stop.wait(every):
            try:
                storage.put(path, _body(save_id))
            except Exception as e:  # the save goes on; a later beat may get through
                logger.warning("%s: lock heartbeat failed: %s", path, e)

    thread = threading.Thread(target=beat, name="unickpt-store-lock", daemon=True)
    thread.start()
    try:
        yield found
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(Exception):  # a lock left behind goes stale
            _delete(storage, path)


def _delete(storage: Storage, path: str) -> None:
    """One DELETE of the lock object (not a batch delete)."""
    if isinstance(storage, FsspecStorage):
        storage.fs.rm_file(path)
    else:
        storage.remove([path])
