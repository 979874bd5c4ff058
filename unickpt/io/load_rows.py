"""A rank's row-block boxes read in bulk: located from arrays, read in runs.

FSDP's and TP's ``Shard(0)`` store a tensor as row blocks, one per rank's file, and a rank's box
of the tensor is a row range of it. For such a box read straight into its contiguous target,
every part (the rows a stored slice shares with the box) is computed for all its slices at once
from the slice table and the spans located by ``ckpt/slice_spans.py`` (no per-slice lookup),
then added to the load's ``ReadBatch`` as arrays: per file, adjacent parts become one vectored read
(locally one ``preadv``, on an object store coalesced ranged requests),
and the parts of one tensor stored back to back become one buffer.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from unickpt.ckpt.read_batch import ReadBatch
from unickpt.ckpt.slice_spans import Spans
from unickpt.spec.index import TensorEntry

__all__ = ["Located", "add_row_box", "as_bytes"]

#: ``id`` of a ``TensorEntry`` -> (the sorted positions of its slices located, their spans)
Located = dict[int, tuple[np.ndarray, Spans]]


def as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def add_row_box(
    located: Located,
    entry: TensorEntry,
    offsets: tuple[int, ...],
    shape: tuple[int, ...],
    out: torch.Tensor,
    batch: ReadBatch,
) -> bool:
    """Add the reads of the box (offsets, shape) of ``entry`` into ``out`` (contiguous, CPU,
    the stored dtype) to ``batch``. False (nothing added) when the box or its slices are not row
    blocks, a slice was not located, or a part would fall outside its slice's bytes: the per-box
    path (``load.read_box``) then reads it, or names what is wrong."""
    got = located.get(id(entry))
    gshape = list(entry.shape)
    if got is None or len(gshape) < 1 or len(shape) != len(gshape) or list(shape[1:]) != gshape[1:]:
        return False
    if not out.is_contiguous() or math.prod(shape) == 0:
        return False
    table = entry.table
    known, (offs, lens) = got
    whole = not any(offsets) and list(shape) == gshape  # then the slices located are exactly those it needs
    sel = known if whole else np.asarray(table.overlapping(offsets, shape), dtype=np.int64)
    if not len(sel):
        return False
    if len(gshape) > 1 and not (table.shapes[sel, 1:] == np.asarray(gshape[1:], dtype=np.int64)).all():
        return False
    at = np.searchsorted(known, sel)
    if (at >= len(known)).any() or not np.array_equal(known[np.minimum(at, len(known) - 1)], sel):
        return False
    row = math.prod(gshape[1:]) * out.element_size()
    starts = table.offsets[sel, 0]
    lo = np.maximum(starts, offsets[0])
    hi = np.minimum(starts + table.shapes[sel, 0], offsets[0] + shape[0])
    if ((hi - starts) * row > lens[at]).any():
        return False
    batch.add_many(
        table,
        sel,
        offs[at] + (lo - starts) * row,
        (lo - offsets[0]) * row,
        (hi - offsets[0]) * row,
        as_bytes(out),
    )
    return True
