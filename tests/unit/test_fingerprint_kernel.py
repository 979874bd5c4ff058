"""The compiled fingerprint v1 kernel (legacy, for version 1 indexes) gives exactly the numpy
reference's numbers, for every item size, block placement and chunking, on both of its row
kernels (AVX2 and plain C). Fingerprint v2 has its own tests in test_fingerprint_v2.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.format import hashing
from unickpt.format.hashing import KERNEL, _partial_numpy, fingerprint_partial, hash_block

native = pytest.mark.skipif(hashing._native is None, reason="the compiled v1 kernel is not built here")


def test_kernel_is_built_where_required() -> None:
    # `make test` sets UNICKPT_REQUIRE_NATIVE: a build that silently fell back to numpy fails here
    # (and hashing.py refuses to import at all).
    if os.environ.get("UNICKPT_REQUIRE_NATIVE"):
        assert KERNEL in ("avx2", "scalar") and hashing._native is not None


@st.composite
def blocks(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int]:
    nd = draw(st.integers(0, 4))
    gshape = []
    for d in range(nd):
        # A wide last dim crosses the kernel's 2048-column weight tables; many short rows cross
        # its 256-row groups.
        hi = 5000 if d == nd - 1 and draw(st.booleans()) else 9
        gshape.append(draw(st.integers(1, hi)))
    offsets = tuple(draw(st.integers(0, g - 1)) for g in gshape)
    shape = tuple(draw(st.integers(1, g - o)) for g, o in zip(gshape, offsets, strict=True))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    chunk_items = draw(st.integers(1, 3000))
    return tuple(gshape), offsets, shape, itemsize, chunk_items


@native
@settings(max_examples=300, deadline=None)
@given(blocks(), st.integers(0, 2**32 - 1))
def test_kernel_matches_numpy_reference(
    block: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int], seed: int
) -> None:
    gshape, offsets, shape, itemsize, chunk_items = block
    n = int(np.prod(shape))
    rng = np.random.default_rng(seed)
    words = rng.integers(0, 2**64 - 1, size=n, dtype=np.uint64, endpoint=True)
    words = words.view(np.uint8)[: n * itemsize].view(f"<u{itemsize}")
    expected = _partial_numpy(words, gshape, offsets, shape)
    assert fingerprint_partial(words, gshape, offsets, shape, version=1) == expected
    # In chunks that start and end mid-row, as the save engine feeds it.
    old = hashing._CHUNK_BYTES
    hashing._CHUNK_BYTES = chunk_items * itemsize
    try:
        digest, total = hash_block(words.view(np.uint8), itemsize, gshape, offsets, shape, version=1)
    finally:
        hashing._CHUNK_BYTES = old
    assert total == expected
    assert digest == xxhash.xxh3_64_hexdigest(words.tobytes())


@native
def test_extreme_words_wrap_mod_2_64() -> None:
    # All-ones words make every product and sum overflow: the wrap must match numpy's uint64.
    for itemsize in (1, 2, 4, 8):
        words = np.full((300, 2100), np.iinfo(f"<u{itemsize}").max, dtype=f"<u{itemsize}")
        assert fingerprint_partial(words, (301, 4200), (1, 7), words.shape, version=1) == _partial_numpy(
            words, (301, 4200), (1, 7), words.shape
        )


@native
def test_both_row_kernels_agree() -> None:
    """The plain-C row kernel (CPUs without AVX2, other architectures) gives the same sums."""
    code = (
        "import json, numpy as np\n"
        "from unickpt.format.hashing import KERNEL, fingerprint_partial\n"
        "rng = np.random.default_rng(7)\n"
        "out = [KERNEL]\n"
        "for isz in (1, 2, 4, 8):\n"
        "    w = rng.integers(0, 2**63, size=(37, 2049), dtype=np.uint64).astype(f'<u{isz}')\n"
        "    out.append(str(fingerprint_partial(w, (40, 3000), (2, 900), w.shape, version=1)))\n"
        "print(json.dumps(out))\n"
    )
    runs = []
    for scalar in (False, True):
        env = dict(os.environ)
        env.pop("UNICKPT_FP_SCALAR", None)
        if scalar:
            env["UNICKPT_FP_SCALAR"] = "1"
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        runs.append(json.loads(out.stdout))
    assert runs[1][0] == "scalar"
    assert runs[0][1:] == runs[1][1:]


@native
def test_kernel_refuses_bad_arguments() -> None:
    from unickpt.format import _fpkernel

    four = np.zeros(4, dtype="<u4").tobytes()
    with pytest.raises(ValueError, match="itemsize must be 1, 2, 4 or 8"):
        _fpkernel.partial(four, 3, (), (), (), 0, 4, 0)
    with pytest.raises(ValueError, match="not a whole number of 4-byte words"):
        _fpkernel.partial(four[:5], 4, (), (), (), 0, 4, 0)
    with pytest.raises(ValueError, match="outside the block"):
        _fpkernel.partial(four, 4, (), (), (), 0, 4, 1)
    with pytest.raises(ValueError, match="exceeds the tensor on dim 0"):
        _fpkernel.partial(four, 4, (2,), (1,), (2,), 0, 2, 0)
    with pytest.raises(ValueError, match="differ in length"):
        _fpkernel.partial(four, 4, (2,), (), (2,), 0, 2, 0)
    with pytest.raises(ValueError, match="words for a block"):
        fingerprint_partial(np.zeros(5, dtype="<u4"), (2, 2), (0, 0), (2, 2), version=1)


def test_numpy_fallback_gives_the_same_hashes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel is not built, save, merge and diff get the same numbers from numpy."""
    rng = np.random.default_rng(3)
    words = rng.integers(0, 2**16, size=(40, 3000), dtype=np.uint16)
    with_kernel = hash_block(words, 2, (50, 3000), (10, 0), words.shape, version=1)
    monkeypatch.setattr(hashing, "_native", None)
    assert hash_block(words, 2, (50, 3000), (10, 0), words.shape, version=1) == with_kernel
    assert fingerprint_partial(words, (50, 3000), (10, 0), words.shape, version=1) == with_kernel[1]
    fp_off = hash_block(words, 2, (50, 3000), (10, 0), words.shape, fingerprint=False, version=1)
    assert fp_off == (with_kernel[0], 0)
    assert hash_block(words, 2, (50, 3000), (10, 0), words.shape, xxh3=False, version=1) == (
        None,
        with_kernel[1],
    )


@native
@pytest.mark.parametrize("cap_cols", [8, 16, 1000])
def test_narrow_workspace_sums_wide_rows_in_blocks(cap_cols: int) -> None:
    """A workspace narrower than the rows (rows wider than the kernel's 2^20-column table) gives
    the same sums, whole or in chunks that start and end mid-row."""
    from unickpt.format import _fpkernel

    rng = np.random.default_rng(cap_cols)
    for itemsize in (1, 2, 4, 8):
        words = rng.integers(0, 2**63, size=(7, 3001), dtype=np.uint64).astype(f"<u{itemsize}")
        expected = _partial_numpy(words, (9, 5000), (2, 1999), words.shape)
        raw = words.tobytes()
        ws = bytearray(_fpkernel.table_bytes(cap_cols))
        for step in (len(raw), 1000 * itemsize, 24 * itemsize):
            total = 0
            for at in range(0, len(raw), step):
                total += _fpkernel.partial(
                    raw[at : at + step], itemsize, (9,), (2,), (7,), 1999, 3001, at // itemsize, ws
                )
            assert total % 2**64 == expected, (itemsize, step)
    with pytest.raises(ValueError, match="workspace is too small"):
        _fpkernel.partial(raw[:8], 8, (), (), (), 0, 1, 0, bytearray(10))
