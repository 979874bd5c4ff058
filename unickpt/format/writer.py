"""Writing a checkpoint, the mirror of ``reader.py`` (no torch).

Every path that writes checkpoint files goes through here: the save engine (``io/save.py``,
which keeps only the collective work), ``tools/_write.py`` (convert, hand-made layouts) and
``merge``. This module

- groups tensors into shard files (``group_files``, huggingface_hub's splitter);
- streams blocks into staged data files, hashing each block on a second thread while the
  next one is written (``write_files``);
- builds the index from what was written (``tensor_entry``, ``build_block``, ``build_index``);
- writes a single-file checkpoint, whose header carries the unickpt block: written first with
  same-length placeholders, rewritten once the data is hashed (``write_single_file``,
  ``rewrite_header``);
- and leaves staging names, save ids, the index's commit, superseding and cleanup to
  ``store.publish``.

``CheckpointWriter`` ties these together for one directory and one save id.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unickpt._faults import maybe_fail
from unickpt.format.dtypes import itemsize
from unickpt.format.hashing import combine_partials, finalize_fingerprint, hash_block
from unickpt.format.index import IndexFile, IndexMetadata, LayoutInfo, SliceEntry, TensorEntry, UnickptBlock
from unickpt.format.index_compact import compact_tensors
from unickpt.format.lazy_slices import LazySlices
from unickpt.format.naming import SLICED_SENTINEL, single_name
from unickpt.format.reader import UNICKPT_METADATA_KEY
from unickpt.format.safetensors_io import SafetensorsWriter, encode_header
from unickpt.format.slice_table import SliceTable
from unickpt.format.storage import Storage
from unickpt.store.lock import Fence
from unickpt.store.publish import (
    SAVE_ID_KEY,
    commit_directory,
    commit_single_file,
    commit_store_index,
    remove_superseded,
    temp_name,
)

__all__ = [
    "PLACEHOLDER",
    "Block",
    "CheckpointWriter",
    "FileSpec",
    "build_block",
    "build_index",
    "data_file_metadata",
    "group_files",
    "rewrite_header",
    "single_file_metadata",
    "tensor_entry",
    "write_all",
    "write_files",
    "write_single_file",
]

# Same length as a real xxh3-64 digest or fingerprint: a header written with it keeps its size.
PLACEHOLDER = "0" * 16

# (key, dtype, shape) of each block of one file, in file order.
TensorSpec = tuple[str, str, tuple[int, ...]]
# A data file to write: its name (in the target directory) and its blocks.
FileSpec = tuple[str, Sequence[TensorSpec]]
# One block to write: (key, C-order bytes as a numpy array, (global shape, offsets, shape)).
Block = tuple[str, np.ndarray, tuple[Sequence[int], Sequence[int], Sequence[int]]]
# What writing a block gives: (xxh3-64 digest or None, fingerprint partial).
Written = tuple[str | None, int]


# -------------------------------------------------------------- files
def group_files(sizes: Mapping[str, int], max_shard_size: int | str) -> list[list[str]]:
    """Group names (in order, with their byte sizes) into shard files, in file order.

    huggingface_hub's splitter, so that files split as Hugging Face's own saves split them
    (``max_shard_size`` in bytes or as "5GB"). Used by the save planner and by merge.
    """
    from huggingface_hub import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        dict(sizes),
        get_storage_size=lambda n: n,
        filename_pattern="shard{suffix}",
        max_shard_size=max_shard_size,
    )
    # The splitter's files follow insertion order; their names say their number.
    return [list(split.filename_to_tensors[f]) for f in sorted(split.filename_to_tensors, key=_shard_order)]


def _shard_order(fname: str) -> tuple[int, str]:
    digits = "".join(ch if ch.isdigit() else " " for ch in fname).split()
    return (int(digits[0]) if digits else 0, fname)


def data_file_metadata(sliced: bool, save_id: str) -> dict[str, str]:
    """The header metadata of a data file of a sharded or sliced checkpoint.

    Sliced files say so in their format tag: transformers refuses any format it does not know.
    Hugging Face loaders check only "format"; unickpt's reader checks the save id.
    """
    return {"format": "unickpt-sliced" if sliced else "pt", SAVE_ID_KEY: save_id}


def single_file_metadata(block: UnickptBlock | dict[str, Any], save_id: str) -> dict[str, str]:
    """The header metadata of a single-file checkpoint: the unickpt block travels in it."""
    dumped = block if isinstance(block, dict) else block.model_dump(mode="json", exclude_none=True)
    return {"format": "pt", UNICKPT_METADATA_KEY: json.dumps(dumped), SAVE_ID_KEY: save_id}


def write_all(fd: int, data: memoryview, pos: int) -> None:
    """pwrite all of ``data`` at ``pos`` (pwrite may write less than asked)."""
    done = 0
    n = data.nbytes
    while done < n:
        done += os.pwrite(fd, data[done:], pos + done)


def rewrite_header(
    fd: int,
    specs: Sequence[TensorSpec],
    old: Mapping[str, str],
    new: Mapping[str, str],
    *,
    fsync: bool = True,
) -> None:
    """Replace a file's header written with metadata ``old`` by the same header with ``new``.

    Only same-length values may change (placeholders replaced by hashes, a save id by
    another), so the data section stays where it is.
    """
    header0, _ = encode_header(list(specs), dict(old))
    header, _ = encode_header(list(specs), dict(new))
    if len(header) != len(header0):
        raise RuntimeError("internal: a header changed length after hashing")  # pragma: no cover
    write_all(fd, memoryview(header), 0)
    if fsync:
        os.fsync(fd)


def write_files(
    directory: str,
    files: Sequence[FileSpec],
    metadata_for: Callable[[str], Mapping[str, str]],
    blocks: Iterator[Block],
    *,
    hashes: bool = True,
    fingerprints: bool = True,
    fsync: bool = True,
    storage: Storage | None = None,
) -> dict[str, Written]:
    """Stream ``blocks`` (in file order) into ``files``; return each key's (xxh3, partial).

    Hashing of block i runs on a worker thread while block i is written and block i+1 is
    fetched and written (numpy, xxhash and file writes all release the GIL), so hashes cost
    little on top of the write; at most two blocks are alive at once. On any failure the
    files written so far are removed. With an object ``storage`` (``directory`` a location in
    it) each file is one streamed multipart upload, completed when the file is whole and
    aborted on failure (nothing of it becomes visible).
    """
    store = _object_store(storage)
    results: dict[str, Written] = {}
    written: list[str] = []
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unickpt-hash")
    # The hash of block i may finish while block i+1 is written: at most two blocks are alive.
    pending: collections.deque[tuple[str, Future[Written]]] = collections.deque()
    try:
        if store is not None:
            store.makedirs(directory)
        for fname, specs in files:
            path = os.path.join(directory, fname) if store is None else store.join(directory, fname)
            w = SafetensorsWriter(
                path, list(specs), dict(metadata_for(fname)), writeback=fsync, storage=store
            )
            written.append(path)
            try:
                for spec_key, dtype, _shape in specs:
                    key, arr, (gshape, off, shp) = next(blocks)
                    if key != spec_key:
                        raise RuntimeError(f"internal: expected block {spec_key!r}, got {key!r}")
                    fut = pool.submit(_hash, arr, gshape, off, shp, dtype, hashes, fingerprints)
                    w.write(key, memoryview(arr))  # type: ignore[arg-type]
                    maybe_fail("save.write")
                    pending.append((key, fut))
                    del arr
                    while len(pending) > 1:
                        done, older = pending.popleft()
                        results[done] = older.result()
                w.close(fsync=fsync)
            except BaseException:
                w.abort()
                raise
        while pending:
            done, older = pending.popleft()
            results[done] = older.result()
    except BaseException:
        if store is not None:
            store.remove(written)
        for p in written if store is None else []:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        raise
    finally:
        pool.shutdown(wait=True)
    return results


def _object_store(storage: Storage | None) -> Storage | None:
    """``storage`` when it is an object store (no rename); None for local files (today's path)."""
    return None if storage is None or storage.atomic_rename else storage


def _hash(
    arr: np.ndarray,
    gshape: Sequence[int],
    off: Sequence[int],
    shp: Sequence[int],
    dtype: str,
    hashes: bool,
    fingerprints: bool,
) -> Written:
    if not (hashes or fingerprints):
        return None, 0
    return hash_block(arr, itemsize(dtype), gshape, off, shp, xxh3=hashes, fingerprint=fingerprints)


# -------------------------------------------------------------- index
def tensor_entry(
    name: str,
    dtype: str,
    shape: Sequence[int],
    slices: list[SliceEntry] | SliceTable,
    partials: Iterable[int] | None,
    *,
    placeholder: bool = False,
    **extras: Any,
) -> TensorEntry:
    """A tensor's index entry; its fingerprint from the partials of its slices (None: no fingerprint).

    ``slices`` is a list of ``SliceEntry`` or, with no per-slice object, a ``SliceTable``;
    ``build_block`` writes either compactly.
    """
    fp = None
    if partials is not None:
        total = combine_partials(partials)
        fp = PLACEHOLDER if placeholder else finalize_fingerprint(name, dtype, shape, total)
    if isinstance(slices, SliceTable):
        entry = TensorEntry(dtype=dtype, shape=list(shape), fingerprint=fp, **extras)
        entry.__dict__["slices"] = LazySlices(slices)
        return entry
    return TensorEntry(dtype=dtype, shape=list(shape), fingerprint=fp, slices=slices, **extras)


def build_block(
    *,
    kind: str,
    created_by: str,
    layout: LayoutInfo,
    tensors: dict[str, TensorEntry],
    aliases: Mapping[str, str] | None,
    save_id: str | None,
    **extras: Any,
) -> UnickptBlock:
    """The unickpt block (``extras``: ``param_groups``, ``param_state`` ...), each tensor's slices
    described compactly (``index_compact``; a tensor with byte-range hashes stays listed)."""
    tensors, extras["files"] = compact_tensors(tensors)
    return UnickptBlock(
        kind=kind,  # type: ignore[arg-type]
        created_by=created_by,
        layout=layout,
        tensors=tensors,  # type: ignore[arg-type]
        aliases=dict(aliases or {}),
        save_id=save_id,
        **extras,
    )


def build_index(block: UnickptBlock, *, sliced: bool) -> IndexFile:
    """The index of ``block``: ``weight_map`` names each tensor's file, or the sentinel when sliced."""
    total = sum(t.nbytes for t in block.tensors.values())
    if sliced:
        weight_map = dict.fromkeys(block.tensors, SLICED_SENTINEL)
    else:
        weight_map = {name: t.table.file(0) for name, t in block.tensors.items()}
    # The block's models were validated as they were built; pydantic keeps model instances
    # as they are (no dump and re-validation of every slice, seconds at 10^5 slices).
    return IndexFile(metadata=IndexMetadata(total_size=total), weight_map=weight_map, unickpt=block)


# -------------------------------------------------------------- single file
def write_single_file(
    file_path: str,
    specs: Sequence[TensorSpec],
    blocks: Iterator[Block],
    make_block: Callable[[Mapping[str, Written], bool], UnickptBlock],
    *,
    kind: str,
    save_id: str,
    hashes: bool = True,
    fingerprints: bool = True,
    fsync: bool = True,
    storage: Storage | None = None,
    fence: Fence | None = None,
) -> dict[str, Written]:
    """One ``.safetensors`` file carrying the unickpt block in its header metadata.

    ``make_block(written, placeholder)`` builds the block from each key's (xxh3, partial). The
    header is written first with placeholder values of the same length as the real ones
    (``placeholder=True``), and rewritten once the data is hashed, in the staging file no
    reader opens; the file is then committed by ``store.publish.commit_single_file``. On an
    object ``storage`` (see :func:`_write_single_to_store`) the file is one upload, fenced by
    the save's lock ``fence`` (checked before the upload completes and before the removals).
    """
    store = _object_store(storage)
    if store is not None:
        return _write_single_to_store(
            store, file_path, specs, blocks, make_block, kind, save_id, hashes, fingerprints, fence
        )
    placeholder = {key: (PLACEHOLDER if hashes else None, 0) for key, _, _ in specs}
    meta0 = single_file_metadata(make_block(placeholder, True), save_id)
    tmp = temp_name(file_path, save_id)
    results = write_files(
        os.path.dirname(tmp),
        [(os.path.basename(tmp), specs)],
        lambda _f: meta0,
        blocks,
        hashes=hashes,
        fingerprints=fingerprints,
        fsync=fsync,
    )
    try:
        meta = single_file_metadata(make_block(results, False), save_id)
        fd = os.open(tmp, os.O_WRONLY)
        try:
            rewrite_header(fd, specs, meta0, meta, fsync=fsync)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    commit_single_file(file_path, tmp, kind, fsync=fsync)
    return results


def _write_single_to_store(
    store: Storage,
    file_path: str,
    specs: Sequence[TensorSpec],
    blocks: Iterator[Block],
    make_block: Callable[[Mapping[str, Written], bool], UnickptBlock],
    kind: str,
    save_id: str,
    hashes: bool,
    fingerprints: bool,
    fence: Fence | None = None,
) -> dict[str, Written]:
    """A single file on an object store: one multipart upload, visible whole once complete.

    Its header carries the block, hashes included, and an upload cannot be rewritten, so the
    blocks are hashed as they arrive and kept in memory until the header is known; then the
    file is uploaded front to back, each block released once sent. Committing it (the upload's
    completion) supersedes the kind's index and shard files, removed after it.
    """
    kept: collections.deque[tuple[str, np.ndarray]] = collections.deque()
    results: dict[str, Written] = {}
    for spec_key, dtype, _shape in specs:
        key, arr, (gshape, off, shp) = next(blocks)
        if key != spec_key:
            raise RuntimeError(f"internal: expected block {spec_key!r}, got {key!r}")
        results[key] = _hash(arr, gshape, off, shp, dtype, hashes, fingerprints)
        kept.append((key, arr))
        del arr
    meta = single_file_metadata(make_block(results, False), save_id)
    store.makedirs(posixpath.dirname(file_path))
    w = SafetensorsWriter(file_path, list(specs), meta, storage=store)
    try:
        while kept:
            key, arr = kept.popleft()
            w.write(key, memoryview(arr))  # type: ignore[arg-type]
            del arr
            maybe_fail("save.write")
        if fence is not None:  # the upload's completion is the commit
            fence.check(f"completing {file_path}")
        w.close(fsync=False)
    except BaseException:
        w.abort()
        raise
    directory, base = posixpath.split(file_path)
    if base == single_name(kind):
        remove_superseded(store, directory, kind, {base}, single=True, fence=fence)
    return results


# -------------------------------------------------------------- one checkpoint
@dataclass
class CheckpointWriter:
    """Writes the files of one checkpoint of ``kind`` into ``directory`` under one save id.

    ``write`` streams data files under their staging names (``store.publish.temp_name``);
    ``commit`` builds nothing itself: it writes the given index last through
    ``store.publish.commit_directory`` (staged index, un-commit of the previous checkpoint,
    renames, removal of superseded files and leftovers). The caller holds the directory lock.
    """

    directory: str
    kind: str
    save_id: str
    sliced: bool
    staged: dict[str, str] = field(default_factory=dict, init=False)  # final name -> staging path
    hashes: bool = True
    fingerprints: bool = True
    fsync: bool = True
    #: Where ``directory`` is; an object store writes each file under the name given (see
    #: ``store.publish``: the save's plan names them), nothing is staged or renamed.
    storage: Storage | None = None

    def staged_name(self, fname: str) -> str:
        """The staging path of data file ``fname`` (renamed into place by the commit)."""
        store = _object_store(self.storage)
        if store is not None:
            return store.join(self.directory, fname)
        return temp_name(os.path.join(self.directory, fname), self.save_id)

    def write(self, files: Sequence[FileSpec], blocks: Iterator[Block]) -> dict[str, Written]:
        """Stream ``blocks`` into ``files`` (final names; written under staging names locally,
        under the names given on an object store)."""
        store = _object_store(self.storage)
        names = [(f if store is not None else os.path.basename(self.staged_name(f)), s) for f, s in files]
        meta = data_file_metadata(self.sliced, self.save_id)
        results = write_files(
            self.directory,
            names,
            lambda _f: meta,
            blocks,
            hashes=self.hashes,
            fingerprints=self.fingerprints,
            fsync=self.fsync,
            storage=store,
        )
        self.staged.update({f: self.staged_name(f) for f, _ in files})
        return results

    def commit(self, index: bytes) -> None:
        """Write the index last and commit the staged files (``store.publish.commit_directory``;
        on an object store ``store.publish.commit_store_index``)."""
        store = _object_store(self.storage)
        if store is not None:
            commit_store_index(store, self.directory, self.kind, index, set(self.staged))
            return
        commit_directory(
            self.directory, self.kind, self.staged, index, save_id=self.save_id, fsync=self.fsync
        )
