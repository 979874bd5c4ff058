"""Pure functions of the format and planner, tested with plain numbers (no torch.distributed)."""

from __future__ import annotations

import numpy as np
import pytest

from unickpt.errors import StateMismatchError
from unickpt.io.planner import plan_save
from unickpt.spec.boxes import coverage_problem, flat_range_to_boxes
from unickpt.spec.hashing import (
    combine_partials,
    finalize_fingerprint,
    fingerprint_of_array,
    fingerprint_partial,
)


def _fp_of_blocks(a: np.ndarray, blocks: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> int:
    parts = []
    for off, shp in blocks:
        sl = tuple(slice(o, o + n) for o, n in zip(off, shp, strict=True))
        parts.append(fingerprint_partial(a[sl], a.shape, off, shp))
    return combine_partials(parts)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32, np.uint64])
def test_fingerprint_is_layout_invariant(dtype: type) -> None:
    rng = np.random.default_rng(0)
    a = rng.integers(0, np.iinfo(dtype).max, size=(33, 7, 5), dtype=dtype)
    whole = _fp_of_blocks(a, [((0, 0, 0), a.shape)])
    rows = _fp_of_blocks(a, [((0, 0, 0), (9, 7, 5)), ((9, 0, 0), (9, 7, 5)), ((18, 0, 0), (15, 7, 5))])
    cols = _fp_of_blocks(a, [((0, 0, 0), (33, 7, 2)), ((0, 0, 2), (33, 7, 3))])
    grid = _fp_of_blocks(
        a,
        [
            ((0, 0, 0), (10, 3, 5)),
            ((0, 3, 0), (10, 4, 5)),
            ((10, 0, 0), (23, 3, 5)),
            ((10, 3, 0), (23, 4, 5)),
        ],
    )
    flat = a.reshape(-1)
    zero = []
    for s, e in [(0, 400), (400, 401), (401, flat.size)]:
        for (off, shp), fs in flat_range_to_boxes(a.shape, s, e):
            zero.append(fingerprint_partial(flat[fs : fs + int(np.prod(shp))], a.shape, off, shp))
    assert whole == rows == cols == grid == combine_partials(zero)


def test_fingerprint_detects_every_single_element_change() -> None:
    rng = np.random.default_rng(1)
    a = rng.integers(0, 2**16, size=(6, 5), dtype=np.uint16)
    base = fingerprint_of_array("w", "BF16", a.tobytes(), a.shape)
    seen = {base}
    for i in range(a.size):
        b = a.copy().reshape(-1)
        b[i] ^= 1 << (i % 16)
        fp = fingerprint_of_array("w", "BF16", b.tobytes(), a.shape)
        assert fp not in seen
        seen.add(fp)


def test_fingerprint_binds_name_dtype_and_shape() -> None:
    data = np.arange(12, dtype=np.uint32).tobytes()
    base = fingerprint_of_array("w", "F32", data, (3, 4))
    assert fingerprint_of_array("v", "F32", data, (3, 4)) != base
    assert fingerprint_of_array("w", "I32", data, (3, 4)) != base
    assert fingerprint_of_array("w", "F32", data, (4, 3)) != base
    assert finalize_fingerprint("w", "F32", (), 0) == finalize_fingerprint("w", "F32", (), 0)
    assert len(base) == 16 and int(base, 16) >= 0


def test_coverage_problems_are_named() -> None:
    assert coverage_problem((4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4))]) is None
    assert "overlap" in str(coverage_problem((4, 4), [((0, 0), (3, 4)), ((2, 0), (2, 4))]))
    assert "missing" in str(coverage_problem((4, 4), [((0, 0), (2, 4))]))
    assert "outside" in str(coverage_problem((4, 4), [((0, 0), (5, 4))]))
    assert coverage_problem((), [((), ())]) is None
    assert coverage_problem((0, 3), []) is None


def test_plan_dedups_replicas_and_balances_writers() -> None:
    # DDP x4: every rank holds every tensor whole; each tensor must be written exactly once,
    # spread over the ranks by bytes.
    metas = [
        ("a", "F32", (100,), (0,), (100,)),
        ("b", "F32", (90,), (0,), (90,)),
        ("c", "F32", (80,), (0,), (80,)),
        ("d", "F32", (70,), (0,), (70,)),
    ]
    plan = plan_save([metas] * 4, kind="model", size_per_shard_bytes=None, sliced=True)
    writers = {ps.name: ps.rank for sl in plan.slices.values() for ps in sl}
    assert sorted(writers.values()) == [0, 1, 2, 3]
    assert [f.name for f in plan.files] == [f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)]
    assert all(len(v) == 1 for v in plan.slices.values())


def test_plan_uneven_rows_and_size_split() -> None:
    per_rank = []
    for o, s in [(0, 9), (9, 9), (18, 9), (27, 6)]:
        per_rank.append([("w", "F32", (33, 8), (o, 0), (s, 8))])
    plan = plan_save(per_rank, kind="model", size_per_shard_bytes=None, sliced=True)
    assert [(ps.key, ps.offsets, ps.shape, ps.rank) for ps in plan.slices["w"]] == [
        ("w@0", (0, 0), (9, 8), 0),
        ("w@1", (9, 0), (9, 8), 1),
        ("w@2", (18, 0), (9, 8), 2),
        ("w@3", (27, 0), (6, 8), 3),
    ]
    metas = [(n, "F32", (64,), (0,), (64,)) for n in "abcdef"]
    plan = plan_save([metas], kind="optimizer", size_per_shard_bytes=600, sliced=False)
    assert [len(f.slices) for f in plan.files] == [2, 2, 2]
    assert plan.files[0].name == "optimizer-00001-of-00003.safetensors"


def test_plan_refuses_disagreement_and_gaps() -> None:
    with pytest.raises(StateMismatchError, match="rank 1 has F16"):
        plan_save(
            [[("w", "F32", (4,), (0,), (4,))], [("w", "F16", (4,), (0,), (4,))]],
            kind="model",
            size_per_shard_bytes=None,
            sliced=True,
        )
    with pytest.raises(StateMismatchError, match="missing"):
        plan_save(
            [[("w", "F32", (4, 2), (0, 0), (2, 2))]], kind="model", size_per_shard_bytes=None, sliced=True
        )
    with pytest.raises(StateMismatchError, match="overlap"):
        plan_save(
            [[("w", "F32", (4,), (0,), (3,))], [("w", "F32", (4,), (2,), (2,))]],
            kind="model",
            size_per_shard_bytes=None,
            sliced=True,
        )


def test_coverage_agrees_with_counting_every_element() -> None:
    import random

    rnd = random.Random(0)
    for _ in range(500):
        shape = (rnd.randint(1, 6), rnd.randint(1, 6), rnd.randint(1, 3))
        boxes = []
        for _ in range(rnd.randint(1, 6)):
            off = tuple(rnd.randrange(g) for g in shape)
            shp = tuple(rnd.randint(1, g - o) for g, o in zip(shape, off, strict=True))
            boxes.append((off, shp))
        count = np.zeros(shape, dtype=int)
        for off, shp in boxes:
            count[tuple(slice(o, o + n) for o, n in zip(off, shp, strict=True))] += 1
        assert (coverage_problem(shape, boxes) is None) == bool((count == 1).all()), (shape, boxes)


def test_coverage_of_a_hundred_thousand_slices_is_fast_enough() -> None:
    n = 100_000
    rows = [((i, 0), (1, 4)) for i in range(n)]
    assert coverage_problem((n, 4), rows) is None
    rows[n // 2] = ((n // 2 - 1, 0), (2, 4))
    assert "overlap" in str(coverage_problem((n, 4), rows))
