"""Column slices of a gathered save become row slices first: one write and one range per rank.

A gathered save writes each tensor's bytes in C order, so a rank's local slice of a DTensor
sharded on a dimension other than the first (``Shard(1)``: TP's row-parallel weights, and
FSDP2 or DDP over them) is one byte run per row: thousands of small writes and as many hash
ranges. Here each such DTensor is redistributed, one tensor at a time just before its bytes
are written, to placements that cut only the first dimension (``Shard(d)`` becomes
``Shard(0)``, ``Replicate`` stays), so that every rank's piece is one run. The files do not
change (the bytes of the global tensor are the same); only who writes which bytes does, and
the index records one range per writing rank instead of one per row.

The plan needs every rank's boxes before any data moves: :class:`RowMoves` lists each
tensor's box after the redistribution (``compute_local_shape_and_global_offset`` of the target
placements) when the slices are listed, and :meth:`RowMoves.local` runs the redistribution
(a collective on the tensor's mesh) when the tensor's turn to be written comes. Every rank of
the mesh calls it for the same tensors in the same order (the save order), including ranks that
write nothing of the tensor; a rank whose writing failed keeps taking part.

Left as they were (one run per row): ``_StridedShard`` placements (FSDP2 over TP on the same
dimension already gives each rank rows), local slices that are not the DTensor's live shard
(an async save's CPU copy: its redistribution happens in the foreground, see
:func:`row_snapshot`), and tensors whose leading dimensions hold one row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from unickpt.io.tensors import LocalSlice, global_shape, is_dtensor

__all__ = ["RowMoves", "row_placements", "row_snapshot"]

# False writes column slices row by row, as before the moves (benchmarks/hf_columns.py compares).
ROW_MOVES = True


def row_placements(t: torch.Tensor) -> tuple[Any, ...] | None:
    """The placements that give ``t``'s ranks row slices, or None when it needs no move."""
    if not ROW_MOVES or not is_dtensor(t):
        return None
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = tuple(t.placements)  # type: ignore[attr-defined]
    if any(isinstance(p, _StridedShard) for p in placements):
        return None
    gshape = global_shape(t)
    cut = [p.dim for p in placements if isinstance(p, Shard) and p.dim > 0]
    # A column cut after leading dimensions of one row is already one run per rank.
    if not cut or math.prod(gshape[: min(cut)]) <= 1:
        return None
    return tuple(Shard(0) if isinstance(p, Shard) else p for p in placements)


def _row_box(t: torch.Tensor, target: tuple[Any, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offsets = compute_local_shape_and_global_offset(global_shape(t), t.device_mesh, target)  # type: ignore[attr-defined]
    return tuple(int(o) for o in offsets), tuple(int(s) for s in shape)


def _is_live_shard(t: torch.Tensor, slices: list[LocalSlice]) -> bool:
    """Whether ``slices`` are the DTensor's own local shard (not a copy, not a custom cut)."""
    local = t._local_tensor  # type: ignore[attr-defined]
    if not slices:
        return bool(local.numel() == 0)
    if len(slices) != 1:
        return False
    lt = slices[0].tensor
    return (
        tuple(lt.shape) == tuple(local.shape)
        and lt.data_ptr() == local.data_ptr()
        and lt.stride() == local.stride()
    )


class RowMoves:
    """The tensors of one gathered save that this rank redistributes to row slices, in save order."""

    def __init__(self) -> None:
        self.moves: dict[str, tuple[torch.Tensor, tuple[Any, ...]]] = {}

    def take(self, name: str, t: torch.Tensor, slices: list[LocalSlice]) -> list[LocalSlice]:
        """This rank's slices of ``name`` as the save will write them (row boxes after a move)."""
        target = row_placements(t)
        if target is None or not _is_live_shard(t, slices):
            return slices
        self.moves[name] = (t, target)
        offsets, shape = _row_box(t, target)
        if math.prod(shape) == 0:
            return []
        dtype = slices[0].dtype if slices else _st(t, name)
        # The tensor is the DTensor itself until ``local`` moves it.
        return [LocalSlice(name, dtype, global_shape(t), offsets, shape, t)]

    def __contains__(self, name: str) -> bool:
        return name in self.moves

    def local(self, name: str) -> torch.Tensor:
        """Collective on the tensor's mesh: this rank's row slice of ``name`` (a new tensor)."""
        t, target = self.moves[name]
        with torch.no_grad():
            moved = t.detach().redistribute(t.device_mesh, target)  # type: ignore[attr-defined]
            local: torch.Tensor = moved.to_local()
        # Without an all-to-all (gloo) torch gathers the whole tensor and keeps a view of it:
        # copy the slice out, so that only the slice stays alive until it is written and hashed.
        if local.untyped_storage().nbytes() > local.numel() * local.element_size():
            local = local.contiguous() if not local.is_contiguous() else local.clone()
        return local


def _st(t: torch.Tensor, name: str) -> str:
    from unickpt.io.tensors import st_dtype

    return st_dtype(t.dtype, name)


def row_snapshot(
    tensors: dict[str, torch.Tensor], slices: dict[str, list[LocalSlice]]
) -> dict[str, list[LocalSlice]]:
    """Collective: ``slices`` with every column-sharded DTensor's replaced by its row slice.

    For an async gathered save, in the foreground (the redistribution uses the training's
    meshes, which the background thread must not touch); the row slices are new tensors,
    copied to CPU by the snapshot that follows, so the thread writes them as one run each.
    """
    out = dict(slices)
    moves = RowMoves()
    for name, t in tensors.items():
        if name in slices:
            out[name] = moves.take(name, t, slices[name])
    for name in moves.moves:
        moved = moves.local(name)
        out[name] = [dataclasses.replace(sl, tensor=moved) for sl in out[name]]
    return out
