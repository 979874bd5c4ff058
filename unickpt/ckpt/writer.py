"""Writing a checkpoint, the mirror of ``reader.py`` (no torch).

Every path that writes checkpoint files goes through here: the save engine (``io/save.py``,
which keeps only the collective work), ``tools/_write.py`` (convert, hand-made layouts) and
``merge``. This module

- groups tensors into shard files (``group_files``, huggingface_hub's splitter);
- streams blocks into staged data files, hashing each block on a second thread while the
  next one is written (``write_files``);
- builds the index from what was written (``tensor_entry``, ``build_block``, ``build_index``);
- writes a single-file checkpoint, whose header carries the unickpt block: on a store that
  writes at offsets (``Storage.range_write``) written first with same-length placeholders and
  rewritten in place once the data is hashed (``write_single_file``, ``rewrite_header``); on
  one that cannot, hashed first and written front to back;
- and leaves staging names, save ids, the index's commit, superseding and cleanup to
  ``store.publish``.

``CheckpointWriter`` ties these together for one directory and one save id.

Every file goes through a :class:`~unickpt.store.storage.Storage` (a ``LocalStorage`` for a
path when none is given); what the store can do picks the strategy: ``range_write`` the in-place
header rewrite, ``atomic_rename`` staging names and renames (``store.publish``) rather than final
names and an index written last (``store.publish``).
"""

from __future__ import annotations

import collections
import json
import os
import posixpath
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unickpt._faults import maybe_fail
from unickpt.ckpt.reader import UNICKPT_METADATA_KEY
from unickpt.ckpt.safetensors_io import SafetensorsWriter, encode_header
from unickpt.spec.dtypes import itemsize
from unickpt.spec.hashing import combine_partials, finalize_fingerprint, hash_block
from unickpt.spec.index import (
    IndexFile,
    IndexMetadata,
    LayoutInfo,
    TensorEntry,
    UnickptBlock,
    compact_tensors,
)
from unickpt.spec.naming import SLICED_SENTINEL, single_name
from unickpt.spec.slice_table import SliceTable
from unickpt.store.lock import Fence
from unickpt.store.publish import (
    SAVE_ID_KEY,
    commit_directory,
    commit_single_file,
    commit_store_index,
    remove_superseded,
    temp_name,
)
from unickpt.store.storage import LocalStorage, RangeFile, Storage, pwrite_all

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
    pwrite_all(fd, data, pos)


def rewrite_header(
    fd: int | RangeFile,
    specs: Sequence[TensorSpec],
    old: Mapping[str, str],
    new: Mapping[str, str],
    *,
    fsync: bool = True,
) -> None:
    """Replace a file's header written with metadata ``old`` by the same header with ``new``.

    Only same-length values may change (placeholders replaced by hashes, a save id by
    another), so the data section stays where it is. ``fd``: a descriptor, or a file a store
    opened for range writes (``Storage.open_range``).
    """
    header0, _ = encode_header(list(specs), dict(old))
    header, _ = encode_header(list(specs), dict(new))
    if len(header) != len(header0):
        raise RuntimeError("internal: a header changed length after hashing")  # pragma: no cover
    if isinstance(fd, int):
        write_all(fd, memoryview(header), 0)
        if fsync:
            os.fsync(fd)
        return
    fd.pwrite(header, 0)
    if fsync:
        fd.sync()


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
    files written so far are removed. Files are written through ``storage`` (``directory`` a
    location in it; local files when None): on an object store each file is one streamed
    multipart upload, completed when the file is whole and aborted on failure (nothing of it
    becomes visible).
    """
    store = storage if storage is not None else LocalStorage(directory)
    results: dict[str, Written] = {}
    written: list[str] = []
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unickpt-hash")
    # The hash of block i may finish while block i+1 is written: at most two blocks are alive.
    pending: collections.deque[tuple[str, Future[Written]]] = collections.deque()
    try:
        store.makedirs(directory)
        for fname, specs in files:
            path = store.join(directory, fname)
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
        store.remove(written)
        raise
    finally:
        pool.shutdown(wait=True)
    return results


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
    slices: SliceTable,
    partials: Iterable[int] | None,
    *,
    placeholder: bool = False,
    **extras: Any,
) -> TensorEntry:
    """A tensor's index entry over its slice table (``SliceColumns`` builds one); its fingerprint
    from the partials of its slices (None: no fingerprint). ``build_block`` writes it compactly."""
    fp = None
    if partials is not None:
        total = combine_partials(partials)
        fp = PLACEHOLDER if placeholder else finalize_fingerprint(name, dtype, shape, total)
    return TensorEntry.of_table(dtype, shape, slices, fingerprint=fp, **extras)


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
    described compactly (``index.compact_tensors``; a tensor with byte-range hashes stays listed)."""
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

    ``make_block(written, placeholder)`` builds the block from each key's (xxh3, partial). On a
    store with ``atomic_rename`` (local files when ``storage`` is None) the file is staged and
    committed by ``store.publish.commit_single_file``; where the store also has ``range_write``
    the header is written first with placeholder values of the same length as the real ones
    (``placeholder=True``) and rewritten in place once the data is hashed, in the staging file no
    reader opens (the blocks stream through, two alive at most); without, the blocks are hashed
    first (:func:`_write_hashed_first`). On a store without rename the file is one upload under
    its final name, its completion the commit, fenced by the save's lock ``fence`` (checked before
    the upload completes and before the removals of what it supersedes).
    """
    store = storage if storage is not None else LocalStorage(os.path.dirname(file_path))
    if not store.atomic_rename:
        store.makedirs(posixpath.dirname(file_path))
        results = _write_hashed_first(
            store, file_path, specs, blocks, make_block, save_id, hashes, fingerprints, False, fence
        )
        directory, base = posixpath.split(file_path)
        if base == single_name(kind):
            remove_superseded(store, directory, kind, {base}, single=True, fence=fence)
        return results
    tmp = temp_name(file_path, save_id)
    if not store.range_write:
        results = _write_hashed_first(
            store, tmp, specs, blocks, make_block, save_id, hashes, fingerprints, fsync
        )
        commit_single_file(file_path, tmp, kind, fsync=fsync)
        return results
    placeholder = {key: (PLACEHOLDER if hashes else None, 0) for key, _, _ in specs}
    meta0 = single_file_metadata(make_block(placeholder, True), save_id)
    results = write_files(
        os.path.dirname(tmp),
        [(os.path.basename(tmp), specs)],
        lambda _f: meta0,
        blocks,
        hashes=hashes,
        fingerprints=fingerprints,
        fsync=fsync,
        storage=store,
    )
    try:
        meta = single_file_metadata(make_block(results, False), save_id)
        f = store.open_range(tmp)
        try:
            rewrite_header(f, specs, meta0, meta, fsync=fsync)
        finally:
            f.close()
    except BaseException:
        store.remove([tmp])
        raise
    commit_single_file(file_path, tmp, kind, fsync=fsync)
    return results


def _write_hashed_first(
    store: Storage,
    path: str,
    specs: Sequence[TensorSpec],
    blocks: Iterator[Block],
    make_block: Callable[[Mapping[str, Written], bool], UnickptBlock],
    save_id: str,
    hashes: bool,
    fingerprints: bool,
    fsync: bool,
    fence: Fence | None = None,
) -> dict[str, Written]:
    """A single file on a store that cannot rewrite its header in place (an upload, written
    front to back once): its header carries the block, hashes included, so the blocks are
    hashed as they arrive and kept in memory until the header is known; then the file is written
    front to back, each block released once sent. ``fence`` is checked before the file is made
    whole (on an object store the upload's completion is the commit).
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
    w = SafetensorsWriter(path, list(specs), meta, writeback=fsync, storage=store)
    try:
        while kept:
            key, arr = kept.popleft()
            w.write(key, memoryview(arr))  # type: ignore[arg-type]
            del arr
            maybe_fail("save.write")
        if fence is not None:  # the upload's completion is the commit
            fence.check(f"completing {path}")
        w.close(fsync=fsync)
    except BaseException:
        w.abort()
        raise
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
    #: Where ``directory`` is (a ``LocalStorage`` for local files). A store without
    #: ``atomic_rename`` (an object store) writes each file under the name given (see
    #: ``store.publish``: the save's plan names them), nothing is staged or renamed.
    storage: Storage = field(kw_only=True)

    def staged_name(self, fname: str) -> str:
        """The path data file ``fname`` is written at: its staging name where the store renames
        (renamed into place by the commit), else its name."""
        if not self.storage.atomic_rename:
            return self.storage.join(self.directory, fname)
        return temp_name(self.storage.join(self.directory, fname), self.save_id)

    def write(self, files: Sequence[FileSpec], blocks: Iterator[Block]) -> dict[str, Written]:
        """Stream ``blocks`` into ``files`` (final names; written under staging names where the
        store renames, else under the names given)."""
        store = self.storage
        names = [(posixpath.basename(self.staged_name(f)) if store.atomic_rename else f, s) for f, s in files]
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
        on a store without rename ``store.publish.commit_store_index``)."""
        store = self.storage
        if not store.atomic_rename:
            commit_store_index(store, self.directory, self.kind, index, set(self.staged))
            return
        commit_directory(
            self.directory, self.kind, self.staged, index, save_id=self.save_id, fsync=self.fsync
        )
