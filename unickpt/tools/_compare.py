"""Element-by-element comparison of two stored tensors, streamed in bounded memory (``diff --deep``).

Each tensor is read in global C order, a flat range of elements at a time, whatever its slices:
the range is split into boxes that are contiguous runs of the global tensor
(:func:`~unickpt.spec.boxes.flat_range_to_boxes`); the part of a box that one slice holds is
a contiguous run of that slice's bytes, read with one ``pread`` and put in place. Elements are
compared as raw words of the item size, so ``-0.0`` differs from ``0.0`` and a NaN payload
counts: the question is whether the stored bits are equal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from unickpt.ckpt.reader import CheckpointReader
from unickpt.errors import CheckpointFormatError
from unickpt.spec.boxes import contiguous_start, flat_range_to_boxes, intersect
from unickpt.spec.dtypes import word_dtype
from unickpt.spec.index import TensorEntry

__all__ = ["DataDifference", "compare_tensors", "read_flat"]

#: Elements per side and step: 16 MiB of fp32; memory stays a few times this whatever the tensor.
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class DataDifference:
    """Where two stored tensors of equal dtype and shape differ."""

    name: str
    first_index: list[int]  # the first differing element (C order), as a multi-index
    first_flat: int
    count: int  # differing elements
    numel: int

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.count} of {self.numel} element(s) differ, "
            f"first at index {self.first_index} (flat {self.first_flat})"
        )


def read_flat(r: CheckpointReader, t: TensorEntry, start: int, stop: int) -> np.ndarray:
    """Elements [start, stop) of the global C-order tensor as unsigned words of the item size.

    The slices are read from the tensor's table (``SliceTable``: file, key and box from its
    columns, the slices a box meets by ``overlapping``): no ``SliceEntry`` built."""
    wd = word_dtype(t.dtype)
    out = np.empty(stop - start, dtype=wd)
    if stop == start:
        return out
    table = t.table
    isz = wd.itemsize
    if len(t.shape) == 0:  # one element: any slice holds it
        r.read_key_bytes(table.file(0), table.key(0), 0, isz, memoryview(out.view(np.uint8)))  # type: ignore[arg-type]
        return out
    for (boff, bshape), flat0 in flat_range_to_boxes(t.shape, start, stop):
        box = out[flat0 - start : flat0 - start + math.prod(bshape)].reshape(bshape)
        got = 0
        for k in table.overlapping(boff, bshape):
            offsets, shape = table.box(k)
            inter = intersect(boff, bshape, offsets, shape)
            if inter is None:  # pragma: no cover - overlapping gives the slices that meet the box
                continue
            ioff, ishp = inter
            src_off = [a - b for a, b in zip(ioff, offsets, strict=True)]
            first = contiguous_start(shape, src_off, ishp)
            if first is None:  # pragma: no cover - a run of the global tensor is a run of any slice
                raise CheckpointFormatError(f"tensor: internal: box {ioff}+{ishp} is not a run of a slice")
            n = math.prod(ishp)
            buf = np.empty(n, dtype=wd)
            view = memoryview(buf.view(np.uint8))  # type: ignore[arg-type]
            r.read_key_bytes(table.file(k), table.key(k), first * isz, n * isz, view)
            dst = tuple(slice(a - b, a - b + c) for a, b, c in zip(ioff, boff, ishp, strict=True))
            box[dst] = buf.reshape(ishp)
            got += n
        if got != math.prod(bshape):
            raise CheckpointFormatError(
                f"{r.index_path or r.directory}: the slices of a tensor of shape {t.shape} hold {got} "
                f"of the {math.prod(bshape)} elements of box {list(boff)}+{list(bshape)} "
                "(overlapping or missing slices)"
            )
    return out


def compare_tensors(
    name: str, ra: CheckpointReader, ta: TensorEntry, rb: CheckpointReader, tb: TensorEntry
) -> DataDifference | None:
    """None when the two tensors (equal dtype and shape) hold the same bits, else where they differ."""
    numel = math.prod(ta.shape)
    step = max(1, CHUNK_BYTES // word_dtype(ta.dtype).itemsize)
    first = -1
    count = 0
    for start in range(0, numel, step):
        stop = min(numel, start + step)
        neq = read_flat(ra, ta, start, stop) != read_flat(rb, tb, start, stop)
        k = int(np.count_nonzero(neq))
        if k and first < 0:
            first = start + int(np.argmax(neq))
        count += k
    if count == 0:
        return None
    index = [int(i) for i in np.unravel_index(first, ta.shape)] if ta.shape else []
    return DataDifference(name, index, first, count, numel)
