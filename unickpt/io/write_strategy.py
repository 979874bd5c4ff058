"""A save's write strategy: what one save is written with (``SaveOptions``), what every rank plans
it from (``PlanInputs``), the state every rank holds of it once planned (``SaveRun``), the steps the engine calls (``WriteStrategy``), and what
the strategies share: the writer of a save's files, the block a save records, and the commit
across ranks on top of ``store.publish`` (docs/format.md, section 6).

The engine (``io/save.py``: ``save_tensors``, ``choose_strategy``) runs list -> agree -> plan ->
prepare -> agree -> write -> agree -> commit and calls the strategy's step at each; a strategy
runs no collective of its own but those its write and commit steps name (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from unickpt import __version__, _dist
from unickpt._faults import maybe_fail
from unickpt.ckpt.writer import CheckpointWriter, FileSpec, build_block, build_index, tensor_entry
from unickpt.errors import ConfigError
from unickpt.io.planner import PlannedFile, SavePlan, SliceMeta, plan_save
from unickpt.io.replicas import check_gathered_metas
from unickpt.io.tensors import LocalSlice
from unickpt.spec.index import LayoutInfo, TensorEntry, UnickptBlock, index_to_json
from unickpt.spec.slice_table import SliceColumns
from unickpt.store.lock import Fence
from unickpt.store.publish import (
    commit_and_clean,
    commit_directory,
    discard,
    finish_commit,
    place_staged,
    prepare_commit,
)
from unickpt.store.storage import Storage

__all__ = [
    "PlanInputs",
    "Results",
    "SaveOptions",
    "SaveRun",
    "VERSION",
    "WriteStrategy",
    "build_save_block",
    "by_slice",
    "SafetensorsOnlyWarning",
    "check_size_per_shard",
    "check_use_safetensors",
    "commit_collective",
    "commit_written",
    "file_specs",
    "make_writer",
    "settle",
]

VERSION = f"unickpt {__version__}"

#: (tensor name, slice number) -> (xxh3-64 or None, fingerprint partial)
Results = dict[tuple[str, int], tuple[str | None, int]]


@dataclass(frozen=True)
class SaveOptions:
    """The options of one save: its kind, layout (``shard``, ``gather``, the shard size in MB, the
    parallel layout the index records) and what it writes beside the bytes (hashes,
    fingerprints), whether data files are fsynced, and the fsspec options of a URL.

    ``CheckpointIO`` builds it from its own options (``WriteSpec`` in ``io/save.py`` carries it to
    an async save's writer process)."""

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


# The largest shard size a save plans with (1 EiB): ``size_per_shard=float("inf")`` means no
# limit, as in Colossal-AI (every tensor in one file), and stays an integer byte count.
_MAX_SHARD_MB = float(1 << 40)


def check_size_per_shard(size_mb: object) -> float:
    """``size_per_shard`` (MB) as a float; ``ConfigError`` naming it for anything but a positive number.

    ``inf`` is no limit (one file, as Colossal-AI writes). ``None``, strings, NaN, zero and
    negative sizes are refused before anything is planned.
    """
    if not isinstance(size_mb, numbers.Real) or math.isnan(float(size_mb)) or float(size_mb) <= 0:
        raise ConfigError(
            f"size_per_shard must be a positive number of MB (int or float; inf for no limit), got {size_mb!r}"
        )
    return min(float(size_mb), _MAX_SHARD_MB)


class SafetensorsOnlyWarning(UserWarning):
    """``use_safetensors=False`` was passed: unickpt writes safetensors regardless."""


def check_use_safetensors(use_safetensors: bool | None, method: str) -> None:
    """Colossal-AI's ``use_safetensors``: ``True``/``None`` need nothing; ``False`` is explained.

    Colossal-AI writes pickled ``.bin`` files when it is False (its default). unickpt never
    writes pickles: a pickle runs code when it is loaded, cannot be read a slice at a time, and
    has no place for the hashes and fingerprints that ``verify`` and ``diff`` use. The save goes
    ahead in safetensors, and this warning says so.
    """
    if use_safetensors is None or use_safetensors:
        return
    warnings.warn(
        f"{method}(use_safetensors=False): unickpt always writes safetensors (never pickled .bin files: "
        "a pickle executes code when loaded, cannot be read one slice at a time, and has no room for the "
        "slice hashes and fingerprints); saving as safetensors. transformers, huggingface_hub and "
        "Colossal-AI's loaders (given a directory or a .safetensors path) read the result. Pass "
        "use_safetensors=True (or omit it) to silence this.",
        SafetensorsOnlyWarning,
        stacklevel=3,
    )


@dataclass(frozen=True)
class PlanInputs:
    """What a save is planned from, the same on every rank once the listing is gathered
    (``io.save.save_tensors``): ``WriteStrategy.plan`` is a function of it."""

    listed: list[list[SliceMeta]]  # what every rank listed (``WriteStrategy.metas``), in rank order
    writes: list[list[SliceMeta]]  # the slices each rank writes (``WriteStrategy.writers``)
    opts: SaveOptions
    root: str  # the save's location in its store (a local path absolute)
    path: str  # the location as given (for messages)
    size_per_shard_bytes: int | None  # None: no shard size (an unsharded save)


@dataclass
class SaveRun:
    """One save as every rank sees it once planned (built by ``io.save.save_tensors``): what the
    strategy's prepare, write and commit steps take."""

    plan: SavePlan  # the writer of every slice (a gathered save's keys unused)
    local: list[LocalSlice]  # this rank's slices (``PlannedSlice.local_index`` points here)
    tensors: dict[str, torch.Tensor]  # this rank's tensors (a funnel gathers them whole)
    store: Storage
    directory: str
    file_path: str  # the single file, or "" for a sharded or sliced save
    size_per_shard_bytes: int | None
    save_id: str
    opts: SaveOptions
    aliases: dict[str, str]
    entry_extras: dict[str, dict[str, Any]]
    block_extras: dict[str, Any]
    order: list[str]  # tensor names as the ranks list them, rank 0's first: a gathered save's files
    group: Any
    rank: int
    world: int
    # rank 0's save lock: released once committed, before the last agreement (``settle``)
    lock: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    # rank 0's lock on a store (store/lock.py), set once taken: fences the commit
    fence: Fence | None = None
    # a store holds a committed checkpoint of the kind here: new files get save-id names
    over: bool = False
    # rank 0 on a store: the directory held data files before this save (cleanup after the commit)
    clean: bool = True

    @property
    def kind(self) -> str:
        return self.opts.kind


class WriteStrategy:
    """How a save's bytes reach its files: the steps ``io.save.save_tensors`` calls, in order.

    The defaults are a sliced save's listing (every local slice, as held); a strategy overrides
    what it does differently. ``choose_strategy`` (``io/save.py``) picks one from the options and
    the store's capabilities.
    """

    #: what the strategy is, for messages and tests
    name = ""

    #: the listing sends this rank's slices as held, so the replica check rides the save's own
    #: exchanges; False (a strategy listing whole tensors, the funnel): the engine checks the
    #: slices first, in an exchange of their own (``io.save.save_tensors``)
    lists_held = True
    #: the plan cuts the save's files (at most ``size_per_shard`` each); False: it gives only the
    #: writer of every slice, one file per writer, the files planned later from the Hugging Face
    #: layout (``ckpt/hf_layout``)
    plans_files = True
    #: the plan's keys are a sliced save's (one per slice); False: one per tensor, written whole
    slice_keys = True

    def list_slices(
        self, tensors: dict[str, torch.Tensor], boxes_fn: Callable[[str, torch.Tensor], list[LocalSlice]]
    ) -> tuple[list[LocalSlice], dict[str, list[LocalSlice]]]:
        """This rank's local slices as the plan takes them, and the tensors listed otherwise than
        held (their slices as held: the replica check digests those)."""
        local: list[LocalSlice] = []
        for name, t in tensors.items():
            local.extend(boxes_fn(name, t))
        return local, {}

    def metas(self, local: list[LocalSlice]) -> list[SliceMeta]:
        """What this rank's listing sends (names, dtypes and boxes)."""
        return [sl.meta() for sl in local]

    def writers(self, all_metas: list[list[SliceMeta]]) -> list[list[SliceMeta]]:
        """The slices each rank writes, from every rank's listing."""
        return all_metas

    def plan(self, inputs: PlanInputs) -> SavePlan:
        """Every rank's same plan, a function of ``inputs``: a gathered save's listings checked to
        agree on every tensor's dtype and shape (``check_gathered_metas``), then the writer of
        every slice and the files (``planner.plan_save``, as ``plans_files`` and ``slice_keys`` say)."""
        if inputs.opts.gather:
            check_gathered_metas(inputs.listed, inputs.path)
        size = inputs.size_per_shard_bytes if self.plans_files else None
        return plan_save(
            inputs.writes, kind=inputs.opts.kind, size_per_shard_bytes=size, sliced=self.slice_keys
        )

    def stage(self, run: SaveRun) -> None:
        """Local phase on every rank, after rank 0 prepared the directory (one agreement covers both)."""

    def unstage(self, run: SaveRun) -> None:
        """The preparation's agreement failed: remove what ``stage`` created."""

    def write_and_commit(self, run: SaveRun) -> None:
        """Collective: write the files and commit them; every rank raises if any rank failed."""
        raise NotImplementedError


def make_writer(
    directory: str, opts: SaveOptions, plan: SavePlan, save_id: str, store: Storage
) -> CheckpointWriter:
    """The writer of one save's files."""
    return CheckpointWriter(
        directory, opts.kind, save_id, plan.sliced, opts.hashes, opts.fingerprints, opts.fsync, storage=store
    )


def file_specs(plan: SavePlan, files: list[PlannedFile]) -> list[FileSpec]:
    return [(f.name, [(ps.key, plan.tensors[ps.name][0], ps.shape) for ps in f.slices]) for f in files]


def by_slice(files: list[PlannedFile], written: dict[str, tuple[str | None, int]]) -> Results:
    """What the writer returned per key, per (tensor, slice number) (merged across ranks)."""
    return {(ps.name, ps.k): written[ps.key] for f in files for ps in f.slices}


def build_save_block(
    plan: SavePlan,
    results: Results,
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
        slices = SliceColumns(name, gshape)
        for ps in planned:
            slices.add(
                file_name or file_of[(name, ps.k)], ps.key, ps.offsets, ps.shape, results[(name, ps.k)][0]
            )
        partials = [results[(name, ps.k)][1] for ps in planned] if opts.fingerprints else None
        extra = (entry_extras or {}).get(name, {})
        entries[name] = tensor_entry(
            name, dtype, gshape, slices.table(), partials, placeholder=placeholder, **extra
        )
    return build_block(
        kind=opts.kind,
        created_by=VERSION,
        layout=opts.layout.model_copy(update={"gathered": opts.gather}),
        tensors=entries,
        aliases=aliases,
        save_id=save_id,
        **(block_extras or {}),
    )


def commit_written(run: SaveRun, results: Results, err: BaseException | None, own: list[PlannedFile]) -> None:
    """Collective, after each rank wrote its files ``own`` (``results``: their hashes; ``err``: its
    failure): the writes' agreement carries the hashes (one exchange; on a failure every rank
    removes its files), rank 0 builds the block and the index, and the files are committed
    across ranks (``commit_collective``)."""
    plan, store = run.plan, run.store
    # Each rank's own staged files (in its own directory: shared, or node-local before an upload).
    writer = make_writer(run.directory, run.opts, plan, run.save_id, store)
    staged = {f.name: writer.staged_name(f.name) for f in own}
    try:  # the agreement carries the hashes: one exchange
        all_results = _dist.agree_gather(err, results, f"writing {run.directory}", run.group)
    except BaseException:
        # every rank has stopped writing: the successful ranks' files go too
        store.remove(staged.values())
        raise
    index = b""
    if run.rank == 0:
        try:
            maybe_fail("save.commit")
            merged: Results = {}
            for r in all_results:
                merged.update(r)
            block = build_save_block(
                plan, merged, run.opts, run.aliases, run.entry_extras, run.block_extras, save_id=run.save_id
            )
            index = index_to_json(build_index(block, sliced=plan.sliced))
        except BaseException as e:
            err = e
    commit_collective(
        run.directory,
        run.kind,
        run.opts.fsync,
        plan,
        staged,
        index,
        run.save_id,
        err,
        run.group,
        run.rank,
        run.world,
        store,
        run.lock,
        clean=run.clean,
        fence=run.fence,
    )


def commit_collective(
    directory: str,
    kind: str,
    fsync: bool,
    plan: SavePlan,
    staged: dict[str, str],
    index: bytes,
    save_id: str,
    err: BaseException | None,
    group: Any,
    rank: int,
    world: int,
    store: Storage,
    lock: contextlib.ExitStack | None = None,
    *,
    clean: bool = True,
    fence: Fence | None = None,
) -> None:
    """Collective: commit a sharded or sliced save (``store.publish``), or raise on every rank.

    One process commits in one call. Several ranks each rename their own staged files (their
    directories may differ, as with node-local staging before an upload) between rank 0's
    un-commit of the previous checkpoint and its rename of the index. ``lock`` (rank 0's save
    lock) is released after a successful commit, before the last agreement (``settle``).
    ``clean=False`` (rank 0, a store): the directory held no data file when the save began, so the
    commit on the store skips the listing and cleanup after the index PUT (``commit_and_clean``).
    ``fence`` (rank 0, a store): its save lock, which fences the commit (``publish.put_commit_point``).
    Where ``store`` renames atomically, staged files are renamed into place, else the index is
    written last.
    """
    where = f"committing {directory}"
    if not store.atomic_rename:  # every file uploaded whole: the index written last
        _commit_on_store(store, directory, kind, plan, staged, index, err, group, rank, lock, clean, fence)
        return
    if world == 1:
        try:
            if err is None:
                commit_directory(directory, kind, staged, index, save_id=save_id, fsync=fsync)
        except BaseException as e:
            err = e
        settle(err, where, group, lock)
        return
    idx_tmp = ""
    if rank == 0 and err is None:
        try:
            idx_tmp = prepare_commit(directory, kind, index, save_id=save_id, fsync=fsync)
        except BaseException as e:
            err = e
    try:
        _dist.agree(err, where, group)
    except BaseException:
        discard(staged.values())
        raise
    try:
        place_staged(directory, staged, fsync=fsync)
    except BaseException as e:
        err = e
    try:
        _dist.agree(err, where, group)
    except BaseException:
        discard([idx_tmp] if idx_tmp else [])
        raise
    if rank == 0:
        try:
            finish_commit(directory, kind, idx_tmp, {f.name for f in plan.files}, fsync=fsync)
        except BaseException as e:
            err = e
    settle(err, where, group, lock)


def _commit_on_store(
    store: Storage,
    directory: str,
    kind: str,
    plan: SavePlan,
    staged: dict[str, str],
    index: bytes,
    err: BaseException | None,
    group: Any,
    rank: int,
    lock: contextlib.ExitStack | None,
    clean: bool,
    fence: Fence | None = None,
) -> None:
    """Collective, object stores: every data file is uploaded whole; rank 0 writes the index
    (one PUT: the commit), removes what it supersedes and the leftovers of killed saves (one
    listing for both, ``commit_and_clean``; a cleanup failure is only logged)."""
    if rank == 0 and err is None:
        try:
            commit_and_clean(
                store, directory, kind, index, {f.name for f in plan.files}, clean=clean, fence=fence
            )
        except BaseException as e:
            err = e
    try:
        settle(err, f"committing {store.url}", group, lock)
    except BaseException:
        store.remove(staged.values())  # never named by a committed index
        raise


def settle(err: BaseException | None, what: str, group: Any, lock: contextlib.ExitStack | None) -> None:
    """Collective, the last agreement of a save, after rank 0's commit (``err``: this rank's failure).

    A rank that did not fail releases ``lock`` first (rank 0's save lock; on other ranks an empty
    stack), so this agreement is also the save's final barrier: no rank returns before the
    checkpoint is committed and its lock released. A failed rank keeps the lock until it has
    removed its leftovers; a failure to release it fails the save on every rank.
    """
    if err is None and lock is not None:
        try:
            lock.close()
        except BaseException as e:
            err = e
    _dist.agree(err, what, group)
