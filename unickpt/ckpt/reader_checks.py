"""What a ``CheckpointReader`` (whose base class this is) checks of each data file against its index.

- the file is of the save the index records (:meth:`FileChecks.check_same_save`);
- it has room for the slices the index stores in it (the bounds of ``spec/bounds.py``),
  checked as its header is read (:meth:`FileChecks._check_entries`, called by
  ``CheckpointReader.header``), before any per-slice key or array of those slices is built;
- a single file holds the slices and bytes its block declares; tools that read no header
  (``inspect``) check the index against the files' sizes (:meth:`FileChecks.check_capacity`).
"""

from __future__ import annotations

from collections.abc import Callable

from unickpt.ckpt.reader_paths import regular_size
from unickpt.ckpt.safetensors_io import SafetensorsHeader
from unickpt.errors import CheckpointChangedError, IndexFileError
from unickpt.spec.bounds import capacity_problem, entries_problem, slices_per_file
from unickpt.spec.index import UnickptBlock
from unickpt.store.publish import SAVE_ID_KEY
from unickpt.store.storage import Storage

__all__ = ["FileChecks", "shown"]


def shown(v: object) -> str:
    """A name, key or shape from a file as a message shows it: repr, escaped, cut to 80 characters
    (a name can be a megabyte long)."""
    r = ascii(v) if isinstance(v, str) else repr(v)
    return r if len(r) <= 80 else f"{r[:77]}..."


class FileChecks:
    """What a reader checks of each data file against its index: its save, its room for slices."""

    # Set by CheckpointReader.
    block: UnickptBlock
    directory: str
    has_unickpt_block: bool
    index_path: str | None
    single_file: str | None
    storage: Storage
    _headers: dict[str, SafetensorsHeader]
    _file_slices: dict[str, int] | None

    def file_path(self, name: str) -> str:  # pragma: no cover - CheckpointReader's
        raise NotImplementedError

    def _index_changed(self) -> bool:  # pragma: no cover - CheckpointReader's
        raise NotImplementedError

    def check_same_save(self, name: str, metadata: dict[str, str] | None) -> None:
        """Raise ``CheckpointChangedError`` unless ``metadata`` (a header's) is of this checkpoint's save."""
        found = (metadata or {}).get(SAVE_ID_KEY)
        # A file that names no save (older writers, edited metadata) is not refused: every writer
        # of this version names its save. A unickpt index without a save id (older writers) never
        # names a file that has one; a plain Hugging Face index says nothing about saves.
        if found is not None and found != self.block.save_id and self.has_unickpt_block:
            raise CheckpointChangedError(
                f"{self.file_path(name)}: written by save {found}, but the index "
                f"{self.index_path or self.directory} records "
                f"{'save ' + self.block.save_id if self.block.save_id else 'no save id'}: a save "
                "replaced the checkpoint while it was read; load it again"
            )

    def _check_entries(self, name: str, h: SafetensorsHeader) -> None:
        """The slices the index stores in data file ``name`` fit the entries its size leaves room
        for: checked as the header is read, before any per-slice key or array is built (fewer
        entries than that are the per-slice checks' to name: a key the file lacks)."""
        if self._file_slices is None:
            self._file_slices = slices_per_file(self.block.tensors)
        self._refuse(entries_problem(name, self._file_slices.get(name, 0), h.file_size, h.path))

    def file_size(self, name: str) -> int | None:
        """Data file ``name``'s size; None where it is not known without opening the file (a store
        without OS paths, before its header is read) or when it is not a regular file (reading its
        header says what it is)."""
        h = self._headers.get(name)
        if h is not None:
            return h.file_size
        path = self.storage.local_path(self.file_path(name))
        return None if path is None else regular_size(path)

    def check_single_file(self, name: str, h: SafetensorsHeader) -> None:
        """A single file's block stores no more slices and bytes in it than it can hold."""
        self._check_entries(name, h)
        self.check_capacity(lambda f: h.file_size if f == name else None)

    def check_capacity(self, size_of: Callable[[str], int | None], with_bytes: bool = True) -> None:
        """The index declares no more slices (and, ``with_bytes``, bytes) than its data files, of
        the sizes ``size_of`` gives (None: unknown), can hold."""
        self._refuse(capacity_problem(self.block.tensors, size_of, with_bytes))

    def _refuse(self, problem: str | None) -> None:
        """``IndexFileError`` naming the index for ``problem``; ``CheckpointChangedError`` when a
        save replaced the index since it was read (the files are then another save's)."""
        if problem is None:
            return
        if self._index_changed():
            raise CheckpointChangedError(
                f"{self.index_path}: the data files do not match the index, which is no longer the one "
                "read: a save replaced the checkpoint; load it again"
            )
        raise IndexFileError(f"{self.index_path or self.single_file or self.directory}: {problem}")
