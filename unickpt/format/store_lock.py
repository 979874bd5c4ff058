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

**Fencing.** A lock taken over need not belong to a dead save: its holder may only have
stalled (a long GC or VM pause, a partition during which its heartbeats failed). Such a save
must never commit, nor touch the files of the save that took its place. So every write of the
lock object is conditional on the version this save last wrote, and the save's destructive
steps are fenced (:class:`StoreLock`, ``format/commit_store.py``):

- the heartbeat rewrites the lock with ``If-Match`` its last ETag; refused, it reads the lock
  back (one GET gives body and ETag): a lock naming another save is never written again;
- right before its commit point (the index PUT; a single file's completion) the save reads the
  lock back (:meth:`StoreLock.check`, one GET) and raises ``CheckpointBusyError``, naming the
  URL and the new holder, unless it still names this save;
- the index PUT itself is conditional on the version the directory held when the lock was
  taken (``If-Match`` its ETag, ``If-None-Match: *`` where there was none), so a save that
  resumes between its check and its PUT, after another save committed, is refused too;
- after the commit, only objects listed when the lock was taken are removed (the index only
  while still the version listed: a conditional DELETE); a save that took over a stale lock
  names its data files with its save id (``commit_store.store_file_name``), so the uploads of
  a stalled predecessor that resumes never land on its files;
- the release deletes the lock with ``If-Match`` its ETag: a lock taken over is left to its
  new holder (a warning). A save that committed before it lost its lock has committed: it
  returns normally.

This holds on S3 (conditional PUT, conditional DELETE; moto's server in the tests). Stores
without conditional writes (``memory://``, others) get the same checks by reading the lock
back (its save id) before every heartbeat, commit and release, and the same listing rule for
removals; what they lack is atomicity: a takeover landing between a read-back and the write
that follows it is not seen (a heartbeat may then overwrite the new holder's lock, which that
save's own check then reports). Local directories need none of this: their lock is a kernel
``flock`` (``format/commit_lock.py``), released only when its holder closes it or dies, and
never taken over while the holder lives, however long it stalls.
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
from typing import Any

from unickpt._logging import get_logger
from unickpt.errors import CheckpointBusyError
from unickpt.format import conditional
from unickpt.format.commit_store import listing_versions, object_version
from unickpt.format.storage import FsspecStorage, Storage

__all__ = ["LOCK_NAME", "Listed", "StoreLock", "store_lock", "stale_after"]

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


def _who(info: dict[str, Any] | None) -> str:
    if info is None:
        return "an unknown save"
    return f"save {info.get('save_id')} on {info.get('host')} (pid {info.get('pid')})"


def _parse(data: bytes) -> dict[str, Any] | None:
    try:
        info = json.loads(data)
    except ValueError:
        return None
    return info if isinstance(info, dict) else None


def _holder(storage: Storage, path: str) -> tuple[str, float | None, str | None]:
    """(who holds the lock, seconds since it was last written, the version seen: its ETag where
    the store gives one), as far as the store says."""
    try:
        who = _who(_parse(storage.read_bytes(path, limit=1 << 16)))
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
    #: name -> ETag of every object listed (None where the store gives none): a commit point
    #: is rewritten only while still the version listed here (``commit_store``)
    etags: dict[str, str | None] = dataclasses.field(default_factory=dict)


def _put_lock(storage: Storage, path: str, body: bytes, etag: str | None) -> tuple[bool, str | None]:
    """Write the lock while it is the version ``etag`` (None: while absent): (written, its
    ETag). Stores without conditional overwrites: an exclusive put, or False for a rewrite."""
    got = conditional.write_if(storage, path, body, etag)
    if got is not None:
        return got
    if etag is not None:
        return False, None
    try:
        return storage.put(path, body, exclusive=True), None
    except FileNotFoundError:  # a file-like store wants the directory first (object stores never)
        storage.makedirs(posixpath.dirname(path))
        return storage.put(path, body, exclusive=True), None


def _acquire(storage: Storage, path: str, body: bytes) -> tuple[bool, str | None]:
    """Take the lock: (True when a stale lock was taken over (replaced, or removed first), the
    ETag of the lock written)."""
    limit = stale_after()
    for attempt in (0, 1):
        took, mine = _put_lock(storage, path, body, None)
        if took:
            return attempt == 1, mine
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
            replaced = conditional.write_if(storage, path, body, etag) if etag else None
            if replaced is not None and replaced[0]:
                return True, replaced[1]
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


class StoreLock:
    """A save lock held on a store (what :func:`store_lock` yields): every write of the lock
    object and every check of it are fenced (module docstring, "Fencing").

    ``listed`` is the directory listed once the lock was taken (``store_lock(listed=True)``),
    else None; ``versions`` gives the ETags of that listing (a commit point is rewritten only
    while still the version listed), None when not listed.
    """

    def __init__(self, storage: Storage, path: str, save_id: str, etag: str | None) -> None:
        self.storage, self.path, self.save_id = storage, path, save_id
        self.listed: Listed | None = None
        self._etag = etag  # the version this save last wrote (None: a store without ETags)
        self._lost: str | None = None  # who holds the lock now, once this save lost it
        self._guard = threading.Lock()  # the heartbeat, the checks and the release take turns

    @property
    def url(self) -> str:
        return (
            self.path if "://" in self.path else f"{getattr(self.storage, 'protocol', 'file')}://{self.path}"
        )

    @property
    def versions(self) -> dict[str, str | None] | None:
        return None if self.listed is None else self.listed.etags

    def _look(self) -> str | None:
        """None while the lock object names this save (its ETag adopted: a heartbeat whose reply
        was lost still counts); else who holds it now. One GET."""
        got = conditional.read_version(self.storage, self.path, 1 << 16)
        if got is None:
            return "nobody (the lock object was deleted)"
        info = _parse(got[0])
        if info is not None and info.get("save_id") == self.save_id:
            if got[1] is not None:
                self._etag = got[1]
            return None
        return _who(info)

    def _busy(self, before: str) -> CheckpointBusyError:
        return CheckpointBusyError(
            f"{self.url}: this save (save {self.save_id}) lost its lock before {before}: it is now held by "
            f"{self._lost} (a lock not rewritten for {stale_after():.0f} s, UNICKPT_STORE_LOCK_STALE, is "
            "taken over as a killed save's: this save stalled that long or its heartbeats failed, or the "
            "lock was deleted); this save commits nothing and leaves the other save's files alone"
        )

    def check(self, before: str) -> None:
        """Raise ``CheckpointBusyError`` (naming the lock and its holder) unless the lock object
        still names this save: one GET of it, done right before ``before`` (a commit point, a
        removal of files another save may own)."""
        with self._guard:
            if self._lost is None:
                self._lost = self._look()
            if self._lost is not None:
                raise self._busy(before)

    def holder(self) -> str:
        """Who holds the lock now: "this save", or as :meth:`check` names it (one GET)."""
        with self._guard:
            if self._lost is None:
                self._lost = self._look()
            return "this save" if self._lost is None else self._lost

    def beat(self) -> None:
        """Rewrite the lock (a heartbeat) while it is still this save's: conditional on the
        version last written (``If-Match``); on stores without conditional overwrites, after
        reading it back. A lock found taken is never written again."""
        with self._guard:
            if self._lost is not None:
                return
            body = _body(self.save_id)
            if self._etag is not None:
                done, etag = _put_lock(self.storage, self.path, body, self._etag)
                if done:
                    self._etag = etag
                    return
            self._lost = self._look()  # changed: still ours (a lost reply) or taken over
            if self._lost is not None:
                logger.warning(
                    "%s: this save's lock was taken over by %s; the save fails before its commit",
                    self.url,
                    self._lost,
                )
                return
            if self._etag is not None:
                self._etag = _put_lock(self.storage, self.path, body, self._etag)[1] or self._etag
            else:
                self.storage.put(self.path, body)

    def release(self) -> None:
        """Delete the lock while it is still this save's (``If-Match`` its ETag on S3; read back
        first elsewhere). A lock taken over is left to its holder, with a warning."""
        with self._guard:
            if self._lost is None and self._etag is not None:
                for _ in (0, 1):
                    gone = conditional.delete_if(self.storage, self.path, self._etag)
                    if gone is None:
                        break
                    if gone:
                        return
                    self._lost = self._look()  # changed: still ours (a lost reply) or taken over
                    if self._lost is not None:
                        break
            if self._lost is None:
                self._lost = self._look()
                if self._lost is None:
                    _delete(self.storage, self.path)
                    return
            if not self._lost.startswith("nobody"):
                logger.warning("%s: left in place: its lock is now held by %s", self.url, self._lost)


def _listed(storage: Storage, directory: str, took_over: bool) -> Listed:
    if isinstance(storage, FsspecStorage):
        found = {n: v for n, v in listing_versions(storage, directory).items() if n != LOCK_NAME}
        return Listed({n: v[0] for n, v in found.items()}, took_over, {n: v[1] for n, v in found.items()})
    names = [n for n in storage.listdir(directory) if n != LOCK_NAME]
    return Listed(dict.fromkeys(names), took_over, dict.fromkeys(names))


@contextlib.contextmanager
def store_lock(
    storage: Storage, directory: str, save_id: str, *, listed: bool = False
) -> Iterator[StoreLock]:
    """Hold the directory's save lock (see the module docstring) while the block runs.

    The block gets the :class:`StoreLock`: its ``check(before)`` raises ``CheckpointBusyError``
    once the lock was taken over. With ``listed``, its ``listed`` is the directory's objects
    (:class:`Listed`), listed once the lock is taken: no other save can commit there after that
    listing until this one releases the lock (or loses it: then this one commits nothing). (The
    LIST is not sent beside the lock's PUT: served before it, it could miss a checkpoint another
    save commits in between.)
    """
    path = storage.join(directory, LOCK_NAME)
    took_over, etag = _acquire(storage, path, _body(save_id))
    held = StoreLock(storage, path, save_id, etag)
    if listed:
        held.listed = _listed(storage, directory, took_over)
    stop = threading.Event()
    every = max(stale_after() / 4, 0.05)

    def beat() -> None:
        while not stop.wait(every):
            try:
                held.beat()
            except Exception as e:  # the save goes on; a later beat may get through
                logger.warning("%s: lock heartbeat failed: %s", path, e)

    thread = threading.Thread(target=beat, name="unickpt-store-lock", daemon=True)
    thread.start()
    try:
        yield held
    finally:
        stop.set()
        thread.join()
        with contextlib.suppress(Exception):  # a lock left behind goes stale
            held.release()


def _delete(storage: Storage, path: str) -> None:
    """One DELETE of the lock object (not a batch delete)."""
    if isinstance(storage, FsspecStorage):
        storage.fs.rm_file(path)
    else:
        storage.remove([path])
