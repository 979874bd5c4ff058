"""One writer per checkpoint directory: the save lock, and the fence it puts on a commit.

:func:`save_lock` holds the lock of a directory for one save (or one tool run) and yields a
:class:`Fence`. Which lock it takes comes from the store object (``Storage.atomic_rename``):

**Local directories**: a kernel advisory lock (``flock``) on the file ``.unickpt.lock``
(:func:`directory_lock`). It cannot be held twice (two processes, or two holders in one
process), the kernel releases it when its holder dies, so a killed save never blocks the next
one and there is no stale lock to take over; a holder that stalls keeps it however long it
stalls, so its fence never fails (:class:`HeldFlock`). The file is unlinked only by its
holder, under the lock; a process that locked a file which was unlinked meanwhile sees that
the path no longer names the inode it locked and tries again. It holds the holder's pid for
diagnostics only.

**Object stores** have no ``flock``. Two saves into one URL would otherwise upload data files
under the same names and each clean up the other's files, leaving a checkpoint that neither
wrote whole. So rank 0 of a save takes the lock object ``<directory>/.unickpt.lock``
(:func:`store_lock`) before anything is uploaded: one PUT with ``If-None-Match: *``
(``Storage.put(exclusive=True)``; atomic on S3, check-then-write elsewhere). A second save into
the directory finds it and raises ``CheckpointBusyError`` naming the holder; the lock is deleted
when the save commits or fails.

*Stale locks.* While held, the lock object is rewritten every quarter of the stale threshold (a
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

*Fencing.* A lock taken over need not belong to a dead save: its holder may only have
stalled (a long GC or VM pause, a partition during which its heartbeats failed). Such a save
must never commit, nor touch the files of the save that took its place. So every write of the
lock object is conditional on the version this save last wrote, and the save's destructive
steps are fenced (:class:`StoreLock`, ``store/publish.py``):

- the heartbeat rewrites the lock with ``If-Match`` its last ETag; refused, it reads the lock
  back (one GET gives body and ETag): a lock naming another save is never written again;
- right before its commit point (the index PUT; a single file's completion) the save reads the
  lock back (:meth:`StoreLock.check`, one GET) and raises ``CheckpointBusyError``, naming the
  URL and the new holder, unless it still names this save;
- the index PUT itself is conditional on the version the directory held when the lock was
  taken (``If-Match`` its ETag, ``If-None-Match: *`` where there was none), so a save that
  resumes between its check and its PUT, after another save committed, is refused too
  (``publish.put_commit_point``);
- after the commit, only objects listed when the lock was taken are removed (the index only
  while still the version listed: a conditional DELETE); a save that took over a stale lock
  names its data files with its save id (``publish.store_file_name``), so the uploads of
  a stalled predecessor that resumes never land on its files;
- the release deletes the lock with ``If-Match`` its ETag: a lock taken over is left to its
  new holder (a warning). A save that committed before it lost its lock has committed: it
  returns normally.

This holds on S3 (conditional PUT, conditional DELETE: ``Storage.conditional_put``; moto's
server in the tests). Stores without conditional writes (``memory://``, others) get the same
checks by reading the lock back (its save id) before every heartbeat, commit and release, and
the same listing rule for removals; what they lack is atomicity: a takeover landing between a
read-back and the write that follows it is not seen (a heartbeat may then overwrite the new
holder's lock, which that save's own check then reports).

The conditional requests themselves (:func:`write_if`, :func:`delete_if`, :func:`read_version`)
and the store's listing with versions (:func:`listing_versions`, :func:`object_version`) live
here too: the fence is built of them. No torch here.
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
from datetime import datetime
from typing import Any, Protocol

from unickpt._logging import get_logger
from unickpt.errors import CheckpointBusyError, IncompleteCheckpointError
from unickpt.store import storage_s3
from unickpt.store.storage import FsspecStorage, Storage

__all__ = [
    "LOCK_NAME",
    "Fence",
    "HeldFlock",
    "Listed",
    "StoreLock",
    "save_lock",
    "directory_lock",
    "store_lock",
    "take_unheld_lock",
    "busy_error",
    "stale_after",
    "write_if",
    "delete_if",
    "read_version",
    "object_version",
    "listing_versions",
]

logger = get_logger(__name__)
#: The lock of a checkpoint directory: a ``flock``ed file locally, a lock object on a store.
LOCK_NAME = ".unickpt.lock"


class Fence(Protocol):
    """The save lock that fences a commit (:class:`StoreLock` on a store, :class:`HeldFlock` locally)."""

    @property
    def versions(self) -> dict[str, str | None] | None:
        """Name -> ETag of every object the directory held once the lock was taken (None: not
        listed). Files another save may own are never among them (``publish.put_commit_point``)."""
        ...

    def check(self, before: str) -> None:
        """Raise ``CheckpointBusyError`` unless the lock is still this save's."""
        ...

    def holder(self) -> str:
        """Who holds the lock now ("this save" while it does), as far as the store says."""
        ...


class HeldFlock:
    """A local directory's lock while held (:func:`save_lock`): a ``flock`` is never taken over
    while its holder lives, so the fence always passes and there is no listing to condition on."""

    versions: dict[str, str | None] | None = None

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, LOCK_NAME)

    def check(self, before: str) -> None:
        """Nothing to check: the kernel keeps the lock this process's until it closes it."""

    def holder(self) -> str:
        return "this save"


@contextlib.contextmanager
def save_lock(
    storage: Storage, directory: str, save_id: str, *, listed: bool = False
) -> Iterator[HeldFlock | StoreLock]:
    """Hold the save lock of ``directory`` while the block runs (the module docstring): a ``flock``
    where ``storage`` renames atomically (a local directory), else the store's lock object (with
    ``listed``: the directory listed under it, :class:`Listed`). Yields the :class:`Fence`."""
    if storage.atomic_rename:
        with directory_lock(directory):
            yield HeldFlock(directory)
        return
    with store_lock(storage, directory, save_id, listed=listed) as held:
        yield held


# ----------------------------------------------------------------------------- local: flock


@contextlib.contextmanager
def directory_lock(directory: str) -> Iterator[None]:
    """Hold the exclusive save lock of ``directory`` for the duration of one save.

    Two saves into the same directory at once would interleave files; the second one is
    refused with ``CheckpointBusyError``. The lock is a kernel advisory lock (``flock``) on the
    file ``.unickpt.lock``: it cannot be held twice (two processes, or two holders in one
    process), and the kernel releases it when its holder dies, so a killed save never blocks
    the next one and there is no "stale lock" to take over. The file is unlinked only by its
    holder, under the lock; a process that locked a file which was unlinked meanwhile sees
    that the path no longer names the inode it locked and tries again. The file holds the
    holder's pid for diagnostics only.
    """
    path = os.path.join(directory, LOCK_NAME)
    fd, key = _acquire_flock(path, directory)
    try:
        yield
    finally:
        _release_flock(path, fd, key)


# (st_dev, st_ino) of every save lock this process holds: ``flock`` already refuses a second
# open file description of the same file, this also covers filesystems that emulate ``flock``
# with per-process POSIX locks (NFS), where a process would otherwise not conflict with itself.
_HELD: set[tuple[int, int]] = set()


_HELD_GUARD = threading.Lock()


def busy_error(directory: str, path: str, own: bool = False) -> CheckpointBusyError:
    holder = f" (held by this process, pid {os.getpid()})" if own else ""
    if not own:  # (never open a lock file this process holds: see _HELD)
        with contextlib.suppress(OSError, ValueError, IndexError), open(path, "rb") as f:
            holder = f" (held by pid {int(f.read(32).split()[0])})"
    return CheckpointBusyError(
        f"{directory} is being written by another save: its lock {path} is held{holder}; "
        "wait for that save to finish (the lock is released when its process ends)"
    )


def _acquire_flock(path: str, directory: str) -> tuple[int, tuple[int, int]]:
    import fcntl

    with _HELD_GUARD:  # never open (then close) a second descriptor of a lock this process holds
        while True:
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(path)
                if (st.st_dev, st.st_ino) in _HELD:
                    raise busy_error(directory, path, own=True)
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o644)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise busy_error(directory, path) from None
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                try:
                    now = os.stat(path)
                except FileNotFoundError:
                    now = None
                if now is None or (now.st_dev, now.st_ino) != key:
                    # Its holder unlinked this inode when releasing it: lock the file there now.
                    os.close(fd)
                    continue
                with contextlib.suppress(OSError):  # the pid is for diagnostics only
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                _HELD.add(key)
                return fd, key
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise


def _release_flock(path: str, fd: int, key: tuple[int, int]) -> None:
    """Unlink the lock file if it still is the one we locked (only the holder unlinks), then unlock."""
    with _HELD_GUARD:
        try:
            with contextlib.suppress(OSError):
                now = os.stat(path)
                if (now.st_dev, now.st_ino) == key:
                    os.unlink(path)
        finally:
            _HELD.discard(key)
            os.close(fd)


def take_unheld_lock(path: str, *, remove: bool) -> bool:
    """True when nobody holds the lock file at ``path`` (a dead save's leftover); with ``remove``,
    unlink it while holding it, as only a holder may."""
    try:
        fd, key = _acquire_flock(path, os.path.dirname(path))
    except CheckpointBusyError:
        return False
    if remove:
        _release_flock(path, fd, key)
    else:
        with _HELD_GUARD:
            _HELD.discard(key)
            os.close(fd)
    return True


# ----------------------------------------------------------------------------- conditional requests


def _s3(storage: Storage) -> FsspecStorage | None:
    """The store, where it has conditional requests (``Storage.conditional_put``: S3)."""
    if isinstance(storage, FsspecStorage) and storage.conditional_put:
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


# ----------------------------------------------------------------------------- listings with versions


def object_version(storage: Storage, path: str, *, fresh: bool = False) -> tuple[float | None, str | None]:
    """An object's last modification (seconds since the epoch, where the store says it) and ETag (None where the store
    gives none), from one look at it; ``fresh`` asks the store, not fsspec's listing cache."""
    if not isinstance(storage, FsspecStorage):
        try:
            return os.stat(path).st_mtime, None
        except OSError:
            return None, None
    try:
        info: dict[str, Any] = storage.fs.info(path, refresh=True) if fresh else storage.fs.info(path)
    except (FileNotFoundError, OSError):
        return None, None
    etag = info.get("ETag") or info.get("etag")
    return _info_time(info), (str(etag) if etag else None)


def _info_time(info: dict[str, Any]) -> float | None:
    """Seconds since the epoch of an object's last modification in a listing or ``info`` entry."""
    for k in ("LastModified", "last_modified", "mtime", "updated", "created"):
        v = info.get(k)
        if isinstance(v, datetime):
            return v.timestamp()
        if isinstance(v, (int, float)):
            return float(v)
        if isinstance(v, str):
            try:
                return datetime.fromisoformat(v.replace("Z", "+00:00")).timestamp()
            except ValueError:
                continue
    return None


def listing_versions(storage: FsspecStorage, directory: str) -> dict[str, tuple[float | None, str | None]]:
    """As :func:`listing_times`, with each object's ETag (None where the store gives none)."""
    out: dict[str, tuple[float | None, str | None]] = {}
    for n, info in _listing(storage, directory).items():
        etag = info.get("ETag") or info.get("etag")
        out[n] = (_info_time(info), str(etag) if etag else None)
    return out


def _s3_listing(storage: FsspecStorage, directory: str) -> dict[str, dict[str, Any]]:
    bucket, key, _ = storage.fs.split_path(directory)
    prefix = key.rstrip("/") + "/" if key else ""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
    out: dict[str, dict[str, Any]] = {}
    while True:
        page = storage.fs.call_s3("list_objects_v2", **kwargs)
        for c in page.get("Contents", []) or []:
            name = str(c["Key"])[len(prefix) :]
            if name:
                out[name] = dict(c, name=f"{bucket}/{c['Key']}", type="file", size=c.get("Size"))
        if not page.get("IsTruncated"):
            return out
        kwargs["ContinuationToken"] = page["NextContinuationToken"]


def _listing(storage: FsspecStorage, directory: str) -> dict[str, dict[str, Any]]:
    """Name -> the store's description (``LastModified``...) of every object directly in ``directory``."""
    if storage.protocol in ("s3", "s3a"):  # s3fs's ls lists the parent too when a prefix is empty
        return _s3_listing(storage, directory)
    try:
        entries = storage.fs.ls(directory, detail=True, refresh=True)
    except FileNotFoundError:
        return {}
    base = directory.rstrip("/")
    out: dict[str, dict[str, Any]] = {}
    for info in entries:
        name = str(info.get("name", "")).rstrip("/")
        if name != base and info.get("type") != "directory":
            out[posixpath.basename(name)] = info
    return out


# ----------------------------------------------------------------------------- object stores: the lock object


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
    #: is rewritten only while still the version listed here (``publish.put_commit_point``)
    etags: dict[str, str | None] = dataclasses.field(default_factory=dict)


def _put_lock(storage: Storage, path: str, body: bytes, etag: str | None) -> tuple[bool, str | None]:
    """Write the lock while it is the version ``etag`` (None: while absent): (written, its
    ETag). Stores without conditional overwrites: an exclusive put, or False for a rewrite."""
    got = write_if(storage, path, body, etag)
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
            replaced = write_if(storage, path, body, etag) if etag else None
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
        got = read_version(self.storage, self.path, 1 << 16)
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
                    gone = delete_if(self.storage, self.path, self._etag)
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
