"""The copy of an async save into CPU memory: exactly the slices this rank will write.

A replica (a DDP parameter, a TP bias, the data-parallel copies of HSDP shards) is written by one
of its holders (``planner.plan_save``), so copying every local slice would stage the whole model
on every DDP rank while each writes a quarter of it at 4 ranks. :func:`stage_written` plans first,
in the foreground, from the same listing the save makes, and copies only the slices the plan gives
this rank; the others become placeholders on the ``meta`` device (the save's listing still sees
their boxes, so the background save plans exactly what the foreground did, and the replica check
sees which boxes each rank holds).

The replica check compares the truly replicated boxes only (held by two ranks or more): the
writer digests its copy in the background (``replicas.check_replicas``), the other holders
digest their live tensor here, before the save returns, since nothing of it is copied; a box
one rank holds is never digested.

The copies from CUDA run on a side stream (``io/pinned.py``: one per device), ``non_blocking``
into the process's exact-size pinned buffers, after the compute stream's work so far (the
stream waits for it): the save returns once they are issued, and forward and backward overlap
them. A :class:`~unickpt.io.pinned.Fence` (the event recorded after the last copy) is tracked,
and waited for by the next optimizer step (a step pre-hook), by the writer before it reads the
buffers, by ``CheckpointIO.synchronize()`` and by the next save. A buffer a forward changes
(BatchNorm's running statistics, its batch count) is fenced too: given the model, the modules
owning the buffers being copied get a forward pre-hook that waits for the copies, so the next
forward changes them only once they are copied, and the hooks go once the fence is done
(:func:`guard_buffers`). Any other change outside an optimizer step and a module's own forward
(an in-place edit in the script, a buffer a parent module writes) needs
``CheckpointIO.synchronize()`` first. On CPU the copy is synchronous, as before, its fence is
complete when this returns, and no hook is added.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from unickpt import _dist
from unickpt.io.pinned import Fence, side_stream, stage_copy, track
from unickpt.io.planner import SliceMeta, plan_save
from unickpt.io.replicas import digest_live, replicated_boxes
from unickpt.io.tensors import LocalSlice, SavePayload, SliceKey, Staged, is_dtensor

__all__ = ["guard_buffers", "stage_written", "written_keys"]


def written_keys(all_metas: list[list[SliceMeta]], rank: int) -> tuple[set[int], frozenset[SliceKey]]:
    """Every rank, same input: the positions in ``all_metas[rank]`` this rank writes, and the
    boxes held by two ranks or more. The writers are the save's own (``plan_save`` picks them
    whatever the file grouping and key style, which change only the files)."""
    plan = plan_save(all_metas, kind="model", size_per_shard_bytes=None, sliced=True)
    mine = {ps.local_index for sls in plan.slices.values() for ps in sls if ps.rank == rank}
    return mine, replicated_boxes(all_metas)


def _placeholder(sl: LocalSlice) -> LocalSlice:
    """``sl`` without data: its box and dtype only (another rank writes it)."""
    t = sl.tensor
    return dataclasses.replace(sl, tensor=torch.empty(t.shape, dtype=t.dtype, device="meta"))


def stage_written(
    payload: SavePayload,
    staging: dict[Any, torch.Tensor] | None,
    group: Any = None,
    *,
    replicas: bool = True,
    model: torch.nn.Module | None = None,
) -> SavePayload:
    """Collective over ``group`` (the main thread): ``payload`` with the slices this rank writes
    copied to CPU memory and the others left as placeholders.

    One object exchange (the slices' boxes, with the agreement on listing them). ``replicas``:
    the replica check will run (not ``"off"``): the replicated slices this rank does not write
    are digested now. ``staging``: the CPU buffers reused from one save to the next. ``model``:
    the module ``payload`` was planned from; while the copies run, the forward of its modules
    whose buffers are being copied waits for them (:func:`guard_buffers`).
    """
    err: BaseException | None = None
    metas: list[SliceMeta] = []
    flat: list[LocalSlice] = []
    try:
        for name in payload.tensors:
            flat.extend(payload.slices.get(name, []))
        metas = [sl.meta() for sl in flat]
    except BaseException as e:
        err = e
    all_metas = _dist.agree_gather(err, metas, f"listing the {payload.kind} tensors to stage", group)
    rank = _dist.rank(group)
    mine, replicated = written_keys(all_metas, rank)
    position = {id(sl): i for i, sl in enumerate(flat)}
    digests: dict[SliceKey, str] = {}
    streams: dict[torch.device, Any] = {}
    nbytes = 0
    slices: dict[str, list[LocalSlice]] = {}
    copied: list[torch.Tensor] = []
    for name, sls in payload.slices.items():
        out = []
        for k, sl in enumerate(sls):
            key = (name, tuple(sl.offsets), tuple(sl.shape))
            if position.get(id(sl)) in mine:
                if sl.tensor.device.type == "cuda":  # copied on a side stream: pending on return
                    copied.append(sl.tensor)
                copy = _copy(sl.tensor, staging, (name, k), streams)
                nbytes += copy.nbytes
                out.append(dataclasses.replace(sl, tensor=copy))
                continue
            if replicas and key in replicated and sl.tensor.device.type != "meta":
                d = digest_live(sl.tensor)
                if d is not None:
                    digests[key] = d
            out.append(_placeholder(sl))
        slices[name] = out
    fence = Fence([_recorded(stream) for stream in streams.values()])
    if not streams:
        fence.complete()
    track(fence)
    if model is not None:
        guard_buffers(fence, model, copied)
    return dataclasses.replace(payload, slices=slices, staged=Staged(nbytes, replicated, digests))


def _copy(
    src: torch.Tensor, staging: dict[Any, torch.Tensor] | None, key: Any, streams: dict[torch.device, Any]
) -> torch.Tensor:
    """``src`` copied into its host buffer: on CUDA, issued on the device's side stream (which
    first waits for the work queued so far on the current stream), ``src`` kept from reuse by
    the caching allocator until the copy ran; elsewhere, a synchronous copy."""
    if src.device.type != "cuda":
        return stage_copy(src, staging, key)
    stream = streams.get(src.device)
    if stream is None:
        stream = streams[src.device] = side_stream(src.device)
        stream.wait_stream(torch.cuda.current_stream(src.device))
    with torch.cuda.stream(stream):
        out = stage_copy(src, staging, key)
    src.record_stream(stream)
    return out


def _recorded(stream: Any) -> Any:
    """A CUDA event recorded on ``stream`` now (after the copies issued on it)."""
    event = torch.cuda.Event()
    event.record(stream)
    return event


def guard_buffers(fence: Fence, model: torch.nn.Module, copied: list[torch.Tensor]) -> int:
    """Until ``fence`` is done, the forward of each module of ``model`` that owns a buffer among
    the ``copied`` tensors (their storage) waits for it first (``Fence.guard_forward``: the
    hooks go once it is done). Nothing when the fence is done already (every copy on CPU).
    Returns the number of modules guarded."""
    if fence.done():
        return 0
    sources = {_storage(t) for t in copied} - {0}
    owners = [
        m for m in model.modules() if any(_storage(b) in sources for _, b in m.named_buffers(recurse=False))
    ]
    return fence.guard_forward(owners) if owners else 0


def _storage(t: torch.Tensor) -> int:
    """The address of the memory ``t`` (its local part, for a DTensor) lives in; 0 for none."""
    if is_dtensor(t):
        t = t.to_local()  # type: ignore[attr-defined]
    if t.device.type == "meta":
        return 0
    return int(t.untyped_storage().data_ptr())
