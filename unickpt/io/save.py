"""The save engine shared by every CheckpointIO: plan, write, hash, commit.

Order of events (every rank calls ``save_tensors`` with its own tensors):

1. every rank lists the blocks it holds; the lists are all-gathered (names and shapes only);
2. every rank computes the same plan (``planner.plan_save``);
3. rank 0 prepares the directory and takes the save lock; the previous checkpoint stays
   committed and untouched while this save writes;
4. each writer streams its blocks into staging files (hidden temporary names derived from the
   save id), hashing each block on a second thread while the previous one is written, and
   fsyncs every file; every file's header carries the save id;
5. ranks agree that every write succeeded (else every rank raises, partial files removed);
6. rank 0 commits through ``format.commit`` (stage the index, un-commit the previous
   checkpoint, rename the data files and then the index into place, remove superseded files
   and leftovers of killed saves) and releases the lock; a final barrier means no rank
   returns before the checkpoint is committed.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from unickpt import __version__
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt.errors import UnickptError
from unickpt.format.commit import (
    SAVE_ID_KEY,
    commit_single_file,
    directory_lock,
    discard,
    new_save_id,
    temp_name,
)
from unickpt.format.dtypes import itemsize
from unickpt.format.hashing import combine_partials, finalize_fingerprint, hash_block
from unickpt.format.index import (
    IndexFile,
    IndexMetadata,
    LayoutInfo,
    SliceEntry,
    TensorEntry,
    UnickptBlock,
    index_to_json,
)
from unickpt.format.naming import SLICED_SENTINEL, single_name
from unickpt.format.reader import UNICKPT_METADATA_KEY, single_file_name
from unickpt.format.safetensors_io import SafetensorsWriter, encode_header
from unickpt.io import _dist
from unickpt.io._commit import commit_collective
from unickpt.io.planner import PlannedFile, SavePlan, SliceMeta, plan_save
from unickpt.io.replicas import check_gathered_metas
from unickpt.io.tensors import LocalSlice, as_bytes, is_dtensor

__all__ = ["SaveOptions", "save_tensors"]

logger = get_logger(__name__)
_PLACEHOLDER = "0" * 16
_VERSION = f"unickpt {__version__}"


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


def _write_files(
    files: list[PlannedFile],
    plan: SavePlan,
    directory: str,
    opts: SaveOptions,
    blocks: Iterator[tuple[str, np.ndarray, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]],
    metadata_for: Callable[[PlannedFile], dict[str, str]],
) -> dict[tuple[str, int], tuple[str | None, int]]:
    """Stream blocks into files. ``blocks`` yields (key, uint8 array, (global, offsets, shape)) in file order.

    Hashing of block i runs on a worker thread while block i is written and block i+1 is
    fetched and written (numpy, xxhash and file writes all release the GIL), so hashes cost
    little on top of the write; at most two blocks are alive at once.
    """
    results: dict[tuple[str, int], tuple[str | None, int]] = {}
    written: list[str] = []
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="unickpt-hash")
    # The hash of block i may finish while block i+1 is written: at most two blocks are alive.
    pending: collections.deque[tuple[tuple[str, int], Future[tuple[str | None, int]]]] = collections.deque()
    try:
        for f in files:
            specs = [(ps.key, plan.tensors[ps.name][0], ps.shape) for ps in f.slices]
            path = os.path.join(directory, f.name)
            w = SafetensorsWriter(path, specs, metadata_for(f), writeback=opts.fsync)
            written.append(path)
            try:
                for ps in f.slices:
                    key, arr, (gshape, off, shp) = next(blocks)
                    if key != ps.key:
                        raise RuntimeError(f"internal: expected block {ps.key!r}, got {key!r}")
                    dtype = plan.tensors[ps.name][0]
                    fut = pool.submit(_hash_np, arr, gshape, off, shp, dtype, opts)
                    w.write(ps.key, memoryview(arr))  # type: ignore[arg-type]
                    maybe_fail("save.write")
                    pending.append(((ps.name, ps.k), fut))
                    del arr
                    while len(pending) > 1:
                        done, older = pending.popleft()
                        results[done] = older.result()
                w.close(fsync=opts.fsync)
            except BaseException:
                w.abort()
                raise
        while pending:
            done, older = pending.popleft()
            results[done] = older.result()
    except BaseException:
        for p in written:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
        raise
    finally:
        pool.shutdown(wait=True)
    return results


def _hash_np(
    arr: np.ndarray,
    gshape: tuple[int, ...],
    off: tuple[int, ...],
    shp: tuple[int, ...],
    dtype: str,
    opts: SaveOptions,
) -> tuple[str | None, int]:
    if not (opts.hashes or opts.fingerprints):
        return None, 0
    return hash_block(arr, itemsize(dtype), gshape, off, shp, xxh3=opts.hashes, fingerprint=opts.fingerprints)


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
    # An existing file (e.g. a tempfile.NamedTemporaryFile) is replaced by an unsharded save.
    is_file = path.endswith(".safetensors") or os.path.isfile(path)
    if single_file:
        file_path = path if is_file else os.path.join(path, single_name(opts.kind))
        directory = os.path.dirname(os.path.abspath(file_path))
    else:
        file_path = ""
        directory = os.path.abspath(path)
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
    if rank == 0:
        try:
            maybe_fail("save.prepare")
            os.makedirs(directory, exist_ok=True)
            lock.enter_context(directory_lock(directory))
        except BaseException as e:
            err = e
    try:
        _dist.agree(err, f"preparing {directory}", group)

        # 4. write.
        results: dict[tuple[str, int], tuple[str | None, int]] = {}
        try:
            if single_file:
                if rank == 0:
                    results = _write_single(
                        plan, tensors, file_path, opts, aliases, entry_extras, block_extras, group, save_id
                    )
                else:
                    _feed_gather(plan, tensors, group, rank)
            elif opts.gather:
                results = _write_gathered(plan, tensors, directory, opts, group, rank, save_id)
            else:
                mine = plan.files_of(rank)

                def blocks() -> Iterator[Any]:
                    for f in mine:
                        for ps in f.slices:
                            sl = local[ps.local_index]
                            yield ps.key, as_bytes(sl.tensor), (sl.global_shape, sl.offsets, sl.shape)

                results = _write_files(
                    _staged(mine, directory, save_id),
                    plan,
                    directory,
                    opts,
                    blocks(),
                    lambda f: _file_meta(opts, True, save_id),
                )
        except BaseException as e:
            err = e
        # Each rank's own staged files (in its own directory: shared, or node-local before an upload).
        own = (
            [] if single_file else plan.files_of(rank) if not opts.gather else plan.files if rank == 0 else []
        )
        staged = {f.name: temp_name(os.path.join(directory, f.name), save_id) for f in own}
        try:
            _dist.agree(err, f"writing {directory}", group)
        except BaseException:
            discard(staged.values())  # every rank has stopped writing: the successful ranks' files go too
            raise

        # 5-6. commit.
        all_results = _dist.all_gather_object(results, group) if not single_file else [results]
        if not single_file:
            index = b""
            if rank == 0:
                try:
                    maybe_fail("save.commit")
                    merged_results: dict[tuple[str, int], tuple[str | None, int]] = {}
                    for r in all_results:
                        merged_results.update(r)
                    block = _build_block(
                        plan, merged_results, opts, aliases, entry_extras, block_extras, save_id=save_id
                    )
                    index = index_to_json(_build_index(plan, block, opts))
                except BaseException as e:
                    err = e
            commit_collective(
                directory, opts.kind, opts.fsync, plan, staged, index, save_id, err, group, rank, world
            )
    finally:
        lock.close()
    _dist.barrier(group)
    return file_path if single_file else directory


def _file_meta(opts: SaveOptions, sliced: bool, save_id: str) -> dict[str, str]:
    # Sliced files say so in their format tag: transformers refuses any format it does not know.
    # Hugging Face loaders check only "format"; unickpt's reader checks the save id.
    return {"format": "unickpt-sliced" if sliced else "pt", SAVE_ID_KEY: save_id}


def _staged(files: list[PlannedFile], directory: str, save_id: str) -> list[PlannedFile]:
    """The same files under their staging names (renamed into place by the commit)."""
    return [
        PlannedFile(os.path.basename(temp_name(os.path.join(directory, f.name), save_id)), f.rank, f.slices)
        for f in files
    ]


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
) -> dict[tuple[str, int], tuple[str | None, int]]:
    if rank != 0:
        _feed_gather(plan, tensors, group, rank)
        return {}
    gen = _gathered_blocks(plan, tensors, group, rank, plan.files)
    with _draining(gen):
        return _write_files(
            _staged(plan.files, directory, save_id),
            plan,
            directory,
            opts,
            gen,
            lambda f: _file_meta(opts, False, save_id),
        )


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
) -> dict[tuple[str, int], tuple[str | None, int]]:
    """One ``.safetensors`` file carrying the unickpt block in its header metadata.

    The header is written first with placeholder hashes of the same length as the real ones,
    and rewritten once the data is hashed, in the staging file no reader opens; the file is
    committed by ``commit_single_file``.
    """
    (f,) = plan.files
    name = single_file_name(file_path, opts.kind)
    f = PlannedFile(name, 0, f.slices)
    placeholder = {
        k: (_PLACEHOLDER if opts.hashes else None, 0) for k in ((ps.name, ps.k) for ps in f.slices)
    }
    block0 = _build_block(
        plan,
        placeholder,
        opts,
        aliases,
        entry_extras,
        block_extras,
        file_name=name,
        placeholder_fp=True,
        save_id=save_id,
    )
    meta0 = {
        "format": "pt",
        UNICKPT_METADATA_KEY: json.dumps(block0.model_dump(mode="json", exclude_none=True)),
        SAVE_ID_KEY: save_id,
    }
    tmp = temp_name(file_path, save_id)
    tmp_dir = os.path.dirname(tmp)
    staged = PlannedFile(os.path.basename(tmp), 0, f.slices)
    gen = _gathered_blocks(plan, tensors, group, 0, [f])
    with _draining(gen):
        results = _write_files([staged], plan, tmp_dir, opts, gen, lambda _f: meta0)
    try:
        block = _build_block(
            plan, results, opts, aliases, entry_extras, block_extras, file_name=name, save_id=save_id
        )
        meta = {
            "format": "pt",
            UNICKPT_METADATA_KEY: json.dumps(block.model_dump(mode="json", exclude_none=True)),
            SAVE_ID_KEY: save_id,
        }
        specs = [(ps.key, plan.tensors[ps.name][0], ps.shape) for ps in f.slices]
        header0, _ = encode_header(specs, meta0)
        header, _ = encode_header(specs, meta)
        if len(header) != len(header0):
            raise RuntimeError("internal: single-file header changed length after hashing")
        fd = os.open(tmp, os.O_WRONLY)
        try:
            os.pwrite(fd, header, 0)
            if opts.fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    commit_single_file(file_path, tmp, opts.kind, fsync=opts.fsync)
    return results


def _build_block(
    plan: SavePlan,
    results: dict[tuple[str, int], tuple[str | None, int]],
    opts: SaveOptions,
    aliases: dict[str, str],
    entry_extras: dict[str, dict[str, Any]] | None,
    block_extras: dict[str, Any] | None,
    *,
    file_name: str | None = None,
    placeholder_fp: bool = False,
    save_id: str | None = None,
) -> UnickptBlock:
    file_of = {(ps.name, ps.k): f.name for f in plan.files for ps in f.slices}
    entries: dict[str, TensorEntry] = {}
    for name, (dtype, gshape) in plan.tensors.items():
        slices = []
        for ps in plan.slices[name]:
            xxh, _partial = results[(name, ps.k)]
            slices.append(
                SliceEntry(
                    file=file_name or file_of[(name, ps.k)],
                    key=ps.key,
                    offsets=list(ps.offsets),
                    shape=list(ps.shape),
                    xxh3=xxh,
                )
            )
        fp = None
        if opts.fingerprints:
            total = combine_partials(results[(name, ps.k)][1] for ps in plan.slices[name])
            fp = _PLACEHOLDER if placeholder_fp else finalize_fingerprint(name, dtype, gshape, total)
        extra = (entry_extras or {}).get(name, {})
        entries[name] = TensorEntry(dtype=dtype, shape=list(gshape), fingerprint=fp, slices=slices, **extra)
    layout = opts.layout.model_copy(update={"gathered": opts.gather})
    return UnickptBlock(
        kind=opts.kind,  # type: ignore[arg-type]
        created_by=_VERSION,
        layout=layout,
        tensors=entries,  # type: ignore[arg-type]
        aliases=dict(aliases),
        save_id=save_id,
        **(block_extras or {}),
    )


def _build_index(plan: SavePlan, block: UnickptBlock, opts: SaveOptions) -> IndexFile:
    total = sum(t.nbytes for t in block.tensors.values())
    if plan.sliced:
        weight_map = {name: SLICED_SENTINEL for name in block.tensors}
    else:
        weight_map = {name: t.slices[0].file for name, t in block.tensors.items()}
    # The block's models were validated as they were built; pydantic keeps model instances
    # as they are (no dump and re-validation of every slice, seconds at 10^5 slices).
    return IndexFile(metadata=IndexMetadata(total_size=total), weight_map=weight_map, unickpt=block)
