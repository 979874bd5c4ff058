"""Read-only access to a ``CheckpointManager`` run or step, on local disk or at a URL. No torch.

The run commands (``unickpt inspect``/``verify`` on a run or a step, ``tools/run.py``) see a run
through a :class:`RunFiles`: which directories and files exist, their sizes and times, and the
bytes of small files. On local disk these are ``os`` calls. At a URL (``s3://``, ``gs://``,
``memory://``...) the location is listed once, recursively, through ``store/storage.py`` (a few
listing requests however many steps the run holds); existence, sizes and commit times come from
that listing, and only the small files a command asks for are fetched. Credentials and endpoints
come from the store's environment or fsspec's configuration (``--storage-option`` on the command
line), as for every other command on a URL.
"""

from __future__ import annotations

import datetime
import errno
import os
import posixpath
from typing import Any

from unickpt.ckpt.safetensors_io import SafetensorsHeader, read_header
from unickpt.spec.bounds import read_bounded
from unickpt.store.storage import FsspecStorage, open_storage

__all__ = ["RunFiles", "SMALL_FILE_LIMIT", "run_location"]

#: Largest side file (a record, a JSON, a rank's train state) read whole by the run commands.
SMALL_FILE_LIMIT = 1 << 30


def run_location(location: str | os.PathLike[str]) -> str:
    """``location`` as the run commands name it: an absolute path where its storage has OS paths
    (``Storage.local_path``), the URL itself (no trailing ``/``) otherwise."""
    loc = os.fspath(location)
    storage, root = open_storage(loc)
    local = storage.local_path(root)
    return local if local is not None else loc.rstrip("/")


class RunFiles:
    """Files of a run directory or step directory ``location`` (a local path or a URL).

    Paths handed out and accepted are absolute local paths, or URLs below ``location``. Where the
    location's storage has OS paths (``Storage.local_path``), these are ``os`` calls; otherwise
    one recursive listing of the store answers them.
    """

    def __init__(self, location: str | os.PathLike[str]) -> None:
        loc = os.fspath(location)
        storage, root = open_storage(loc)
        local = storage.local_path(root)
        #: True where the files have OS paths (``os`` calls answer); False on an object store.
        self.local = local is not None
        self._listing: dict[str, dict[str, Any]] | None = None
        self._dirs: set[str] = set()
        if local is not None:
            self.root = local
            return
        self.root = loc.rstrip("/")
        if not isinstance(storage, FsspecStorage):  # never: only fsspec stores lack OS paths
            raise TypeError(f"{self.root}: not an fsspec location")
        self.storage = storage
        # What this command sees is the store now: no listing cached by an earlier call in
        # this process (fsspec keeps one per file system instance) may hide or show a COMMIT.
        storage.fs.invalidate_cache()

    # ------------------------------------------------------------------ paths
    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts) if self.local else posixpath.join(base, *parts)

    def basename(self, path: str) -> str:
        return (
            os.path.basename(os.path.normpath(path)) if self.local else posixpath.basename(path.rstrip("/"))
        )

    def _key(self, path: str) -> str:
        return str(self.storage.fs._strip_protocol(path)).rstrip("/")

    def _listed(self) -> dict[str, dict[str, Any]]:
        """Every object below the root (key without protocol -> info), listed once."""
        if self._listing is None:
            fs = self.storage.fs
            base = self._key(self.root)
            try:
                found = fs.find(base, detail=True)
            except FileNotFoundError:
                found = {}
            self._listing = {str(k).rstrip("/"): v for k, v in found.items() if v.get("type") != "directory"}
            for k in self._listing:
                parent = posixpath.dirname(k)
                while parent and parent not in self._dirs and len(parent) >= len(base):
                    self._dirs.add(parent)
                    parent = posixpath.dirname(parent)
        return self._listing

    # ---------------------------------------------------------- what exists
    def is_file(self, path: str) -> bool:
        if self.local:
            return os.path.isfile(path)
        return self._key(path) in self._listed()

    def is_dir(self, path: str) -> bool:
        if self.local:
            return os.path.isdir(path)
        self._listed()
        return self._key(path) in self._dirs

    def listdir(self, path: str) -> list[str]:
        """Names directly below ``path`` (files and directories); [] when it does not exist."""
        if self.local:
            try:
                return sorted(os.listdir(path))
            except (FileNotFoundError, NotADirectoryError):
                return []
        key = self._key(path) + "/"
        names = {k[len(key) :].split("/", 1)[0] for k in self._listed() if k.startswith(key)}
        return sorted(names)

    def file_count(self, path: str) -> int:
        """How many files lie below ``path`` (at a URL: from the listing, nothing is read)."""
        if self.local:
            return sum(len(files) for _dirpath, _dirs, files in os.walk(path))
        key = self._key(path) + "/"
        return sum(1 for k in self._listed() if k.startswith(key))

    def tree_size(self, path: str) -> int:
        """Bytes of the files below ``path`` (at a URL: from the listing, nothing is read)."""
        if self.local:
            total = 0
            for dirpath, _dirs, files in os.walk(path):
                for f in files:
                    try:
                        total += os.lstat(os.path.join(dirpath, f)).st_size
                    except OSError:
                        continue
            return total
        key = self._key(path) + "/"
        return sum(int(v.get("size") or 0) for k, v in self._listed().items() if k.startswith(key))

    def mtime_text(self, path: str) -> str:
        """When ``path`` was last written, as ``YYYY-MM-DD HH:MM:SS UTC`` (``?`` when unknown)."""
        if self.local:
            when = datetime.datetime.fromtimestamp(os.stat(path).st_mtime, datetime.timezone.utc)
        else:
            info = self._listed().get(self._key(path), {})
            raw = (
                info.get("LastModified")
                or info.get("mtime")
                or info.get("last_modified")
                or info.get("created")
            )
            if isinstance(raw, (int, float)):
                when = datetime.datetime.fromtimestamp(raw, datetime.timezone.utc)
            elif isinstance(raw, datetime.datetime):
                when = raw if raw.tzinfo else raw.replace(tzinfo=datetime.timezone.utc)
            else:
                return "?"
        return when.astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")

    # ---------------------------------------------------------------- reads
    def read_bytes(self, path: str, limit: int = SMALL_FILE_LIMIT) -> bytes:
        """The whole file; a missing one raises ``FileNotFoundError`` (an ``OSError``) either way."""
        if self.local:
            return read_bounded(path, limit)
        size = int(self._listed().get(self._key(path), {}).get("size") or 0)
        if size > limit:
            raise OSError(f"{path} is {size} bytes, more than the {limit} allowed for this file")
        try:  # one GET (its size is known from the listing)
            return bytes(self.storage.fs.cat_file(path))
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None

    def read_header(self, path: str) -> SafetensorsHeader:
        """The validated safetensors header of ``path`` (at a URL: one or two ranged requests)."""
        if self.local:
            return read_header(path)
        from unickpt.ckpt.reader import open_header

        handle, header = open_header(self.storage, path)
        handle.close()
        return header
