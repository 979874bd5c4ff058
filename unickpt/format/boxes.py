"""Pure geometry of slices: every function here takes and returns plain integers.

A *box* is ``(offsets, shape)``: the block of a global tensor whose first element is at
``offsets`` and whose extent is ``shape``. Every stored slice is a box; a flat range of a
flattened tensor (ZeRO's partitions) is expressed as a few boxes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["Box", "intersect", "coverage_problem", "flat_range_to_boxes", "box_volume", "contiguous_start"]

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
    pair = _first_overlap(nonempty)
    if pair is not None:
        (o1, s1), (o2, s2) = pair
        return f"slices at {list(o1)} (shape {list(s1)}) and {list(o2)} (shape {list(s2)}) overlap"
    covered = sum(math.prod(s) for _, s in nonempty)
    if covered != total:
        return f"slices cover {covered} of {total} elements: part of the tensor is missing"
    return None


def _first_overlap(boxes: list[Box]) -> tuple[Box, Box] | None:
    """A pair of overlapping boxes, or None. A sweep along the dim with the most distinct offsets.

    Only boxes whose extents on that dim intersect are compared, so row, column, grid and
    flat-range partitions cost about n log n, not n^2 (an index may hold 10^5 slices).
    """
    n = len(boxes)
    if n < 2:
        return None
    lo = np.array([o for o, _ in boxes], dtype=np.int64)
    hi = lo + np.array([s for _, s in boxes], dtype=np.int64)
    d = int(np.argmax([len(np.unique(lo[:, k])) for k in range(lo.shape[1])]))
    order = np.argsort(lo[:, d], kind="stable")
    others = [k for k in range(lo.shape[1]) if k != d]
    if all((lo[:, k] == lo[0, k]).all() and (hi[:, k] == hi[0, k]).all() for k in others):
        # A partition along one dim (the usual case): neighbours in sorted order suffice.
        bad = np.nonzero(hi[order[:-1], d] > lo[order[1:], d])[0]
        if bad.size:
            k = int(bad[0])
            return boxes[int(order[k])], boxes[int(order[k + 1])]
        return None
    active = np.empty(0, dtype=np.int64)
    for i in order:
        # Drop boxes that end on dim d before this one starts: they cannot meet it, nor any later box.
        active = active[hi[active, d] > lo[i, d]]
        if active.size:
            hit = np.all(np.maximum(lo[active], lo[i]) < np.minimum(hi[active], hi[i]), axis=1)
            if hit.any():
                j = int(active[np.argmax(hit)])
                return boxes[j], boxes[int(i)]
        active = np.append(active, i)
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
