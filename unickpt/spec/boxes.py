"""Pure geometry of slices, no I/O: boxes, their intersections and flat ranges (plain integers), and
the exact tiling check of a tensor by its slices (numpy).

A *box* is ``(offsets, shape)``: the block of a global tensor whose first element is at
``offsets`` and whose extent is ``shape``. Every stored slice is a box; a flat range of a
flattened tensor (ZeRO's partitions) is expressed as a few boxes.

**Exact tiling check** of a tensor by boxes in O(S 2^d log S), naming every overlap and gap.
Let ``f(x)`` be the number of boxes holding element ``x``. The boxes tile the tensor ``G``
exactly once iff ``f = 1_G``. A box's indicator is a signed sum of 2^d "corner steps"
(``1_[lo, hi)(x) = prod_k (H(x_k - lo_k) - H(x_k - hi_k))`` with ``H`` the unit step), so
``f - 1_G`` is a signed sum of corner steps whose weights ``R(c)`` are found by adding up,
per distinct corner point, the signed corners of every box and of ``G`` (one sort). If
every ``R(c)`` is 0, ``f = 1_G`` exactly. Otherwise let ``p`` be the lexicographically
smallest corner with ``R(p) != 0``: no other such corner is below ``p`` on every dim, so
``f(p) - 1_G(p) = R(p)``; ``p`` is an element covered ``1 + R(p)`` times (0: a gap, 2 or
more: an overlap). Nothing here compares boxes pairwise, so a staircase of 10^5 slices
costs a sort, not 10^10 comparisons.

To name every problem, the *cell* around ``p`` (the largest box grown from ``p`` that no
box boundary crosses, so every element in it is covered the same number of times) is
reported and corrected (a weighted box added so that ``f = 1`` there), and the search runs
again until nothing is left or ``limit`` problems were named. The reported gaps are then
exactly the uncovered elements, and the reported overlaps exactly the elements stored more
than once (``tests/unit/spec/test_boxes.py`` checks this against counting every element).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = [
    "CoverageProblem",
    "coverage_problems",
    "coverage_problem",
    "Box",
    "intersect",
    "flat_range_to_boxes",
    "box_volume",
    "contiguous_start",
    "runs",
]


Box = tuple[tuple[int, ...], tuple[int, ...]]

#: How many problems a message names before it says "and more".
MESSAGE_LIMIT = 5


@dataclass(frozen=True)
class CoverageProblem:
    """One region where the slices do not tile the tensor exactly once.

    ``kind`` is ``"gap"`` (``count == 0``), ``"overlap"`` (``count >= 2``) or ``"bounds"``.
    ``region`` is the block ``(offsets, shape)`` of elements concerned (for ``bounds``, the
    offending slice); ``slices`` the indices (in the input order) of the slices holding it.
    """

    kind: str
    region: Box
    count: int
    slices: tuple[int, ...]

    def describe(self, global_shape: Sequence[int], boxes: Sequence[Box]) -> str:
        where = _fmt_region(self.region)
        if self.kind == "bounds":
            o, s = boxes[self.slices[0]]
            if len(o) != len(global_shape) or len(s) != len(global_shape):
                return f"slice at {list(o)} has the wrong number of dimensions"
            return f"slice at {list(o)} with shape {list(s)} lies outside shape {list(global_shape)}"
        if self.kind == "gap":
            return f"part of the tensor is missing: elements {where} are in no slice"
        (o1, s1), (o2, s2) = boxes[self.slices[0]], boxes[self.slices[1]]
        more = f" (and {len(self.slices) - 2} more)" if len(self.slices) > 2 else ""
        return (
            f"slices at {list(o1)} (shape {list(s1)}) and {list(o2)} (shape {list(s2)}){more} overlap: "
            f"elements {where} are stored {self.count} times"
        )


def _fmt_region(region: Box) -> str:
    off, shp = region
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(off, shp, strict=True)) + "]"


def _residual_min(lo: np.ndarray, hi: np.ndarray, w: np.ndarray, g: np.ndarray) -> np.ndarray | None:
    """The lexicographically smallest corner ``p`` with ``R(p) != 0``, or None when f == 1_G."""
    n, d = lo.shape
    corners = 1 << d
    pts = np.empty((n + 1, corners, d), dtype=np.int64)
    wts = np.empty((n + 1, corners), dtype=np.int64)
    allo = np.concatenate([lo, np.zeros((1, d), dtype=np.int64)])
    allhi = np.concatenate([hi, g[None, :]])
    allw = np.concatenate([w, np.array([-1], dtype=np.int64)])
    for m in range(corners):
        bits = np.array([(m >> k) & 1 for k in range(d)], dtype=bool)
        pts[:, m, :] = np.where(bits, allhi, allo)
        wts[:, m] = allw if bin(m).count("1") % 2 == 0 else -allw
    pts = pts.reshape(-1, d)
    wts = wts.reshape(-1)
    order = np.lexsort(pts.T[::-1])
    pts = pts[order]
    wts = wts[order]
    new = np.ones(len(pts), dtype=bool)
    new[1:] = (pts[1:] != pts[:-1]).any(axis=1)
    starts = np.flatnonzero(new)
    sums = np.add.reduceat(wts, starts)
    bad = np.flatnonzero(sums)
    if bad.size == 0:
        return None
    first: np.ndarray = pts[starts[bad[0]]]
    return first


def _cell(lo: np.ndarray, hi: np.ndarray, g: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The largest box grown from element ``p`` (dim by dim) that no box boundary crosses.

    Invariant: every box either contains the current cell or is disjoint from it, so every
    element of the cell is held by the same boxes as ``p``.
    """
    clo = p.copy()
    chi = p + 1
    d = len(p)
    for k in range(d - 1, -1, -1):
        meets = np.ones(len(lo), dtype=bool)
        for j in range(d):
            if j != k:
                meets &= (lo[:, j] < chi[j]) & (hi[:, j] > clo[j])
        bounds = np.concatenate([lo[meets, k], hi[meets, k]])
        bounds = bounds[bounds > p[k]]
        chi[k] = min(int(g[k]), int(bounds.min())) if bounds.size else int(g[k])
    return clo, chi


def coverage_problems(
    global_shape: Sequence[int], boxes: Sequence[Box], limit: int | None = MESSAGE_LIMIT
) -> list[CoverageProblem]:
    """Every way ``boxes`` fail to tile ``global_shape`` exactly once (at most ``limit``; None: all).

    Empty boxes are ignored. Out-of-bounds boxes (or boxes of the wrong rank) are reported
    first and alone, since counting elements means nothing then. Otherwise the gaps and
    overlaps are reported in lexicographic order of their first element.
    """
    nd = len(global_shape)
    n_all = len(boxes)
    offs = [o for o, _ in boxes]
    shps = [s for _, s in boxes]
    if (set(map(len, offs)) | set(map(len, shps))) - {nd}:
        wrong = [i for i in range(n_all) if len(offs[i]) != nd or len(shps[i]) != nd]
        return [CoverageProblem("bounds", (tuple(offs[i]), tuple(shps[i])), 0, (i,)) for i in wrong[:limit]]
    lo_all = np.fromiter(itertools.chain.from_iterable(offs), dtype=np.int64, count=n_all * nd).reshape(
        n_all, nd
    )
    sh_all = np.fromiter(itertools.chain.from_iterable(shps), dtype=np.int64, count=n_all * nd).reshape(
        n_all, nd
    )
    g_full = np.array(global_shape, dtype=np.int64).reshape(nd)
    nonempty = (sh_all > 0).all(axis=1)
    outside = nonempty & ((lo_all < 0) | (lo_all + sh_all > g_full)).any(axis=1)
    if outside.any():
        return [
            CoverageProblem("bounds", (tuple(offs[i]), tuple(shps[i])), 0, (int(i),))
            for i in np.flatnonzero(outside)[:limit]
        ]
    out: list[CoverageProblem] = []
    if math.prod(global_shape) == 0:
        return out
    keep_idx = np.flatnonzero(nonempty)
    keep = keep_idx.tolist()
    if nd == 0:
        if not keep:
            return [CoverageProblem("gap", ((), ()), 0, ())]
        if len(keep) > 1:
            return [CoverageProblem("overlap", ((), ()), len(keep), tuple(keep))]
        return out
    n = len(keep)
    lo_full = lo_all[keep_idx]
    hi_full = lo_full + sh_all[keep_idx]
    # Dims that every box spans whole change nothing: check the tiling of the others.
    dims = [k for k in range(nd) if not ((lo_full[:, k] == 0).all() and (hi_full[:, k] == g_full[k]).all())]
    lo, hi, g = lo_full[:, dims], hi_full[:, dims], g_full[dims]
    if not dims:  # every box is the whole tensor
        if n == 1:
            return out
        region: Box = ((0,) * nd, tuple(global_shape))
        if n == 0:
            return [CoverageProblem("gap", region, 0, ())]
        return [CoverageProblem("overlap", region, n, tuple(keep))]
    w = np.ones(n, dtype=np.int64)
    while limit is None or len(out) < limit:
        p = _residual_min(lo, hi, w, g)
        if p is None:
            break
        inside: np.ndarray = np.asarray(((lo <= p) & (hi > p)).all(axis=1))
        count = int(w[inside].sum())
        clo, chi = _cell(lo, hi, g, p)
        full_off = [0] * nd
        full_shape = list(global_shape)
        for j, k in enumerate(dims):
            full_off[k] = int(clo[j])
            full_shape[k] = int(chi[j] - clo[j])
        holders = tuple(keep[i] for i in np.flatnonzero(inside[:n]))
        kind = "gap" if count == 0 else "overlap"
        out.append(CoverageProblem(kind, (tuple(full_off), tuple(full_shape)), count, holders))
        # Correct f on the cell to 1 and look for the next problem.
        lo = np.concatenate([lo, clo[None, :]])
        hi = np.concatenate([hi, chi[None, :]])
        w = np.concatenate([w, np.array([1 - count], dtype=np.int64)])
    return out


def _tiles_along_one_dim(global_shape: Sequence[int], boxes: Sequence[Box]) -> bool:
    """Whether ``boxes`` certainly tile the tensor as consecutive pieces along one dimension.

    The common case of every save (``Shard(0)`` pieces, ZeRO-free tensors written whole), checked
    in pure Python in microseconds. False means "not this simple case", not "a problem": the full
    check then decides.
    """
    nd = len(global_shape)
    pieces = [(o, s) for o, s in boxes if len(o) == nd and len(s) == nd and all(x > 0 for x in s)]
    if not pieces or nd == 0 or any(x == 0 for x in global_shape):
        return False
    cut = [k for k in range(nd) if any(o[k] != 0 or s[k] != global_shape[k] for o, s in pieces)]
    if not cut:
        return len(pieces) == 1
    if len(cut) > 1:
        return False
    k = cut[0]
    at = 0
    for o, s in sorted(pieces, key=lambda b: b[0][k]):
        if o[k] != at:
            return False
        at += s[k]
    return at == global_shape[k]


def coverage_problem(global_shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Describe how ``boxes`` fail to tile ``global_shape`` exactly once, or None if they do."""
    if _tiles_along_one_dim(global_shape, boxes):
        return None
    problems = coverage_problems(global_shape, boxes, MESSAGE_LIMIT + 1)
    if not problems:
        return None
    text = "; ".join(p.describe(global_shape, boxes) for p in problems[:MESSAGE_LIMIT])
    if len(problems) > MESSAGE_LIMIT:
        text += f"; and more past the first {MESSAGE_LIMIT}"
    return text


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
