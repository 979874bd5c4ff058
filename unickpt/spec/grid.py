"""The geometry of grids of slices: ``torch.chunk`` part extents, the cells of a grid, and the
distinct parts a list of slices cuts a dim into (``slice_table`` detects grids with it)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["chunk_extents", "distinct_parts", "grid_boxes", "grid_extents"]


def chunk_extents(g: int, k: int) -> list[int]:
    """The extents of ``torch.chunk``-style parts: ``k`` parts of ``ceil(g / k)``, the last ones
    smaller or empty (what FSDP2's and TP's ``Shard`` produce, empty trailing ranks included)."""
    c = -(-g // k) if k > 0 else 0  # f parts of c, then the rest (maybe 0), then empty ones:
    return [c] * (f := min(k, g // c) if c else 0) + [g - f * c] * (f < k) + [0] * max(0, k - f - 1)


def grid_extents(gshape: Sequence[int], grid: Sequence[int | Sequence[int]]) -> list[list[int]]:
    """Each dim's part extents of a ``grid`` field (an int: chunk parts; a list: the extents)."""
    return [chunk_extents(g, p) if isinstance(p, int) else list(p) for g, p in zip(gshape, grid, strict=True)]


def grid_boxes(extents: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and shapes ``(S, nd)`` of the cells of a grid, in C order."""
    nd = len(extents)
    if nd == 0:
        return np.zeros((1, 0), dtype=np.int64), np.zeros((1, 0), dtype=np.int64)
    ext = [np.asarray(e, dtype=np.int64) for e in extents]
    starts = [np.concatenate(([0], np.cumsum(e)[:-1])).astype(np.int64) for e in ext]
    n = math.prod(len(e) for e in ext)
    offs = np.empty((n, nd), dtype=np.int64)
    shps = np.empty((n, nd), dtype=np.int64)
    for d in range(nd):
        before = math.prod(len(e) for e in ext[:d])
        after = math.prod(len(e) for e in ext[d + 1 :])
        offs[:, d] = np.tile(np.repeat(starts[d], after), before)
        shps[:, d] = np.tile(np.repeat(ext[d], after), before)
    return offs, shps


def distinct_parts(offsets: np.ndarray, extents: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (offset, extent) pairs of slices along a dim of size ``g``, sorted by offset
    then extent: one 1-D ``np.unique`` of ``offset * (g + 1) + extent`` (exact while that fits
    in int64; the row-wise ``np.unique(axis=0)``, about 30x slower, past it)."""
    g1 = int(g) + 1
    if g1 < 1 << 31:
        u = np.unique(offsets.astype(np.int64) * g1 + extents)
        return u // g1, u % g1
    pairs = np.unique(np.stack([offsets, extents], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]
