"""Gathered saves on an object store: rank 0 writes every file (the funnel).

A gathered save into a local directory the ranks share is written by every rank in place
(``io/hf_save.py``: ``pwrite`` into pre-sized staged files). An object store has no ``pwrite``
and no rename: its files are single multipart uploads, so rank 0 assembles each tensor (the
holders' ``full_tensor`` collectives, a ``send`` from the lowest holder of a tensor rank 0 does
not hold, e.g. a pipeline stage) and streams it into the upload, one tensor at a time. Every
rank runs the same iteration so that the collectives line up; a failure on rank 0 keeps it
taking part (``_draining``) so the others reach the agreement.

Two strategies of the save engine (``io.save.choose_strategy``: a gathered save on a store with
neither ``range_write`` and ``atomic_rename`` nor shared multipart uploads): ``Funnel`` writes a
directory of files, committed as a sliced save's (``write_strategy.commit_written``);
``FunnelSingle`` one ``.safetensors`` file, whose upload is the commit. Both list whole tensors
(rank 0 writes each once), so their replica check is an exchange of its own, before the listing.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from unickpt import _dist
from unickpt.ckpt.reader import single_file_name
from unickpt.ckpt.writer import write_single_file
from unickpt.io.pinned import stage_copy
from unickpt.io.planner import PlannedFile, SavePlan, SliceMeta
from unickpt.io.tensors import LocalSlice, SavePayload, as_bytes, is_dtensor, local_slices
from unickpt.io.write_strategy import (
    Results,
    SaveOptions,
    SaveRun,
    WriteStrategy,
    build_save_block,
    by_slice,
    commit_written,
    file_specs,
    make_writer,
    settle,
)
from unickpt.spec.index import UnickptBlock
from unickpt.store.lock import Fence
from unickpt.store.storage import Storage

__all__ = [
    "Funnel",
    "FunnelSingle",
    "write_funnelled",
    "write_funnelled_single",
    "feed_funnel",
    "gathered_snapshot",
]


class Funnel(WriteStrategy):
    """A gathered save into a directory of files, written by rank 0 from full tensors."""

    name = "funnel"
    lists_held = False  # whole tensors (``metas``): the replica check is an exchange of its own
    slice_keys = False  # rank 0 writes each tensor whole

    def metas(self, local: list[LocalSlice]) -> list[SliceMeta]:
        """Each tensor this rank holds once, as a whole tensor."""
        metas: list[SliceMeta] = []
        seen: set[str] = set()
        for sl in local:
            if sl.name not in seen:
                seen.add(sl.name)
                metas.append(
                    (sl.name, sl.dtype, sl.global_shape, (0,) * len(sl.global_shape), sl.global_shape)
                )
        return metas

    def writers(self, all_metas: list[list[SliceMeta]]) -> list[list[SliceMeta]]:
        """Rank 0 writes every tensor whole (the first rank that lists a tensor gives its meta):
        the metas only say which tensors exist."""
        merged: list[SliceMeta] = []
        names: set[str] = set()
        for ms in all_metas:
            for m in ms:
                if m[0] not in names:
                    names.add(m[0])
                    merged.append(m)
        return [merged] + [[] for _ in range(len(all_metas) - 1)]

    def write_and_commit(self, run: SaveRun) -> None:
        err: BaseException | None = None
        results: Results = {}
        try:
            results = write_funnelled(
                run.plan, run.tensors, run.directory, run.opts, run.group, run.rank, run.save_id, run.store
            )
        except BaseException as e:
            err = e
        commit_written(run, results, err, run.plan.files if run.rank == 0 else [])


class FunnelSingle(Funnel):
    """A gathered save into one ``.safetensors`` file, written by rank 0 from full tensors: its
    upload is the commit, so the writes' agreement ends the save."""

    name = "funnel-single"

    def write_and_commit(self, run: SaveRun) -> None:
        err: BaseException | None = None
        try:
            if run.rank == 0:
                write_funnelled_single(
                    run.plan,
                    run.tensors,
                    run.file_path,
                    run.opts,
                    run.aliases,
                    run.entry_extras,
                    run.block_extras,
                    run.group,
                    run.save_id,
                    run.store,
                    run.fence,
                )
            else:
                feed_funnel(run.plan, run.tensors, run.group, run.rank)
        except BaseException as e:
            err = e
        settle(err, f"writing {run.directory}", run.group, run.lock)


def _refuse_slices_only(name: str, t: torch.Tensor) -> None:
    """A tensor under a mapped (Hub) name made of sharded tensors is known by its slices only
    (``io/mapping.map_payload``): it cannot be gathered whole here."""
    if t.device.type == "meta":
        from unickpt.errors import UnsupportedError

        raise UnsupportedError(
            f"{name}: a gathered save under mapped (Hub) names of sharded tensors needs a local "
            "directory or a store with shared multipart uploads; save sliced (gather_dtensor=False) "
            "and run unickpt merge"
        )


def _full_tensor_for(
    name: str, tensors: dict[str, torch.Tensor], group: Any, rank: int, holder: int
) -> torch.Tensor | None:
    """Collective over the holders of ``name``: return the full tensor on rank 0, None elsewhere."""
    t = tensors.get(name)
    full = None
    if t is not None:
        _refuse_slices_only(name, t)
        full = t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]
    if holder != 0 and rank == holder and full is not None:
        # The tensor lives only on other ranks (pipeline stages): the lowest holder sends it,
        # and rank 0 receives it in _gathered_blocks.
        import torch.distributed as dist

        dist.send(full.detach().cpu().contiguous(), dst=0, group=_dist.cpu_group(group))
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

    Every rank must run the same iteration (``feed_funnel`` on ranks other than 0) so that
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
                    dist.recv(full, src=holder, group=_dist.cpu_group(group))
                yield ps.key, as_bytes(full), (gshape, (0,) * len(gshape), gshape)
            del full


def feed_funnel(plan: SavePlan, tensors: dict[str, torch.Tensor], group: Any, rank: int) -> None:
    for _ in _gathered_blocks(plan, tensors, group, rank, plan.files):
        pass


def write_funnelled(
    plan: SavePlan,
    tensors: dict[str, torch.Tensor],
    directory: str,
    opts: SaveOptions,
    group: Any,
    rank: int,
    save_id: str,
    store: Storage,
) -> Results:
    if rank != 0:
        feed_funnel(plan, tensors, group, rank)
        return {}
    gen = _gathered_blocks(plan, tensors, group, rank, plan.files)
    with _draining(gen):
        written = make_writer(directory, opts, plan, save_id, store).write(file_specs(plan, plan.files), gen)
    return by_slice(plan.files, written)


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


def write_funnelled_single(
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
    fence: Fence | None = None,
) -> Results:
    """One ``.safetensors`` file carrying the unickpt block in its header metadata
    (``format.writer.write_single_file``: placeholder header, data, rewritten header, commit)."""
    (f,) = plan.files
    name = single_file_name(file_path, opts.kind)
    f = PlannedFile(name, 0, f.slices)

    def make_block(written: Mapping[str, tuple[str | None, int]], placeholder: bool) -> UnickptBlock:
        results = {(ps.name, ps.k): written[ps.key] for ps in f.slices}
        return build_save_block(
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
            file_specs(plan, [f])[0][1],
            gen,
            make_block,
            kind=opts.kind,
            save_id=save_id,
            hashes=opts.hashes,
            fingerprints=opts.fingerprints,
            fsync=opts.fsync,
            storage=store,
            fence=fence,
        )
    return by_slice([f], written)


def gathered_snapshot(
    payload: SavePayload, group: Any, staging: dict[Any, torch.Tensor] | None = None
) -> SavePayload:
    """Collective: a copy of ``payload`` for an async funnelled save: CPU copies of the full
    tensors, each kept only by the rank that writes or sends it (the lowest rank holding it).

    Every rank runs the same loop, so the ``full_tensor`` collectives line up as in the
    synchronous save; ``staging`` keeps the buffers for the next call.
    """
    names = _dist.all_gather_object(list(payload.tensors), group)
    holder: dict[str, int] = {}
    for r, ns in enumerate(names):
        for n in ns:
            holder.setdefault(n, r)
    me = _dist.rank(group)
    out: dict[str, torch.Tensor] = {}
    for name, t in payload.tensors.items():
        _refuse_slices_only(name, t)
        full = t.full_tensor() if is_dtensor(t) else t  # type: ignore[attr-defined]
        if holder[name] == me:
            out[name] = stage_copy(full, staging, name)
        del full
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return dataclasses.replace(payload, tensors=out, slices={n: local_slices(n, t) for n, t in out.items()})
