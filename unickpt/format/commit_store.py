"""Committing a checkpoint on an object store (no rename): the index is the commit point.

A store has no atomic rename, so the local protocol of ``format/commit.py`` (stage, un-commit,
rename) cannot run there. Instead (docs/reliability.md, "Object stores"):

- **a fresh directory** (no committed checkpoint of the kind): the data files are uploaded
  under their final names, then the index is written with one PUT, last. Until that PUT a
  reader finds no committed checkpoint (data files without an index are never loaded);
- **over a committed checkpoint**: the new data files are uploaded under fresh names that
  carry the save id (:func:`store_file_name`, ``model-00001-of-00002.<id>.safetensors``:
  ``weight_map`` and the slice table name them, transformers follows ``weight_map``), so the
  committed checkpoint's files are never touched; then one PUT replaces the index (the store
  replaces an object atomically: a reader gets the old index or the new one, whole); only
  then are the files the new index does not name deleted (:func:`remove_superseded`);
- **a single file** is one streamed (multipart) upload, visible whole when it completes; a
  committed index of the kind is deleted after it (a reader prefers the index, so the old
  checkpoint stays readable until then) together with its data files.

Every data file's header carries its save id and the reader checks it against the index, so a
file of another save under a name the index uses is refused, never read. Killed saves leave
files no index names and multipart uploads never completed: :func:`clean_store_leftovers`
removes the files older than the last commit and aborts the uploads begun before it.

Every commit point and every removal after it is fenced by the save's lock (``fence``:
``format/commit_fence.py``, ``format/store_lock.py``): a save whose lock was taken over commits
nothing and removes none of the files of the save that took its place.
"""

from __future__ import annotations

import os
import posixpath
import re
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from unickpt._logging import get_logger
from unickpt.errors import IncompleteCheckpointError
from unickpt.format import conditional
from unickpt.format.bounds import read_bounded
from unickpt.format.commit import atomic_write_bytes, makedirs_durable
from unickpt.format.commit_fence import Fence, put_commit_point, removable
from unickpt.format.naming import index_name, is_own_data_file, single_name
from unickpt.format.storage import FsspecStorage, Storage, is_url, open_storage

__all__ = [
    "store_file_name",
    "is_store_data_file",
    "committed_on_store",
    "committed_in",
    "needs_cleanup",
    "listing_times",
    "listing_versions",
    "referenced_files",
    "commit_store_index",
    "commit_and_clean",
    "remove_superseded",
    "clean_store_leftovers",
    "abort_dead_uploads",
    "object_time",
    "object_version",
    "read_small_file",
    "write_small_file",
    "checkpoint_directory",
]

logger = get_logger(__name__)
_KINDS = ("model", "optimizer")
# ``<standard name without .safetensors>.<12 hex digits>.safetensors``
_ID_RE = re.compile(r"^(?P<base>.+)\.(?P<token>[0-9a-f]{12})\.safetensors$")


def store_file_name(fname: str, save_id: str) -> str:
    """The fresh name of data file ``fname`` for a save over a committed checkpoint on a store."""
    stem = fname[: -len(".safetensors")] if fname.endswith(".safetensors") else fname
    return f"{stem}.{save_id[:12]}.safetensors"


def is_store_data_file(kind: str, name: str) -> bool:
    """True for the names a save of ``kind`` writes on a store (standard or with a save id)."""
    if is_own_data_file(kind, name):
        return True
    m = _ID_RE.match(name)
    return m is not None and is_own_data_file(kind, m.group("base") + ".safetensors")


def committed_on_store(storage: Storage, directory: str, kind: str) -> bool:
    """True when ``directory`` holds a committed ``kind`` checkpoint (an index or a single file)."""
    return committed_in(storage.listdir(directory), kind)  # one LIST request on a store, not two HEADs


def committed_in(names: Iterable[str], kind: str) -> bool:
    """True when a directory listing ``names`` holds a committed ``kind`` checkpoint."""
    found = set(names)
    return index_name(kind) in found or single_name(kind) in found


def needs_cleanup(names: Iterable[str]) -> bool:
    """False when a directory listing taken under the save lock, before a save writes anything,
    holds no data file of either kind: after that save's commit nothing is superseded and no
    killed save's file is left, so its post-commit listing can be skipped. (A killed save's
    multipart uploads are in no listing of objects: the save that takes over its stale lock
    cleans up all the same, docs/reliability.md.)"""
    return any(is_store_data_file(k, n) for n in names for k in _KINDS)


def referenced_files(index: bytes, path: str = "index.json") -> set[str]:
    """The data files an index names (``weight_map``, the block's ``files`` table, listed slices);
    nothing for bytes that are not a valid index."""
    from unickpt.errors import IndexFileError
    from unickpt.format.index import parse_index

    try:
        idx = parse_index(index, path)
    except (IndexFileError, ValueError):
        return set()
    out = set(idx.weight_map.values())
    block = idx.unickpt
    if block is not None:
        # Version 3: the block's file table names every data file its compact tensors use.
        out |= set(block.files or [])
        for entry in block.tensors.values():
            if not entry.compact:
                out |= {s.file for s in entry.slices}
    return out


def commit_store_index(
    storage: Storage, directory: str, kind: str, index: bytes, keep: set[str], fence: Fence | None = None
) -> None:
    """Write the index with one PUT (the commit, :func:`put_commit_point`), then remove what it supersedes.

    ``keep`` are the data files the index names, all uploaded whole before this call.
    """
    put_commit_point(storage, storage.join(directory, index_name(kind)), index, fence)
    remove_superseded(storage, directory, kind, keep, single=False, fence=fence)


def remove_superseded(
    storage: Storage, directory: str, kind: str, keep: set[str], *, single: bool, fence: Fence | None = None
) -> None:
    """After a commit: remove the kind's data files (and, for a single file, its index) not in ``keep``.

    For a single-file commit the index goes first: from then on the new single file is what a
    reader opens, and the old shards are unreferenced. With ``fence`` (the save's lock), only
    objects the directory held when the lock was taken (``commit_fence.removable``; the index only
    while still the version listed then: a conditional DELETE on S3): files of a save that took
    the lock over since are never removed.
    """
    seen = removable(fence, directory)
    if single:
        where, name = storage.join(directory, index_name(kind)), index_name(kind)
        if seen is None:
            storage.remove([where])
        elif name in seen:  # else another save's index, written since the lock was taken
            etag = seen[name]
            if etag is None or conditional.delete_if(storage, where, etag) is None:
                storage.remove([where])  # no conditional deletes: the lock's check is the fence
    names = storage.listdir(directory)
    storage.remove(
        [
            storage.join(directory, n)
            for n in names
            if n not in keep and is_store_data_file(kind, n) and (seen is None or n in seen)
        ]
    )


def object_time(storage: Storage, path: str) -> float | None:
    """Seconds since the epoch of an object's last modification, where the store says it."""
    return object_version(storage, path)[0]


def object_version(storage: Storage, path: str, *, fresh: bool = False) -> tuple[float | None, str | None]:
    """An object's last modification (as :func:`object_time`) and ETag (None where the store
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


def listing_times(storage: FsspecStorage, directory: str) -> dict[str, float | None]:
    """Name -> last modification of every object directly in ``directory`` (sub-prefixes left
    out): one LIST request (per 1000 objects on S3)."""
    return {n: _info_time(info) for n, info in _listing(storage, directory).items()}


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


def _commit_time(
    storage: Storage, directory: str, times: dict[str, float | None], known: dict[str, set[str]] | None = None
) -> tuple[float | None, set[str]]:
    """(time of the newest commit point in ``directory``, files the committed checkpoints use),
    from the directory's listing ``times`` (and each committed index, fetched unless ``known``
    gives the files it names)."""
    newest: float | None = None
    used: set[str] = set()
    for kind in _KINDS:
        for name, is_index in ((index_name(kind), True), (single_name(kind), False)):
            t = times.get(name)
            if name not in times or t is None:
                continue
            newest = t if newest is None else max(newest, t)
            if is_index and known is not None and name in known:
                used |= known[name]
            elif is_index:
                try:
                    where = storage.join(directory, name)
                    used |= referenced_files(storage.read_bytes(where, limit=1 << 30), where)
                except (OSError, ValueError):
                    continue
            else:
                used.add(name)
    return newest, used


def _uploads(storage: FsspecStorage, prefix: str) -> list[dict[str, Any]]:
    """Multipart uploads begun under ``prefix`` and never completed (S3 only; [] elsewhere)."""
    if storage.protocol not in ("s3", "s3a"):
        return []
    bucket, _, key = prefix.partition("/")
    try:
        out = storage.fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key.rstrip("/") + "/")
    except (OSError, ValueError):
        return []
    return [dict(u, Bucket=bucket) for u in out.get("Uploads", []) or []]


def abort_dead_uploads(storage: Storage, prefix: str, before: float | str) -> list[str]:
    """Abort the multipart uploads below ``prefix`` begun before ``before`` (seconds since the
    epoch, or the path of an object whose time is used): a killed save's. Returns them."""
    if not isinstance(storage, FsspecStorage):
        return []
    if isinstance(before, str):
        t = object_time(storage, before)
        if t is None:
            return []
        before = t
    aborted = []
    for u in _uploads(storage, prefix):
        started = u.get("Initiated")
        if isinstance(started, datetime) and started.timestamp() < before:
            storage.fs.call_s3(
                "abort_multipart_upload", Bucket=u["Bucket"], Key=u["Key"], UploadId=u["UploadId"]
            )
            aborted.append(f"{u['Bucket']}/{u['Key']} (upload {u['UploadId']})")
    return aborted


def clean_store_leftovers(storage: Storage, directory: str) -> list[str]:
    """Remove what killed saves left in ``directory`` on a store; returns the paths removed.

    Data files of either kind that no committed checkpoint names and that are older than the
    last commit, and multipart uploads begun before it, are a dead save's: a save still
    running began after that commit, so its files and uploads are newer and stay.
    """
    if not isinstance(storage, FsspecStorage):
        return []
    return _clean(storage, directory, listing_times(storage, directory))  # one LIST: every object's time


def commit_and_clean(
    storage: Storage,
    directory: str,
    kind: str,
    index: bytes,
    keep: set[str],
    *,
    clean: bool = True,
    fence: Fence | None = None,
) -> None:
    """:func:`commit_store_index` then :func:`clean_store_leftovers`, from one listing taken
    after the index PUT (the index's own file list is ``keep``: not fetched back). A failure of
    the removals is logged, not raised: the checkpoint is committed, leftovers go next time.

    ``clean=False`` (the save's listing under its lock showed no data file: :func:`needs_cleanup`)
    makes the commit the index PUT alone: nothing to supersede, no file of a killed save.
    ``fence`` (the save's lock) fences the commit (``commit_fence.put_commit_point``) and the removals
    (checked first; only objects listed when the lock was taken, :func:`remove_superseded`)."""
    if not isinstance(storage, FsspecStorage):
        commit_store_index(storage, directory, kind, index, keep, fence)
        return
    put_commit_point(storage, storage.join(directory, index_name(kind)), index, fence)
    if not clean:
        return
    try:  # committed: from here on a failure leaves only unreferenced files, removed next time
        seen = removable(fence, directory)
        times = listing_times(storage, directory)
        gone = [
            n for n in times if n not in keep and is_store_data_file(kind, n) and (seen is None or n in seen)
        ]
        storage.remove([storage.join(directory, n) for n in gone])
        _clean(
            storage,
            directory,
            {n: t for n, t in times.items() if n not in gone},
            {index_name(kind): keep},
            None if seen is None else set(seen),
        )
    except Exception as e:
        logger.warning("%s: leftovers of killed saves not removed: %s", storage.url, e)


def _clean(
    storage: FsspecStorage,
    directory: str,
    times: dict[str, float | None],
    known: dict[str, set[str]] | None = None,
    only: set[str] | None = None,
) -> list[str]:
    """Remove the leftovers in ``times`` (only names in ``only``, when given: what the directory
    held when the save's lock was taken)."""
    newest, used = _commit_time(storage, directory, times, known)
    if newest is None:
        return []
    removed: list[str] = []
    for n, t in times.items():
        if (
            n in used
            or not any(is_store_data_file(k, n) for k in _KINDS)
            or (only is not None and n not in only)
        ):
            continue
        if t is not None and t < newest:
            removed.append(storage.join(directory, n))
    storage.remove(removed)
    removed += abort_dead_uploads(storage, directory, newest)
    if removed:
        logger.info("%s: removed leftovers of killed saves: %s", storage.url, removed)
    return removed


def read_small_file(
    location: str, storage_options: dict[str, Any] | None = None, limit: int = 64 << 20
) -> bytes:
    """A small side file (a scheduler's JSON, a rank's training state) from a local path or a
    URL; a missing one raises ``FileNotFoundError`` either way."""
    if not is_url(location):
        return read_bounded(location.removeprefix("file://"), limit)
    storage, _ = open_storage(location, storage_options)
    try:
        return storage.read_bytes(location, limit=limit)
    except IncompleteCheckpointError as e:
        raise FileNotFoundError(str(e)) from None


def write_small_file(location: str, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Write a small file whole (a scheduler's JSON, ``config.json``): locally an atomic
    replacement (``commit.atomic_write_bytes``), on a store one PUT (atomic there)."""
    if not is_url(location):
        path = location[len("file://") :] if location.startswith("file://") else location
        makedirs_durable(os.path.dirname(os.path.abspath(path)))
        atomic_write_bytes(path, data)
        return
    store, path = open_storage(location, storage_options)
    store.makedirs(posixpath.dirname(path))
    store.put(path, data)


def checkpoint_directory(path: str) -> str:
    """The directory of a committed checkpoint ``path`` (itself, or a single file's parent); URLs too."""
    if is_url(path):
        return posixpath.dirname(path) if path.endswith(".safetensors") else path
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
