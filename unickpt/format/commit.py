"""Durable, atomic file operations: the only place that decides when bytes are committed.

Every save into a local directory (``io/save.py``, ``tools/_write.py``, ``merge``, ``convert``)
stages its files under hidden temporary names (:func:`temp_name`) and then calls one of:

- :func:`commit_directory` (sharded or sliced layout): stage the index, un-commit the previous
  checkpoint of the kind (remove its index or single file), rename the staged data files into
  place, rename the index into place (the commit), remove superseded data files, clean leftovers;
- :func:`commit_single_file`: remove the kind's index, rename the staged file into place (the
  commit), remove superseded shard files, clean leftovers;
- :func:`publish_directory` (merge, convert): rename a whole staged directory into place.

No file a reader may have open is ever modified: a new file is written and renamed over the old
name, so a reader holding the old file keeps reading the old save's bytes. See docs/format.md,
section 6, for what a reader sees at every instant.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import stat
import sys
import uuid
from collections.abc import Callable, Iterable, Mapping

from unickpt.format.commit_lock import LOCK_NAME, busy_error, directory_lock, take_unheld_lock
from unickpt.format.naming import index_name, is_own_data_file, single_name

__all__ = [
    "fsync_dir",
    "makedirs_durable",
    "atomic_write_bytes",
    "temp_name",
    "parse_temp_name",
    "new_save_id",
    "content_save_id",
    "SAVE_ID_KEY",
    "write_staged",
    "commit_directory",
    "prepare_commit",
    "place_staged",
    "finish_commit",
    "commit_single_file",
    "discard",
    "clean_leftovers",
    "publish_directory",
    "only_leftovers",
    "directory_lock",
    "start_writeback",
    "Writeback",
    "LOCK_NAME",
]

_KINDS = ("model", "optimizer")


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


_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait
_sync_file_range: Callable[[int, int, int, int], int] | None = None
_sync_file_range_loaded = False


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

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


# ----------------------------------------------------------------------------- commits
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


def write_staged(path: str, data: bytes, *, fsync: bool = True) -> None:
    """Write ``data`` to the staging file ``path`` (a :func:`temp_name`), durably when ``fsync``."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if fsync:
            os.fsync(f.fileno())


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
