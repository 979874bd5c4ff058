"""Pure geometry of slices: every function here takes and returns plain integers.

A *box* is ``(offsets, shape)``: the block of a global tensor whose first element is at
``offsets`` and whose extent is ``shape``. Every stored slice is a box; a flat range of a
flattened tensor (ZeRO's partitions) is expressed as a few boxes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from unickpt.spec.coverage import coverage_problem

__all__ = [
    "Box",
    "intersect",
    "coverage_problem",
    "flat_range_to_boxes",
    "box_volume",
    "contiguous_start",
    "runs",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]


def box_volume(shape: Sequence[int]) -> int:
    return math.prod(shape)


def intersect(
    a_off: Sequence[int], a_shape: Sequence[int], b_off: Sequence[int], b_shape: Sequence[int]
) -> Box | None:
    """The common block of two boxes, or None when they share no element."""
    off = []
    shp = []
    for ao, an, bo, bn in zip(a_off, a_shape, b_off, b_shape, strict=True):
        lo = max(ao, bo)
        hi = min(ao + an, bo + bn)
        if hi <= lo:
            return None
        off.append(lo)
        shp.append(hi - lo)
    return tuple(off), tuple(shp)


def contiguous_start(shape: Sequence[int], offsets: Sequence[int], sub: Sequence[int]) -> int | None:
    """Flat index of the box's first element if the box (offsets, sub) of a C-order array of
    ``shape`` is one contiguous run of elements, else None.

    Contiguous iff, past the first dim of extent other than 1, every dim spans the whole array.
    """
    first_partial = next((d for d, n in enumerate(sub) if n != 1), len(sub))
    if any(offsets[d] != 0 or sub[d] != shape[d] for d in range(first_partial + 1, len(shape))):
        return None
    start = 0
    for o, n in zip(offsets, shape, strict=True):
        start = start * n + o
    return start


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[Box, int]]:
    """Split the flat element range [start, stop) of a C-order tensor into boxes.

    Returns ``[(box, flat_start_of_box)]`` in flat order; each box is a contiguous run of the
    flattened tensor, so its elements are a plain sub-range of the flat buffer. An N-dim
    range needs at most 2N - 1 boxes.
    """
    shape = tuple(shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    if start == stop:
        return []
    if len(shape) == 0:
        return [(((), ()), 0)]
    out: list[tuple[Box, int]] = []
    _split(shape, 0, start, stop, (), out, 0)
    return out


def _split(
    shape: tuple[int, ...],
    dim: int,
    start: int,
    stop: int,
    prefix: tuple[int, ...],
    out: list[tuple[Box, int]],
    base: int,
) -> None:
    # [start, stop) is relative to the sub-tensor shape[dim:], whose flat start is `base`.
    inner = math.prod(shape[dim + 1 :])
    rest = len(shape) - dim - 1
    if inner == 0:
        return
    first, first_off = divmod(start, inner)
    last, last_off = divmod(stop, inner)
    if first == last:
        _split(shape, dim + 1, first_off, last_off, (*prefix, first), out, base + first * inner)
        return
    if first_off:
        _split(shape, dim + 1, first_off, inner, (*prefix, first), out, base + first * inner)
        first += 1
    if last > first:
        off = (*prefix, first) + (0,) * rest
        shp = (1,) * len(prefix) + (last - first,) + tuple(shape[dim + 1 :])
        out.append(((off, shp), base + first * inner))
    if last_off:
        _split(shape, dim + 1, 0, last_off, (*prefix, last), out, base + last * inner)


def runs(shape: Sequence[int], offsets: Sequence[int], sub: Sequence[int]) -> list[tuple[int, int]]:
    """The box (offsets, sub) of a C-order array of ``shape`` as contiguous runs of elements.

    Returns ``[(flat start, element count)]`` in C order of the box, so reading the runs back to
    back gives the box's elements in C order. The trailing dims the box spans whole fold into
    each run: a row range is one run, a column range one run per row.
    """
    if any(n == 0 for n in sub):
        return []
    nd = len(shape)
    if nd == 0:
        return [(0, 1)]
    k = max((d for d in range(nd) if offsets[d] != 0 or sub[d] != shape[d]), default=0)
    inner = math.prod(shape[k + 1 :])
    strides = [math.prod(shape[d + 1 :]) for d in range(nd)]
    base = offsets[k] * strides[k]
    length = sub[k] * inner
    out: list[tuple[int, int]] = []
    for idx in itertools.product(*(range(offsets[d], offsets[d] + sub[d]) for d in range(k))):
        out.append((base + sum(i * st for i, st in zip(idx, strides, strict=False)), length))
    return out
