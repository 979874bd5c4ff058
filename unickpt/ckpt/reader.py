"""Open a checkpoint from files alone: detect its layout, validate it, read and verify bytes.

No torch here. ``CheckpointReader`` is what ``load_model``, ``verify``, ``inspect``,
``merge`` and ``diff`` all stand on, so every one of them applies the same checks:

1. the index (or single file's header) parses against the schema and names only safe files;
2. every tensor's slices tile it exactly once (no gap, no overlap, nothing out of bounds);
3. every slice's key exists in its file with the recorded dtype and shape, and every
   file's header is itself valid (``validate_structure``);
4. optionally, every slice's bytes hash to the recorded xxh3-64 (``verify``).

Every read goes through the reader's ``Storage`` (``store/storage.py``: a ``LocalStorage`` for
a path, an ``FsspecStorage`` for a URL). A data file is opened once; its header and its bytes
are read through the same handle (locally one descriptor), and the save id in its header must be
the one the index records, so that a reader racing a save reads the old checkpoint, the new one,
or raises ``CheckpointChangedError``: never a mix (writers never modify a file in place, they
rename new files over old names, or commit a new index last).

Opening is here too: ``open_checkpoint`` for a local path or a URL. A location with an OS path
(``Storage.local_path``) is examined with the file system's own checks (what stands where a file
should be, another tool's checkpoint); otherwise ``locate`` finds what the location holds and
fetches the index bytes (one rank of a distributed load) and ``open_located`` parses them and
builds the reader (every rank). The modules below build blocks (``reader_blocks``), read through
a Storage (``reader_storage``) and check byte ranges (``range_hashes``); none of them imports
this one.
"""

from __future__ import annotations

import contextlib
import math
import os
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from unickpt.ckpt.consistency import check_block, check_keys_referenced
from unickpt.ckpt.dcp_hf import block_from_dcp_hf, dcp_hf_files
from unickpt.ckpt.foreign import foreign_dir
from unickpt.ckpt.range_hashes import has_hashes, slice_failures
from unickpt.ckpt.reader_blocks import (
    UNICKPT_METADATA_KEY,
    block_from_header,
    block_from_plain_index,
    file_kind,
    single_file_name,
)
from unickpt.ckpt.reader_checks import FileChecks
from unickpt.ckpt.reader_paths import hint_foreign, hint_other_files, not_regular
from unickpt.ckpt.reader_storage import (
    Prefetched,
    PrefetchedRead,
    fetch_index,
    iter_handle,
    no_path,
    open_header,
    read_into,
    read_runs,
)
from unickpt.ckpt.safetensors_io import SafetensorsHeader
from unickpt.ckpt.slice_spans import Spans, all_referenced, locate_all, slice_error
from unickpt.errors import (
    CheckpointChangedError,
    CheckpointFormatError,
    HeaderError,
    IncompleteCheckpointError,
    IndexFileError,
    IntegrityFailure,
)
from unickpt.spec.dtypes import itemsize
from unickpt.spec.hashing import SliceHasher
from unickpt.spec.index import (
    IndexFile,
    SliceEntry,
    TensorEntry,
    UnickptBlock,
    check_file_name,
    load_index,
    parse_index,
)
from unickpt.spec.naming import index_name, single_name
from unickpt.store.storage import LocalStorage, ReadHandle, Storage, open_storage

# file_kind, single_file_name and the metadata key live in reader_blocks; re-exported.
__all__ = [
    "CheckpointReader",
    "open_checkpoint",
    "Located",
    "locate",
    "open_located",
    "open_url",
    "single_file_name",
    "UNICKPT_METADATA_KEY",
    "describe",
    "file_kind",
]


@dataclass
class CheckpointReader(FileChecks):
    """A validated, read-only view of one checkpoint (model or optimizer)."""

    directory: str
    kind: str
    block: UnickptBlock
    index_path: str | None  # None for a single-file checkpoint
    has_unickpt_block: bool
    index: IndexFile | None = field(default=None, repr=False)  # the parsed index, if any
    # A single-file checkpoint opened by its path: that path, whatever the file is called, and the
    # name its slices use for it (the file's own name when it is a safe one).
    single_file: str | None = None
    single_slice_file: str | None = None
    # The store every file is read through (``ckpt/reader_storage.py``): ``directory`` and
    # ``index_path`` are locations in it (URLs on an object store). Left out, a LocalStorage.
    storage: Storage = field(default=None, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if not isinstance(self.storage, Storage):  # a reader built from local files alone (tools)
            self.storage = LocalStorage(self.directory)
        self._headers: dict[str, SafetensorsHeader] = {}
        self._handles: dict[str, ReadHandle] = {}
        self._prefetched: Prefetched | None = None  # while a load on a URL copies
        self.spans: dict[str, Spans] = {}  # tensor -> every slice's (offsets, lengths), once located
        self._file_slices = None  # data file -> slices the index puts there (``FileChecks``)

    # ----------------------------------------------------------------- paths and files
    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return self.block.tensors

    @property
    def files(self) -> list[str]:
        """The data files the slices name, sorted (from the slice tables: no per-slice object)."""
        return sorted({f for t in self.block.tensors.values() for f in t.table.distinct_files()})

    def file_path(self, name: str) -> str:
        if self.single_file is not None and name == self.single_slice_file:
            return self.single_file
        # locally, a symbolic link out of the directory is refused (format.confine; the HF cache's are not)
        where = self.index_path or self.directory
        return self.storage.confined(self.directory, check_file_name(name), where, "data file")

    def header(self, name: str) -> SafetensorsHeader:
        """The validated header of data file ``name``, which stays open for reading its bytes."""
        h = self._headers.get(name)
        if h is None:
            try:
                with self._vanishing(name):
                    h = self._open_data_file(name)
            except IncompleteCheckpointError as e:
                raise IncompleteCheckpointError(
                    f"{self.directory}: data file {name!r} named by the index is missing"
                ) from e
            try:
                self.check_same_save(name, h.metadata)
                self._check_entries(name, h)
            except (CheckpointChangedError, IndexFileError):
                self._close_file(name)
                raise
            self._headers[name] = h
        return h

    def _open_data_file(self, name: str) -> SafetensorsHeader:
        """Open data file ``name`` (kept open for its bytes) and validate its header."""
        handle, h = open_header(self.storage, self.file_path(name))
        self._handles[name] = handle
        return h

    def _close_file(self, name: str) -> None:
        handle = self._handles.pop(name, None)
        if handle is not None:
            handle.close()

    def pinned_path(self, name: str) -> str:
        """A path to the very file whose header :meth:`header` checked (``/proc/self/fd/N`` on
        Linux), for libraries that open files by name; the file's own name elsewhere.
        ``UnsupportedError`` on a store without OS paths (see :meth:`os_path`)."""
        got = self.os_path(name)
        if got is None:
            raise no_path(self.file_path(name))
        return got

    def os_path(self, name: str) -> str | None:
        """:meth:`pinned_path`, or None when data file ``name`` has no OS path (an object store)."""
        self.header(name)
        path = self.storage.local_path(self.file_path(name))
        fd = self._handles[name].descriptor()
        if path is None or fd is None:
            return None
        proc = f"/proc/self/fd/{fd}"
        return proc if os.path.exists(proc) else path

    @contextlib.contextmanager
    def _vanishing(self, name: str) -> Iterator[None]:
        """A data file gone (or cut short) after its header was read (a save replaced the checkpoint
        and deleted it) raises ``CheckpointChangedError`` when the committed index changed since this
        reader parsed it; otherwise the error stands."""
        try:
            yield
        except IncompleteCheckpointError:
            if self._index_changed():
                raise CheckpointChangedError(
                    f"{self.index_path}: data file {name!r} vanished while the checkpoint was read, "
                    "and the index is no longer the one read: a save replaced the checkpoint; load it again"
                ) from None
            raise

    def _index_changed(self) -> bool:
        """True when the index this reader parsed is no longer the committed one (or is gone)."""
        if self.index_path is None or self.block.save_id is None:
            return False
        try:
            now = parse_index(fetch_index(self.storage, self.index_path), self.index_path).unickpt
        except (OSError, ValueError, IncompleteCheckpointError):
            return True
        return now is None or now.save_id != self.block.save_id

    def read_handle(self, name: str) -> ReadHandle:
        """The read handle of data file ``name``, its header read and checked (the reader keeps it
        open: callers read through it, never close it). While a load's ranges are prefetched,
        reads they cover are served from memory."""
        self.header(name)
        handle = self._handles[name]
        return handle if self._prefetched is None else PrefetchedRead(handle, self._prefetched, name)

    def _read(self, name: str, offset: int, length: int, out: memoryview | None) -> memoryview:
        with self._vanishing(name):
            return read_into(self.read_handle(name), offset, length, out)

    def prefetch(self, wanted: dict[str, list[tuple[int, int]]], threads: int = 8) -> None:
        """On a store that fetches ahead (``Storage.fetch_ahead``, an object store): fetch these
        ``(absolute offset, length)`` ranges of each data file now, as coalesced requests all in
        flight; reads they cover are then served from memory until :meth:`drop_prefetched`. A
        no-op for local files (the page cache does this)."""
        if not self.storage.fetch_ahead:
            return
        if self._prefetched is None:
            self._prefetched = Prefetched()
        with self._vanishing(", ".join(sorted(wanted))):
            for name in wanted:
                self.header(name)
            self._prefetched.fetch({name: self._handles[name] for name in wanted}, wanted, threads)

    def drop_prefetched(self) -> None:
        self._prefetched = None

    def pin(self) -> None:
        """Open every data file now (headers checked, save ids matched): later reads need no name."""
        self.open_files(self.files)

    def open_files(self, names: list[str], threads: int = 8) -> None:
        """Open these data files now (headers checked, save ids matched); on a store that fetches
        ahead, ``threads`` at a time (each header is a round trip to the store)."""
        todo = [n for n in dict.fromkeys(names) if n not in self._headers]
        if not self.storage.fetch_ahead or len(todo) < 2:
            for name in todo:
                self.header(name)
            return
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(threads, len(todo)), thread_name_prefix="unickpt-open") as pool:
            list(pool.map(self.header, todo))

    def close(self) -> None:
        for handle in self._handles.values():
            handle.close()
        self._handles.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- validation
    def check_coverage(self) -> None:
        """Every tensor's slices tile it exactly once. Reads no data file."""
        for name, t in self.block.tensors.items():
            problem = t.table.coverage_problem()
            if problem:
                raise IndexFileError(f"{self.index_path or self.directory}: tensor {name!r}: {problem}")

    def validate_structure(self) -> None:
        """Coverage, plus every slice present in its file with the recorded dtype and shape, and
        (for a unickpt checkpoint) every key of every data file referenced by a slice.

        Reads every data file's header (small), no tensor data.
        """
        # Every header first: each bounds the slices the index puts in its file (``header``)
        # before the keys and arrays of all slices are built.
        self.open_files(self.files)
        self.check_coverage()
        matched = locate_all(self)  # every slice at once; raises naming the first bad one
        if self.has_unickpt_block and not all_referenced(self.header, self.files, matched):
            check_keys_referenced(self.block, self.files, self.header)

    def _check_slice(self, name: str, t: TensorEntry, s: SliceEntry) -> None:
        """The slice's key is in its file's (valid) header with the dtype and shape the index records
        (``slice_spans.slice_error``: the check and the wording of ``locate``, for one slice)."""
        err = slice_error(self.header(s.file), name, t.dtype, s.key, list(s.shape))
        if err is not None:
            raise err

    # ----------------------------------------------------------------- reading bytes
    def slice_location(self, s: SliceEntry) -> tuple[str, int, int]:
        """(absolute path, absolute offset, byte length) of one stored slice."""
        h = self.header(s.file)
        if s.key not in h.entries:
            raise HeaderError(f"{h.path}: key {s.key!r} named by the index is not in the file")
        off, n = h.absolute(s.key)
        return h.path, off, n

    def read_slice(self, s: SliceEntry, out: memoryview | None = None) -> memoryview:
        _, off, n = self.slice_location(s)
        return self._read(s.file, off, n, out)

    def read_bytes(
        self, s: SliceEntry, rel_offset: int, length: int, out: memoryview | None = None
    ) -> memoryview:
        """``length`` bytes starting ``rel_offset`` bytes into a stored slice."""
        _, off, n = self.slice_location(s)
        if rel_offset < 0 or rel_offset + length > n:
            raise HeaderError(f"{s.file}: read of {length} bytes at {rel_offset} outside slice {s.key!r}")
        return self._read(s.file, off + rel_offset, length, out)

    def read_runs(self, s: SliceEntry, runs: list[tuple[int, int]], out: memoryview) -> None:
        """Read runs ``(byte offset into the slice, length)`` of a stored slice back to back into
        ``out`` with one vectored read (``ReadHandle.readv``: locally a ``preadv`` per run, on an
        object store one coalesced batch of ranged requests)."""
        _, off, n = self.slice_location(s)
        for o, k in runs:
            if o < 0 or o + k > n:
                raise HeaderError(f"{s.file}: read of {k} bytes at {o} outside slice {s.key!r}")
        with self._vanishing(s.file):
            read_runs(self.read_handle(s.file), [(off + o, k) for o, k in runs], out)

    def iter_slice(self, s: SliceEntry, chunk: int = 16 << 20) -> Iterator[bytes]:
        _, off, n = self.slice_location(s)
        yield from iter_handle(self.read_handle(s.file), off, n, chunk)

    def hash_slice(self, s: SliceEntry) -> str:
        h = SliceHasher()
        for buf in self.iter_slice(s):
            h.update(buf)
        return h.hexdigest()

    def verify(
        self, names: list[str] | None = None, progress: Callable[[int], None] | None = None
    ) -> list[IntegrityFailure]:
        """Rehash every stored slice (of ``names``, default all). Returns the failures.

        A slice without a recorded hash (plain Hugging Face files) is skipped. ``progress``
        is called with the byte count of each slice checked.
        """
        failures: list[IntegrityFailure] = []
        for name in names if names is not None else list(self.block.tensors):
            t = self.block.tensors[name]
            for s in t.slices:
                if not has_hashes(s):  # xxh3, or ranges (docs/format.md 5.1)
                    continue
                try:
                    self._check_slice(name, t, s)
                    failures.extend(slice_failures(name, s, self.iter_slice(s)))
                except (IncompleteCheckpointError, CheckpointFormatError) as e:
                    # Missing or truncated file, edited header, key absent: report it with the rest.
                    failures.append(IntegrityFailure(name, s.file, s.key, s.xxh3 or "-", f"unreadable ({e})"))
                if progress is not None:
                    progress(math.prod(s.shape) * itemsize(t.dtype))
        return failures


def describe(reader: CheckpointReader) -> dict[str, Any]:
    """A plain-data summary (used by ``inspect --json``)."""
    b = reader.block
    return {
        "path": reader.index_path or reader.directory,
        "kind": b.kind,
        "layout": b.layout.model_dump(),
        "tensors": len(b.tensors),
        "total_bytes": sum(t.nbytes for t in b.tensors.values()),
    }


def open_checkpoint(
    path: str | os.PathLike[str],
    kind: str = "model",
    *,
    pin: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> CheckpointReader:
    """Open the checkpoint at ``path`` (a directory, an index file or a single .safetensors file).

    ``path`` may be a local path, a ``file://`` URL or an fsspec URL (``s3://...``, with
    ``storage_options`` for fsspec, else the store's own environment); a URL is read through
    ``store/storage.py`` with the same checks and errors, naming the URL.
    Raises ``IncompleteCheckpointError`` when there is no committed checkpoint there. With
    ``pin``, every data file is opened and matched to the index at once; when a save replaced
    the checkpoint meanwhile (``CheckpointChangedError``), the new one is opened instead, once.
    """
    storage, root = open_storage(path, storage_options)  # ConfigError: options for a local path
    local = storage.local_path(root)

    def reopen() -> CheckpointReader:
        if local is None:
            return open_url(path, kind, storage_options)
        return _open_checkpoint(storage, os.fspath(path).removeprefix("file://"), kind)

    r = reopen()
    if not pin:
        return r
    for attempt in range(2):
        try:
            r.pin()
            return r
        except CheckpointChangedError:
            r.close()
            if attempt:
                raise
        except BaseException:
            r.close()
            raise
        r = reopen()
    raise AssertionError("unreachable")  # pragma: no cover


def _open_checkpoint(storage: Storage, p: str, kind: str) -> CheckpointReader:
    """The reader of the location ``p`` of a storage with OS paths (``Storage.local_path``): what
    stands there is examined with the file system's own checks, every file read through ``storage``."""
    if os.path.lexists(p) and not os.path.isfile(p) and not os.path.isdir(p):
        raise (IndexFileError if p.endswith(".json") else HeaderError)(
            f"{p} is {not_regular(p)}, not a checkpoint file or directory"
        )
    if os.path.isfile(p) and p.endswith(".index.json"):
        directory = os.path.dirname(os.path.abspath(p))
        return _from_index(storage, p, directory, kind)
    if os.path.isfile(p):
        handle, h = open_header(storage, p)
        try:
            block, has = block_from_header(h, kind)
            if has:
                check_block(h.path, block, None)
        except BaseException:
            handle.close()
            raise
        file = single_file_name(p, kind)
        r = CheckpointReader(
            os.path.dirname(os.path.abspath(p)),
            kind,
            block,
            None,
            has,
            single_file=os.path.abspath(p),
            single_slice_file=file,
            storage=storage,
        )
        try:
            r.check_single_file(file, h)
        except BaseException:
            handle.close()
            raise
        r._headers[file] = h
        r._handles[file] = handle
        return r
    if os.path.isdir(p):
        idx = os.path.join(p, index_name(kind))
        if os.path.isfile(idx):
            return _from_index(storage, idx, p, kind)
        if os.path.lexists(idx):
            raise IndexFileError(f"{idx} is {not_regular(idx)}, not an index file")
        single = os.path.join(p, single_name(kind))
        if os.path.isfile(single):
            return _open_checkpoint(storage, single, kind)
        if os.path.lexists(single):
            raise HeaderError(f"{single} is {not_regular(single)}, not a safetensors file")
        shards = dcp_hf_files(p) if kind == "model" else []
        if shards:  # torch's HuggingFaceStorageWriter(save_distributed=True): see ckpt/dcp_hf.py
            r = CheckpointReader(p, kind, block_from_dcp_hf(p, shards), None, False, storage=storage)
            r.check_coverage()
            return r
        raise IncompleteCheckpointError(
            f"{p} holds no committed {kind} checkpoint: neither {index_name(kind)} nor {single_name(kind)} "
            "is present (an interrupted save leaves data files without an index; such a directory is "
            f"never loaded){hint_foreign(p) or hint_other_files(p)}"
        )
    raise IncompleteCheckpointError(f"no checkpoint at {p}: the path does not exist")


def _from_index(storage: Storage, idx_path: str, directory: str, kind: str) -> CheckpointReader:
    try:
        idx = load_index(idx_path)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{idx_path} vanished while being opened: a save into {directory} is replacing the "
            f"{kind} checkpoint; open it again once the save has finished"
        ) from None
    if idx.unickpt is None:
        block = block_from_plain_index(
            idx, directory, idx_path, kind, _header_of(storage, directory, idx_path)
        )
        return CheckpointReader(directory, kind, block, idx_path, False, idx, storage=storage)
    block = idx.unickpt
    if block.kind != kind:
        raise IndexFileError(f"{idx_path}: holds a {block.kind} checkpoint, expected a {kind} checkpoint")
    check_block(idx_path, block, idx.weight_map)
    return CheckpointReader(directory, kind, block, idx_path, True, idx, storage=storage)


def _header_of(storage: Storage, directory: str, where: str) -> Callable[[str], SafetensorsHeader]:
    """The validated header of a data file of ``directory`` named by the index ``where``."""

    def header_of(file: str) -> SafetensorsHeader:
        handle, h = open_header(
            storage, storage.confined(directory, check_file_name(file), where, "data file")
        )
        handle.close()
        return h

    return header_of


@dataclass(frozen=True)
class Located:
    """What a URL holds: an index (with its bytes) or a single safetensors file."""

    url: str  # the index or the single file
    directory: str
    index_bytes: bytes | None  # None for a single file


def _url_of(location: str | os.PathLike[str]) -> str:
    return os.fspath(location).rstrip("/")


def locate(
    location: str | os.PathLike[str], kind: str, storage_options: dict[str, Any] | None = None
) -> Located:
    """Find the checkpoint of ``kind`` at a URL and fetch its index (one request when it is there).

    A URL ending in ``.index.json`` is the index; one ending in ``.safetensors`` is a single
    file; anything else is a directory holding ``<kind>.safetensors.index.json`` or
    ``<kind>.safetensors``.
    """
    url = _url_of(location)
    storage, _ = open_storage(url, storage_options)
    if url.endswith(".index.json"):
        return Located(url, posixpath.dirname(url), fetch_index(storage, url))
    if url.endswith(".safetensors") and storage.exists(url):
        return Located(url, posixpath.dirname(url), None)
    idx = f"{url}/{index_name(kind)}"
    try:
        return Located(idx, url, fetch_index(storage, idx))
    except IncompleteCheckpointError:
        pass
    single = f"{url}/{single_name(kind)}"
    if storage.exists(single):
        return Located(single, url, None)
    other = foreign_dir(storage.listdir(url), lambda n: storage.listdir(f"{url}/{n}"))
    raise IncompleteCheckpointError(
        f"{url} holds no committed {kind} checkpoint: neither {index_name(kind)} nor {single_name(kind)} "
        "is present (an interrupted save leaves data files without an index; such a location is never loaded)"
        + ("" if other is None else f"; {other.hint(url)}")
    )


def open_located(
    located: Located, kind: str, storage_options: dict[str, Any] | None = None
) -> CheckpointReader:
    """The reader of what :func:`locate` found; parses the index bytes it carries."""
    storage, _ = open_storage(located.url, storage_options)
    if located.index_bytes is None:
        handle, h = open_header(storage, located.url)
        try:
            block, has = block_from_header(h, kind)
            if has:
                check_block(h.path, block, None)
        except BaseException:
            handle.close()
            raise
        file = single_file_name(located.url, kind)
        r = CheckpointReader(
            located.directory,
            kind,
            block,
            None,
            has,
            single_file=located.url,
            single_slice_file=file,
            storage=storage,
        )
        try:
            r.check_single_file(file, h)
        except BaseException:
            handle.close()
            raise
        r._headers[file] = h
        r._handles[file] = handle
        return r
    idx: IndexFile = parse_index(located.index_bytes, located.url)
    if idx.unickpt is None:
        header_of = _header_of(storage, located.directory, located.url)
        block = block_from_plain_index(idx, located.directory, located.url, kind, header_of)
        return CheckpointReader(located.directory, kind, block, located.url, False, idx, storage=storage)
    block = idx.unickpt
    if block.kind != kind:
        raise IndexFileError(f"{located.url}: holds a {block.kind} checkpoint, expected a {kind} checkpoint")
    check_block(located.url, block, idx.weight_map)
    return CheckpointReader(located.directory, kind, block, located.url, True, idx, storage=storage)


def open_url(
    location: str | os.PathLike[str], kind: str, storage_options: dict[str, Any] | None = None
) -> CheckpointReader:
    """``open_located(locate(...))``: the reader of a URL, opened by this process alone."""
    return open_located(locate(location, kind, storage_options), kind, storage_options)
