"""The save engine shared by every CheckpointIO: one sequence of steps, list -> agree -> plan
-> prepare -> agree -> write -> agree -> commit, each step the write strategy's
(``io/write_strategy.WriteStrategy``), the strategy chosen once, by ``choose_strategy``, from the
plan's kind and the store's capabilities. A sliced save's files, hashes and index are written by
``ckpt.writer``, as ``merge`` and ``convert`` write theirs.

Order of events (every rank calls ``save_tensors`` with its own tensors):

1. every rank lists the slices it holds (``WriteStrategy.list_slices``, ``metas``); the lists are
   all-gathered (names and shapes only) with the listing's agreement, the aliases, entry
   extras, save id and names (one exchange);
2. every rank computes the same plan (``WriteStrategy.plan``: ``planner.plan_save``; a gathered
   save in a directory reuses the plan of an earlier save with the same slices, ``hf_save.gathered_plan``);
3. rank 0 prepares the directory and takes the save lock; the previous checkpoint stays
   committed and untouched while this save writes; the strategy stages what it writes into
   (``WriteStrategy.stage``: a gathered save's files created by rank 0); one agreement covers
   the plan and the preparation (rank 0 prepares only when its plan succeeded);
4. each writer streams its slices into staging files (``ckpt.writer.CheckpointWriter``:
   hidden temporary names derived from the save id), hashing each slice on a second thread
   while the previous one is written, and fsyncs every file; every file's header carries the
   save id (``WriteStrategy.write_and_commit``, steps 4-6);
5. ranks agree that every write succeeded (else every rank raises, partial files removed);
   the agreement carries every rank's hashes;
6. rank 0 commits through ``store.publish`` (stage the index, un-commit the previous
   checkpoint, rename the data files and then the index into place, remove superseded files
   and leftovers of killed saves) and releases the lock; the last agreement follows that
   release (``write_strategy.settle``), so no rank returns before the checkpoint is committed.

A sliced save in a directory makes 6 object collectives over 2+ ranks (listing, plan and
preparation, writing, the commit's 3), on a store 4 (one commit agreement), a gathered save
in a directory 4 (docs/performance.md, issue 17).

Every file is written through a ``Storage`` (``store/storage.py``: a ``LocalStorage`` for a path),
and what the store can do picks the strategy, never the location (``choose_strategy``): a store
with ``atomic_rename`` stages and renames as above; with ``range_write`` too, a gathered save's
ranks write their bytes in place (``io/hf_save.py``). A URL (``s3://``, ``gs://``...:
``SaveOptions.storage_options``) opens an object store, which has neither (``store/publish.py``,
docs/format.md section 6.1): no staging; rank 0 takes the directory's lock object
(``store/lock.py``: a second writer gets ``CheckpointBusyError``), lists the directory once
under it: a committed checkpoint there, or a stale lock taken over, gives every file a save-id
name, and a directory without data files (nor a stale lock taken over) needs no cleanup after
the commit; each writer streams its files as multipart uploads, and rank 0's commit is the
index's PUT, fenced by the lock (``StoreLock.check`` right before, the PUT conditional on the
version listed under the lock: a save whose lock was taken over raises ``CheckpointBusyError``
and commits nothing). A gathered save on S3 has every rank upload parts of the same multipart
uploads (``io/parts_save.py``); on other stores (no ``pwrite``, no shared uploads) rank 0
writes it (``io/funnel_save.py``).
"""

from __future__ import annotations

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
from unickpt.errors import UnickptError
from unickpt.io.funnel_save import Funnel, FunnelSingle
from unickpt.io.hf_rows import RowMoves
from unickpt.io.hf_save import InPlaceHF
from unickpt.io.parts_save import SharedParts
from unickpt.io.pinned import wait_staged
from unickpt.io.planner import SavePlan, SliceMeta
from unickpt.io.replicas import ReplicaCheck, check_replicas, judge, replica_digests, replicated_boxes
from unickpt.io.tensors import LocalSlice, SavePayload, Staged, as_bytes
from unickpt.io.write_strategy import (
    PlanInputs,
    Results,
    SaveOptions,
    SaveRun,
    WriteStrategy,
    by_slice,
    commit_written,
    file_specs,
    make_writer,
)
from unickpt.spec.naming import single_name
from unickpt.store.lock import directory_lock, store_lock
from unickpt.store.publish import committed_in, makedirs_durable, needs_cleanup, new_save_id, store_file_name
from unickpt.store.storage import Storage, open_location
from unickpt.store.storage_parts import supports_shared_parts

# SaveOptions is write_strategy.py's, re-exported: what a save is written with, beside save_tensors.
__all__ = ["SaveOptions", "WriteSpec", "choose_strategy", "save_tensors", "writes_in_place"]

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
    single_file = opts.gather and not opts.shard
    # Every file goes through the storage layer; what it can do picks how (module docstring).
    where = open_location(path, opts.storage_options)
    store, root = where.storage, where.path
    # An existing file (e.g. a tempfile.NamedTemporaryFile) is replaced by an unsharded save.
    is_file = where.is_file
    file_path = root if is_file else store.join(root, single_name(opts.kind))
    directory = posixpath.dirname(file_path)
    # The committed location is returned as a URL was given; a directory absolute, a single
    # file below the path given (``io.async_save.committed_path``).
    shown = where.shown_file(single_name(opts.kind)) if single_file else where.shown
    if not single_file:
        file_path = ""
        directory = root
        if is_file:
            _dist.agree(
                UnickptError(f"{path}: a sharded or sliced checkpoint is a directory; pass a directory path"),
                "save",
                group,
            )
    strategy = choose_strategy(opts, store, live=live)

    # 1-2. list blocks, gather the lists (with aliases, extras, save id, names), plan.
    err: BaseException | None = None
    local: list[LocalSlice] = []
    save_id = new_save_id()  # rank 0's id is the save's id
    # A gathered save orders its files by the tensors' names as the ranks list them (rank 0's
    # first): a rank may hold no slice of a tensor (a ZeRO range it does not own).
    names_listed = list(tensors) if opts.gather else []
    metas: list[SliceMeta] = []
    before_moves: dict[str, list[LocalSlice]] = {}
    if not strategy.lists_held and replicas is not None:
        # The listing names whole tensors: the slices are checked first, in an exchange of their own.
        held = {name: boxes_fn(name, t) for name, t in tensors.items()}
        check_replicas(held, replicas.mode, replicas.what, group, everywhere=replicas.everywhere)
        replicas = None
    try:
        maybe_fail("save.list")
        local, before_moves = strategy.list_slices(tensors, boxes_fn)
        metas = strategy.metas(local)
    except BaseException as e:
        err = e
    # One exchange agrees on the listing and gathers what planning needs. Entry extras (an
    # optimizer tensor's parameter) and aliases are known to the ranks that hold those tensors:
    # pipeline stages and ZeRO ranks each know part of them.
    gathered = _dist.agree_gather(
        err,
        (metas, aliases or {}, entry_extras or {}, save_id, names_listed),
        "listing tensors to save",
        group,
    )
    all_metas: list[list[SliceMeta]] = [g[0] for g in gathered]
    save_id = gathered[0][3]
    order = list(dict.fromkeys(n for g in gathered for n in g[4]))
    merged_aliases: dict[str, str] = {}
    merged_extras: dict[str, dict[str, Any]] = {}
    for _, rank_aliases, rank_extras, _, _ in gathered:
        for k, v in rank_aliases.items():
            merged_aliases.setdefault(k, v)
        for k, x in rank_extras.items():
            merged_extras.setdefault(k, x)
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
        plan = strategy.plan(PlanInputs(all_metas, strategy.writers(all_metas), opts, root, path, size))
    except BaseException as e:
        err = e

    # 3. rank 0 prepares the directory (and the strategy stages what it writes into). The plan is
    # the same on every rank (a function of the gathered lists): its agreement is the
    # preparation's, and rank 0 prepares only when its own plan succeeded.
    run: SaveRun | None = None
    if plan is not None:
        run = SaveRun(
            plan,
            local,
            tensors,
            store,
            directory,
            file_path,
            size,
            save_id,
            opts,
            merged_aliases,
            merged_extras,
            block_extras or {},
            order,
            group,
            rank,
            world,
        )
    over = False  # an object store holds a committed checkpoint of the kind here
    try:
        if err is None and run is not None and rank == 0:
            maybe_fail("save.prepare")
            over = _prepare(run)
        if run is not None:
            strategy.stage(run)
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
            if run is not None:
                strategy.unstage(run)
            raise
        if run is None:  # never: agree_gather() raised when planning failed on any rank
            raise RuntimeError(f"{path}: no save plan after planning succeeded")
        run.over = not single_file and prepared[0][0]
        if run.over:
            for pf in run.plan.files:  # never overwrite the committed checkpoint's files
                pf.name = store_file_name(pf.name, save_id)

        # 4-6. write, agree (with the hashes), commit: the strategy's.
        strategy.write_and_commit(run)
    finally:
        if run is not None:
            run.lock.close()  # held still only when the save failed before its commit
    # The save's last agreement followed rank 0's commit (and the release of its lock,
    # ``settle``): no rank returns before the checkpoint is committed.
    return shown


def choose_strategy(opts: SaveOptions, store: Storage, *, live: bool = True) -> WriteStrategy:
    """The write strategy of a save with ``opts`` on ``store``, from the plan's kind and what the
    store can do (the one place it is chosen):

    - a sliced save (``gather`` false): ``Sliced``, each rank streams its own slices into its
      own files (staged and renamed where the store has ``atomic_rename``, else uploaded whole);
    - a gathered save on a store with ``range_write`` and ``atomic_rename`` (a local directory):
      ``InPlaceHF`` (``io/hf_save.py``), every rank writes its bytes of the Hugging Face files
      in place (``live``: column-sharded DTensors moved to row slices first, ``io/hf_rows.py``);
    - a gathered save on a store with shared multipart uploads (S3, ``supports_shared_parts``):
      ``SharedParts`` (``io/parts_save.py``), every rank uploads the parts it owns;
    - elsewhere (an object store with neither): rank 0 writes every file from full tensors,
      ``Funnel`` into a directory of files, ``FunnelSingle`` for one file (``io/funnel_save.py``).
    """
    if not opts.gather:
        return Sliced()
    if writes_in_place(store):
        return InPlaceHF(RowMoves() if live else None)
    if supports_shared_parts(store):
        return SharedParts(store)
    return Funnel() if opts.shard else FunnelSingle()


def writes_in_place(store: Storage) -> bool:
    """Whether a gathered save on ``store`` has every rank write its own bytes in place: the store
    writes at offsets and stages by renames (``range_write`` and ``atomic_rename``)."""
    return store.range_write and store.atomic_rename


class Sliced(WriteStrategy):
    """A sliced save: each rank streams the slices the plan gives it into its own files
    (``ckpt/writer.CheckpointWriter``), the writes' agreement carries the hashes, rank 0 builds
    the index and the commit goes across ranks (``commit_written``)."""

    name = "sliced"

    def write_and_commit(self, run: SaveRun) -> None:
        err: BaseException | None = None
        results: Results = {}
        plan, local = run.plan, run.local
        mine = plan.files_of(run.rank)
        try:

            def blocks() -> Iterator[Any]:
                for f in mine:
                    for ps in f.slices:
                        sl = local[ps.local_index]
                        yield ps.key, as_bytes(sl.tensor), (sl.global_shape, sl.offsets, sl.shape)

            writer = make_writer(run.directory, run.opts, plan, run.save_id, run.store)
            results = by_slice(mine, writer.write(file_specs(plan, mine), blocks()))
        except BaseException as e:
            err = e
        commit_written(run, results, err, mine)


def _prepare(run: SaveRun) -> bool:
    """Rank 0: take the directory's save lock (``store/lock.py``), held by ``run.lock``; whether
    a store holds a committed checkpoint of the kind there (its files get save-id names).

    Where the store renames atomically the directory is created (durable) and staged files are
    renamed into place under its ``flock``; on a store, one writer per directory too (its lock
    object), the directory listed under it."""
    store, directory, opts = run.store, run.directory, run.opts
    if store.atomic_rename:
        makedirs_durable(directory, fsync=opts.fsync)
        run.lock.enter_context(directory_lock(directory))
        return False
    held = run.lock.enter_context(store_lock(store, directory, run.save_id, listed=True))
    found = held.listed
    run.fence = held
    # nothing to supersede nor left by a killed save: the commit is the index PUT alone
    run.clean = found is None or found.took_over or needs_cleanup(found.times)
    # Fresh names (with the save id) over a committed checkpoint, and after taking over a stale
    # lock: its holder may only have stalled, and its uploads, should it resume, must never land
    # on this save's files (it fails at its fenced commit).
    return found is not None and (found.took_over or committed_in(found.times, opts.kind))


def open_store(path: str, storage_options: dict[str, Any] | None) -> tuple[Storage, str]:
    """``(storage, location in it)``: an fsspec store for a URL, a ``LocalStorage`` for a local
    path or ``file://`` URL (its location the absolute path).

    The options an IO was given apply to the URLs it saves to; a local path ignores them."""
    where = open_location(path, storage_options)
    return where.storage, where.path


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
        # Replicas to compare: another rank holds them (a world of one has none), and checking is on.
        compared = self.check_replicas != "off" and _dist.world_size(group) > 1
        check = ReplicaCheck(self.check_replicas, what, self.everywhere) if compared else None
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
            replicas=None if payload.staged is not None else check,
        )
