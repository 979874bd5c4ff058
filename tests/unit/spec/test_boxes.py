"""The exact tiling check (unickpt.spec.boxes) against counting every element, and its speed."""

from __future__ import annotations

import itertools
import random
import time

import numpy as np
import pytest

from unickpt.spec.boxes import CoverageProblem, coverage_problem, coverage_problems

Box = tuple[tuple[int, ...], tuple[int, ...]]


def _guillotine(rnd: random.Random, off: list[int], shape: list[int], out: list[Box], depth: int) -> None:
    """A random exact tiling of the block (off, shape): split on a random dim, recurse."""
    splittable = [k for k, n in enumerate(shape) if n > 1]
    if not splittable or depth == 0 or rnd.random() < 0.15:
        out.append((tuple(off), tuple(shape)))
        return
    k = rnd.choice(splittable)
    cut = rnd.randint(1, shape[k] - 1)
    a_shape = list(shape)
    a_shape[k] = cut
    b_off = list(off)
    b_off[k] += cut
    b_shape = list(shape)
    b_shape[k] -= cut
    _guillotine(rnd, off, a_shape, out, depth - 1)
    _guillotine(rnd, b_off, b_shape, out, depth - 1)


def _random_box(rnd: random.Random, shape: tuple[int, ...]) -> Box:
    off = tuple(rnd.randrange(g) for g in shape)
    return off, tuple(rnd.randint(1, g - o) for g, o in zip(shape, off, strict=True))


def _damage(rnd: random.Random, shape: tuple[int, ...], boxes: list[Box]) -> list[Box]:
    boxes = list(boxes)
    for _ in range(rnd.randint(0, 3)):
        what = rnd.random()
        if what < 0.3 and boxes:
            boxes.pop(rnd.randrange(len(boxes)))  # a gap
        elif what < 0.5 and boxes:
            boxes.append(boxes[rnd.randrange(len(boxes))])  # a duplicated slice
        elif what < 0.7 and boxes:
            # shrink one box on one dim: a gap beside it
            i = rnd.randrange(len(boxes))
            o, s = boxes[i]
            k = rnd.randrange(len(s))
            if s[k] > 1:
                boxes[i] = (o, tuple(n - 1 if j == k else n for j, n in enumerate(s)))
        else:
            boxes.append(_random_box(rnd, shape))  # overlaps something
    rnd.shuffle(boxes)
    return boxes


def _count(shape: tuple[int, ...], boxes: list[Box]) -> np.ndarray:
    count = np.zeros(shape, dtype=np.int64)
    for o, s in boxes:
        count[tuple(slice(a, a + n) for a, n in zip(o, s, strict=True))] += 1
    return count


def _region(shape: tuple[int, ...], p: CoverageProblem) -> tuple[slice, ...]:
    o, s = p.region
    return tuple(slice(a, a + n) for a, n in zip(o, s, strict=True))


def _check_against_counting(shape: tuple[int, ...], boxes: list[Box]) -> None:
    count = _count(shape, boxes)
    problems = coverage_problems(shape, boxes, limit=None)
    assert (not problems) == bool((count == 1).all()), (shape, boxes, problems)
    assert (coverage_problem(shape, boxes) is None) == (not problems)
    seen = np.zeros(shape, dtype=np.int64)
    for p in problems:
        sel = _region(shape, p)
        # Every element of a reported region is held exactly `count` times, by exactly `slices`.
        assert (count[sel] == p.count).all(), (shape, boxes, p)
        assert p.kind == ("gap" if p.count == 0 else "overlap")
        first = p.region[0]
        holders = tuple(
            i
            for i, (o, s) in enumerate(boxes)
            if all(a <= x < a + n for a, n, x in zip(o, s, first, strict=True))
        )
        assert p.slices == holders, (shape, boxes, p)
        seen[sel] += 1
    # Regions are disjoint and name every element not held exactly once, and only those.
    assert (seen <= 1).all()
    assert ((seen == 1) == (count != 1)).all(), (shape, boxes, problems)


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_random_tilings_with_gaps_and_overlaps_match_counting(ndim: int) -> None:
    rnd = random.Random(1000 + ndim)
    for _ in range(150):
        shape = tuple(rnd.randint(1, 7 if ndim < 4 else 4) for _ in range(ndim))
        tiles: list[Box] = []
        _guillotine(rnd, [0] * ndim, list(shape), tiles, depth=8)
        _check_against_counting(shape, _damage(rnd, shape, tiles))


@pytest.mark.parametrize("ndim", [1, 2, 3, 4])
def test_random_boxes_match_counting(ndim: int) -> None:
    rnd = random.Random(ndim)
    for _ in range(120):
        shape = tuple(rnd.randint(1, 5) for _ in range(ndim))
        boxes = [_random_box(rnd, shape) for _ in range(rnd.randint(0, 6))]
        _check_against_counting(shape, boxes)


def test_named_problems_in_messages() -> None:
    msg = coverage_problem((4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))])
    assert msg == (
        "slices at [0, 0] (shape [3, 4]) and [2, 0] (shape [2, 4]) overlap: elements [2:3, 0:4] are stored 2 times"
    )
    msg = coverage_problem((4, 4), [((0, 0), (2, 4)), ((3, 0), (1, 2))])
    assert msg == (
        "part of the tensor is missing: elements [2:3, 0:4] are in no slice; "
        "part of the tensor is missing: elements [3:4, 2:4] are in no slice"
    )
    assert coverage_problem((4,), [((0,), (5,))]) == "slice at [0] with shape [5] lies outside shape [4]"
    # Many problems: the first five are named, then "and more".
    msg = coverage_problem((20,), [((i,), (1,)) for i in range(0, 20, 2)])
    assert msg is not None and msg.count("in no slice") == 5 and msg.endswith("and more past the first 5")
    # Three copies of one slice: named once with the count.
    msg = coverage_problem((2, 3), [((0, 0), (2, 3))] * 3)
    assert msg == (
        "slices at [0, 0] (shape [2, 3]) and [0, 0] (shape [2, 3]) (and 1 more) overlap: "
        "elements [0:2, 0:3] are stored 3 times"
    )


def _staircase(rows: int) -> tuple[tuple[int, int], list[Box]]:
    """Row i split at column i + 1: 2 x rows slices, every column offset distinct."""
    cols = rows + 1
    boxes: list[Box] = []
    for i in range(rows):
        boxes.append(((i, 0), (1, i + 1)))
        boxes.append(((i, i + 1), (1, cols - i - 1)))
    return (rows, cols), boxes


def test_staircase_of_80k_slices_is_checked_in_seconds() -> None:
    shape, boxes = _staircase(40_000)
    t0 = time.perf_counter()
    assert coverage_problem(shape, boxes) is None
    took = time.perf_counter() - t0
    assert took < 3.0, f"{took:.1f} s for a valid staircase of {len(boxes)} slices"
    # One slice widened by one column into its neighbour: found and named, as fast.
    (o, s) = boxes[40_000]
    boxes[40_000] = (o, (1, s[1] + 1))
    t0 = time.perf_counter()
    msg = coverage_problem(shape, boxes)
    took = time.perf_counter() - t0
    assert msg == (
        "slices at [20000, 0] (shape [1, 20002]) and [20000, 20001] (shape [1, 20000]) overlap: "
        "elements [20000:20001, 20001:20002] are stored 2 times"
    )
    assert took < 3.0, f"{took:.1f} s to name the overlap among {len(boxes)} slices"
    # A slice dropped: the gap is named.
    del boxes[12_345]
    msg = coverage_problem(shape, boxes)
    assert msg is not None and msg.startswith(
        "part of the tensor is missing: elements [6172:6173, 6173:40001]"
    )


@pytest.mark.parametrize("ndim", [1, 2, 3])
def test_pieces_along_one_dim_agree_with_the_full_check(ndim: int) -> None:
    """The fast path for pieces cut along one dim (every Shard(0) save) decides as the full check
    does: clean tilings pass, and a gap, an overlap, a duplicate, an out-of-bounds or a short
    piece on another dim is still named."""
    from unickpt.spec.boxes import _tiles_along_one_dim

    rnd = random.Random(7 + ndim)
    fast = 0
    for _ in range(100):
        shape = tuple(rnd.randint(1, 9) for _ in range(ndim))
        k = rnd.randrange(ndim)
        cuts = sorted(rnd.sample(range(1, shape[k]), min(shape[k] - 1, rnd.randint(0, 3))))
        bounds = [0, *cuts, shape[k]]
        boxes: list[Box] = []
        for a, b in itertools.pairwise(bounds):
            off = [0] * ndim
            shp = list(shape)
            off[k], shp[k] = a, b - a
            boxes.append((tuple(off), tuple(shp)))
        rnd.shuffle(boxes)
        how = rnd.choice(["clean", "drop", "dup", "grow", "shrink_other", "empty"])
        if how == "drop" and len(boxes) > 1:
            boxes.pop()
        elif how == "dup":
            boxes.append(boxes[0])
        elif how == "grow":
            o, s = boxes[0]
            boxes[0] = (o, tuple(x + (1 if j == k else 0) for j, x in enumerate(s)))
        elif how == "shrink_other" and ndim > 1:
            o, s = boxes[0]
            j = (k + 1) % ndim
            if s[j] > 1:
                boxes[0] = (o, tuple(x - (1 if i == j else 0) for i, x in enumerate(s)))
        elif how == "empty":
            boxes.append(((0,) * ndim, (0,) * ndim))
        full = coverage_problems(shape, boxes)
        fast_ok = _tiles_along_one_dim(shape, boxes)
        assert not (fast_ok and full), (shape, boxes, full)  # the fast path never hides a problem
        assert (coverage_problem(shape, boxes) is None) == (not full), (shape, boxes)
        fast += fast_ok
    assert fast > 15  # the fast path did decide most clean cases
