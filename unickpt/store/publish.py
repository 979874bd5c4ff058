"""Publishing: how a checkpoint, a manager step or a tool's output becomes visible, atomically.

Every writer of unickpt publishes through one protocol, whatever it writes and wherever:

1. **staged names**: everything is written first under names no reader takes as committed
   (:func:`temp_name`: ``.<name>.tmp-<token>`` locally; on a store fresh names, or final names in
   a directory holding no commit point yet);
2. **the commit point, last**, once everything it names is durable: locally a rename (an index
   renamed into place, a step directory renamed or exchanged, a staged output directory
   renamed), on an object store one PUT of the commit point (an index, a step's ``COMMIT``, a
   tool's index or ``.metadata``), conditional where the store can (``If-Match`` /
   ``If-None-Match``, fenced by the save lock: ``store/lock.py``);
3. **cleanup after**: superseded files and the leftovers of killed writers, only once the new
   commit point is durable, and on a store only objects the fence allows.

Which variant runs comes from the store object (``Storage.atomic_rename``,
``Storage.conditional_put``), never from the shape of a path. The writers:

============================  =================================  ====================================
what                          local directory (rename)           object store (commit marker)
============================  =================================  ====================================
a checkpoint (io, tools)      :func:`commit_directory`,          :func:`commit_and_clean`,
                              :func:`commit_single_file`         :func:`commit_store_index`,
                                                                 :func:`remove_superseded`
a manager step                :func:`commit_step`,               :class:`RemoteStore` (``COMMIT``
                              :func:`remove_step`                exclusive, then promoted)
a tool's output, one          :class:`DirectoryOutput`,          :class:`StoreOutput`
:class:`Sink` (output_sink)   (a staged directory,               (:func:`store_output`)
                              :func:`publish_directory`)
a trainer's checkpoint of     :class:`PartsOutput` (a staged     :class:`PartsOutput` (in place under
parts (integrations)          directory exchanged or renamed     the save lock: the old commit file
                              in; :func:`open_parts`)            deleted first, the new one last)
a small file                  :func:`write_small_file`: staged + fsync + rename; one PUT on a store
============================  =================================  ====================================

No file a reader may have open is ever modified: a new file is written and renamed over the old
name, so a reader holding the old file keeps reading the old save's bytes. See docs/format.md,
section 6, for what a reader sees at every instant, and docs/reliability.md for the crash-state
searches (``tests/crashfs.py``, ``tests/crashstore.py``) that explore every step here.
No torch here.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import posixpath
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from typing import Any, BinaryIO, Protocol, cast

from unickpt._logging import get_logger
from unickpt.errors import CheckpointBusyError, IncompleteCheckpointError, OutputExistsError, UnsupportedError
from unickpt.spec.naming import index_name, is_own_data_file, single_name
from unickpt.spec.run_names import (
    COMMIT_NAME,
    LATEST_NAME,
    REPLACING_RE,
    STEP_RE,
    WORK_RE,
    latest_record,
    step_name,
    work_name,
)
from unickpt.spec.untrusted import read_bounded
from unickpt.store.lock import (
    LOCK_NAME,
    Fence,
    busy_error,
    delete_if,
    directory_lock,
    listing_versions,
    object_version,
    save_lock,
    take_unheld_lock,
    write_if,
)
from unickpt.store.storage import (
    FsspecStorage,
    LocalStorage,
    Storage,
    is_url,
    join_location,
    open_storage,
    url_options,
)

logger = get_logger(__name__)
__all__ = [
    "SAVE_ID_KEY",
    "new_save_id",
    "content_save_id",
    "temp_name",
    "parse_temp_name",
    "fsync_dir",
    "makedirs_durable",
    "keep_mode",
    "write_staged",
    "atomic_write_bytes",
    "write_small_file",
    "read_small_file",
    "discard",
    "commit_directory",
    "prepare_commit",
    "place_staged",
    "finish_commit",
    "commit_single_file",
    "clean_leftovers",
    "only_leftovers",
    "store_file_name",
    "is_store_data_file",
    "holds_committed",
    "committed_in",
    "needs_cleanup",
    "referenced_files",
    "put_commit_point",
    "commit_condition",
    "refused_commit",
    "removable",
    "commit_store_index",
    "remove_superseded",
    "commit_and_clean",
    "clean_store_leftovers",
    "abort_dead_uploads",
    "object_time",
    "listing_times",
    "checkpoint_directory",
    "copy_files",
    "rename_aside",
    "install_step",
    "commit_step",
    "exchange",
    "restore_step",
    "committed_steps",
    "committed_step_dirs",
    "clean_work_dirs",
    "make_work_dir",
    "discard_step",
    "remove_step",
    "RemoteStore",
    "PartsOutput",
    "open_parts",
    "remove_parts",
    "check_output",
    "publish_directory",
    "COMMIT_POINTS",
    "is_commit_point",
    "StoreFile",
    "HeadLastFile",
    "StoreOutput",
    "store_output",
    "DirectoryOutput",
    "Sink",
    "checkpoint_sink",
    "output_sink",
    "LOCK_NAME",
    "Fence",
]

_KINDS = ("model", "optimizer")


# ----------------------------------------------------------------------------- names, small files


# Header metadata key of every data file a save writes: the save id its index records.
SAVE_ID_KEY = "unickpt_save"


# ``.<final name>.tmp-[<pid>-]<12 to 32 hex digits>``: the pid is that of the process that
# made the name (absent in staged data files, whose name derives from the save id).
_TEMP_RE = re.compile(r"^\.(?P<base>.+)\.tmp-(?:(?P<pid>[0-9]+)-)?(?P<token>[0-9a-f]{12,32})$")


def new_save_id() -> str:
    """A random id for one save: 32 lowercase hex digits."""
    return uuid.uuid4().hex


def content_save_id(data: bytes) -> str:
    """A save id derived from what a save wrote (``merge``: its block, which holds every slice's
    hash), so that the same output is the same bytes; 32 lowercase hex digits, like :func:`new_save_id`."""
    import xxhash

    return xxhash.xxh3_128_hexdigest(data)


def temp_name(final_path: str, save_id: str | None = None) -> str:
    """A hidden sibling name for staging ``final_path``; never matches a committed name.

    With ``save_id`` the name is ``.<base>.tmp-<first 12 digits of the id>``, so that every rank
    of a save can name the files the others stage; without, ``.<base>.tmp-<pid>-<random>``.
    """
    d, base = os.path.split(final_path)
    token = save_id[:12] if save_id else f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
    return os.path.join(d, f".{base}.tmp-{token}")


def parse_temp_name(entry: str) -> tuple[str, int | None] | None:
    """(final name, pid or None) of a name made by :func:`temp_name`; None for any other name."""
    m = _TEMP_RE.match(entry)
    if m is None:
        return None
    pid = m.group("pid")
    return m.group("base"), (int(pid) if pid else None)


def fsync_dir(path: str) -> None:
    """fsync a directory so that renames and new entries in it survive a power loss."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:  # some filesystems refuse fsync on directories
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def makedirs_durable(path: str, *, fsync: bool = True) -> None:
    """``os.makedirs(path, exist_ok=True)``, each directory it creates made durable (with ``fsync``).

    A new directory's name lives in its parent: until the parent is fsynced a power loss may
    drop it, and everything committed inside it with it, even after the save returned. So the
    parent of every directory created here is fsynced, top down.
    """
    created = []
    p = os.path.abspath(path)
    while not os.path.isdir(p):
        created.append(p)
        up = os.path.dirname(p)
        if up == p:
            break
        p = up
    os.makedirs(path, exist_ok=True)
    if fsync:
        for d in reversed(created):
            fsync_dir(os.path.dirname(d))


def keep_mode(new: str, old: str) -> None:
    """Give ``new`` the permission bits of the regular file ``old`` it is about to replace.

    A save onto an existing file replaces it atomically; the file keeps its permissions, as a
    file written over in place would (Colossal-AI's ``torch.save`` onto a path).
    """
    try:
        st = os.stat(old)
    except OSError:
        return
    if stat.S_ISREG(st.st_mode):
        os.chmod(new, stat.S_IMODE(st.st_mode))


def write_staged(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to the staging file ``path`` (a :func:`temp_name`), durably when ``fsync``."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        keep_mode(tmp, path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def write_small_file(location: str, data: bytes, storage_options: dict[str, Any] | None = None) -> None:
    """Write a small file whole (a scheduler's JSON, ``config.json``): locally an atomic
    replacement (:func:`atomic_write_bytes`) where the store renames, on a store one PUT (atomic
    there). ``storage_options`` apply to a URL only (:func:`~unickpt.store.storage.url_options`)."""
    store, path = open_storage(location, url_options(location, storage_options))
    if store.atomic_rename:
        makedirs_durable(os.path.dirname(path))
        atomic_write_bytes(path, data)
        return
    store.makedirs(posixpath.dirname(path))
    store.put(path, data)


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


# ----------------------------------------------------------------------------- a checkpoint, locally


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def discard(paths: Iterable[str]) -> None:
    """Remove staged files that will not be committed (absent ones are fine)."""
    for p in paths:
        _unlink(p)


def commit_directory(
    directory: str,
    kind: str,
    staged: Mapping[str, str],
    index: bytes,
    *,
    save_id: str,
    fsync: bool = True,
) -> None:
    """Commit a sharded or sliced ``kind`` checkpoint whose data files are staged and fsynced.

    ``staged`` maps each final data file name to its staging path in ``directory``. The caller
    holds the directory lock. Steps (each a single file-system operation a reader may see):

    1. the index is written and fsynced under its staging name;
    2. the kind's committed index and single file are removed: from here until step 4 a
       reader finds no committed checkpoint of the kind (``IncompleteCheckpointError``), never
       the previous one with new data files;
    3. each staged data file is renamed over its final name (a reader holding the old file
       keeps its old bytes; a reader opening it now finds this save's id and refuses it);
    4. the index is renamed into place: the commit;
    5. data files of the kind that the new index does not name are removed, then leftovers.

    A save whose ranks stage files in directories of their own (node-local disks) runs the three
    parts itself: :func:`prepare_commit` (steps 1-2, the index's rank), :func:`place_staged`
    (step 3, every rank its own files), :func:`finish_commit` (steps 4-5).
    """
    try:
        idx_tmp = prepare_commit(directory, kind, index, save_id=save_id, fsync=fsync)
    except BaseException:
        discard(staged.values())
        raise
    try:
        place_staged(directory, staged, fsync=fsync)
    except BaseException:
        discard([idx_tmp, *staged.values()])
        raise
    finish_commit(directory, kind, idx_tmp, set(staged), fsync=fsync)


def prepare_commit(directory: str, kind: str, index: bytes, *, save_id: str, fsync: bool = True) -> str:
    """Stage the index, then un-commit the kind's previous checkpoint. Returns the staged index path."""
    idx_tmp = temp_name(os.path.join(directory, index_name(kind)), save_id)
    try:
        write_staged(idx_tmp, index, fsync=fsync)
        if fsync:
            fsync_dir(directory)
        removed = _unlink(os.path.join(directory, index_name(kind)))
        removed = _unlink(os.path.join(directory, single_name(kind))) or removed
        if removed and fsync:
            fsync_dir(directory)
    except BaseException:
        discard([idx_tmp])
        raise
    return idx_tmp


def place_staged(directory: str, staged: Mapping[str, str], *, fsync: bool = True) -> None:
    """Rename staged data files over their final names in ``directory`` (after :func:`prepare_commit`)."""
    try:
        for final, tmp in staged.items():
            os.replace(tmp, os.path.join(directory, final))
    except BaseException:
        discard(staged.values())
        raise
    if fsync and staged:
        fsync_dir(directory)


def finish_commit(directory: str, kind: str, idx_tmp: str, keep: set[str], *, fsync: bool = True) -> None:
    """Rename the staged index into place (the commit), then remove superseded files and leftovers."""
    try:
        os.replace(idx_tmp, os.path.join(directory, index_name(kind)))
    except BaseException:
        discard([idx_tmp])
        raise
    if fsync:
        fsync_dir(directory)
    _remove_superseded(directory, kind, keep)
    clean_leftovers(directory)


def commit_single_file(file_path: str, staged: str, kind: str, *, fsync: bool = True) -> None:
    """Commit a single-file checkpoint staged (written and fsynced) at ``staged``.

    When ``file_path`` is the kind's standard name in its directory (``model.safetensors``),
    the file becomes that directory's ``kind`` checkpoint: the kind's index is removed first
    (so no reader, whichever of the two it prefers, ever finds the previous checkpoint after
    this one is committed), and the previous save's shard files are removed after the rename.
    The caller holds the directory lock.
    """
    directory = os.path.dirname(os.path.abspath(file_path))
    base = os.path.basename(file_path)
    own = base == single_name(kind)
    try:
        if own and _unlink(os.path.join(directory, index_name(kind))) and fsync:
            fsync_dir(directory)
        keep_mode(staged, file_path)
        os.replace(staged, file_path)
    except BaseException:
        discard([staged])
        raise
    if fsync:
        fsync_dir(directory)
    if own:
        _remove_superseded(directory, kind, {base})
    clean_leftovers(directory, also=base)


def _remove_superseded(directory: str, kind: str, keep: set[str]) -> None:
    """Remove data files of ``kind`` (standard names only) that the committed checkpoint does not use.

    Shard files of the other kind are removed too when that kind has no committed index (a killed
    save left them beside a single file, or nothing is committed): no reader ever reads them.
    """
    entries = os.listdir(directory)
    orphaned = {k for k in _KINDS if k != kind and index_name(k) not in entries}
    for entry in entries:
        mine = entry not in keep and is_own_data_file(kind, entry)
        if mine or any(is_own_data_file(k, entry) and entry != single_name(k) for k in orphaned):
            _unlink(os.path.join(directory, entry))


def _checkpoint_name(name: str) -> bool:
    return any(name == index_name(k) or is_own_data_file(k, name) for k in _KINDS)


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def clean_leftovers(directory: str, *, also: str | None = None, locked: bool = True) -> list[str]:
    """Remove staging files (and staging directories) that no running save owns; returns them.

    A leftover is a name made by :func:`temp_name`. It is removed when the pid in its name is
    not running on this host, or, with ``locked`` (the caller holds the directory lock, so no
    save into this directory is running), when it stages a checkpoint file name of either kind
    or ``also``. Any other name, whatever it looks like, is left alone.
    """
    removed = []
    for entry in os.listdir(directory):
        parsed = parse_temp_name(entry)
        if parsed is None:
            continue
        base, pid = parsed
        dead = pid is not None and not _pid_alive(pid)
        if not (dead or (locked and (_checkpoint_name(base) or base == also))):
            continue
        path = os.path.join(directory, entry)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            _unlink(path)
        removed.append(path)
    return removed


def only_leftovers(directory: str) -> bool:
    """True when ``directory`` holds nothing but leftovers of dead saves (see :func:`publish_directory`)."""
    for entry in os.listdir(directory):
        parsed = parse_temp_name(entry)
        if parsed is not None and (parsed[1] is None or not _pid_alive(parsed[1])):
            continue
        if entry == LOCK_NAME and take_unheld_lock(os.path.join(directory, entry), remove=False):
            continue
        return False
    return True


# ----------------------------------------------------------------------------- a checkpoint on a store


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


def holds_committed(storage: Storage, directory: str, kind: str) -> bool:
    """True when ``directory`` holds a committed ``kind`` checkpoint (an index or a single file)."""
    return committed_in(storage.listdir(directory), kind)  # one listing (one LIST request on a store)


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
    from unickpt.spec.index import parse_index

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
                out |= set(entry.table.distinct_files())
    return out


def put_commit_point(
    storage: Storage, path: str, data: bytes, fence: Fence | None, *, exclusive: bool = False
) -> bool:
    """Write the commit point ``path`` (an index, a ``COMMIT``) with one PUT; with ``fence``, only
    while this save still holds its lock: checked right before, and the PUT conditional on the
    version the directory held when the lock was taken (``If-Match`` its ETag, ``If-None-Match: *``
    where there was none): a save that stalled past its lock's threshold while another took the
    lock over and committed is refused even when it resumes between its check and its PUT.
    Stores without conditional writes get the check alone. With ``exclusive`` (and nothing listed
    to condition on) the PUT happens only where no object is there yet (``Storage.put``): False
    when one is, nothing written."""
    seen = None
    if fence is not None:
        fence.check(f"writing its commit point {path}")
        seen = fence.versions
    name = posixpath.basename(path)
    if seen is not None and fence is not None and (name not in seen or seen[name] is not None):
        got = write_if(storage, path, data, seen.get(name))
        if got is not None:
            if not got[0]:
                raise refused_commit(path, fence)
            return True
    return storage.put(path, data, exclusive=exclusive)


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
    objects the directory held when the lock was taken (:func:`removable`; the index only
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
            if etag is None or delete_if(storage, where, etag) is None:
                storage.remove([where])  # no conditional deletes: the lock's check is the fence
    names = storage.listdir(directory)
    storage.remove(
        [
            storage.join(directory, n)
            for n in names
            if n not in keep and is_store_data_file(kind, n) and (seen is None or n in seen)
        ]
    )


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
    ``fence`` (the save's lock) fences the commit (:func:`put_commit_point`) and the removals
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


def clean_store_leftovers(storage: Storage, directory: str) -> list[str]:
    """Remove what killed saves left in ``directory`` on a store; returns the paths removed.

    Data files of either kind that no committed checkpoint names and that are older than the
    last commit, and multipart uploads begun before it, are a dead save's: a save still
    running began after that commit, so its files and uploads are newer and stay.
    """
    if not isinstance(storage, FsspecStorage):
        return []
    return _clean(storage, directory, listing_times(storage, directory))  # one LIST: every object's time


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


def object_time(storage: Storage, path: str) -> float | None:
    """Seconds since the epoch of an object's last modification, where the store says it."""
    return object_version(storage, path)[0]


def listing_times(storage: FsspecStorage, directory: str) -> dict[str, float | None]:
    """Name -> last modification of every object directly in ``directory`` (sub-prefixes left
    out): one LIST request (per 1000 objects on S3)."""
    return {n: v[0] for n, v in listing_versions(storage, directory).items()}


def checkpoint_directory(path: str) -> str:
    """The directory of a committed checkpoint ``path`` (itself, or a single file's parent); URLs too."""
    if is_url(path):
        return posixpath.dirname(path) if path.endswith(".safetensors") else path
    return path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))


# ----------------------------------------------------------------------------- a manager step, locally


def copy_files(src: str, dst: str, *, fsync: bool = True, part: tuple[int, int] = (0, 1)) -> None:
    """Give the local directory ``dst`` a copy of every regular, non-hidden file of ``src``, each
    a file of its own (a manager step's ``hf/`` beside its ``model/``: an edit of the copy never
    writes through to the checkpoint). The bytes move in the kernel (``LocalStorage.copy_range``:
    a copy-on-write clone where the file system makes one), in bounded memory; with ``fsync``
    every copy and ``dst`` itself are durable when this returns.

    ``part=(i, n)``: this call copies the files at positions ``i``, ``i + n``, ... of ``src``'s
    sorted listing, so that ``n`` processes sharing the directory copy it together, each its
    share, instead of one process copying it all; ``dst`` is durable with the entries made so
    far, and the caller fsyncs it once all have copied (:func:`fsync_dir`)."""
    i, n = part
    storage = LocalStorage(src)
    makedirs_durable(dst, fsync=fsync)
    names = sorted(
        name
        for name in storage.listdir(src)
        if not name.startswith(".") and storage.is_file(storage.join(src, name))
    )
    for name in names[i::n]:
        a = storage.join(src, name)
        h = storage.open_read(a)
        try:
            fd = h.descriptor()
            if fd is None:  # pragma: no cover - a local file always has one
                raise UnsupportedError(f"{a}: no file descriptor to copy from")
            out = storage.open_range(storage.join(dst, name), size=h.size)
            try:
                storage.copy_range(fd, 0, out, 0, h.size)
                if fsync:
                    out.sync()
            finally:
                out.close()
        finally:
            h.close()
    if fsync:
        fsync_dir(dst)


def rename_aside(directory: str, path: str, step: int, kind: str) -> str:
    dst = os.path.join(directory, work_name(step, kind))
    os.rename(path, dst)
    return dst


def install_step(directory: str, stage: str, final: str, step: int) -> str | None:
    """Rank 0, under the lock: make the committed ``stage`` the directory ``final`` (``step-<N>``).

    Returns the path now holding the copy it replaced (to delete once ``latest`` is written), or
    ``None``. At every instant a committed copy of step N exists: a replaced ``step-<N>`` is
    swapped atomically with the stage (``renameat2(RENAME_EXCHANGE)``: the old copy ends up
    under the staging name, never loaded), or, where the kernel or filesystem cannot swap,
    renamed to ``.step-<N>.old-<id>`` (still committed: see :func:`committed_step_dirs`)
    before the stage is renamed into place.
    """
    if not os.path.lexists(final):
        os.rename(stage, final)
        fsync_dir(directory)
        return None
    if exchange(stage, final):
        fsync_dir(directory)
        return stage
    old = rename_aside(directory, final, step, "old")
    fsync_dir(directory)
    os.rename(stage, final)
    fsync_dir(directory)
    return old


def commit_step(directory: str, stage: str, step: int, record: bytes) -> str:
    """Commit the fully written (and fsynced) ``stage`` as step ``step`` of ``directory``; returns ``step-<N>``.

    ``COMMIT`` (``record``) is written last into the stage, which is then put in place
    (:func:`install_step`); only then is ``latest`` replaced and a replaced copy deleted.
    The manager's saves (rank 0, under the lock) commit here; ``unickpt convert --to run`` writes
    its step in the same order (``COMMIT``, then ``latest``) into its one output
    (``ckpt/run_layout.write_step``).
    """
    atomic_write_bytes(os.path.join(stage, COMMIT_NAME), record)
    fsync_dir(stage)
    final = os.path.join(directory, step_name(step))
    replaced = install_step(directory, stage, final, step)
    atomic_write_bytes(os.path.join(directory, LATEST_NAME), latest_record(step))
    if replaced is not None:  # the new step-<N> is committed: the replaced copy may go
        discard_step(replaced)
    return final


_RENAME_EXCHANGE = 2  # <linux/fs.h>


_AT_FDCWD = -100


_renameat2: Any = None


_renameat2_loaded = False


def exchange(a: str, b: str) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``).

    False (nothing changed) where the call is missing or the filesystem refuses it.
    """
    global _renameat2, _renameat2_loaded
    if not _renameat2_loaded:
        _renameat2_loaded = True
        if sys.platform.startswith("linux"):
            import ctypes

            try:
                fn = ctypes.CDLL(None, use_errno=True).renameat2
            except (OSError, AttributeError):  # glibc < 2.28
                fn = None
            if fn is not None:
                fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
                fn.restype = ctypes.c_int
                _renameat2 = fn
    if _renameat2 is None:
        return False
    import ctypes

    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) {a} <-> {b}: {os.strerror(err)}")


def restore_step(directory: str, path: str, final: str, step: int) -> None:
    """Move the replaced copy ``path`` (the only committed copy of ``step``) back to ``final``."""
    if os.path.lexists(final):  # an uncommitted leftover in the way
        discard_step(rename_aside(directory, final, step, "deleting"))
    os.rename(path, final)
    fsync_dir(directory)


def committed_steps(directory: str) -> list[int]:
    return sorted(committed_step_dirs(directory))


def committed_step_dirs(directory: str) -> dict[int, str]:
    """{N: directory holding committed step N}: ``step-<N>`` with ``COMMIT``, else a replaced copy.

    Recovery rule: a save replacing step N without ``renameat2(RENAME_EXCHANGE)`` moves the old
    ``step-<N>`` (committed) to ``.step-<N>.old-<id>``, then the new one into place. Killed in
    between, the old copy is the committed step N: it is found here, loaded, kept by retention,
    and moved back to ``step-<N>`` by the next save (``clean_work_dirs``).
    """
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return {}
    out: dict[int, str] = {}
    replaced: dict[int, str] = {}
    for n in names:
        m = STEP_RE.match(n)
        w = WORK_RE.match(n)
        if m and os.path.isfile(os.path.join(directory, n, COMMIT_NAME)):
            out[int(m.group(1))] = os.path.join(directory, n)
        elif w and w.group(2) == "old" and os.path.isfile(os.path.join(directory, n, COMMIT_NAME)):
            replaced.setdefault(int(w.group(1)), os.path.join(directory, n))
    for step, path in replaced.items():
        out.setdefault(step, path)
    return out


def clean_work_dirs(directory: str) -> None:
    """Remove staging/old/deleting/download directories left by killed saves and loads.

    A directory whose owner still runs (it holds the ``flock`` taken by :func:`make_work_dir`)
    is left alone, so a cleanup never deletes another live writer's (or reader's) directory. A
    replaced copy ``.step-<N>.old-<id>`` that is the only committed copy of step N (see
    :func:`committed_step_dirs`) is moved back to ``step-<N>`` instead of being deleted.
    Local checkpoint directories: rank 0, under the save lock.
    """
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return
    recovered = committed_step_dirs(directory)
    for n in names:
        m = WORK_RE.match(n)
        if not m:
            # the temporary file of an interrupted replacement of ``latest`` (atomic_write_bytes)
            if (parsed := parse_temp_name(n)) is not None and parsed[0] == LATEST_NAME:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(directory, n))
            continue
        path = os.path.join(directory, n)
        step = int(m.group(1))
        if m.group(2) == "old" and recovered.get(step) == path:
            final = os.path.join(directory, step_name(step))
            logger.warning(
                "step %s: restoring its committed copy %s to %s (a save replacing it was interrupted)",
                step,
                path,
                final,
            )
            restore_step(directory, path, final, step)
            continue
        if not os.path.isdir(path) or os.path.islink(path):
            discard_step(path)
            continue
        fd = _try_own(path)
        if fd is None:
            logger.info("leaving %s: its owner is still running", path)
            continue
        try:
            logger.info("removing %s left by an interrupted save", path)
            discard_step(path)
        finally:
            os.close(fd)


def make_work_dir(path: str) -> int:
    """Create the work directory ``path`` and lock it (``flock`` on the directory): returns the fd.

    The lock marks the directory as owned by a live process (``clean_work_dirs`` skips it);
    the kernel drops it when the process dies. Close the fd to release it.
    """
    import fcntl

    os.makedirs(path)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # a cleaner holds it only while deleting
        except OSError as e:
            if isinstance(e, InterruptedError) or e.errno not in _NO_DIR_LOCK:
                raise
            # Some network filesystems (NFS: flock emulated by POSIX locks, which need a file
            # open for writing) cannot lock a directory. The save lock of the checkpoint
            # directory still serialises its writers and cleanups; only a local_cache_dir shared
            # by several managers loses this protection there.
            logger.debug("%s: cannot lock the work directory (%s)", path, e)
            return fd
        if os.fstat(fd).st_nlink == 0:  # a cleaner removed it between mkdir and flock
            raise FileNotFoundError(errno.ENOENT, "work directory removed by a concurrent cleanup", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


_NO_DIR_LOCK = {errno.EBADF, errno.ENOLCK, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


def _try_own(path: str) -> int | None:
    """A locked fd of the work directory ``path`` if no live process owns it, else ``None``."""
    import fcntl

    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:  # gone already (another cleanup)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    except OSError as e:  # no directory locks on this filesystem (see make_work_dir)
        if e.errno not in _NO_DIR_LOCK:
            os.close(fd)
            raise
    return fd


def discard_step(path: str) -> None:
    """Delete a directory that is no longer (or never was) the committed copy: ``COMMIT`` first."""
    if not os.path.isdir(path) or os.path.islink(path):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(path, COMMIT_NAME))  # a half-deleted copy is never committed
    shutil.rmtree(path, ignore_errors=True)


def remove_step(directory: str, step: int) -> None:
    """Rank 0, under the lock: un-commit every copy of ``step`` (atomic renames, each made durable
    by an fsync of ``directory`` before the copy's files are deleted), then delete them.

    Replaced copies (``.step-<N>.old-<id>``) go first: a kill part way never leaves one of them
    to be taken for step N once ``step-<N>`` is gone.
    """
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return
    copies = [n for n in names if (m := WORK_RE.match(n)) and m.group(2) == "old" and int(m.group(1)) == step]
    if step_name(step) in names:
        copies.append(step_name(step))
    for n in copies:
        try:
            dst = rename_aside(directory, os.path.join(directory, n), step, "deleting")
        except FileNotFoundError:
            continue
        # The un-commit is made durable before any of the copy's files goes: otherwise a power
        # loss could keep the name (and COMMIT) of a copy whose data files are already gone.
        fsync_dir(directory)
        discard_step(dst)
    if copies:
        logger.info("removed %s (keep_last)", os.path.join(directory, step_name(step)))


# ----------------------------------------------------------------------------- a manager step on a store


class RemoteStore:
    """``step-<N>/`` prefixes under an fsspec URL; see the module docstring."""

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        storage, root = open_storage(url, storage_options)
        if not isinstance(storage, FsspecStorage):  # pragma: no cover - callers pass URLs only
            raise UnsupportedError(f"checkpoint_dir {url!r} is not an fsspec URL")
        self.storage = storage
        self.url = url.rstrip("/")
        self.fs: Any = storage.fs
        self.root: str = root

    def url_of(self, rel: str) -> str:
        """The URL of ``rel`` below the checkpoint directory (what the saves write to)."""
        return f"{self.url}/{rel}"

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if self.root else rel

    def _prefixes(self) -> tuple[dict[int, str], dict[int, list[str]]]:
        """({N: ``step-<N>`` rel}, {N: [``.step-<N>.replacing-<id>`` rels]}), committed or not."""
        self.fs.invalidate_cache()  # listings may be cached (s3fs, gcsfs); we need the current state
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return {}, {}
        steps: dict[int, str] = {}
        replacing: dict[int, list[str]] = {}
        for n in names:
            base = posixpath.basename(str(n).rstrip("/"))
            m = STEP_RE.match(base)
            if m:
                steps[int(m.group(1))] = base
            r = REPLACING_RE.match(base)
            if r:
                replacing.setdefault(int(r.group(1)), []).append(base)
        for v in replacing.values():
            v.sort()
        return steps, replacing

    def _committed(self, rel: str) -> bool:
        return bool(self.fs.exists(self.path(f"{rel}/{COMMIT_NAME}")))

    def committed_prefixes(self) -> dict[int, str]:
        """{N: the prefix holding committed step N}: ``step-<N>``, else a committed replacement copy."""
        steps, replacing = self._prefixes()
        out = {s: rel for s, rel in steps.items() if self._committed(rel)}
        for s, rels in replacing.items():
            if s not in out:
                for rel in rels:
                    if self._committed(rel):
                        out[s] = rel
                        break
        return out

    def committed_steps(self) -> list[int]:
        return sorted(self.committed_prefixes())

    def read_latest(self) -> int | None:
        try:
            obj = json.loads(self.fs.cat_file(self.path(LATEST_NAME)))
            return int(obj["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put_bytes(self, rel: str, data: bytes, *, exclusive: bool = False) -> bool:
        """Write ``rel`` whole; with ``exclusive`` return False (nothing written) if it exists."""
        path = self.path(rel)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        return put_commit_point(self.storage, path, data, None, exclusive=exclusive)

    def _delete(self, rel: str) -> None:
        """Un-commit (delete ``COMMIT``), then delete the rest: a half-deleted copy is never committed."""
        path = self.path(rel)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(posixpath.join(path, COMMIT_NAME))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)

    def remove_step(self, step: int) -> None:
        """Delete every copy of ``step`` (``step-<N>`` and replacement copies), each ``COMMIT`` first."""
        steps, replacing = self._prefixes()
        for rel in [*replacing.get(step, []), *([steps[step]] if step in steps else [])]:
            self._delete(rel)
        logger.info("removed %s", f"{self.url}/step-{step}")

    def _promote(self, step: int, src: str) -> None:
        """Make the committed replacement copy ``src`` the directory ``step-<N>``; then delete ``src``.

        ``src`` stays committed until ``step-<N>/COMMIT`` is copied (last), so step N is committed
        at every instant.
        """
        dst = f"step-{step}"
        self._delete(dst)  # from here until its COMMIT is copied, ``src`` is step N
        base = self.path(src)
        rels = sorted(posixpath.relpath(str(p), base) for p in self.fs.find(base))
        if COMMIT_NAME not in rels:
            raise IncompleteCheckpointError(f"{self.url}/{src}: lost its COMMIT while being promoted")
        made: set[str] = set()
        for rel in [r for r in rels if r != COMMIT_NAME] + [COMMIT_NAME]:
            target = self.path(f"{dst}/{rel}")
            parent = posixpath.dirname(target)
            if parent not in made:
                self.fs.makedirs(parent, exist_ok=True)
                made.add(parent)
            self.fs.cp_file(posixpath.join(base, rel), target)
        self._delete(src)

    def prepare(self, step: int) -> str:
        """Rank 0, before uploading ``step``: tidy the store; returns the prefix to upload into.

        Finishes an interrupted replacement (a committed ``.step-<M>.replacing-*`` whose ``step-<M>``
        is not committed is promoted), deletes replacement copies made obsolete and every prefix
        without ``COMMIT``. Returns ``step-<N>``, or a new ``.step-<N>.replacing-<id>`` when step N
        is committed (it stays so until the new copy is committed).
        """
        steps, replacing = self._prefixes()
        for s, rels in replacing.items():
            keep = None
            if not (s in steps and self._committed(steps[s])):
                keep = next((rel for rel in rels if self._committed(rel)), None)
            for rel in rels:
                if rel != keep:
                    self._delete(rel)
            if keep is not None:
                logger.warning(
                    "%s/step-%s: finishing its replacement by %s (a save was interrupted)", self.url, s, keep
                )
                self._promote(s, keep)
        steps, _ = self._prefixes()
        target = f"step-{step}"
        for s, rel in steps.items():
            if self._committed(rel):
                if s == step:
                    target = work_name(step, "replacing")
                continue
            logger.info("removing %s/%s left by an interrupted save", self.url, rel)
            self._delete(rel)
        return target

    def commit(self, step: int, target: str, commit: bytes) -> None:
        """Rank 0, once every file is written to ``target``: ``COMMIT`` last, exclusively; promote
        a replacement copy; abort multipart uploads of killed saves begun before this commit."""
        if not self.put_bytes(f"{target}/{COMMIT_NAME}", commit, exclusive=True):
            raise CheckpointBusyError(
                f"{self.url}/{target}: another save committed step {step} first (its {COMMIT_NAME} "
                "exists); this save's files are left for the next save's cleanup"
            )
        if target != f"step-{step}":
            self._promote(step, target)
        with contextlib.suppress(OSError, ValueError):
            abort_dead_uploads(self.storage, self.root, self.path(f"{target}/{COMMIT_NAME}"))


# ----------------------------------------------------------------------------- a checkpoint of parts


#: ``.<name>.replaced-<12 hex digits>``: a checkpoint of parts renamed aside while the new one is
#: put in its place (where the kernel cannot swap two names), put back when a kill left no other.
_REPLACED_RE = re.compile(r"^\.(?P<base>.+)\.replaced-[0-9a-f]{12}$")


class PartsOutput:
    """A checkpoint made of parts (checkpoints in sub-directories, small files) and one commit
    file, replacing as one the checkpoint of the same name: a trainer's checkpoint directory
    (``integrations/``), written by one process or by every rank of a job.

    The parts are written below :attr:`root` (a path or a URL, as a save takes it:
    :meth:`location`); :meth:`commit` writes the commit file, last, and publishes; :meth:`abort`
    drops what was written. Which variant runs comes from the store (``Storage.atomic_rename``):

    - **a local directory**: :attr:`root` is a staged directory beside ``target``
      (:func:`temp_name`; a killed writer's is removed by the next one). :meth:`commit` makes
      every file and directory in it durable and swaps it with an existing ``target`` in one step
      (:func:`exchange`), or, where the kernel cannot swap, renames the old one aside
      (``.<name>.replaced-<id>``, put back by the next writer if a kill left no ``target``) and
      the new one in; the replaced one is deleted after. Readers see the old checkpoint or the new
      one, whole.
    - **an object store**, which cannot rename: the parts are written in place, under ``target``'s
      save lock (``store/lock.py``). The commit file of the checkpoint being replaced is deleted
      first, its other objects after: from then until :meth:`commit` the name holds no committed
      checkpoint (never a mix of the two). The new commit file is written last, with an exclusive
      PUT, only while the lock is still this writer's.
    """

    def __init__(self, target: str, commit_name: str, storage_options: dict[str, Any] | None = None) -> None:
        self.target = os.fspath(target)
        self.commit_name = commit_name
        self.storage, self.path = open_storage(self.target, url_options(self.target, storage_options))
        self._held = contextlib.ExitStack()
        self._fence: Fence | None = None
        #: where the parts are written: a staged local directory, or the target's URL
        self.root: str
        if self.storage.atomic_rename:
            self._begin_renaming()
        else:
            self._begin_in_place()

    def location(self, name: str) -> str:
        """The location of the part ``name`` (a sub-directory or a file below :attr:`root`)."""
        return join_location(self.root, name)

    # ---------------------------------------------------------------- a local directory
    def _begin_renaming(self) -> None:
        parent, base = os.path.split(self.path)
        makedirs_durable(parent)
        for entry in os.listdir(parent):
            m = _REPLACED_RE.match(entry)
            if m is None or m.group("base") != base:
                continue
            aside = os.path.join(parent, entry)
            if not os.path.lexists(self.path) and os.path.isfile(os.path.join(aside, self.commit_name)):
                logger.warning(
                    "%s: putting back its committed copy %s (a replacement was interrupted)", self.path, aside
                )
                os.rename(aside, self.path)
                fsync_dir(parent)
            else:
                _remove_tree(aside)
        clean_leftovers(parent, locked=False)
        self.root = temp_name(self.path)
        os.mkdir(self.root)

    def _commit_renaming(self, data: bytes) -> None:
        write_staged(os.path.join(self.root, self.commit_name), data)
        for d, _, _ in sorted(os.walk(self.root), reverse=True):  # deepest first, the root last
            fsync_dir(d)
        parent = os.path.dirname(self.path)
        old: str | None = None
        if not os.path.lexists(self.path):
            os.rename(self.root, self.path)
        elif exchange(self.root, self.path):
            old = self.root  # now the replaced checkpoint
        else:
            old = os.path.join(parent, f".{os.path.basename(self.path)}.replaced-{uuid.uuid4().hex[:12]}")
            os.rename(self.path, old)
            fsync_dir(parent)
            os.rename(self.root, self.path)
        fsync_dir(parent)
        if old is not None:
            _remove_tree(old)

    # ---------------------------------------------------------------- an object store
    def _begin_in_place(self) -> None:
        self.root = self.target.rstrip("/")
        self.storage.makedirs(self.path)
        self._fence = self._held.enter_context(save_lock(self.storage, self.path, new_save_id()))
        try:
            self.storage.remove([self.storage.join(self.path, self.commit_name)])  # un-commit first
            for name in self.storage.listdir(self.path):
                if name != LOCK_NAME:
                    self.storage.remove_tree(self.storage.join(self.path, name))
        except BaseException:
            self._held.close()
            raise

    def _commit_in_place(self, data: bytes) -> None:
        path = self.storage.join(self.path, self.commit_name)
        if not put_commit_point(self.storage, path, data, self._fence, exclusive=True):
            raise CheckpointBusyError(
                f"{self.root}/{self.commit_name} was written by another save while this one wrote; "
                "this save committed nothing"
            )

    # ---------------------------------------------------------------- both
    def commit(self, data: bytes) -> None:
        """Write the commit file ``data`` and publish the checkpoint (on failure, :meth:`abort`)."""
        try:
            if self.storage.atomic_rename:
                self._commit_renaming(data)
            else:
                self._commit_in_place(data)
        except BaseException:
            self.abort()
            raise
        self._held.close()

    def abort(self) -> None:
        """Drop what was written: the staged directory, or (while the lock is this writer's) the
        objects below ``target``; release the lock."""
        try:
            if self.storage.atomic_rename:
                _remove_tree(self.root)
            elif self._fence is not None and self._fence.holder() == "this save":
                for name in self.storage.listdir(self.path):
                    if name != LOCK_NAME:
                        self.storage.remove_tree(self.storage.join(self.path, name))
        finally:
            self._held.close()


def open_parts(
    target: str, commit_name: str, storage_options: dict[str, Any] | None = None, limit: int = 256 << 20
) -> tuple[str, bytes]:
    """``(location, commit file)`` of the committed checkpoint of parts at ``target``
    (:class:`PartsOutput`): ``target`` itself, or, where a replacement renaming the old copy aside
    was interrupted before the new one was in place, that copy. ``IncompleteCheckpointError``
    naming ``target`` when there is none (missing, a file, or a directory no writer committed);
    ``ValueError`` when the commit file is larger than ``limit``."""
    storage, path = open_storage(target, url_options(target, storage_options))
    names = storage.listdir(path)
    location = target
    if commit_name not in names and not names and storage.atomic_rename and not os.path.lexists(path):
        parent, base = os.path.split(path)
        for entry in storage.listdir(parent):
            m = _REPLACED_RE.match(entry)
            aside = os.path.join(parent, entry)
            if m is not None and m.group("base") == base and commit_name in storage.listdir(aside):
                location, path, names = aside, aside, [commit_name]
                break
    if commit_name not in names:
        if names or (storage.atomic_rename and os.path.isdir(path)):
            found = f"no {commit_name}; not a committed checkpoint"
        elif storage.atomic_rename and os.path.lexists(path):
            found = "found a file, not a checkpoint directory"
        else:
            found = "missing"
        raise IncompleteCheckpointError(f"{target}: {found}")
    return location, storage.read_bytes(storage.join(path, commit_name), limit=limit)


def remove_parts(target: str, commit_name: str, storage_options: dict[str, Any] | None = None) -> None:
    """Remove the checkpoint of parts at ``target``: its commit file first (a half-removed one is
    never committed), then the rest. A directory without the commit file is refused
    (``UnsupportedError``): nothing a writer of parts made is there to remove. A file at
    ``target`` (what another writer left under that name) is removed."""
    storage, path = open_storage(target, url_options(target, storage_options))
    names = [] if storage.atomic_rename and os.path.islink(path) else storage.listdir(path)
    if not names:
        storage.remove_tree(path)  # a file, a symbolic link, or nothing
        return
    if commit_name not in names:
        raise UnsupportedError(f"{target}: a directory without {commit_name}; refusing to remove it")
    storage.remove([storage.join(path, commit_name)])
    storage.remove_tree(path)


def _remove_tree(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        _unlink(path)


# ----------------------------------------------------------------------------- a tool output


def output_location(out: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> str:
    """The output ``out`` as a tool shows and returns it (a URL as given without a trailing
    slash, a local path absolute), refused before anything is read when it is in use: a local
    path holding a file or a non-empty directory (:func:`check_output`), a prefix holding any
    object (:meth:`StoreOutput.check`). ``storage_options`` apply to a URL only."""
    s = os.fspath(out)
    storage, _ = open_storage(s, url_options(s, storage_options))
    if storage.atomic_rename:
        return check_output(s)
    StoreOutput.check(s, url_options(s, storage_options))
    return s.rstrip("/")


def check_output(out: str) -> str:
    """Absolute output path; refuses a path holding a file or a non-empty directory.

    A directory holding only what killed saves left (staging files, a dead save's lock file)
    counts as empty: those leftovers are removed when the output is published.
    """
    p = os.path.abspath(out)
    if os.path.lexists(p) and not (os.path.isdir(p) and not os.path.islink(p) and only_leftovers(p)):
        raise OutputExistsError(f"{p} already exists and is not an empty directory; choose a new output path")
    return p


@contextlib.contextmanager
def _staged_output(out: str) -> Iterator[str]:
    """Yield a hidden temporary directory beside ``out``; publish it as ``out`` on success
    (:func:`output_sink`'s local directory).

    On any failure the temporary directory is removed, so a failed run leaves no ``out``.
    Every file written into it must already be fsynced; every directory below it is fsynced
    here (so the names of what sub-directories hold survive a power loss), and
    :func:`publish_directory` fsyncs the directory and its parent around the rename, and removes
    what killed runs left (in ``out``, and staging directories of dead processes beside it).
    """
    final = check_output(out)
    parent = os.path.dirname(final)
    makedirs_durable(parent)
    tmp = temp_name(final)
    os.mkdir(tmp)
    try:
        yield tmp
        for d, _, _ in sorted(os.walk(tmp), reverse=True):  # deepest first, tmp itself by publish
            if d != tmp:
                fsync_dir(d)
        try:
            publish_directory(tmp, final)
        except FileExistsError:
            raise OutputExistsError(
                f"{final} was filled by someone else while this run wrote; its output is discarded"
            ) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def publish_directory(staged_dir: str, final: str, *, fsync: bool = True) -> None:
    """Rename a fully written staging directory to ``final`` (absent, or empty but for leftovers).

    Leftovers in ``final`` (staged files of killed saves, a dead save's lock file) and staging
    directories of killed runs for the same ``final`` beside it are removed first.
    """
    parent = os.path.dirname(os.path.abspath(final))
    if fsync:
        fsync_dir(staged_dir)
    if os.path.isdir(final):
        if not only_leftovers(final):
            raise FileExistsError(errno.ENOTEMPTY, "output directory is not empty", final)
        for entry in os.listdir(final):
            p = os.path.join(final, entry)
            if entry == LOCK_NAME:
                if not take_unheld_lock(p, remove=True):
                    raise busy_error(final, p)
            elif os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                _unlink(p)
        os.rmdir(final)  # rename() would replace an empty directory too, but not on every OS
    os.rename(staged_dir, final)
    if fsync:
        fsync_dir(parent)
    clean_leftovers(parent, locked=False)


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
        from unickpt.store.storage_parts import SharedUpload, part_size_for

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
        #: where a part (:meth:`within`) lies below the output: its commit points are named from the top
        self._prefix = ""
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

    def within(self, sub: str) -> StoreOutput:
        """The sub-directory ``sub`` of this output (a run's ``step-<N>/model``): its files are
        this output's, under the same lock, its commit points among this output's (in the order
        given), removed by the same abort."""
        part = copy.copy(self)  # the lists of written files, uploads and commit points are shared
        part.url = f"{self.url}/{sub}"
        part.root = self.path(sub)
        part._prefix = f"{self._prefix}{sub}/"
        return part

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
        from unickpt.store.storage_parts import supports_shared_parts

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
        self._commits.append((self._prefix + name, data))

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
            if not put_commit_point(self.storage, self.path(name), data, None, exclusive=True):
                self._written.pop()  # someone else's: never removed by this run
                raise OutputExistsError(
                    f"{self.url}/{name} was written by someone else while this run wrote; its output is discarded"
                )

    @contextlib.contextmanager
    def writing(self, *, fsync: bool = True) -> Iterator[None]:
        """Nothing to make or lock while a checkpoint is written: the prefix's save lock is held
        by :func:`store_output`."""
        yield

    def commit_index(self, name: str, index: bytes, writer_commit: Callable[[bytes], None]) -> None:
        """A checkpoint's index ``name``: a commit point of the output (:meth:`commit_later`)."""
        self.commit_later(name, index)

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


@contextlib.contextmanager
def store_output(url: str, storage_options: dict[str, Any] | None = None) -> Iterator[StoreOutput]:
    """A :class:`StoreOutput` committed when the block ends, removed when it raises; the
    prefix's save lock is held meanwhile (module docstring)."""
    out = StoreOutput(url, storage_options)
    with save_lock(out.storage, out.root, new_save_id()) as held:
        out.fence = held
        try:
            yield out
            out.commit()
        except BaseException:
            out.abort()
            raise


class DirectoryOutput:
    """A tool's output written into the local directory ``root``: the staged directory of
    :func:`output_sink` (shown as ``url``, the final path), or a checkpoint directory written
    in place. The interface of :class:`StoreOutput` over a store that renames: files are written
    now, under the directory's save lock, and a checkpoint's index is committed by its writer
    (:func:`commit_directory`); the directory's rename is the output's commit point."""

    def __init__(self, root: str, url: str | None = None) -> None:
        self.root = root
        self.url = root if url is None else url
        self.storage: Storage = LocalStorage(root)

    def path(self, name: str) -> str:
        return self.storage.join(self.root, name)

    def within(self, sub: str) -> DirectoryOutput:
        """The sub-directory ``sub`` of this output, made (durably) when a file is first written
        into it; committed by the same rename."""
        return DirectoryOutput(self.path(sub), f"{self.url}/{sub}")

    def _file(self, name: str) -> str:
        """The path of ``name``, its directory made (durably) where missing."""
        path = self.path(name)
        if not os.path.isdir(os.path.dirname(path)):
            makedirs_durable(os.path.dirname(path))
        return path

    def track(self, name: str) -> str:
        """The path of ``name`` (a failed output is removed whole, by whoever staged it)."""
        return self.path(name)

    def open(self, name: str) -> StoreFile:
        """A data file written front to back; ``close(sf)`` makes it durable."""
        return StoreFile(self.storage.open_write(self._file(name)), name)

    def close(self, sf: StoreFile) -> None:
        self.storage.finish_write(sf.f)

    def open_head_last(self, name: str, size: int) -> HeadLastFile | None:
        """None: a file here is written at offsets, its header rewritten in place."""
        return None

    def put(self, name: str, data: bytes) -> None:
        """A small file (``config.json``, ...) written now, whole and durable."""
        write_staged(self._file(name), data)

    def commit_later(self, name: str, data: bytes | str | Callable[[], None]) -> None:
        """A commit point, written now (the directory's rename commits the output): bytes, the
        path of a local file, or a function completing it."""
        if callable(data):
            data()
            return
        if isinstance(data, str):
            with open(data, "rb") as f:
                data = f.read()
        atomic_write_bytes(self._file(name), data)

    @contextlib.contextmanager
    def writing(self, *, fsync: bool = True) -> Iterator[None]:
        """The directory made (durably with ``fsync``) and its save lock held while a checkpoint
        is written into it."""
        makedirs_durable(self.root, fsync=fsync)
        with directory_lock(self.root):
            yield

    def commit_index(self, name: str, index: bytes, writer_commit: Callable[[bytes], None]) -> None:
        """A checkpoint's index ``name``: committed now by its writer (``writer_commit``)."""
        writer_commit(index)


class Sink(Protocol):
    """A tool's output, wherever it goes: :class:`DirectoryOutput` (a store that renames) or
    :class:`StoreOutput` (an object store's prefix). Writers choose how to write from
    ``storage``'s capabilities (``range_write``, ``atomic_rename``), never from the type."""

    url: str
    root: str
    storage: Storage

    def path(self, name: str) -> str: ...

    def within(self, sub: str) -> Sink: ...

    def open(self, name: str) -> StoreFile: ...

    def close(self, sf: StoreFile) -> None: ...

    def track(self, name: str) -> str: ...

    def open_head_last(self, name: str, size: int) -> HeadLastFile | None: ...

    def put(self, name: str, data: bytes) -> None: ...

    def commit_later(self, name: str, data: bytes | str | Callable[[], None]) -> None: ...

    def writing(self, *, fsync: bool = True) -> contextlib.AbstractContextManager[None]: ...

    def commit_index(self, name: str, index: bytes, writer_commit: Callable[[bytes], None]) -> None: ...


def checkpoint_sink(target: str | Sink) -> Sink:
    """The sink a checkpoint is written to: ``target`` itself, or the local directory ``target``
    written in place (:class:`DirectoryOutput`)."""
    return DirectoryOutput(target) if isinstance(target, str) else target


@contextlib.contextmanager
def output_sink(out: str, storage_options: dict[str, Any] | None = None) -> Iterator[Sink]:
    """The sink of the output ``out`` (see the module docstring), committed when the block ends:
    a staged :class:`DirectoryOutput` where the store renames, else a :class:`StoreOutput`.
    ``storage_options`` apply to a URL only."""
    storage, _ = open_storage(out, url_options(out, storage_options))
    if storage.atomic_rename:
        with _staged_output(out) as tmp:
            yield DirectoryOutput(tmp, os.path.abspath(out))
        return
    with store_output(out, storage_options) as store:
        yield store
