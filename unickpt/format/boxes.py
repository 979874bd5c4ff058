"""Pure geometry of slices: every function here takes and returns plain integers.

A *box* is ``(offsets, shape)``: the block of a global tensor whose first element is at
``offsets`` and whose extent is ``shape``. Every stored slice is a box; a flat range of a
flattened tensor (ZeRO's partitions) is expressed as a few boxes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["Box", "intersect", "coverage_problem", "flat_range_to_boxes", "box_volume"]

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


def coverage_problem(global_shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Describe how ``boxes`` fail to tile ``global_shape`` exactly once, or None if they do.

    Checks bounds, that no two non-empty boxes overlap, and that the volumes add up to the
    whole tensor (which, with no overlaps, means there is no gap).
    """
    total = math.prod(global_shape)
    nonempty = [(tuple(o), tuple(s)) for o, s in boxes if math.prod(s) > 0]
    for o, s in nonempty:
        if len(o) != len(global_shape) or len(s) != len(global_shape):
            return f"slice at {list(o)} has the wrong number of dimensions"
        if any(x < 0 or x + n > g for x, n, g in zip(o, s, global_shape, strict=True)):
            return f"slice at {list(o)} with shape {list(s)} lies outside shape {list(global_shape)}"
    if len(global_shape) == 0:
        if total and not nonempty:
            return "no slice holds the 0-dim value"
        if len(nonempty) > 1:
            return f"{len(nonempty)} slices hold the same 0-dim value"
        return None
    n = len(nonempty)
    if n > 1:
        lo = np.array([o for o, _ in nonempty], dtype=np.int64)
        hi = lo + np.array([s for _, s in nonempty], dtype=np.int64)
        # Pairwise overlap test, in blocks so that n^2 x ndim stays bounded.
        block = max(1, 4_000_000 // (n * max(1, lo.shape[1])))
        for i0 in range(0, n, block):
            a_lo = lo[i0 : i0 + block, None, :]
            a_hi = hi[i0 : i0 + block, None, :]
            ov = np.all((np.maximum(a_lo, lo[None]) < np.minimum(a_hi, hi[None])), axis=2)
            idx = np.arange(i0, min(n, i0 + block))
            ov[np.arange(len(idx)), idx] = False
            if ov.any():
                i, j = np.argwhere(ov)[0]
                i = int(i) + i0
                return (
                    f"slices at {list(nonempty[i][0])} (shape {list(nonempty[i][1])}) and "
                    f"{list(nonempty[int(j)][0])} (shape {list(nonempty[int(j)][1])}) overlap"
                )
    covered = sum(math.prod(s) for _, s in nonempty)
    if covered != total:
        return f"slices cover {covered} of {total} elements: part of the tensor is missing"
    return None


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
