"""The save engine shared by every CheckpointIO: the collective work of a save (listing
slices, planning, agreeing); a sliced save's files, hashes and index are written by
``format.writer``, as ``merge`` and ``convert`` write theirs. A gathered save (Hugging Face
files) takes steps 4-6 in ``io.hf_save``: every rank writes its own bytes into the files.

Order of events (every rank calls ``save_tensors`` with its own tensors):

1. every rank lists the blocks it holds; the lists are all-gathered (names and shapes only)
   with the listing's agreement, the aliases, entry extras, save id and names (one exchange);
2. every rank computes the same plan (``planner.plan_save``; a gathered save in a directory
   reuses the plan of an earlier save with the same slices, ``io.plan_cache``);
3. rank 0 prepares the directory and takes the save lock; the previous checkpoint stays
   committed and untouched while this save writes; one agreement covers the plan and the
   preparation (rank 0 prepares only when its plan succeeded);
4. each writer streams its blocks into staging files (``format.writer.CheckpointWriter``:
   hidden temporary names derived from the save id), hashing each block on a second thread
   while the previous one is written, and fsyncs every file; every file's header carries the
   save id;
5. ranks agree that every write succeeded (else every rank raises, partial files removed);
   the agreement carries every rank's hashes;
6. rank 0 commits through ``store.publish`` (stage the index, un-commit the previous
   checkpoint, rename the data files and then the index into place, remove superseded files
   and leftovers of killed saves) and releases the lock; the last agreement follows that
   release (``io._commit.settle``), so no rank returns before the checkpoint is committed.

A sliced save in a directory makes 6 object collectives over 2+ ranks (listing, plan and
preparation, writing, the commit's 3), on a store 4 (one commit agreement), a gathered save
in a directory 4 (docs/performance.md, issue 17).

Every file is written through a ``Storage`` (``store/storage.py``: a ``LocalStorage`` for a path),
and what the store can do picks the strategy, never the location: a store with ``atomic_rename``
stages and renames as above; ``range_write`` lets a gathered save's ranks write their bytes in
place (``io/hf_save.py``). A URL (``s3://``, ``gs://``...: ``SaveOptions.storage_options``) opens
an object store, which has neither (``store/publish.py``, docs/format.md section 6.1): no staging; rank 0 takes the
directory's lock object (``store/lock.py``: a second writer gets ``CheckpointBusyError``),
lists the directory once under it: a committed checkpoint there, or a stale lock taken over,
gives every file a save-id name, and a directory without data files (nor a stale lock taken
over) needs no cleanup after the commit; each writer streams its files as multipart uploads,
and rank 0's commit is the index's PUT, fenced by the lock (``StoreLock.check`` right before,
the PUT conditional on the version listed under the lock: a save whose lock was taken over
raises ``CheckpointBusyError`` and commits nothing). A gathered save
on S3 has every rank upload parts of the same multipart uploads (``io/parts_save.py``); on
other stores (no ``pwrite``, no shared uploads) rank 0 writes it (``io/funnel_save.py``).
"""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt._rng import keeps_python_random
from unickpt.ckpt.writer import build_index
from unickpt.errors import UnickptError
from unickpt.io._commit import commit_collective, settle
from unickpt.io.funnel_save import feed_funnel, write_funnelled, write_funnelled_single
from unickpt.io.hf_rows import RowMoves
from unickpt.io.hf_save import GatheredSave, StagedHF, save_gathered, stage_gathered
from unickpt.io.parts_save import save_gathered_parts
from unickpt.io.payload import SavePayload, Staged
from unickpt.io.pinned import wait_staged
from unickpt.io.plan_cache import gathered_plan
from unickpt.io.planner import SavePlan, SliceMeta, plan_save
from unickpt.io.replicas import (
    ReplicaCheck,
    check_gathered_metas,
    check_replicas,
    judge,
    replica_digests,
    replicated_boxes,
)
from unickpt.io.save_block import Results as _Results
from unickpt.io.save_block import build_save_block, by_slice, file_specs, make_writer
from unickpt.io.save_options import SaveOptions
from unickpt.io.tensors import LocalSlice, as_bytes
from unickpt.spec.index import index_to_json
from unickpt.spec.naming import single_name
from unickpt.store.lock import StoreLock, directory_lock, store_lock
from unickpt.store.publish import (
    committed_in,
    makedirs_durable,
    needs_cleanup,
    new_save_id,
    store_file_name,
)
from unickpt.store.storage import FsspecStorage, Storage, is_url, open_storage
from unickpt.store.storage_parts import supports_shared_parts

# SaveOptions is save_options.py's, re-exported: what a save is written with, beside save_tensors.
__all__ = ["SaveOptions", "WriteSpec", "save_tensors"]

logger = get_logger(__name__)


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
    live: bool = True,
    replicas: ReplicaCheck | None = None,
) -> str:
    """Collective. Save ``tensors`` (this rank's view) as one checkpoint; returns the committed path.

    ``live=False``: the slices ``boxes_fn`` gives are copies (an async save's snapshot), on every
    rank alike, so no tensor is redistributed to row slices (``io/hf_rows.py``): that collective
    runs on the training's mesh, and whether a rank would take part must not depend on what it
    holds (a rank holding no slice of a tensor cannot tell a copy from a live shard).

    ``replicas``: the replica check (``io/replicas.py``), made inside the save's own exchanges:
    once the listing is gathered, each rank digests only the boxes two ranks or more hold, and
    the digests travel with the planning agreement; divergent replicas warn, or raise on every
    rank before anything is written. A funnelled save (a store without shared uploads) lists
    whole tensors, so it checks its slices first, in an exchange of their own.
    """

    rank, world = _dist.rank(group), _dist.world_size(group)
    aliases = aliases or {}
    single_file = opts.gather and not opts.shard
    # Every file goes through the storage layer; what it can do picks how (module docstring).
    store, root = open_store(path, opts.storage_options)
    # The committed location is returned as a URL was given; a directory absolute, a single
    # file below the path given (``io.async_save.committed_path``).
    url = is_url(path)
    given = path if url else path.removeprefix("file://")
    # An existing file (e.g. a tempfile.NamedTemporaryFile) is replaced by an unsharded save.
    is_file = root.endswith(".safetensors") or (not url and os.path.isfile(root))
    file_path = root if is_file else store.join(root, single_name(opts.kind))
    shown_file = path if url else given if is_file else os.path.join(given, single_name(opts.kind))
    directory = posixpath.dirname(file_path)
    if not single_file:
        file_path = ""
        directory = root
        if is_file:
            _dist.agree(
                UnickptError(f"{path}: a sharded or sliced checkpoint is a directory; pass a directory path"),
                "save",
                group,
            )

    # 1-2. list blocks, gather the lists (with aliases, extras, save id, names), plan.
    err: BaseException | None = None
    local: list[LocalSlice] = []
    # A gathered save in a directory moves column-sharded DTensors to row slices as it writes
    # them (io/hf_rows.py): the plan takes their boxes after the move.
    # A gathered save on a store that writes at offsets (and stages by renames) has every rank
    # write its own bytes in place (io/hf_save.py); on one with shared multipart uploads (S3)
    # every rank uploads parts of the files (io/parts_save.py); elsewhere rank 0 writes them
    # whole (io/funnel_save.py).
    in_place = opts.gather and store.range_write and store.atomic_rename
    rows = RowMoves() if in_place and live else None
    funnel = opts.gather and not in_place and not supports_shared_parts(store)
    save_id = new_save_id()  # rank 0's id is the save's id
    # A gathered save orders its files by the tensors' names as the ranks list them (rank 0's
    # first): a rank may hold no slice of a tensor (a ZeRO range it does not own).
    names_listed = list(tensors) if opts.gather else []
    metas: list[SliceMeta] = []
    before_moves: dict[str, list[LocalSlice]] = {}
    if replicas is not None and funnel:
        by_name: dict[str, list[LocalSlice]] = {}
        for name, t in tensors.items():
            by_name[name] = boxes_fn(name, t)
        check_replicas(by_name, replicas.mode, replicas.what, group, everywhere=replicas.everywhere)
        replicas = None
    try:
        maybe_fail("save.list")
        for name, t in tensors.items():
            sls = boxes_fn(name, t)
            local.extend(sls if rows is None else rows.take(name, t, sls))
            if rows is not None and name in rows:  # its row slice is not moved yet: check these
                before_moves[name] = sls
        metas = _funnel_metas(local) if funnel else [sl.meta() for sl in local]
    except BaseException as e:
        err = e
    # One exchange agrees on the listing and gathers what planning needs. Entry extras (an
    # optimizer tensor's parameter) and aliases are known to the ranks that hold those tensors:
    # pipeline stages and ZeRO ranks each know part of them.
    gathered = _dist.agree_gather(
        err, (metas, aliases, entry_extras or {}, save_id, names_listed), "listing tensors to save", group
    )
    all_metas: list[list[SliceMeta]] = [g[0] for g in gathered]
    if funnel:  # each tensor is written whole by rank 0; metas only say which tensors exist
        per_rank: list[list[SliceMeta]] = [_merge_metas(all_metas)] + [[] for _ in range(world - 1)]
    else:  # every rank's slices (names and boxes only); a gathered save writes them in place too
        per_rank = all_metas
    save_id = gathered[0][3]
    order = list(dict.fromkeys(n for g in gathered for n in g[4]))
    merged_aliases: dict[str, str] = {}
    merged_extras: dict[str, dict[str, Any]] = {}
    for _, rank_aliases, rank_extras, _, _ in gathered:
        for k, v in rank_aliases.items():
            merged_aliases.setdefault(k, v)
        for k, x in rank_extras.items():
            merged_extras.setdefault(k, x)
    aliases, entry_extras = merged_aliases, merged_extras
    size = None if not opts.shard else int(opts.size_per_shard_mb * 1024 * 1024)
    plan: SavePlan | None = None
    report: dict[Any, str] = {}  # this rank's replica digests, carried by the planning agreement
    try:
        if replicas is not None and replicas.mode != "off" and world > 1:
            maybe_fail("replicas.digest")
            boxes: dict[str, list[LocalSlice]] = {}
            for sl in local:
                if sl.name not in before_moves:
                    boxes.setdefault(sl.name, []).append(sl)
            report = replica_digests(boxes, Staged(0, replicated_boxes(all_metas)))
            # A tensor moved to row slices as it is written: its slices as held now, all digested.
            report.update(replica_digests(before_moves))
        else:
            replicas = None
        maybe_fail("save.plan")
        if in_place:  # the plan of the last save of this layout, when it repeats
            plan = gathered_plan(all_metas, kind=opts.kind, path=root)
        elif funnel:
            check_gathered_metas(all_metas, path)
            plan = plan_save(per_rank, kind=opts.kind, size_per_shard_bytes=size, sliced=False)
        else:  # a gathered save uses the plan for its writers only: hf_save plans its files
            if opts.gather:
                check_gathered_metas(all_metas, path)
            plan = plan_save(
                per_rank, kind=opts.kind, size_per_shard_bytes=None if opts.gather else size, sliced=True
            )
    except BaseException as e:
        err = e

    # 3. rank 0 prepares the directory (and, for a gathered save, creates its staged files). The
    # plan is the same on every rank (a function of the gathered lists): its agreement is the
    # preparation's, and rank 0 prepares only when its own plan succeeded.
    lock = contextlib.ExitStack()
    over = False  # an object store holds a committed checkpoint of the kind here
    clean = True  # rank 0 on a store: the directory held data files before this save
    held: StoreLock | None = None  # rank 0 on a store: its lock, which fences the commit
    gs: GatheredSave | None = None
    if plan is not None and opts.gather and not funnel:  # 4-6: every rank writes its bytes of the HF files
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
            rows,
            lock,
        )
    staged_hf: StagedHF | None = None
    try:
        if err is None and rank == 0:
            maybe_fail("save.prepare")
            if store.atomic_rename:  # staged files, renamed into place under the directory's lock
                makedirs_durable(directory, fsync=opts.fsync)
                lock.enter_context(directory_lock(directory))
            else:  # one writer per directory on a store too (store/lock.py), listed under it
                held = lock.enter_context(store_lock(store, directory, save_id, listed=True))
                found = held.listed
                # Fresh names (with the save id) over a committed checkpoint, and after taking over
                # a stale lock: its holder may only have stalled, and its uploads, should it resume,
                # must never land on this save's files (it fails at its fenced commit).
                over = found is not None and (found.took_over or committed_in(found.times, opts.kind))
                # nothing to supersede nor left by a killed save: the commit is the index PUT alone
                clean = found is None or found.took_over or needs_cleanup(found.times)
                if gs is not None:
                    gs.fence = held
        if gs is not None and in_place:  # the files' layout; rank 0 creates them (one agreement)
            staged_hf = stage_gathered(gs, store, rank)
    except BaseException as e:
        err = e
    try:
        try:  # rank 0's finding on the store travels with the agreement
            prepared = _dist.agree_gather(
                err, (over, report), f"planning the save and preparing {directory}", group
            )
            if replicas is not None:  # every rank, the same reports: warns, or raises everywhere
                judge([p[1] for p in prepared], replicas.mode, replicas.what, everywhere=replicas.everywhere)
        except BaseException:
            if staged_hf is not None:
                store.remove(staged_hf.own.values())
            raise
        if plan is None:  # never: agree_gather() raised when planning failed on any rank
            raise RuntimeError(f"{path}: no save plan after planning succeeded")
        over = not store.atomic_rename and not single_file and prepared[0][0]
        if over:
            for pf in plan.files:  # never overwrite the committed checkpoint's files
                pf.name = store_file_name(pf.name, save_id)

        if gs is not None:
            if staged_hf is not None:
                save_gathered(gs, staged_hf, group, rank)
            elif isinstance(store, FsspecStorage):  # S3: every rank uploads its parts
                save_gathered_parts(gs, store, over, group, rank, world)
            return _finish(lock, shown_file if single_file else path if url else directory)
        # 4. write.
        results: _Results = {}
        try:
            if single_file:
                if rank == 0:
                    results = write_funnelled_single(
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
                        held,
                    )
                else:
                    feed_funnel(plan, tensors, group, rank)
            elif opts.gather:
                results = write_funnelled(plan, tensors, directory, opts, group, rank, save_id, store)
            else:
                mine = plan.files_of(rank)

                def blocks() -> Iterator[Any]:
                    for f in mine:
                        for ps in f.slices:
                            sl = local[ps.local_index]
                            yield ps.key, as_bytes(sl.tensor), (sl.global_shape, sl.offsets, sl.shape)

                written = make_writer(directory, opts, plan, save_id, store).write(
                    file_specs(plan, mine), blocks()
                )
                results = by_slice(mine, written)
        except BaseException as e:
            err = e
        # Each rank's own staged files (in its own directory: shared, or node-local before an upload).
        own = (
            [] if single_file else plan.files_of(rank) if not opts.gather else plan.files if rank == 0 else []
        )
        staged = {f.name: make_writer(directory, opts, plan, save_id, store).staged_name(f.name) for f in own}
        if single_file:  # rank 0 wrote and committed the file: this agreement ends the save
            settle(err, f"writing {directory}", group, lock)
            return _finish(lock, shown_file)
        try:  # the agreement carries the hashes: one exchange
            all_results = _dist.agree_gather(err, results, f"writing {directory}", group)
        except BaseException:
            # every rank has stopped writing: the successful ranks' files go too
            store.remove(staged.values())
            raise

        # 5-6. commit.
        index = b""
        if rank == 0:
            try:
                maybe_fail("save.commit")
                merged_results: _Results = {}
                for r in all_results:
                    merged_results.update(r)
                block = build_save_block(
                    plan, merged_results, opts, aliases, entry_extras, block_extras, save_id=save_id
                )
                index = index_to_json(build_index(block, sliced=plan.sliced))
            except BaseException as e:
                err = e
        commit_collective(
            directory,
            opts.kind,
            opts.fsync,
            plan,
            staged,
            index,
            save_id,
            err,
            group,
            rank,
            world,
            None if store.atomic_rename else store,  # renamed into place, or the index written last
            lock,
            clean=clean,
            fence=held,
        )
    finally:
        lock.close()
    return _finish(lock, path if url else directory)


def _finish(lock: contextlib.ExitStack, committed: str) -> str:
    """``committed``, the committed path. The save's last agreement followed rank 0's commit (and
    the release of its lock, ``io._commit.settle``): no rank returns before the checkpoint is
    committed."""
    lock.close()  # held still only when the save failed before its commit
    return committed


def _funnel_metas(local: list[LocalSlice]) -> list[SliceMeta]:
    """A funnelled save's metas: each tensor this rank holds once, as a whole tensor."""
    metas: list[SliceMeta] = []
    seen: set[str] = set()
    for sl in local:
        if sl.name not in seen:
            seen.add(sl.name)
            metas.append((sl.name, sl.dtype, sl.global_shape, (0,) * len(sl.global_shape), sl.global_shape))
    return metas


def _merge_metas(all_metas: list[list[SliceMeta]]) -> list[SliceMeta]:
    """Every rank's tensors once (the first rank that lists a tensor gives its meta)."""
    merged: list[SliceMeta] = []
    names: set[str] = set()
    for ms in all_metas:
        for m in ms:
            if m[0] not in names:
                names.add(m[0])
                merged.append(m)
    return merged


def open_store(path: str, storage_options: dict[str, Any] | None) -> tuple[Storage, str]:
    """``(storage, location in it)``: an fsspec store for a URL, a ``LocalStorage`` for a local
    path or ``file://`` URL (its location the absolute path).

    The options an IO was given apply to the URLs it saves to; a local path ignores them."""
    return open_storage(path, storage_options if is_url(path) else None)


@dataclass(frozen=True)
class WriteSpec:
    """What ``CheckpointIO.write`` saves with: its ``SaveOptions`` and replica check, without the IO
    (picklable: no process group, no mesh; an async save's writer process runs it)."""

    options: SaveOptions
    check_replicas: str
    everywhere: bool

    @keeps_python_random
    def write(self, payload: SavePayload, checkpoint: str | os.PathLike[str], group: Any) -> str:
        """Collective over ``group``: save ``payload``; returns the committed path."""
        slices = payload.slices
        what = f"saving the {payload.kind} to {os.fspath(checkpoint)}"
        check = ReplicaCheck(self.check_replicas, what, self.everywhere)
        if payload.staged is not None:  # a copy: its replica digests were planned when it was staged
            wait_staged()  # its copies (a side CUDA stream, io/stage.py) are done before it is read
            check_replicas(
                slices, self.check_replicas, what, group, everywhere=self.everywhere, staged=payload.staged
            )

        def slices_fn(name: str, tensor: torch.Tensor) -> list[LocalSlice]:
            del tensor
            return slices[name]

        return save_tensors(
            payload.tensors,
            os.fspath(checkpoint),
            self.options,
            slices_fn,
            aliases=payload.aliases,
            entry_extras=payload.entry_extras,
            block_extras=payload.block_extras,
            group=group,
            live=payload.staged is None,
            replicas=check if payload.staged is None else None,
        )
