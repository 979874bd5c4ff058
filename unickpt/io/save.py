"""The save engine shared by every CheckpointIO: the collective work of a save (listing
slices, planning, agreeing); a sliced save's files, hashes and index are written by
``format.writer``, as ``merge`` and ``convert`` write theirs. A gathered save (Hugging Face
files) takes steps 4-6 in ``io.hf_save``: every rank writes its own bytes into the files.

Order of events (every rank calls ``save_tensors`` with its own tensors):

1. every rank lists the blocks it holds; the lists are all-gathered (names and shapes only);
2. every rank computes the same plan (``planner.plan_save``);
3. rank 0 prepares the directory and takes the save lock; the previous checkpoint stays
   committed and untouched while this save writes;
4. each writer streams its blocks into staging files (``format.writer.CheckpointWriter``:
   hidden temporary names derived from the save id), hashing each block on a second thread
   while the previous one is written, and fsyncs every file; every file's header carries the
   save id;
5. ranks agree that every write succeeded (else every rank raises, partial files removed);
6. rank 0 commits through ``format.commit`` (stage the index, un-commit the previous
   checkpoint, rename the data files and then the index into place, remove superseded files
   and leftovers of killed saves) and releases the lock; a final barrier means no rank
   returns before the checkpoint is committed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from unickpt import __version__, _dist
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt.errors import UnickptError
from unickpt.format.commit import directory_lock, discard, new_save_id
from unickpt.format.index import LayoutInfo, SliceEntry, TensorEntry, UnickptBlock, index_to_json
from unickpt.format.naming import single_name
from unickpt.format.writer import (
    CheckpointWriter,
    FileSpec,
    build_block,
    build_index,
    tensor_entry,
)
from unickpt.io._commit import commit_collective
from unickpt.io.hf_save import GatheredSave, save_gathered
from unickpt.io.planner import PlannedFile, SavePlan, SliceMeta, plan_save
from unickpt.io.replicas import check_gathered_metas
from unickpt.io.tensors import LocalSlice, as_bytes

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
    # Every rank's slices (names and boxes only); a gathered save writes them in place too.
    per_rank: list[list[SliceMeta]] = _dist.all_gather_object([sl.meta() for sl in local], group)
    # Entry extras (an optimizer tensor's parameter) and aliases are known to the ranks that
    # hold those tensors: pipeline stages and ZeRO ranks each know part of them.
    merged_aliases: dict[str, str] = {}
    merged_extras: dict[str, dict[str, Any]] = {}
    save_id = new_save_id()  # rank 0's id is the save's id
    # A gathered save orders its files by the tensors' names as the ranks list them (rank 0's
    # first): a rank may hold no slice of a tensor (a ZeRO range it does not own).
    names = list(tensors) if opts.gather else []
    gathered = _dist.all_gather_object((aliases, entry_extras or {}, save_id, names), group)
    save_id = gathered[0][2]
    order = list(dict.fromkeys(n for g in gathered for n in g[3]))
    for rank_aliases, rank_extras, _, _ in gathered:
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
            check_gathered_metas(per_rank, path)
        # A gathered save uses the plan for its writers only: its files are planned by hf_save.
        plan = plan_save(
            per_rank, kind=opts.kind, size_per_shard_bytes=None if opts.gather else size, sliced=True
        )
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

        if opts.gather:  # 4-6: every rank writes its bytes of the Hugging Face files (io/hf_save.py)
            gs = GatheredSave(
                plan,
                local,
                opts.kind,
                directory,
                file_path if single_file else "",
                size,
                save_id,
                opts,
                aliases,
                entry_extras,
                block_extras or {},
                order,
            )
            save_gathered(gs, group, rank, world)
        else:  # 4-6: every writer streams its slices into its own files
            # 4. write.
            results: _Results = {}
            try:
                mine = plan.files_of(rank)

                def blocks() -> Iterator[Any]:
                    for f in mine:
                        for ps in f.slices:
                            sl = local[ps.local_index]
                            yield ps.key, as_bytes(sl.tensor), (sl.global_shape, sl.offsets, sl.shape)

                written = _writer(directory, opts, plan, save_id).write(_file_specs(plan, mine), blocks())
                results = _by_slice(mine, written)
            except BaseException as e:
                err = e
            # Each rank's own staged files (in its own directory: shared, or node-local before an upload).
            staged = {
                f.name: _writer(directory, opts, plan, save_id).staged_name(f.name)
                for f in plan.files_of(rank)
            }
            try:
                _dist.agree(err, f"writing {directory}", group)
            except BaseException:
                discard(staged.values())  # every rank has stopped writing: the successful ranks' files go too
                raise

            # 5-6. commit.
            all_results = _dist.all_gather_object(results, group)
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
                directory, opts.kind, opts.fsync, plan, staged, index, save_id, err, group, rank, world
            )
    finally:
        lock.close()
    _dist.barrier(group)
    return file_path if single_file else directory


def _writer(directory: str, opts: SaveOptions, plan: SavePlan, save_id: str) -> CheckpointWriter:
    return CheckpointWriter(
        directory, opts.kind, save_id, plan.sliced, opts.hashes, opts.fingerprints, opts.fsync
    )


def _file_specs(plan: SavePlan, files: list[PlannedFile]) -> list[FileSpec]:
    return [(f.name, [(ps.key, plan.tensors[ps.name][0], ps.shape) for ps in f.slices]) for f in files]


def _by_slice(files: list[PlannedFile], written: dict[str, tuple[str | None, int]]) -> _Results:
    """What the writer returned per key, per (tensor, slice number) (merged across ranks)."""
    return {(ps.name, ps.k): written[ps.key] for f in files for ps in f.slices}


def _build_block(
    plan: SavePlan,
    results: _Results,
    opts: SaveOptions,
    aliases: dict[str, str],
    entry_extras: dict[str, dict[str, Any]] | None,
    block_extras: dict[str, Any] | None,
    *,
    save_id: str | None = None,
) -> UnickptBlock:
    """The unickpt block of a sliced save's ``plan`` from each slice's (xxh3, partial)."""
    file_of = {(ps.name, ps.k): f.name for f in plan.files for ps in f.slices}
    entries: dict[str, TensorEntry] = {}
    for name, (dtype, gshape) in plan.tensors.items():
        planned = plan.slices[name]
        slices = [
            SliceEntry(
                file=file_of[(name, ps.k)],
                key=ps.key,
                offsets=list(ps.offsets),
                shape=list(ps.shape),
                xxh3=results[(name, ps.k)][0],
            )
            for ps in planned
        ]
        partials = [results[(name, ps.k)][1] for ps in planned] if opts.fingerprints else None
        extra = (entry_extras or {}).get(name, {})
        entries[name] = tensor_entry(name, dtype, gshape, slices, partials, **extra)
    return build_block(
        kind=opts.kind,
        created_by=_VERSION,
        layout=opts.layout.model_copy(update={"gathered": opts.gather}),
        tensors=entries,
        aliases=aliases,
        save_id=save_id,
        **(block_extras or {}),
    )
