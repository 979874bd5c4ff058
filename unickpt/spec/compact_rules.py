"""The rules of version 3's compact slice fields (docs/format.md 3.1), checked once their types are.

The index parser (``index.IndexParser``) calls them on what it reads, and ``index_models``' validators
on what code builds, so a rule is written once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

__all__ = ["compact_count", "compact_problem"]


def compact_count(
    gshape: Sequence[int], grid: Sequence[int | Sequence[int]] | None, boxes: Sequence[Any] | None
) -> int:
    """The number of slices the compact fields describe (``grid`` checked to have ``len(gshape)`` items)."""
    if boxes is not None:
        return len(boxes)
    if grid is None:
        return 1
    return math.prod(p if isinstance(p, int) else len(p) for p in grid)


def compact_problem(
    gshape: Sequence[int],
    grid: Sequence[int | Sequence[int]] | None,
    boxes: Sequence[Sequence[int]] | None,
    file: int | Sequence[int] | None,
    keys: Sequence[str] | None,
    xxh3: str | None,
) -> str | None:
    """What is wrong with the compact slice fields of a version 3 tensor (types already checked)."""
    nd = len(gshape)
    if grid is not None and boxes is not None:
        return "has both 'grid' and 'boxes' (one describes the slices)"
    if grid is not None:
        if len(grid) != nd:
            return f"grid has {len(grid)} dims for a {nd}-dim tensor"
        for d, (p, g) in enumerate(zip(grid, gshape, strict=True)):
            if not isinstance(p, int) and (not p or sum(p) != g):
                return f"grid dim {d}: part extents {list(p)[:8]} do not add up to the tensor's size {g}"
    elif boxes is not None:
        for i, b in enumerate(boxes):
            if len(b) != 2 * nd:
                return f"box {i} has {len(b)} integers, expected {2 * nd} (offsets then shape)"
            for d in range(nd):
                if b[d] + b[nd + d] > gshape[d]:
                    return f"box {i} spans [{b[d]}, {b[d] + b[nd + d]}) on dim {d} of a tensor of size {gshape[d]}"
    n = compact_count(gshape, grid, boxes)
    if file is not None and not isinstance(file, int) and len(file) != n:
        return f"'file' lists {len(file)} file(s) for {n} slice(s)"
    if keys is not None and len(keys) != n:
        return f"'keys' lists {len(keys)} key(s) for {n} slice(s)"
    if xxh3 is not None and len(xxh3) != 16 * n:
        return f"'xxh3' holds {len(xxh3)} characters for {n} slice(s) (16 per slice)"
    return None
