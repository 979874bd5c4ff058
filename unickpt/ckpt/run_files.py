"""Read-only access to a ``CheckpointManager`` run or step, on local disk or at a URL. No torch.

The run commands (``unickpt inspect``/``verify`` on a run or a step, ``tools/run.py``) see a run
through a :class:`RunFiles`: which directories and files exist, their sizes and times, and the
bytes of small files. The location is listed once, recursively, through its storage
(``Storage.tree``: a walk of a local directory, a few listing requests on a store however many
steps the run holds); existence, sizes and commit times come from that listing, and only the
small files a command asks for are read. Credentials and endpoints come from the store's
environment or fsspec's configuration (``--storage-option`` on the command line), as for every
other command on a URL.
"""

from __future__ import annotations

import datetime
import errno
import os
import posixpath

from unickpt.ckpt.safetensors_io import SafetensorsHeader
from unickpt.errors import HeaderError, IncompleteCheckpointError
from unickpt.store.storage import Tree, join_location, open_storage, shown_location

__all__ = ["RunFiles", "SMALL_FILE_LIMIT"]

#: Largest side file (a record, a JSON, a rank's train state) read whole by the run commands.
SMALL_FILE_LIMIT = 1 << 30


class RunFiles:
    """Files of a run directory or step directory ``location`` (a local path or a URL).

    Paths handed out and accepted are absolute local paths, or URLs below ``location``; what
    exists below it is listed once (``Storage.tree``), when first asked.
    """

    def __init__(self, location: str | os.PathLike[str]) -> None:
        self.root = shown_location(location)
        self.storage, _ = open_storage(self.root)
        self._tree: Tree | None = None

    # ------------------------------------------------------------------ paths
    def join(self, base: str, *parts: str) -> str:
        for p in parts:
            base = join_location(base, p)
        return base

    def basename(self, path: str) -> str:
        return posixpath.basename(path.rstrip("/"))

    def _listed(self) -> Tree:
        if self._tree is None:
            self._tree = self.storage.tree(self.root)
        return self._tree

    def _below(self, path: str) -> str:
        return self.storage.key(path) + "/"

    # ---------------------------------------------------------- what exists
    def is_file(self, path: str) -> bool:
        return self.storage.key(path) in self._listed().files

    def is_dir(self, path: str) -> bool:
        return self.storage.key(path) in self._listed().dirs

    def listdir(self, path: str) -> list[str]:
        """Names directly below ``path`` (files and directories); [] when it does not exist."""
        key, tree = self._below(path), self._listed()
        names = {k[len(key) :].split("/", 1)[0] for k in (*tree.files, *tree.dirs) if k.startswith(key)}
        return sorted(names)

    def file_count(self, path: str) -> int:
        """How many files lie below ``path`` (from the listing, nothing is read)."""
        key = self._below(path)
        return sum(1 for k in self._listed().files if k.startswith(key))

    def tree_size(self, path: str) -> int:
        """Bytes of the files below ``path`` (from the listing, nothing is read)."""
        key = self._below(path)
        return sum(size for k, (size, _) in self._listed().files.items() if k.startswith(key))

    def mtime_text(self, path: str) -> str:
        """When ``path`` was last written, as ``YYYY-MM-DD HH:MM:SS UTC`` (``?`` when unknown)."""
        when = self._listed().files.get(self.storage.key(path), (0, None))[1]
        if when is None:
            return "?"
        stamp = datetime.datetime.fromtimestamp(when, datetime.timezone.utc)
        return stamp.strftime("%Y-%m-%d %H:%M:%S UTC")

    # ---------------------------------------------------------------- reads
    def read_bytes(self, path: str, limit: int = SMALL_FILE_LIMIT) -> bytes:
        """The whole file; a missing one raises ``FileNotFoundError`` (an ``OSError``), a larger one
        than ``limit`` an ``OSError``."""
        try:
            return self.storage.read_bytes(self.storage.key(path), limit=limit)
        except IncompleteCheckpointError:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), path) from None
        except HeaderError as e:  # a directory, a FIFO, a link loop where a file should be
            raise OSError(errno.EINVAL, str(e), path) from None
        except ValueError:  # larger than limit
            raise OSError(errno.EFBIG, f"more than the {limit} bytes allowed for this file", path) from None

    def read_header(self, path: str) -> SafetensorsHeader:
        """The validated safetensors header of ``path`` (on a store: one or two ranged requests)."""
        from unickpt.ckpt.reader import open_header

        handle, header = open_header(self.storage, self.storage.key(path))
        handle.close()
        return header
