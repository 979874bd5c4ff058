"""Gathered saves without a rank-0 funnel: every rank writes its own bytes of the Hugging Face files.

A gathered save (``gather_dtensor=True``, the manager's ``save_hf``) writes ordinary Hugging
Face safetensors files, each tensor whole under its own name. No rank gathers a tensor:

1. every rank computes the same file layout (``format.hf_layout``: files, headers, where each
   tensor's bytes start) from the plan's global shapes, and the same writer of every slice
   (``planner.plan_save``: a replicated slice is written once);
2. rank 0 creates every staged file (hidden name, ``store.publish.temp_name``), writes its
   header and sizes it, while it prepares the directory (``stage_gathered``): the ranks agree
   once on both (they share the directory, as sliced saves do);
3. each rank ``pwrite``s (``Storage.open_range``: the in-place strategy of a store with
   ``range_write``) the byte runs of the slices it writes straight into place (a row
   slice is one run; a column-sharded DTensor is first moved to row slices, one tensor at a
   time, ``io.hf_rows``; any other column slice is one run per row), hashing each range it
   wrote (xxh3-64) and each slice's fingerprint partial on a second thread while the next
   tensor is written, then fsyncs each file it wrote into once (rank 0: every file, headers too);
4. one exchange both agrees that every write succeeded (else rank 0 removes the files) and
   gathers the hashes; rank 0 builds the block (one whole slice per tensor: its ``xxh3`` when
   one rank wrote it all, else its ``ranges``), rewrites a single file's header with the real
   values (same length as the placeholders) and, having staged every file, commits alone
   through ``store.publish``, index last; a last agreement tells every rank the outcome.

Files are byte-identical to what the rank-0 gathered save wrote (same order, header and metadata).
``InPlaceHF`` is this strategy of the save engine (``io.save.choose_strategy``: a store with
``range_write`` and ``atomic_rename``); ``io/parts_save.py`` shares its layout and block.

**Plans kept for the next save of the same layout** (issue 19).

A training run saves the same tensors, with the same global shapes and the same slices on the
same ranks, every time. The plan of a gathered save in a directory (the replica check of the
ranks' metas, ``planner.plan_save`` with its tiling check, then the files' order and every
tensor's writer ranges, ``order_files``) is a pure function of the all-gathered slice
metas, the kind and the ranks' order of names, which every rank holds after the listing; so
each rank keeps the last few plans keyed on those inputs and reuses one when they repeat. The
key is the xxh3-128 digest of the pickled metas (not the metas: at thousands of ranks they
would hold hundreds of MB between saves), and layouts of more than ``_MAX_SLICES`` slices are
not kept. A plan that failed is never kept (the next save raises the same error again).

Cached plans are shared between saves: nothing may modify them (the object-store branch, which
renames planned files, never uses this cache).
"""

from __future__ import annotations

import collections
import os
import pickle
from collections.abc import Callable, Hashable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import torch
import xxhash

from unickpt import __version__, _dist
from unickpt._faults import maybe_fail
from unickpt.ckpt.hf_layout import HFLayout, box_runs, plan_hf_layout, writer_ranges
from unickpt.ckpt.reader import single_file_name
from unickpt.ckpt.writer import (
    PLACEHOLDER,
    build_block,
    build_index,
    data_file_metadata,
    single_file_metadata,
    tensor_entry,
)
from unickpt.errors import UnsupportedError
from unickpt.io.hf_rows import RowMoves
from unickpt.io.planner import SavePlan, SliceMeta
from unickpt.io.tensors import LocalSlice, as_bytes
from unickpt.io.write_strategy import PlanInputs, SaveOptions, SaveRun, WriteStrategy, settle
from unickpt.spec.dtypes import itemsize
from unickpt.spec.hashing import hash_block, slice_hash
from unickpt.spec.index import ByteRange, TensorEntry, UnickptBlock, index_to_json
from unickpt.spec.slice_table import SliceTable
from unickpt.store.publish import commit_directory, commit_single_file, temp_name
from unickpt.store.storage import RangeFile, Storage

__all__ = [
    "InPlaceHF",
    "cached",
    "gathered_block",
    "gathered_plan",
    "hash_tensor_ranges",
    "holds",
    "save_gathered",
]

_VERSION = f"unickpt {__version__}"
# name -> [(start, end, writer rank)]: the byte ranges of each tensor, relative to its first byte.
_Ranges = dict[str, list[tuple[int, int, int]]]
# What a rank's writes give: {(name, range start): xxh3}, {name: [fingerprint partials]}.
_Hashes = dict[tuple[str, int], str]
_Partials = dict[str, list[int]]


@dataclass
class StagedHF:
    """A gathered save's files as planned (``stage_gathered``): what the writing needs."""

    ranges: _Ranges
    layout: HFLayout
    staged: dict[str, str]  # file name -> staged path
    own: dict[str, str]  # the staged files this rank created (rank 0: all)
    placeholders: UnickptBlock | None  # a single file's first block
    file_name: str | None  # a single file's name
    store: Storage  # where the files are (it writes at offsets: ``range_write``)


T = TypeVar("T")

# A manager saves a model and an optimizer alternately (its Hugging Face copy is the model's save).
_KEEP = 4
_MAX_SLICES = 1 << 16  # about 15 MB of plan per kept layout
_cache: collections.OrderedDict[Hashable, object] = collections.OrderedDict()


def cached(key: Hashable, compute: Callable[[], T]) -> T:
    """``compute()``, or its value for an equal ``key`` computed before (the last ``_KEEP`` kept)."""
    try:
        value = _cache[key]
    except KeyError:
        value = compute()  # raises before anything is kept
        _cache[key] = value
        if len(_cache) > _KEEP:
            _cache.popitem(last=False)
    else:
        _cache.move_to_end(key)
    return value  # type: ignore[return-value]


def holds(value: object) -> bool:
    """Whether ``value`` is one of the kept values (the very object)."""
    return any(v is value for v in _cache.values())


def metas_key(per_rank: Sequence[Sequence[SliceMeta]]) -> str:
    """Every rank's slice metas (names, dtypes, global shapes, boxes) as one xxh3-128 digest of
    their pickle: equal bytes mean equal metas; equal metas pickled with other containers or
    other object sharing only miss the cache (each save builds its metas the same way)."""
    return xxhash.xxh3_128_hexdigest(pickle.dumps(per_rank, protocol=pickle.HIGHEST_PROTOCOL))


def gathered_plan(inputs: PlanInputs, compute: Callable[[], SavePlan]) -> SavePlan:
    """``compute()``, the plan of a gathered save in a directory from ``inputs``, or the same plan
    object it gave for equal listings of the same kind (layouts of more than ``_MAX_SLICES``
    slices are not kept)."""
    listed = inputs.listed
    if sum(len(m) for m in listed) > _MAX_SLICES:
        return compute()
    return cached(("gathered_plan", inputs.opts.kind, metas_key(listed)), compute)


def order_files(s: SaveRun) -> tuple[SavePlan, _Ranges, list[tuple[str, str, tuple[int, ...]]]]:
    """The files' order (the ranks' order of names, rank 0's first, not the order in which slices
    appear: a rank may hold no slice of a tensor it names), set as ``s.plan``; each tensor's writer
    ranges; the (name, dtype, shape) of each tensor in that order."""
    given = s.plan

    def compute() -> tuple[SavePlan, _Ranges, list[tuple[str, str, tuple[int, ...]]]]:
        known = [n for n in s.order if n in given.tensors]
        listed = set(known)
        known += [n for n in given.tensors if n not in listed]
        plan = SavePlan({n: given.tensors[n] for n in known}, given.files, given.slices, given.sliced)
        ranges = {
            name: writer_ranges(gshape, dtype, [(ps.offsets, ps.shape, ps.rank) for ps in plan.slices[name]])
            for name, (dtype, gshape) in plan.tensors.items()
        }
        return plan, ranges, [(n, d, tuple(g)) for n, (d, g) in plan.tensors.items()]

    # A plan kept for repeated layouts (gathered_plan) keeps its files' order and ranges too:
    # the entry holds the plan itself, so its id names no other plan while it is kept.
    if holds(given):
        out = cached(("hf_files", id(given), tuple(s.order)), lambda: (given, compute()))[1]
    else:
        out = compute()
    s.plan = out[0]
    return out


class InPlaceHF(WriteStrategy):
    """A gathered save on a store with ``range_write`` and ``atomic_rename`` (a local directory):
    every rank writes its own bytes of the Hugging Face files in place (the module docstring).

    ``rows``: column-sharded DTensors moved to row slices as they are written (a live save; an
    async save's copies are not moved, ``io.save.save_tensors``)."""

    name = "in-place"
    plans_files = (
        False  # the writer of every slice: the files are planned from the layout (``stage_gathered``)
    )

    def __init__(self, rows: RowMoves | None) -> None:
        self.rows = rows
        self.staged: StagedHF | None = None

    def list_slices(
        self, tensors: dict[str, torch.Tensor], boxes_fn: Callable[[str, torch.Tensor], list[LocalSlice]]
    ) -> tuple[list[LocalSlice], dict[str, list[LocalSlice]]]:
        """The plan takes a moved tensor's boxes after the move; its slices as held now are the
        ones its replica check digests (its row slice is not moved yet)."""
        rows = self.rows
        if rows is None:
            return super().list_slices(tensors, boxes_fn)
        local: list[LocalSlice] = []
        before: dict[str, list[LocalSlice]] = {}
        for name, t in tensors.items():
            sls = boxes_fn(name, t)
            local.extend(rows.take(name, t, sls))
            if name in rows:
                before[name] = sls
        return local, before

    def plan(self, inputs: PlanInputs) -> SavePlan:
        """The writer of every slice (``WriteStrategy.plan``), the plan of the last save of this
        layout when it repeats (``gathered_plan``)."""
        compute = super().plan
        return gathered_plan(inputs, lambda: compute(inputs))

    def stage(self, run: SaveRun) -> None:
        """The files' layout; rank 0 creates them (the preparation's agreement covers it)."""
        self.staged = stage_gathered(run, run.store, run.rank)

    def unstage(self, run: SaveRun) -> None:
        if self.staged is not None:
            run.store.remove(self.staged.own.values())

    def write_and_commit(self, run: SaveRun) -> None:
        if self.staged is None:  # never: stage() ran on every rank before the agreement
            raise RuntimeError(f"{run.directory}: a gathered save's files were not staged")
        save_gathered(run, self.staged, self.rows)


def stage_gathered(s: SaveRun, store: Storage, rank: int) -> StagedHF:
    """Local phase: the files' layout; rank 0 creates every staged file (header, full size) in
    ``store`` (one with ``range_write`` and ``atomic_rename``).

    ``io.save`` runs it while preparing the directory (after rank 0 took the lock), so that one
    agreement covers both; when that agreement fails, rank 0 removes ``own``.
    """
    _, ranges, descs = order_files(s)
    file_name = single_file_name(s.file_path, s.kind) if s.file_path else None
    placeholders = None
    if file_name is not None:
        placeholders = gathered_block(s, ranges, None, None, file_name=file_name, placeholder=True)
        layout = plan_hf_layout(
            descs,
            kind=s.kind,
            size_per_shard_bytes=None,
            metadata=single_file_metadata(placeholders, s.save_id),
            single_file=file_name,
        )
        staged = {layout.files[0].name: temp_name(s.file_path, s.save_id)}
    else:
        layout = plan_hf_layout(
            descs,
            kind=s.kind,
            size_per_shard_bytes=s.size_per_shard_bytes,
            metadata=data_file_metadata(False, s.save_id),
        )
        staged = {f.name: temp_name(os.path.join(s.directory, f.name), s.save_id) for f in layout.files}
    if rank == 0:
        maybe_fail("save.hf_create")
        _create_files(store, layout, staged, s.save_id, placeholders)
    return StagedHF(ranges, layout, staged, staged if rank == 0 else {}, placeholders, file_name, store)


def save_gathered(s: SaveRun, st: StagedHF, rows: RowMoves | None) -> None:
    """Collective, after ``stage_gathered`` and its agreement: write and commit a gathered save;
    every rank raises if any rank failed. ``rows``: the tensors moved to row slices as they are
    written (``io.hf_rows``)."""
    group, rank = s.group, s.rank
    opts, plan = s.opts, s.plan
    ranges, layout, staged, own = st.ranges, st.layout, st.staged, st.own
    placeholders, file_name, single = st.placeholders, st.file_name, st.file_name is not None
    where = f"writing {s.file_path or s.directory}"
    err: BaseException | None = None

    # 3. every rank writes its slices into place.
    hashes: _Hashes = {}
    partials: _Partials = {}
    try:
        hashes, partials = _write_own(plan, layout, ranges, s.local, staged, st.store, rank, opts, rows, own)
    except BaseException as e:
        err = e
    try:  # the agreement carries the hashes: one exchange
        results = _dist.agree_gather(err, (hashes, partials), where, group)
    except BaseException:
        st.store.remove(own.values())  # every rank has stopped writing
        raise

    # 4. rank 0: the block, then the commit.
    all_hashes: _Hashes = {}
    all_partials: _Partials = {}
    for h, p in results:
        all_hashes.update(h)
        for name, parts in p.items():
            all_partials.setdefault(name, []).extend(parts)
    if single:
        if rank == 0:
            try:
                maybe_fail("save.commit")
                block = gathered_block(s, ranges, all_hashes, all_partials, file_name=file_name)
                _finish_single(layout, staged, placeholders, block, s, st.store)
            except BaseException as e:
                err = e
        settle(err, f"committing {s.file_path}", group, s.lock)
        return
    index = b""
    if rank == 0:
        try:
            maybe_fail("save.commit")
            block = gathered_block(
                s, ranges, all_hashes, all_partials, {n: p.file for n, p in layout.places.items()}
            )
            index = index_to_json(build_index(block, sliced=False))
        except BaseException as e:
            err = e
    # Rank 0 staged every file: it commits alone (``store.publish``), the others wait for it.
    if rank == 0:
        try:
            if err is None:
                commit_directory(s.directory, s.kind, own, index, save_id=s.save_id, fsync=opts.fsync)
            else:
                st.store.remove(own.values())
        except BaseException as e:
            err = e
    settle(err, f"committing {s.directory}", group, s.lock)


def _create_files(
    store: Storage, layout: HFLayout, staged: dict[str, str], save_id: str, placeholders: UnickptBlock | None
) -> None:
    """Rank 0: every staged file with its header, sized to its final length (removed on failure).

    Not fsynced here: rank 0 fsyncs every file it created after its writes (``_write_own``),
    before the writes' agreement, so a header costs no flush of its own."""
    made: list[str] = []
    try:
        for f in layout.files:
            if placeholders is not None:
                meta = single_file_metadata(placeholders, save_id)
            else:
                meta = data_file_metadata(False, save_id)
            path = staged[f.name]
            store.open_range(path, size=f.size, header=f.header(meta)).close()
            made.append(path)
    except BaseException:
        store.remove(made)
        raise


def _write_own(
    plan: SavePlan,
    layout: HFLayout,
    ranges: _Ranges,
    local: list[LocalSlice],
    staged: dict[str, str],
    store: Storage,
    rank: int,
    opts: SaveOptions,
    rows: RowMoves | None = None,
    created: Mapping[str, str] | None = None,
) -> tuple[_Hashes, _Partials]:
    """This rank's slices written into place; hashed on a second thread while the next is written.

    ``rows``: the tensors moved to row slices (``io.hf_rows``) when their turn comes; every rank
    of their meshes takes part in each move, even after its own writing failed. ``created``: the
    staged files this rank created (rank 0: every file), fsynced with the ones it wrote into, so
    that every header is durable even in a file rank 0 writes no data into.
    """
    hashes: _Hashes = {}
    partials: _Partials = {}
    fds: dict[str, RangeFile] = {}
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unickpt-hash")
    pending: collections.deque[Future[tuple[_Hashes, _Partials]]] = collections.deque()
    err: BaseException | None = None

    def collect(fut: Future[tuple[_Hashes, _Partials]]) -> None:
        h, p = fut.result()
        hashes.update(h)
        for name, parts in p.items():
            partials.setdefault(name, []).extend(parts)

    try:
        try:
            maybe_fail("save.hf_write")
        except BaseException as e:
            err = e
        for name, (dtype, gshape) in plan.tensors.items():
            moved = rows.local(name) if rows is not None and name in rows else None  # collective
            if err is not None:
                continue
            try:
                fut = _write_tensor(
                    name,
                    dtype,
                    gshape,
                    plan,
                    layout,
                    ranges,
                    local,
                    staged,
                    store,
                    fds,
                    rank,
                    opts,
                    pool,
                    moved,
                )
                del moved
                if fut is not None:
                    pending.append(fut)
                while len(pending) > 1:
                    collect(pending.popleft())
            except BaseException as e:
                err = e
        if err is not None:
            raise err
        while pending:
            collect(pending.popleft())
        if opts.fsync:
            for fname in created or {}:
                if fname not in fds:
                    fds[fname] = _open_staged(store, staged[fname], rank)
            for fd in fds.values():
                fd.sync()
    finally:
        for fd in fds.values():
            fd.close()
        pool.shutdown(wait=True)
    return hashes, partials


def _write_tensor(
    name: str,
    dtype: str,
    gshape: tuple[int, ...],
    plan: SavePlan,
    layout: HFLayout,
    ranges: _Ranges,
    local: list[LocalSlice],
    staged: dict[str, str],
    store: Storage,
    fds: dict[str, RangeFile],
    rank: int,
    opts: SaveOptions,
    pool: ThreadPoolExecutor,
    moved: Any,
) -> Future[tuple[_Hashes, _Partials]] | None:
    """Write this rank's slices of one tensor into place; the future of their hashes (None: none)."""
    mine = [ps for ps in plan.slices[name] if ps.rank == rank]
    if not mine:
        return None
    place = layout.places[name]
    if place.file not in fds:
        fds[place.file] = _open_staged(store, staged[place.file], rank)
    fd = fds[place.file]
    isize = itemsize(dtype)
    blocks: list[tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]] = []
    pieces: list[tuple[int, np.ndarray]] = []
    for ps in mine:
        arr = as_bytes(moved if moved is not None else local[ps.local_index].tensor)
        blocks.append((arr, ps.offsets, ps.shape))
        runs = box_runs(gshape, ps.offsets, ps.shape, isize)
        n = runs[0][1] - runs[0][0] if runs else 0
        pieces.extend((b, arr[j * n : (j + 1) * n]) for j, (b, _) in enumerate(runs))
    pieces.sort(key=lambda bp: bp[0])
    mine_ranges = [(b, e) for b, e, w in ranges[name] if w == rank]
    fut = pool.submit(hash_tensor_ranges, name, dtype, gshape, blocks, pieces, mine_ranges, opts)
    for b, piece in pieces:
        fd.pwrite(memoryview(piece), place.pos + b)  # type: ignore[arg-type]
    if opts.fsync:  # the disk starts on each range now: the final fsync has little left
        for b, e in mine_ranges:
            fd.writeback(place.pos + b, e - b)
    maybe_fail("save.write")
    return fut


def _open_staged(store: Storage, path: str, rank: int) -> RangeFile:
    try:
        return store.open_range(path)
    except FileNotFoundError:
        raise UnsupportedError(
            f"{path}: rank {rank} cannot see the file rank 0 created for this gathered save; every rank "
            "writes its own bytes into the same files, so the ranks must share the checkpoint directory"
        ) from None


def hash_tensor_ranges(
    name: str,
    dtype: str,
    gshape: tuple[int, ...],
    blocks: Sequence[tuple[np.ndarray, tuple[int, ...], tuple[int, ...]]],
    pieces: Sequence[tuple[int, np.ndarray]],
    mine_ranges: Sequence[tuple[int, int]],
    opts: SaveOptions,
) -> tuple[_Hashes, _Partials]:
    """xxh3-64 of each range this rank wrote (its pieces, in file order) and each slice's partial."""
    hashes: _Hashes = {}
    if opts.hashes:
        it = iter(pieces)
        for b, e in mine_ranges:
            h = xxhash.xxh3_64()
            pos = b
            while pos < e:
                at, piece = next(it)
                if at != pos:  # pragma: no cover - the ranges are the merged pieces
                    raise RuntimeError(f"internal: tensor {name!r}: piece at {at}, expected {pos}")
                h.update(memoryview(piece))  # type: ignore[arg-type]
                pos += piece.nbytes
            hashes[(name, b)] = h.hexdigest()
    parts: _Partials = {}
    if opts.fingerprints:
        isize = itemsize(dtype)
        parts[name] = [
            hash_block(arr, isize, gshape, off, shp, xxh3=False, fingerprint=True)[1]
            for arr, off, shp in blocks
        ]
    return hashes, parts


def gathered_block(
    s: SaveRun,
    ranges: _Ranges,
    hashes: _Hashes | None,
    partials: _Partials | None,
    files: Mapping[str, str] | None = None,
    *,
    file_name: str | None = None,
    placeholder: bool = False,
) -> UnickptBlock:
    """The block: one whole slice per tensor, with its ``xxh3`` (one writer) or its ``ranges``.

    ``placeholder``: same-length placeholders for every hash (a single file's first header).
    """
    opts = s.opts
    entries: dict[str, TensorEntry] = {}
    for name, (dtype, gshape) in s.plan.tensors.items():
        rs = ranges[name]
        xxh3: str | None = None
        brs: list[ByteRange] | None = None
        if opts.hashes:
            if not rs:
                xxh3 = slice_hash(b"")
            elif len(rs) == 1:
                xxh3 = PLACEHOLDER if hashes is None else hashes[(name, rs[0][0])]
            else:
                brs = [
                    ByteRange(start=b, end=e, xxh3=PLACEHOLDER if hashes is None else hashes[(name, b)])
                    for b, e, _ in rs
                ]
        file = file_name or (files or {})[name]
        sl = SliceTable.whole(name, gshape, file, xxh3=xxh3, ranges=brs)
        parts = None
        if opts.fingerprints:
            parts = [] if partials is None else partials.get(name, [])
        extra = s.entry_extras.get(name, {})
        entries[name] = tensor_entry(name, dtype, gshape, sl, parts, placeholder=placeholder, **extra)
    return build_block(
        kind=s.kind,
        created_by=_VERSION,
        layout=opts.layout.model_copy(update={"gathered": True}),
        tensors=entries,
        aliases=s.aliases,
        save_id=s.save_id,
        **s.block_extras,
    )


def _finish_single(
    layout: HFLayout,
    staged: dict[str, str],
    placeholders: UnickptBlock | None,
    block: UnickptBlock,
    s: SaveRun,
    store: Storage,
) -> None:
    """Rank 0: the single file's real header (same length as the placeholder one), then its commit."""
    (f,) = layout.files
    path = staged[f.name]
    try:
        old = f.header(single_file_metadata(placeholders or block, s.save_id))
        new = f.header(single_file_metadata(block, s.save_id))
        if len(old) != len(new):  # pragma: no cover - every placeholder has its value's length
            raise RuntimeError("internal: a single file's header changed length after hashing")
        fd = store.open_range(path)
        try:
            fd.pwrite(new, 0)
            if s.opts.fsync:
                fd.sync()
        finally:
            fd.close()
    except BaseException:
        store.remove([path])
        raise
    commit_single_file(s.file_path, path, s.kind, fsync=s.opts.fsync)
