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

Opening is here too, one way for a local path and a URL: ``locate`` asks the location's
``Storage`` what stands under the names a checkpoint goes by (``Storage.what``: a file, a
directory, nothing, or what else: a FIFO, a dangling link), and fetches the index bytes where
one rank of a distributed load does it for all; ``open_located`` reads and parses the index
and builds the reader (every rank); ``open_checkpoint`` is the two. The sections below: what
the parts of an index must agree on, the blocks a reader builds itself, reads through the
Storage, per-range hashes, what a location holds instead of a checkpoint, and what the reader
checks of each data file.

That the parts of a checkpoint agree with each other, not only with the schema.

The schema says each field is well formed; these say the index tells one story:

- no two slices name the same stored key (``check_unique_slices``): a duplicated row would be
  loaded twice, and merge and diff would call it fine;
- in a gathered checkpoint, ``weight_map`` (what Hugging Face loaders read) names exactly the
  tensors of the unickpt block (what unickpt verifies), each in the file that stores it whole
  under its own name; in a sliced one, every entry points at the sentinel
  (``check_weight_map``, ``check_gathered``);
- every key in a data file is referenced by a slice (``check_keys_referenced``): a key nothing
  references is a tensor Hugging Face loaders would read and unickpt never verified;
- optimizer tensors are named ``state.<param>.<state>`` after their ``param`` and ``state``.

Each failure is an ``IndexFileError`` naming the file, the tensor and what disagrees. These
run on every open (index-only checks) or with the headers (``check_keys_referenced``), so
``load_model`` refuses such an index before it copies anything, and ``verify`` reports it.

Blocks a reader builds for itself: from a single file's header metadata, from a plain Hugging
Face index, and what kind of checkpoint a file is (``file_kind``).

No file handle is kept here: each function reads what it needs and returns plain values.

What a ``CheckpointReader`` (whose base class this is) checks of each data file against its index.

- the file is of the save the index records (:meth:`FileChecks.check_same_save`);
- it has room for the slices the index stores in it (the bounds of ``spec/untrusted.py``),
  checked as its header is read (:meth:`FileChecks._check_entries`, called by
  ``CheckpointReader.header``), before any per-slice key or array of those slices is built;
- a single file holds the slices and bytes its block declares; tools that read no header
  (``inspect``) check the index against the files' sizes (:meth:`FileChecks.check_capacity`).

The reader's access to data files through a Storage: headers, index and ranged reads.

Every checkpoint is read through ``store/storage.py``: a local directory through a
``LocalStorage`` (descriptors, ``pread``/``preadv`` straight into the caller's buffers), an
``s3://``, ``gs://``, ``memory://``... location through an ``FsspecStorage`` (exact ranged
requests, neighbouring ones coalesced and several in flight). The checks are the same (strict
header validation, save ids matched to the index, the same error classes), and every message
names the file or URL. No torch here.

A data file is opened once: its size is fixed at open, its header is read with one ranged
read (``HEADER_PROBE`` bytes; a second one when the header is longer), and its tensor bytes
through the same handle. On a store that fetches ahead (``Storage.fetch_ahead``), the ranges a
load will read are fetched first (:class:`Prefetched`) and the reads they cover are served from
memory (:class:`PrefetchedRead`).

Below the reader: nothing here builds a ``CheckpointReader``. Opening a checkpoint
(``reader.locate``, ``reader.open_located``) stands on :func:`fetch_index` and :func:`open_header`.

Checking a slice's byte ranges (``SliceEntry.ranges``, docs/format.md 5.1) while it is read (no torch).

A gathered save written by several ranks records, instead of one xxh3-64 of a tensor's bytes
(which no rank could compute alone), the xxh3-64 of each range of bytes one rank wrote.
:class:`RangeChecker` takes the slice's bytes in order, in chunks of any size, and names every
range whose bytes do not hash to the recorded value, so a damaged range is pinpointed.

What the reader says about a location that holds no checkpoint (for its error messages).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import xxhash

from unickpt.ckpt.dcp_hf import block_from_dcp_hf, dcp_hf_files
from unickpt.ckpt.foreign import foreign_dir
from unickpt.ckpt.safetensors_io import SafetensorsHeader, header_from_bytes, read_header
from unickpt.ckpt.stored_slices import Spans, all_referenced, locate_all, slice_error, slice_keys
from unickpt.errors import (
    CheckpointChangedError,
    CheckpointFormatError,
    HeaderError,
    IncompleteCheckpointError,
    IndexFileError,
    IntegrityFailure,
    UnsafePathError,
    UnsupportedError,
)
from unickpt.spec.dtypes import itemsize
from unickpt.spec.hashing import SliceHasher
from unickpt.spec.index import (
    MAX_INDEX_BYTES,
    ByteRange,
    IndexFile,
    TensorEntry,
    UnickptBlock,
    check_file_name,
    parse_index,
    read_index,
    validate_block,
)
from unickpt.spec.naming import (
    SLICED_SENTINEL,
    index_name,
    optimizer_tensor_name,
    parse_slice_key,
    shown,
    single_name,
)
from unickpt.spec.slice_table import SliceTable
from unickpt.spec.untrusted import capacity_problem, entries_problem, slices_per_file, strict_loads
from unickpt.store.publish import SAVE_ID_KEY
from unickpt.store.storage import (
    MAX_REQUEST,
    STREAM_CHUNK,
    Buffers,
    LocalStorage,
    ReadHandle,
    Storage,
    coalesce,
    join_location,
    open_storage,
    parent_location,
    shown_location,
)

__all__ = [
    "check_unique_slices",
    "check_weight_map",
    "check_gathered",
    "check_optimizer_names",
    "check_param_groups",
    "check_keys_referenced",
    "check_block",
    "CheckpointReader",
    "open_checkpoint",
    "Located",
    "locate",
    "open_located",
    "open_in",
    "single_file_name",
    "UNICKPT_METADATA_KEY",
    "describe",
    "file_kind",
    "block_from_header",
    "block_from_plain_index",
    "FileChecks",
    "shown",
    "HEADER_PROBE",
    "open_header",
    "read_into",
    "iter_handle",
    "read_runs",
    "fetch_index",
    "Prefetched",
    "PrefetchedRead",
    "STREAM_CHUNK",
    "RangeChecker",
    "RangeFailure",
    "slice_failures",
    "hint_foreign",
    "hint_other_files",
]


def _names(names: Iterable[str], limit: int = 5) -> str:
    items = sorted(names)
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(repr(n) for n in items[:limit]) + more


def check_unique_slices(where: str, block: UnickptBlock) -> None:
    """No two slices (of one tensor or of two) name the same key of the same file.

    Keys by the ``NAME@K`` rule (compact tensors without ``keys``) are distinct by
    construction (the name and K follow from the key: K is the digits after the last ``@``), so
    only written-out keys are collected, per file, in bulk from the slice tables; a written key
    that has the rule's form is then looked up among the rule's keys of its file.
    """
    tables = [t.table for t in block.tensors.values()]
    if not any(table.ruled_keys for table in tables):  # keys distinct across files: pairs distinct too
        everywhere: set[str] = set()
        for table in tables:
            everywhere.update(table.keys())
        if len(everywhere) == sum(map(len, tables)):
            return
    per_file: dict[str, set[str]] = {}
    ruled: dict[str, TensorEntry] = {}
    dup = False
    for name, t in block.tensors.items():
        table = t.table
        if table.ruled_keys:
            ruled[name] = t
            continue
        files = table.distinct_files()
        keys_of = table.keys()
        if len(files) == 1:
            keys = per_file.setdefault(files[0], set())
            before = len(keys)
            keys.update(keys_of)
            dup = dup or len(keys) - before != len(keys_of)
        else:
            for file, key in zip(table.file_list(), keys_of, strict=True):
                keys = per_file.setdefault(file, set())
                dup = dup or key in keys
                keys.add(key)
    if ruled and not dup:
        dup = any(_ruled_key_in(ruled, file, key) for file, keys in per_file.items() for key in keys)
    if not dup:
        return
    seen: dict[tuple[str, str], tuple[str, int]] = {}
    for name, t in block.tensors.items():
        table = t.table
        for i, (file, key) in enumerate(zip(table.file_list(), table.keys(), strict=True)):
            first = seen.setdefault((file, key), (name, i))
            if first != (name, i):
                raise IndexFileError(
                    f"{where}: key {shown(key)} of file {shown(file)} is named by two slices: tensor {shown(first[0])} "
                    f"slice {first[1]} and tensor {shown(name)} slice {i} (one stored block would be read twice)"
                )


def _ruled_key_in(ruled: dict[str, TensorEntry], file: str, key: str) -> bool:
    """Whether ``key`` is the ``NAME@K`` key of slice K of a tensor in ``ruled``, stored in ``file``."""
    parsed = parse_slice_key(key)
    if parsed is None:
        return False
    name, i = parsed
    t = ruled.get(name)
    return t is not None and i < len(t.table) and t.table.file(i) == file


def check_gathered(where: str, block: UnickptBlock) -> None:
    """In a gathered checkpoint every tensor is stored whole, under its own name, in one slice."""
    for name, t in block.tensors.items():
        table = t.table  # its one slice read from the table's columns: no per-slice object
        if len(table) != 1:
            raise IndexFileError(
                f"{where}: tensor {shown(name)} has {len(table)} slices in a gathered checkpoint, which stores "
                "each tensor whole under its own name"
            )
        key = table.key(0)
        offsets, shape = table.box(0)
        if key != name or any(offsets) or shape != list(t.shape):
            raise IndexFileError(
                f"{where}: tensor {shown(name)} is stored as key {shown(key)} at offsets {offsets} with shape "
                f"{shape} in a gathered checkpoint, which stores each tensor whole under its own name "
                f"(shape {list(t.shape)}): Hugging Face loaders would read something else"
            )


def check_weight_map(where: str, weight_map: dict[str, str], block: UnickptBlock) -> bool:
    """``weight_map`` and the unickpt block describe the same checkpoint. Returns True if gathered.

    A gathered index maps every stored tensor to the file holding it (so Hugging Face loaders
    read exactly what unickpt verifies); a sliced one maps every stored tensor to the sentinel.
    """
    sentinel = [n for n, f in weight_map.items() if f == SLICED_SENTINEL]
    real = [n for n, f in weight_map.items() if f != SLICED_SENTINEL]
    if sentinel and real:
        raise IndexFileError(
            f"{where}: weight_map mixes the sliced-checkpoint sentinel (e.g. tensor {shown(sentinel[0])}) with "
            f"real files (e.g. tensor {shown(real[0])} -> {shown(weight_map[real[0]])}); an index is either gathered "
            "or sliced"
        )
    gathered = not sentinel if weight_map else block.layout.gathered
    missing = [n for n in block.tensors if n not in weight_map]
    if missing:
        raise IndexFileError(
            f"{where}: tensor(s) {_names(missing)} are in the unickpt block but not in weight_map "
            "(Hugging Face loaders would not see them)"
        )
    extra = [n for n in weight_map if n not in block.tensors]
    if extra:
        raise IndexFileError(
            f"{where}: weight_map names {_names(extra)}, which the unickpt block does not hold "
            "(Hugging Face loaders would read tensors unickpt never verified)"
        )
    if gathered != block.layout.gathered:
        state = "gathered" if gathered else "sliced"
        raise IndexFileError(
            f"{where}: weight_map describes a {state} checkpoint but unickpt.layout.gathered is "
            f"{str(block.layout.gathered).lower()}"
        )
    if not gathered:
        return False
    check_gathered(where, block)
    for name, t in block.tensors.items():
        if weight_map[name] != t.table.file(0):
            raise IndexFileError(
                f"{where}: weight_map puts tensor {shown(name)} in {shown(weight_map[name])} but the unickpt block "
                f"stores it in {shown(t.table.file(0))} (Hugging Face loaders would read a tensor unickpt "
                "never verified)"
            )
    return True


def check_optimizer_names(where: str, block: UnickptBlock) -> None:
    """Optimizer tensors are named ``state.<param>.<state>``; model tensors carry neither field."""
    for name, t in block.tensors.items():
        if block.kind == "model":
            if t.param is not None or t.state is not None:
                raise IndexFileError(
                    f"{where}: model tensor {shown(name)} carries optimizer fields param/state"
                )
            continue
        if t.param is None or t.state is None:
            continue  # an optimizer tensor outside the per-parameter state (none today)
        if name != optimizer_tensor_name(t.param, t.state):
            raise IndexFileError(
                f"{where}: optimizer tensor {shown(name)} says it is state {shown(t.state)} of parameter {shown(t.param)}, "
                f"which is named {shown(optimizer_tensor_name(t.param, t.state))}"
            )
    if block.kind == "optimizer" and block.param_groups is not None:
        check_param_groups(where, block)


def check_param_groups(where: str, block: UnickptBlock) -> None:
    """Every parameter is listed once in ``param_groups``, and all state belongs to a listed one."""
    listed: dict[str, int] = {}
    for i, g in enumerate(block.param_groups or []):
        params = g.get("params")
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise IndexFileError(
                f"{where}: param_groups[{i}].params must be a list of parameter names (FQNs), "
                f"found {type(params).__name__}"
            )
        for p in params:
            if p in listed:
                raise IndexFileError(
                    f"{where}: parameter {shown(p)} is listed in param_groups[{listed[p]}] and param_groups[{i}]"
                )
            listed[p] = i
    for name, t in block.tensors.items():
        if t.param is not None and t.param not in listed:
            raise IndexFileError(
                f"{where}: optimizer tensor {shown(name)} is state of parameter {shown(t.param)}, which no param_group lists"
            )
    for p in block.param_state:
        if p not in listed:
            raise IndexFileError(
                f"{where}: param_state holds state of parameter {shown(p)}, which no param_group lists"
            )


def check_block(where: str, block: UnickptBlock, weight_map: dict[str, str] | None) -> None:
    """The index-only checks: unique slices, weight_map vs block (or whole tensors in a single
    file, ``weight_map=None``), optimizer names."""
    check_unique_slices(where, block)
    if weight_map is None:
        check_gathered(where, block)
    else:
        check_weight_map(where, weight_map, block)
    check_optimizer_names(where, block)


def check_keys_referenced(
    block: UnickptBlock, files: Iterable[str], header: Callable[[str], SafetensorsHeader]
) -> None:
    """Every key of each data file in ``files`` is a slice of the index (``header`` reads one).

    Only the slices stored in ``files`` are collected (a tensor's table says which by file id),
    so a rank that reads a few files costs O(their keys) plus O(tensors).
    """
    files = list(files)
    wanted = set(files)
    refs: dict[str, set[str]] = {f: set() for f in files}
    for t in block.tensors.values():
        table = t.table
        ids = [i for i, f in enumerate(table.files) if f in wanted]
        if not ids:
            continue
        fids = table.file_ids
        ks = np.arange(len(table)) if len(ids) == len(table.files) else np.flatnonzero(np.isin(fids, ids))
        names = list(map(table.files.__getitem__, fids[ks].tolist()))
        keys = slice_keys(table, ks)
        for file, key in zip(names, keys, strict=True):
            refs[file].add(key)

    for file in files:
        h = header(file)
        known = refs[file]
        extra = [] if known.issuperset(h.entries) else [k for k in h.entries if k not in known]
        if extra:
            raise IndexFileError(
                f"{h.path}: holds {len(extra)} key(s) that no slice of the index references: {_names(extra)} "
                "(data the checkpoint does not account for: Hugging Face loaders may read it, unickpt never "
                "verifies it)"
            )


# ---------------------------------------------------------------- blocks the reader builds itself (a single file, a plain Hugging Face index)
UNICKPT_METADATA_KEY = "unickpt"


def block_from_header(h: SafetensorsHeader, kind: str) -> tuple[UnickptBlock, bool]:
    """The unickpt block of a single-file checkpoint, or one synthesised for a plain file."""
    file = single_file_name(h.path, kind)
    raw = h.metadata.get(UNICKPT_METADATA_KEY)
    if raw is not None:
        try:
            obj = strict_loads(raw, IndexFileError, f"{h.path}: the unickpt metadata block")
            tensors = obj.get("tensors") if isinstance(obj, dict) else None
            if isinstance(tensors, dict):
                # Slices of a single file live in that file, whatever it was renamed to.
                for t in tensors.values():
                    slices = t.get("slices") if isinstance(t, dict) else None
                    for s in slices if isinstance(slices, list) else []:
                        if isinstance(s, dict):
                            s["file"] = file
                if isinstance(obj.get("files"), list):  # the compact encoding's file table
                    obj["files"] = [file] * len(obj["files"])
            block = validate_block(obj, h.path, "the unickpt metadata block")
        except CheckpointFormatError:
            raise
        except (ValueError, RecursionError) as e:
            raise IndexFileError(f"{h.path}: the unickpt metadata block is invalid: {e}") from None
        if block.kind != kind:
            raise IndexFileError(
                f"{h.path}: holds a checkpoint of kind {shown(block.kind)} (its unickpt metadata), expected {shown(kind)}"
            )
        return block, True
    tensors = {
        k: TensorEntry.of_table(e.dtype, e.shape, SliceTable.whole(k, e.shape, file))
        for k, e in h.entries.items()
    }
    return UnickptBlock(kind="model" if kind == "model" else "optimizer", tensors=tensors), False


def single_file_name(path: str, kind: str) -> str:
    """The data-file name a single-file checkpoint's slices record: its own name when that is a
    valid data-file name, else ``<kind>.safetensors`` (a file saved onto e.g. a temporary file
    named ``tmpab12cd``); the reader maps every slice to the file it opened either way."""
    name = os.path.basename(path)
    try:
        check_file_name(name)
    except UnsafePathError:
        return single_name("model" if kind == "model" else "optimizer")
    return name


def block_from_plain_index(
    idx: IndexFile,
    directory: str,
    path: str,
    kind: str,
    header_of: Callable[[str], SafetensorsHeader] | None = None,
) -> UnickptBlock:
    """Synthesise the slice table of a plain Hugging Face sharded checkpoint from its headers,
    read with ``header_of(file name)`` (the reader's: through its Storage; left out, the local
    files of ``directory``)."""
    tensors: dict[str, TensorEntry] = {}
    for file in sorted(set(idx.weight_map.values())):
        if file.endswith(".bin"):
            raise CheckpointFormatError(
                f"{path}: shard {shown(file)} is a pickle (.bin) file; convert it first with "
                "`unickpt convert --from bin` (read with torch.load(weights_only=True))"
            )
        h = header_of(file) if header_of is not None else read_header(os.path.join(directory, file))
        for k, e in h.entries.items():
            if idx.weight_map.get(k) != file:
                continue
            tensors[k] = TensorEntry.of_table(e.dtype, e.shape, SliceTable.whole(k, e.shape, file))
    missing = sorted(set(idx.weight_map) - set(tensors))
    if missing:
        raise IndexFileError(
            f"{path}: weight_map names {len(missing)} tensor(s) absent from their files, e.g. {missing[:3]}"
        )
    return UnickptBlock(kind="model" if kind == "model" else "optimizer", tensors=tensors)


def file_kind(storage: Storage, path: str) -> str | None:
    """The ``kind`` recorded in the unickpt metadata of the single safetensors file at ``path``
    on ``storage``, or None (a plain file, unreadable metadata: opening the file reports it)."""
    try:
        handle, h = open_header(storage, path)
        handle.close()
        raw = h.metadata.get(UNICKPT_METADATA_KEY)
        obj = strict_loads(raw, IndexFileError, path) if raw is not None else None
    except CheckpointFormatError:
        return None
    kind = obj.get("kind") if isinstance(obj, dict) else None
    return kind if kind in ("model", "optimizer") else None


# ---------------------------------------------------------------- reads through the Storage, prefetched windows
#: Bytes asked for when a data file is opened: the length prefix and (nearly always) the header.
HEADER_PROBE = 8 << 10
#: A prefetch bridges gaps between wanted ranges only while it fetches at most this fraction
#: more than it needs (gaps under ``storage.SMALL_GAP`` aside).
PREFETCH_WASTE = 1 / 16
#: A prefetch fetches each file's part of a window in about ``PREFETCH_SPLIT`` requests in flight
#: at once (one stream of an object store is slower than several), each between
#: ``PREFETCH_PIECE`` and ``MAX_REQUEST`` bytes (fewer, larger requests as windows grow: stores
#: cap the requests per second of a prefix).
PREFETCH_SPLIT = 4
PREFETCH_PIECE = 4 << 20


def open_header(storage: Storage, path: str) -> tuple[ReadHandle, SafetensorsHeader]:
    """Open a data file on ``storage`` and validate its header: ``(handle, header)`` of one version.

    ``IncompleteCheckpointError`` when it is missing; ``HeaderError`` naming ``path`` when the
    header is not a valid safetensors header of this file's size.
    """
    handle = storage.open_read(path)
    try:
        first = handle.pread(0, min(handle.size, HEADER_PROBE))
        h = header_from_bytes(first, handle.size, path, handle.pread)
    except BaseException:
        handle.close()
        raise
    return handle, h


def read_into(handle: ReadHandle, offset: int, length: int, out: memoryview | None = None) -> memoryview:
    """``length`` bytes at ``offset``, into ``out`` when given (``handle.readinto``: no copy locally)."""
    target = out if out is not None else memoryview(bytearray(length))
    if length:
        handle.readinto(offset, target[:length])
    return target[:length]


def read_runs(handle: ReadHandle, runs: Sequence[tuple[int, int]], out: memoryview) -> None:
    """Read the ``(offset, length)`` runs of a file, in order, back to back into ``out``, with one
    vectored read (``handle.readv``: locally a ``preadv`` per run of adjacent runs)."""
    keep = [(o, n) for o, n in runs if n]
    if not keep:
        return
    src = np.asarray([o for o, _ in keep], dtype=np.int64)
    size = np.asarray([n for _, n in keep], dtype=np.int64)
    dst = np.concatenate(([0], np.cumsum(size)[:-1])).astype(np.int64)
    order = np.argsort(src, kind="stable")
    buffers = Buffers([out])
    src, size, dst = src[order], size[order], dst[order]
    buf = np.zeros(len(src), dtype=np.int64)
    buffers.check(buf, dst, size)
    handle.readv(src, size, buf, dst, buffers)


def iter_handle(handle: ReadHandle, offset: int, length: int, chunk: int = STREAM_CHUNK) -> Iterator[bytes]:
    """Yield the bytes [offset, offset+length) of a file in chunks (one ranged request each)."""
    end = offset + length
    pos = offset
    while pos < end:
        n = min(chunk, end - pos)
        yield handle.pread(pos, n)
        pos += n


def fetch_index(storage: Storage, path: str) -> bytes:
    """The bytes of an index file on ``storage`` (``IndexFileError`` past ``MAX_INDEX_BYTES``)."""
    try:
        return storage.read_bytes(path, limit=MAX_INDEX_BYTES)
    except ValueError:
        raise IndexFileError(
            f"{path}: {storage.size(path)} bytes exceeds the {MAX_INDEX_BYTES}-byte limit for an index"
        ) from None


def no_path(url: str) -> UnsupportedError:
    return UnsupportedError(f"{url} is on an object store: it has no local path to open")


class PrefetchedRead:
    """A data file's handle whose reads are served from :class:`Prefetched` blocks where they
    cover them, from the file otherwise (the reader owns and closes the file's own handle)."""

    def __init__(self, handle: ReadHandle, blocks: Prefetched, name: str) -> None:
        self.handle, self.blocks, self.name = handle, blocks, name
        self.size, self.path = handle.size, handle.path

    def pread(self, offset: int, length: int) -> bytes:
        hit = self.blocks.get(self.name, offset, length)
        return bytes(hit) if hit is not None else self.handle.pread(offset, length)

    def pread_many(self, ranges: Sequence[tuple[int, int]], gap: int = -1) -> list[bytes]:
        return [self.pread(o, n) for o, n in ranges]

    def readinto(self, offset: int, out: memoryview) -> None:
        hit = self.blocks.get(self.name, offset, out.nbytes)
        if hit is None:
            self.handle.readinto(offset, out)
        else:
            out[:] = hit

    def readv(
        self, src: np.ndarray, size: np.ndarray, buf: np.ndarray, dst: np.ndarray, buffers: Buffers
    ) -> None:
        miss = np.ones(len(src), dtype=bool)
        for i, (o, n, k, d) in enumerate(
            zip(src.tolist(), size.tolist(), buf.tolist(), dst.tolist(), strict=True)
        ):
            hit = self.blocks.get(self.name, o, n)
            if hit is not None:
                buffers.piece(k, d, n)[:] = np.frombuffer(hit, dtype=np.uint8)
                miss[i] = False
        if miss.any():
            self.handle.readv(src[miss], size[miss], buf[miss], dst[miss], buffers)

    def descriptor(self) -> int | None:
        return self.handle.descriptor()

    def close(self) -> None:
        pass


class Prefetched:
    """Byte ranges of data files fetched ahead of their reads (coalesced, all in flight at once).

    A load on a URL knows every range it will read before it copies anything: fetching them in
    one batch per file turns hundreds of small per-tensor requests into a few large ones. Reads
    that a prefetched block covers are served from it; others go to the store as usual.
    """

    def __init__(self) -> None:
        self._blocks: dict[str, list[tuple[int, bytes]]] = {}

    def fetch(
        self, handles: dict[str, ReadHandle], wanted: dict[str, list[tuple[int, int]]], threads: int
    ) -> None:
        from concurrent.futures import ThreadPoolExecutor

        def one(name: str) -> tuple[str, list[tuple[int, bytes]]]:
            reqs = [(a, b - a) for a, b, _ in coalesce(wanted[name], waste=PREFETCH_WASTE) if b > a]
            total = sum(n for _, n in reqs)
            step = min(MAX_REQUEST, max(PREFETCH_PIECE, -(-total // PREFETCH_SPLIT)))
            pieces = [(o + at, min(step, n - at)) for o, n in reqs for at in range(0, n, step)]
            got = handles[name].pread_many(pieces, gap=-1)  # grouped already: one request per piece
            return name, sorted(zip((o for o, _ in pieces), got, strict=True))

        # Ranges a block fetched earlier holds (a verified load's hashed slices) are not fetched again.
        wanted = {n: [r for r in rs if not self.covers(n, *r)] for n, rs in wanted.items()}
        names = [n for n in wanted if wanted[n]]
        with ThreadPoolExecutor(max(1, min(threads, len(names))), thread_name_prefix="unickpt-fetch") as pool:
            for name, blocks in pool.map(one, names):
                self._blocks.setdefault(name, []).extend(blocks)

    def get(self, name: str, offset: int, length: int) -> memoryview | None:
        """The prefetched bytes [offset, offset+length) of file ``name``, or None when not all fetched."""
        out: bytearray | None = None
        pos = offset
        end = offset + length
        for start, data in self._blocks.get(name, ()):
            if start <= pos < start + len(data):
                take = min(end, start + len(data)) - pos
                view = memoryview(data)[pos - start : pos - start + take]
                if pos == offset and take == length:
                    return view
                if out is None:
                    out = bytearray()
                out += view
                pos += take
                if pos >= end:
                    return memoryview(out)
        return None if length else memoryview(b"")

    def covers(self, name: str, offset: int, length: int) -> bool:
        """True when [offset, offset+length) of file ``name`` lies within one fetched block."""
        return length == 0 or any(
            start <= offset and offset + length <= start + len(data)
            for start, data in self._blocks.get(name, ())
        )

    def clear(self) -> None:
        self._blocks.clear()


# ---------------------------------------------------------------- per-range hashes of slices written by several ranks
class RangeFailure(IntegrityFailure):
    """One byte range of a slice whose bytes do not hash to the recorded value."""

    __slots__ = ("end", "start")

    def __init__(
        self, tensor: str, file: str, key: str, start: int, end: int, expected: str, found: str
    ) -> None:
        super().__init__(tensor, file, key, expected, found)
        self.start = start
        self.end = end

    def __str__(self) -> str:
        return (
            f"tensor {shown(self.tensor)} in file {shown(self.file)} (stored as {shown(self.key)}): bytes "
            f"[{self.start}, {self.end}) of the tensor: expected xxh3-64 {self.expected}, found {self.found}"
        )


class RangeChecker:
    """Feed a slice's bytes in order (``update``); ``failures()`` names each range that differs."""

    def __init__(self, tensor: str, file: str, key: str, ranges: Sequence[ByteRange]) -> None:
        self.tensor, self.file, self.key = tensor, file, key
        self._ranges = list(ranges)
        self._i = 0
        self._pos = 0
        self._h = xxhash.xxh3_64()
        self._bad: list[RangeFailure] = []

    def update(self, data: bytes | memoryview) -> None:
        mv = memoryview(data).cast("B")
        while mv.nbytes and self._i < len(self._ranges):
            r = self._ranges[self._i]
            take = min(mv.nbytes, r.end - self._pos)
            self._h.update(mv[:take])
            self._pos += take
            mv = mv[take:]
            if self._pos == r.end:
                self._close(r.start, r.end, r.xxh3, self._h.hexdigest())
                self._h = xxhash.xxh3_64()
                self._i += 1

    def _close(self, start: int, end: int, expected: str, found: str) -> None:
        if found != expected:
            self._bad.append(RangeFailure(self.tensor, self.file, self.key, start, end, expected, found))

    def failures(self, unreadable: str | None = None) -> list[RangeFailure]:
        """The ranges that differ; with ``unreadable`` (why reading stopped), every range not fully read."""
        if unreadable is not None or self._pos < (self._ranges[-1].end if self._ranges else 0):
            why = unreadable or "unreadable (the slice ended early)"
            for r in self._ranges[self._i :]:
                self._bad.append(RangeFailure(self.tensor, self.file, self.key, r.start, r.end, r.xxh3, why))
            self._i = len(self._ranges)
        return list(self._bad)


def slice_failures(
    tensor: str,
    file: str,
    key: str,
    xxh3: str | None,
    ranges: Sequence[ByteRange] | None,
    chunks: Iterable[bytes | memoryview],
) -> list[IntegrityFailure]:
    """Rehash a slice's bytes (``chunks``, the whole slice in order) against its ``xxh3`` and each of
    its ``ranges`` (the slice's fields, as its table gives them); the failures
    (empty when every recorded hash matches)."""
    h = xxhash.xxh3_64() if xxh3 is not None else None
    c = RangeChecker(tensor, file, key, ranges) if ranges is not None else None
    for data in chunks:
        if h is not None:
            h.update(data)
        if c is not None:
            c.update(data)
    out: list[IntegrityFailure] = list(c.failures()) if c is not None else []
    if h is not None and xxh3 is not None and h.hexdigest() != xxh3:
        out.append(IntegrityFailure(tensor, file, key, xxh3, h.hexdigest()))
    return out


# ---------------------------------------------------------------- what a location holds instead of a checkpoint
def hint_other_files(names: Iterable[str]) -> str:
    """For a directory without a committed checkpoint, of these ``names``: name the .safetensors
    files it does hold.

    A directory is never guessed from its data files (they may be those of an interrupted
    save); a single file of another name is loaded by passing its path.
    """
    names = sorted(n for n in names if n.endswith(".safetensors"))
    if not names:
        return ""
    listed = ", ".join(shown(n) for n in names[:3])
    more = f" and {len(names) - 3} more" if len(names) > 3 else ""
    return (
        f"; it holds {len(names)} other .safetensors file(s) ({listed}{more}): to load a single-file "
        "checkpoint of another name, pass the path of the file itself"
    )


def hint_foreign(storage: Storage, directory: str) -> str:
    """For a directory without a committed checkpoint: what other tool's checkpoint it holds, if
    any, and the ``convert`` command that reads it (``ckpt/foreign.py``'s rules)."""
    other = foreign_dir(storage.listdir(directory), lambda n: storage.listdir(storage.join(directory, n)))
    return "" if other is None else f"; {other.hint(directory)}"


# ---------------------------------------------------------------- what the reader checks of each data file


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
        """Data file ``name``'s size; None where it is not known without opening the file (on an
        object store, before its header is read) or when it is not a regular file (reading its
        header says what it is)."""
        h = self._headers.get(name)
        if h is not None:
            return h.file_size
        return self.storage.known_size(self.file_path(name))

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
    # The store every file is read through (``ckpt/reader.py``): ``directory`` and
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
        # locally, a symbolic link out of the directory is refused (spec.untrusted; the HF cache's are not)
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
                    f"{self.directory}: data file {shown(name)} named by the index is missing"
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
                    f"{self.index_path}: data file {shown(name)} vanished while the checkpoint was read, "
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
                raise IndexFileError(f"{self.index_path or self.directory}: tensor {shown(name)}: {problem}")

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

    def _check_slice(self, name: str, t: TensorEntry, file: str, key: str, shape: list[int]) -> None:
        """The slice's key is in its file's (valid) header with the dtype and shape the index records
        (``stored_slices.slice_error``: the check and the wording of ``locate``, for one slice)."""
        err = slice_error(self.header(file), name, t.dtype, key, shape)
        if err is not None:
            raise err

    # ----------------------------------------------------------------- reading bytes
    def key_location(self, file: str, key: str) -> tuple[str, int, int]:
        """(absolute path, absolute offset, byte length) of the stored slice ``key`` of ``file``."""
        h = self.header(file)
        if key not in h.entries:
            raise HeaderError(f"{h.path}: key {shown(key)} named by the index is not in the file")
        off, n = h.absolute(key)
        return h.path, off, n

    def read_key(self, file: str, key: str, out: memoryview | None = None) -> memoryview:
        """The bytes of the stored slice ``key`` of ``file`` (into ``out`` when given)."""
        _, off, n = self.key_location(file, key)
        return self._read(file, off, n, out)

    def read_key_bytes(
        self, file: str, key: str, rel_offset: int, length: int, out: memoryview | None = None
    ) -> memoryview:
        """``length`` bytes starting ``rel_offset`` bytes into the stored slice ``key`` of ``file``."""
        _, off, n = self.key_location(file, key)
        if rel_offset < 0 or rel_offset + length > n:
            raise HeaderError(f"{file}: read of {length} bytes at {rel_offset} outside slice {shown(key)}")
        return self._read(file, off + rel_offset, length, out)

    def read_runs(self, file: str, key: str, runs: list[tuple[int, int]], out: memoryview) -> None:
        """Read runs ``(byte offset into the slice, length)`` of the stored slice ``key`` of ``file``
        back to back into ``out`` with one vectored read (``ReadHandle.readv``: locally a ``preadv``
        per run, on an object store one coalesced batch of ranged requests)."""
        _, off, n = self.key_location(file, key)
        for o, k in runs:
            if o < 0 or o + k > n:
                raise HeaderError(f"{file}: read of {k} bytes at {o} outside slice {shown(key)}")
        with self._vanishing(file):
            read_runs(self.read_handle(file), [(off + o, k) for o, k in runs], out)

    def iter_key(self, file: str, key: str, chunk: int = 16 << 20) -> Iterator[bytes]:
        """The bytes of the stored slice ``key`` of ``file``, ``chunk`` bytes at a time."""
        _, off, n = self.key_location(file, key)
        yield from iter_handle(self.read_handle(file), off, n, chunk)

    def hash_key(self, file: str, key: str) -> str:
        """The xxh3-64 of the stored slice ``key`` of ``file``, as 16 hex digits."""
        h = SliceHasher()
        for buf in self.iter_key(file, key):
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
            table = t.table  # the slices read from its columns: no per-slice object
            columns = zip(
                table.file_list(), table.keys(), table.hash_list(), table.shapes.tolist(), strict=True
            )
            for k, (file, key, xxh3, shape) in enumerate(columns):
                rng = table.ranges(k)
                if xxh3 is None and rng is None:  # xxh3, or ranges (docs/format.md 5.1)
                    continue
                try:
                    self._check_slice(name, t, file, key, shape)
                    failures.extend(slice_failures(name, file, key, xxh3, rng, self.iter_key(file, key)))
                except (IncompleteCheckpointError, CheckpointFormatError) as e:
                    # Missing or truncated file, edited header, key absent: report it with the rest.
                    failures.append(IntegrityFailure(name, file, key, xxh3 or "-", f"unreadable ({e})"))
                if progress is not None:
                    progress(math.prod(shape) * itemsize(t.dtype))
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
    ``storage_options`` for fsspec, else the store's own environment); every location is read
    through ``store/storage.py`` with the same checks and errors, naming the location.
    Raises ``IncompleteCheckpointError`` when there is no committed checkpoint there. With
    ``pin``, every data file is opened and matched to the index at once; when a save replaced
    the checkpoint meanwhile (``CheckpointChangedError``), the new one is opened instead, once.
    """
    storage, _ = open_storage(path, storage_options)  # ConfigError: options for a local path
    return open_in(storage, path, kind, pin=pin)


def open_in(
    storage: Storage, path: str | os.PathLike[str], kind: str, *, pin: bool = False
) -> CheckpointReader:
    """:func:`open_checkpoint` of ``path`` on ``storage``, the store of ``path`` opened already."""

    def reopen() -> CheckpointReader:
        return open_located(storage, locate(storage, path, kind), kind)

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


def _single_file_reader(
    storage: Storage, path: str, directory: str, single_file: str, kind: str
) -> CheckpointReader:
    """The reader of the single ``.safetensors`` file at ``path`` (known to the reader as ``single_file``,
    in ``directory``): its header read and checked once, its handle kept open for the reads."""
    handle, h = open_header(storage, path)
    try:
        block, has = block_from_header(h, kind)
        if has:
            check_block(h.path, block, None)
        file = single_file_name(path, kind)
        r = CheckpointReader(
            directory,
            kind,
            block,
            None,
            has,
            single_file=single_file,
            single_slice_file=file,
            storage=storage,
        )
        r.check_single_file(file, h)
    except BaseException:
        handle.close()
        raise
    r._headers[file] = h
    r._handles[file] = handle
    return r


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
    """What a location holds: an index, a single safetensors file, or the per-rank files of a
    distributed Hugging Face DCP save (``files``). ``index_bytes``: the index, fetched once by
    rank 0 of a distributed load for every rank (``locate(fetch=True)``)."""

    url: str  # the index, the single file, or the directory of the per-rank files
    directory: str
    form: str  # "index", "single" or "dcp-hf"
    files: tuple[str, ...] = ()
    index_bytes: bytes | None = None


def _what(found: str) -> str:
    return "a directory" if found == "directory" else found


def locate(storage: Storage, location: str | os.PathLike[str], kind: str, *, fetch: bool = False) -> Located:
    """Find the checkpoint of ``kind`` at ``location`` (a path or a URL on ``storage``), the same way
    on every store.

    A directory holds ``<kind>.safetensors.index.json`` or ``<kind>.safetensors`` (or, for a
    model, a distributed DCP save's per-rank files); a file is an index (``.index.json``) or a
    single file. The names a checkpoint goes by are asked of the store first (on an object
    store, one HEAD request when it is there); what stands at the location itself only when they
    are absent. Anything else that stands where a file should be (a directory, a FIFO, a
    dangling link) is refused naming it. ``fetch``: the index bytes come along (one request).
    """
    p = shown_location(location)  # a local path absolute: the reader keeps it across a chdir
    found = None if p.endswith((".json", ".safetensors")) else _in_directory(storage, p, kind)
    if found is None:
        found = _at(storage, p, kind)
    if fetch and found.form == "index":
        return Located(found.url, found.directory, found.form, index_bytes=fetch_index(storage, found.url))
    return found


def _in_directory(storage: Storage, d: str, kind: str) -> Located | None:
    """The checkpoint of ``kind`` directly in the directory ``d``; None when neither name is there."""
    wanted = (
        (index_name(kind), "index", IndexFileError, "an index file"),
        (single_name(kind), "single", HeaderError, "a safetensors file"),
    )
    for name, form, refused, noun in wanted:
        path = join_location(d, name)
        found = storage.what(path)
        if found == "file":
            return Located(path, d, form)
        if found is not None:
            raise refused(f"{path} is {_what(found)}, not {noun}")
    return None


def _at(storage: Storage, p: str, kind: str) -> Located:
    """What the location ``p`` itself holds, where no checkpoint stands under its names below it."""
    found = storage.what(p)
    if found == "file":
        form = "index" if p.endswith(".index.json") else "single"
        return Located(p, parent_location(p), form)
    if found == "directory":
        inside = _in_directory(storage, p, kind) if p.endswith((".json", ".safetensors")) else None
        if inside is not None:
            return inside
        names = storage.listdir(p)
        shards = dcp_hf_files(names) if kind == "model" else []
        if shards:  # torch's HuggingFaceStorageWriter(save_distributed=True): see ckpt/dcp_hf.py
            return Located(p, p, "dcp-hf", tuple(shards))
        raise IncompleteCheckpointError(
            f"{p} holds no committed {kind} checkpoint: neither {index_name(kind)} nor {single_name(kind)} "
            "is present (an interrupted save leaves data files without an index; such a directory is "
            f"never loaded){hint_foreign(storage, p) or hint_other_files(names)}"
        )
    if found is None:
        raise IncompleteCheckpointError(f"no checkpoint at {p}: the path does not exist")
    raise (IndexFileError if p.endswith(".json") else HeaderError)(
        f"{p} is {_what(found)}, not a checkpoint file or directory"
    )


def open_located(storage: Storage, located: Located, kind: str) -> CheckpointReader:
    """The reader of what :func:`locate` found on ``storage``. An index not fetched yet is read here;
    its bytes are not kept while it is parsed (they are read again in the rare refusal that needs them)."""
    url, directory = located.url, located.directory
    if located.form == "single":
        return _single_file_reader(storage, url, directory, url, kind)
    if located.form == "dcp-hf":
        block = block_from_dcp_hf(directory, list(located.files), _header_of(storage, directory, directory))
        r = CheckpointReader(directory, kind, block, None, False, storage=storage)
        r.check_coverage()
        return r
    try:
        if located.index_bytes is not None:
            idx: IndexFile = parse_index(located.index_bytes, url)
        else:
            idx = read_index(lambda: fetch_index(storage, url), url)
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"{url} vanished while being opened: a save into {directory} is replacing the "
            f"{kind} checkpoint; open it again once the save has finished"
        ) from None
    if idx.unickpt is None:
        header_of = _header_of(storage, directory, url)
        block = block_from_plain_index(idx, directory, url, kind, header_of)
        return CheckpointReader(directory, kind, block, url, False, idx, storage=storage)
    block = idx.unickpt
    if block.kind != kind:
        raise IndexFileError(f"{url}: holds a {block.kind} checkpoint, expected a {kind} checkpoint")
    check_block(url, block, idx.weight_map)
    return CheckpointReader(directory, kind, block, url, True, idx, storage=storage)
