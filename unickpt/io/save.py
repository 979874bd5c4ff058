"""The save engine shared by every CheckpointIO: the collective work of a save (listing
blocks, planning, moving tensors to their writer, agreeing); files, hashes and the index are
written by ``format.writer``, as ``merge`` and ``convert`` write theirs.

Order of events (every rank calls ``save_tensors`` with its own tensors):

1. every rank lists the blocks it holds; the lists are all-gathered (names and shapes only);
2. every rank computes the same plan (``planner.plan_save``);
3. rank 0 prepares the directory and takes the save lock; the previous checkpoint stays
   committed and untouched while this save writes;
4. each writer streams its blocks into staging files (``format.writer.CheckpointWriter``:
   hidden temporary names derived from the save id), hashing each block on a second thread
   while the previous one is written, and fsyncs every file; every file's header carries the
   save id (a single file is written by ``format.writer.write_single_file``);
5. ranks agree that every write succeeded (else every rank raises, partial files removed);
6. rank 0 commits through ``format.commit`` (stage the index, un-commit the previous
   checkpoint, rename the data files and then the index into place, remove superseded files
   and leftovers of killed saves) and releases the lock; a final barrier means no rank
   returns before the checkpoint is committed.

A URL (``s3://``, ``gs://``...: ``SaveOptions.storage_options``) goes through the storage layer
instead (``format/commit_store.py``, docs/format.md section 6.1): no lock and no staging; rank 0
finds whether a checkpoint is committed there (then every file gets a save-id name), each writer
streams its files as multipart uploads, and rank 0's commit is the index's PUT.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from unickpt import __version__
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt.errors import ConfigError, UnickptError
from unickpt.format.commit import directory_lock, discard, new_save_id
from unickpt.format.commit_store import committed_on_store, store_file_name
from unickpt.format.index import LayoutInfo, SliceEntry, TensorEntry, UnickptBlock, index_to_json
from unickpt.format.naming import single_name
from unickpt.format.reader import single_file_name
from unickpt.format.storage import Storage, is_url, open_storage
from unickpt.format.writer import (
    CheckpointWriter,
    FileSpec,
    build_block,
    build_index,
    tensor_entry,
    write_single_file,
)
from unickpt.io import _dist
from unickpt.io._commit import commit_collective
from unickpt.io.planner import PlannedFile, SavePlan, SliceMeta, plan_save
from unickpt.io.replicas import check_gathered_metas
from unickpt.io.tensors import LocalSlice, as_bytes, is_dtensor

__all__ = ["SaveOptions", "save_tensors"]

logger = get_logger(__name__)
_VERSION = f"unickpt {__version__}"
# (tensor name, slice number) -> (xxh3-64 or None, fingerprint partial)
_Results = dict[tuple[str, int], tuple[str | None, int]]


@dataclass(frozen=True)
class SaveOptions:
    kind: str  # "model" or "optimizer"
    shard: bool
    gather: bool
    size_per_shard_mb: float
    layout: LayoutInfo
    hashes: bool = True
    fingerprints: bool = True
    fsync: bool = True
    # fsspec options of a URL ``path`` (credentials, endpoint); None: the environment's.
    storage_options: dict[str, Any] | None = None


def save_tensors(
    tensors: dict[str, torch.Tensor],
    path: str,
    opts: SaveOptions,
    boxes_fn: Callable[[str, torch.Tensor], list[LocalSlice]],
    *,
    aliases: dict[str, str] | None = None,
    entry_extras: dict[str, dict[str, Any]] | None = None,
    block_extras: dict[str, Any] | None = None,
    group: Any = None,
) -> str:
    """Collective. Save ``tensors`` (this rank's view) as one checkpoint; returns the committed path."""
    rank, world = _dist.rank(group), _dist.world_size(group)
    aliases = aliases or {}
    single_file = opts.gather and not opts.shard
    # A URL is written through the storage layer (object stores: no staging, no rename).
    store, root = open_store(path, opts.storage_options)
    # An existing file (e.g. a tempfile.NamedTemporaryFile) is replaced by an unsharded save.
    is_file = path.endswith(".safetensors") or (store is None and os.path.isfile(path))
    if store is not None:
        file_path = root if is_file else store.join(root, single_name(opts.kind))
        directory = posixpath.dirname(file_path) if single_file else root
    elif single_file:
        file_path = path if is_file else os.path.join(path, single_name(opts.kind))
        directory = os.path.dirname(os.path.abspath(file_path))
    if not single_file:
        file_path = ""
        directory = os.path.abspath(path) if store is None else root
        if is_file:
            _dist.agree(
                UnickptError(f"{path}: a sharded or sliced checkpoint is a directory; pass a directory path"),
                "save",
                group,
            )

    # 1-2. list blocks, gather the lists, plan.
    err: BaseException | None = None
    local: list[LocalSlice] = []
    try:
        maybe_fail("save.list")
        for name, t in tensors.items():
            local.extend(boxes_fn(name, t))
    except BaseException as e:
        err = e
    _dist.agree(err, "listing tensors to save", group)
    all_metas: list[list[SliceMeta]] = []
    if opts.gather:
        # Each tensor is written whole by rank 0; metas only say which tensors exist.
        metas: list[SliceMeta] = []
        seen = set()
        for sl in local:
            if sl.name not in seen:
                seen.add(sl.name)
                metas.append(
                    (sl.name, sl.dtype, sl.global_shape, (0,) * len(sl.global_shape), sl.global_shape)
                )
        all_metas = _dist.all_gather_object(metas, group)
        merged: list[SliceMeta] = []
        names: set[str] = set()
        for ms in all_metas:
            for m in ms:
                if m[0] not in names:
                    names.add(m[0])
                    merged.append(m)
        per_rank: list[list[SliceMeta]] = [merged] + [[] for _ in range(world - 1)]
    else:
        per_rank = _dist.all_gather_object([sl.meta() for sl in local], group)
    # Entry extras (an optimizer tensor's parameter) and aliases are known to the ranks that
    # hold those tensors: pipeline stages and ZeRO ranks each know part of them.
    merged_aliases: dict[str, str] = {}
    merged_extras: dict[str, dict[str, Any]] = {}
    save_id = new_save_id()  # rank 0's id is the save's id
    gathered = _dist.all_gather_object((aliases, entry_extras or {}, save_id), group)
    save_id = gathered[0][2]
    for rank_aliases, rank_extras, _ in gathered:
        for k, v in rank_aliases.items():
            merged_aliases.setdefault(k, v)
        for k, x in rank_extras.items():
            merged_extras.setdefault(k, x)
    aliases, entry_extras = merged_aliases, merged_extras
    size = None if not opts.shard else int(opts.size_per_shard_mb * 1024 * 1024)
    plan: SavePlan | None = None
    try:
        maybe_fail("save.plan")
        if opts.gather:
            check_gathered_metas(all_metas, path)
        plan = plan_save(per_rank, kind=opts.kind, size_per_shard_bytes=size, sliced=not opts.gather)
    except BaseException as e:
        err = e
    _dist.agree(err, "planning the save", group)
    if plan is None:  # never: agree() raised when planning failed on any rank
        raise RuntimeError(f"{path}: no save plan after planning succeeded")

    # 3. rank 0 prepares the directory.
    lock = contextlib.ExitStack()
    over = False  # an object store holds a committed checkpoint of the kind here
    if rank == 0:
        try:
            maybe_fail("save.prepare")
            if store is None:
                os.makedirs(directory, exist_ok=True)
                lock.enter_context(directory_lock(directory))
            elif not single_file:
                over = committed_on_store(store, directory, opts.kind)
        except BaseException as e:
            err = e
    try:
        _dist.agree(err, f"preparing {directory}", group)
        if store is not None and not single_file and _dist.broadcast_object(over, 0, group):
            for pf in plan.files:  # never overwrite the committed checkpoint's files
                pf.name = store_file_name(pf.name, save_id)

        # 4. write.
        results: _Results = {}
        try:
            if single_file:
                if rank == 0:
                    results = _write_single(
                        plan,
                        tensors,
                        file_path,
                        opts,
                        aliases,
                        entry_extras,
                        block_extras,
                        group,
                        save_id,
                        store,
                    )
                else:
                    _feed_gather(plan, tensors, group, rank)
            elif opts.gather:
                results = _write_gathered(plan, tensors, directory, opts, group, rank, save_id, store)
            else:
                mine = plan.files_of(rank)

                def blocks() -> Iterator[Any]:
                    for f in mine:
                        for ps in f.slices:
                            sl = local[ps.local_index]
                            yield ps.key, as_bytes(sl.tensor), (sl.global_shape, sl.offsets, sl.shape)

                written = _writer(directory, opts, plan, save_id, store).write(
                    _file_specs(plan, mine), blocks()
                )
                results = _by_slice(mine, written)
        except BaseException as e:
            err = e
        # Each rank's own staged files (in its own directory: shared, or node-local before an upload).
        own = (
            [] if single_file else plan.files_of(rank) if not opts.gather else plan.files if rank == 0 else []
        )
        staged = {f.name: _writer(directory, opts, plan, save_id, store).staged_name(f.name) for f in own}
        try:
            _dist.agree(err, f"writing {directory}", group)
        except BaseException:
            # every rank has stopped writing: the successful ranks' files go too
            discard(staged.values()) if store is None else store.remove(staged.values())
            raise

        # 5-6. commit.
        all_results = _dist.all_gather_object(results, group) if not single_file else [results]
        if not single_file:
            index = b""
            if rank == 0:
                try:
                    maybe_fail("save.commit")
                    merged_results: _Results = {}
                    for r in all_results:
                        merged_results.update(r)
                    block = _build_block(
                        plan, merged_results, opts, aliases, entry_extras, block_extras, save_id=save_id
                    )
                    index = index_to_json(build_index(block, sliced=plan.sliced))
                except BaseException as e:
                    err = e
            commit_collective(
                directory, opts.kind, opts.fsync, plan, staged, index, save_id, err, group, rank, world, store
            )
    finally:
        lock.close()
    _dist.barrier(group)
    if store is not None:
        return path
    return file_path if single_file else directory


def _writer(
    directory: str, opts: SaveOptions, plan: SavePlan, save_id: str, store: Storage | None = None
) -> CheckpointWriter:
    return CheckpointWriter(
        directory, opts.kind, save_id, plan.sliced, opts.hashes, opts.fingerprints, opts.fsync, store
    )


def open_store(path: str, storage_options: dict[str, Any] | None) -> tuple[Storage | None, str]:
    """``(storage, location in it)`` for a URL; ``(None, path)`` for a local path (today's path)."""
    if not is_url(path):
        if storage_options:
            raise ConfigError(f"storage_options are for fsspec URLs; {path!r} is a local path")
        return None, path[len("file://") :] if path.startswith("file://") else path
    store, root = open_storage(path, storage_options)
    return store, root


def _file_specs(plan: SavePlan, files: list[PlannedFile]) -> list[FileSpec]:
    return [(f.name, [(ps.key, plan.tensors[ps.name][0], ps.shape) for ps in f.slices]) for f in files]


def _by_slice(files: list[PlannedFile], written: dict[str, tuple[str | None, int]]) -> _Results:
    """What the writer returned per key, per (tensor, slice number) (merged across ranks)."""
    return {(ps.name, ps.k): written[ps.key] for f in files for ps in f.slices}


def _full_tensor_for(
    name: str, tensors: dict[str, torch.Tensor], group: Any, rank: int, holder: int
) -> torch.Tensor | None:
    """Collective over the holders of ``name``: return the full tensor on rank 0, None elsewhere."""
    t = tensors.get(name)
    full = None
    if t is not None:
        full = t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]
    if holder != 0 and rank == holder and full is not None:
        # The tensor lives only on other ranks (pipeline stages): the lowest holder sends it,
        # and rank 0 receives it in _gathered_blocks.
        import torch.distributed as dist

        dist.send(full.detach().cpu().contiguous(), dst=0, group=group)
    return full if rank == 0 else None


def _holder_table(tensors: dict[str, torch.Tensor], group: Any) -> dict[str, int]:
    names = _dist.all_gather_object(list(tensors), group)
    table: dict[str, int] = {}
    for r, ns in enumerate(names):
        for n in ns:
            table.setdefault(n, r)
    return table


def _gathered_blocks(
    plan: SavePlan, tensors: dict[str, torch.Tensor], group: Any, rank: int, files: list[PlannedFile]
) -> Iterator[Any]:
    """Yield (key, bytes, geometry) for each planned block on rank 0, one tensor at a time.

    Every rank must run the same iteration (``_feed_gather`` on ranks other than 0) so that
    the collectives of ``full_tensor`` and the sends line up.
    """
    import torch.distributed as dist

    holders = _holder_table(tensors, group)
    for f in files:
        for ps in f.slices:
            holder = holders[ps.name]
            full = _full_tensor_for(ps.name, tensors, group, rank, holder)
            if rank == 0:
                dtype_name, gshape = plan.tensors[ps.name]
                if full is None:
                    from unickpt.io.tensors import torch_dtype

                    full = torch.empty(gshape, dtype=torch_dtype(dtype_name))
                    dist.recv(full, src=holder, group=group)
                yield ps.key, as_bytes(full), (gshape, (0,) * len(gshape), gshape)
            del full


def _feed_gather(plan: SavePlan, tensors: dict[str, torch.Tensor], group: Any, rank: int) -> None:
    for _ in _gathered_blocks(plan, tensors, group, rank, plan.files):
        pass


def _write_gathered(
    plan: SavePlan,
    tensors: dict[str, torch.Tensor],
    directory: str,
    opts: SaveOptions,
    group: Any,
    rank: int,
    save_id: str,
    store: Storage | None,
) -> _Results:
    if rank != 0:
        _feed_gather(plan, tensors, group, rank)
        return {}
    gen = _gathered_blocks(plan, tensors, group, rank, plan.files)
    with _draining(gen):
        written = _writer(directory, opts, plan, save_id, store).write(_file_specs(plan, plan.files), gen)
    return _by_slice(plan.files, written)


@contextlib.contextmanager
def _draining(blocks: Iterator[Any]) -> Iterator[None]:
    """Rank 0's writer failed: keep taking part in the gather collectives of the remaining
    blocks (discarding them), so that the other ranks reach the agreement instead of waiting
    in a gather that rank 0 left."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            for _ in blocks:
                pass
        raise


def _write_single(
    plan: SavePlan,
    tensors: dict[str, torch.Tensor],
    file_path: str,
    opts: SaveOptions,
    aliases: dict[str, str],
    entry_extras: dict[str, dict[str, Any]] | None,
    block_extras: dict[str, Any] | None,
    group: Any,
    save_id: str,
    store: Storage | None,
) -> _Results:
    """One ``.safetensors`` file carrying the unickpt block in its header metadata
    (``format.writer.write_single_file``: placeholder header, data, rewritten header, commit)."""
    (f,) = plan.files
    name = single_file_name(file_path, opts.kind)
    f = PlannedFile(name, 0, f.slices)

    def make_block(written: Mapping[str, tuple[str | None, int]], placeholder: bool) -> UnickptBlock:
        results = {(ps.name, ps.k): written[ps.key] for ps in f.slices}
        return _build_block(
            plan,
            results,
            opts,
            aliases,
            entry_extras,
            block_extras,
            file_name=name,
            placeholder=placeholder,
            save_id=save_id,
        )

    gen = _gathered_blocks(plan, tensors, group, 0, [f])
    with _draining(gen):
        written = write_single_file(
            file_path,
            _file_specs(plan, [f])[0][1],
            gen,
            make_block,
            kind=opts.kind,
            save_id=save_id,
            hashes=opts.hashes,
            fingerprints=opts.fingerprints,
            fsync=opts.fsync,
            storage=store,
        )
    return _by_slice([f], written)


def _build_block(
    plan: SavePlan,
    results: _Results,
    opts: SaveOptions,
    aliases: dict[str, str],
    entry_extras: dict[str, dict[str, Any]] | None,
    block_extras: dict[str, Any] | None,
    *,
    file_name: str | None = None,
    placeholder: bool = False,
    save_id: str | None = None,
) -> UnickptBlock:
    """The unickpt block of ``plan`` from each slice's (xxh3, partial); file names from the plan
    (or ``file_name`` for a single file)."""
    file_of = {(ps.name, ps.k): f.name for f in plan.files for ps in f.slices}
    entries: dict[str, TensorEntry] = {}
    for name, (dtype, gshape) in plan.tensors.items():
        planned = plan.slices[name]
        slices = [
            SliceEntry(
                file=file_name or file_of[(name, ps.k)],
                key=ps.key,
                offsets=list(ps.offsets),
                shape=list(ps.shape),
                xxh3=results[(name, ps.k)][0],
            )
            for ps in planned
        ]
        partials = [results[(name, ps.k)][1] for ps in planned] if opts.fingerprints else None
        extra = (entry_extras or {}).get(name, {})
        entries[name] = tensor_entry(name, dtype, gshape, slices, partials, placeholder=placeholder, **extra)
    return build_block(
        kind=opts.kind,
        created_by=_VERSION,
        layout=opts.layout.model_copy(update={"gathered": opts.gather}),
        tensors=entries,
        aliases=aliases,
        save_id=save_id,
        **(block_extras or {}),
    )
