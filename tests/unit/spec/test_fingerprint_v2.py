"""Fingerprint v2 (docs/format.md section 5.2): the written definition, known answers for v1 (which
``unickpt upgrade`` checks in version 1 indexes) and v2, kernel == numpy, layout invariance, and structured changes that v1 misses and v2 must not."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from unickpt.spec import hashing
from unickpt.spec.boxes import flat_range_to_boxes
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.hashing import (
    combine_partials,
    finalize_fingerprint,
    fingerprint_of_array,
    fingerprint_partial,
    hash_block,
)
from unickpt.tools import upgrade
from unickpt.tools.upgrade import v1_finalize, v1_partial

native = pytest.mark.skipif(hashing._native2 is None, reason="the compiled v2 kernel is not built here")
MASK = (1 << 64) - 1


def fingerprint_v1(name: str, dtype: str, data: bytes | memoryview, shape: tuple[int, ...]) -> str:
    """Fingerprint v1 of a whole tensor from its raw C-order bytes, as upgrade checks version 1 indexes."""
    words = np.frombuffer(data, dtype=f"<u{DTYPE_ITEMSIZE[dtype]}")
    return v1_finalize(name, dtype, shape, v1_partial(words, shape, [0] * len(shape), shape))


def test_kernel_is_built_where_required() -> None:
    # `make test` sets UNICKPT_REQUIRE_NATIVE: a build that silently fell back to numpy fails here
    # (and hashing.py refuses to import at all).
    if os.environ.get("UNICKPT_REQUIRE_NATIVE"):
        assert (
            hashing.KERNEL in ("avx512-ifma", "avx512", "avx2", "neon", "scalar")
            and hashing._native2 is not None
        )


# ------------------------------------------------------------------ the definition, literally


def _mix64(x: int) -> int:
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def _reference_v2(name: str, dtype: str, data: bytes, shape: tuple[int, ...]) -> str:
    """Section 5.2 of docs/format.md written out with Python integers, one limb at a time."""
    p1, p2 = 2**32 - 5, 2**32 - 17
    if DTYPE_ITEMSIZE[dtype] == 1:
        limbs = list(data)
    else:
        limbs = [int.from_bytes(data[k : k + 2], "little") for k in range(0, len(data), 2)]
    h1 = h2 = 0
    for i, v in enumerate(limbs):
        zl = _mix64((i % 1024) ^ 0x6A09E667F3BCC909)
        zh = _mix64((i // 1024) ^ 0xBB67AE8584CAA73B)
        w1 = (1 + (zh & 0xFFFFFFFF) % (p1 - 1)) * (1 + (zl & 0xFFFFFFFF) % (p1 - 1))
        w2 = (1 + (zh >> 32) % (p2 - 1)) * (1 + (zl >> 32) % (p2 - 1))
        h1 = (h1 + w1 * v) % p1
        h2 = (h2 + w2 * v) % p2
    msg = b"unickpt-fingerprint-v2\0" + name.encode() + b"\0" + dtype.encode() + b"\0"
    msg += ",".join(map(str, shape)).encode() + b"\0" + h1.to_bytes(4, "little") + h2.to_bytes(4, "little")
    return xxhash.xxh3_64_hexdigest(msg)


KAT = [
    # name, dtype, data, v2, v1 (v1 values computed by the version 1 code before v2 existed)
    (
        "w",
        "F32",
        (np.arange(-6, 6, dtype=np.float32).reshape(3, 4) * 0.5),
        "8cdbccf2a5a73b3a",
        "91c5b2198f9a32c6",
    ),
    ("b", "BF16", np.arange(10, dtype=np.uint16) * 4099, "3b88ac0daa5772ff", "eeea1339a08e4dcd"),
    ("x", "F64", np.linspace(-1, 1, 6).reshape(2, 3), "7a71aec101351ed7", "b15da22a3fe6a0a0"),
    ("m", "U8", np.arange(7, dtype=np.uint8) * 37, "71fb0f37f3530215", "6ba8b5eaa969cd6c"),
    ("s", "I64", np.array(-7, dtype=np.int64), "e75ffc2c3ab15238", "602061062ee5cb2c"),
]


@pytest.mark.parametrize("name,dtype,arr,v2,v1", KAT, ids=[k[1] for k in KAT])
def test_known_answers_of_both_versions(name: str, dtype: str, arr: np.ndarray, v2: str, v1: str) -> None:
    data, shape = arr.tobytes(), list(arr.shape)
    assert fingerprint_of_array(name, dtype, data, shape) == v2
    assert fingerprint_v1(name, dtype, data, shape) == v1  # upgrade's check of version 1 indexes
    assert _reference_v2(name, dtype, data, tuple(shape)) == v2


@pytest.mark.parametrize("dtype", sorted(DTYPE_ITEMSIZE))
def test_follows_the_written_definition_in_every_dtype(dtype: str) -> None:
    rng = np.random.default_rng(len(dtype))
    shape = (3, 700)  # 2100+ limbs: crosses the 1024-limb groups
    data = rng.integers(0, 256, math.prod(shape) * DTYPE_ITEMSIZE[dtype], dtype=np.uint8).tobytes()
    assert fingerprint_of_array("t", dtype, data, shape) == _reference_v2("t", dtype, data, shape)


def test_versions_never_agree() -> None:
    data = np.arange(12, dtype=np.uint32).tobytes()
    assert fingerprint_v1("w", "F32", data, (3, 4)) != fingerprint_of_array("w", "F32", data, (3, 4))


def test_partial_value_is_one_int_that_adds() -> None:
    """The partial value is an int in [0, p1 p2): the pair (H1, H2) by CRT; adding is adding mod p1 p2."""
    for h1, h2 in [(0, 0), (1, 0), (0, 1), (hashing.P1 - 1, hashing.P2 - 1), (12345, 678910)]:
        x = hashing.encode(h1, h2)
        assert 0 <= x < hashing.MODULUS and hashing.decode(x) == (h1, h2)
    a, b = hashing.encode(hashing.P1 - 1, 5), hashing.encode(3, hashing.P2 - 2)
    assert hashing.decode(combine_partials([a, b])) == (2, 3)
    assert combine_partials([]) == 0


# ------------------------------------------------------------------ kernel == numpy


@st.composite
def blocks(draw: st.DrawFn) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int]:
    nd = draw(st.integers(0, 4))
    gshape = []
    for d in range(nd):
        hi = 5000 if d == nd - 1 and draw(st.booleans()) else 9
        gshape.append(draw(st.integers(1, hi)))
    offsets = tuple(draw(st.integers(0, g - 1)) for g in gshape)
    shape = tuple(draw(st.integers(1, g - o)) for g, o in zip(gshape, offsets, strict=True))
    itemsize = draw(st.sampled_from([1, 2, 4, 8]))
    chunk_items = draw(st.integers(1, 3000))
    return tuple(gshape), offsets, shape, itemsize, chunk_items


@native
@settings(max_examples=300, deadline=None)
@given(blocks(), st.integers(0, 2**32 - 1), st.sampled_from(["random", "ones", "sparse"]))
def test_kernel_matches_numpy_reference(
    block: tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int, int], seed: int, fill: str
) -> None:
    gshape, offsets, shape, itemsize, chunk_items = block
    n = math.prod(shape)
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, n * itemsize, dtype=np.uint8)
    if fill == "ones":  # every limb at its maximum: the largest products and sums
        raw[:] = 255
    elif fill == "sparse":
        raw[rng.random(raw.size) < 0.9] = 0
    expected = hashing.partial_numpy(raw.tobytes(), itemsize, gshape, offsets, shape)
    words = raw.view(f"<u{itemsize}")
    assert fingerprint_partial(words, gshape, offsets, shape) == expected
    old = hashing._CHUNK_BYTES
    hashing._CHUNK_BYTES = chunk_items * itemsize  # chunks that start and end anywhere
    try:
        digest, total = hash_block(raw, itemsize, gshape, offsets, shape)
    finally:
        hashing._CHUNK_BYTES = old
    assert total == expected
    assert digest == xxhash.xxh3_64_hexdigest(raw.tobytes())


@native
def test_long_rows_and_numpy_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-D tensor of 3 M limbs and a column range of a wide matrix: kernel == numpy fallback."""
    rng = np.random.default_rng(5)
    flat = rng.integers(0, 2**32, 1_500_001, dtype=np.uint32)
    wide = rng.integers(0, 2**16, (6, 100_003), dtype=np.uint16)
    cases = [
        (flat, (2_000_000,), (123_457,), flat.shape),
        (wide, (9, 300_000), (2, 99_999), wide.shape),
    ]
    with_kernel = [hash_block(a, a.itemsize, *c) for a, *c in cases]
    monkeypatch.setattr(hashing, "_native2", None)
    assert [hash_block(a, a.itemsize, *c) for a, *c in cases] == with_kernel


@native
def test_avx2_and_plain_c_agree() -> None:
    code = (
        "import json, numpy as np\n"
        "from unickpt.spec.hashing import KERNEL, fingerprint_partial\n"
        "rng = np.random.default_rng(7)\n"
        "out = [KERNEL]\n"
        "for isz in (1, 2, 4, 8):\n"
        "    w = rng.integers(0, 2**63, size=(37, 2049), dtype=np.uint64).astype(f'<u{isz}')\n"
        "    out.append(str(fingerprint_partial(w, (40, 3000), (2, 900), w.shape)))\n"
        "    out.append(str(fingerprint_partial(w.reshape(-1), (99999,), (17,), (w.size,))))\n"
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
    from unickpt.spec import _fp2kernel

    four = np.zeros(4, dtype="<u4").tobytes()
    with pytest.raises(ValueError, match="itemsize must be 1, 2, 4 or 8"):
        _fp2kernel.partial(four, 3, (4,), (0,), (4,), 0)
    with pytest.raises(ValueError, match="not a whole number of 4-byte words"):
        _fp2kernel.partial(four[:5], 4, (4,), (0,), (4,), 0)
    with pytest.raises(ValueError, match="outside the block"):
        _fp2kernel.partial(four, 4, (4,), (0,), (4,), 1)
    with pytest.raises(ValueError, match="exceeds the tensor on dim 0"):
        _fp2kernel.partial(four, 4, (2,), (1,), (2,), 0)
    with pytest.raises(ValueError, match="differ in length"):
        _fp2kernel.partial(four, 4, (2,), (), (2,), 0)
    assert _fp2kernel.partial(b"", 4, (0, 3), (0, 0), (0, 3), 0) == (0, 0)


# ------------------------------------------------------------------ layout invariance


@st.composite
def partitions(draw: st.DrawFn) -> tuple[tuple[int, ...], str, int]:
    nd = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 7 if d < nd - 1 else 1500)) for d in range(nd))
    return shape, draw(st.sampled_from(["rows", "cols", "grid", "flat"])), draw(st.integers(0, 2**32 - 1))


def _cuts(rng: np.random.Generator, n: int) -> list[int]:
    k = int(rng.integers(0, min(n, 4)))
    return [0, *sorted({int(x) for x in rng.integers(1, n, k)} if n > 1 else set()), n]


@settings(max_examples=120, deadline=None)
@given(partitions(), st.sampled_from(sorted(DTYPE_ITEMSIZE)))
def test_any_partition_gives_the_whole_tensor_value(
    part: tuple[tuple[int, ...], str, int], dtype: str
) -> None:
    shape, how, seed = part
    rng = np.random.default_rng(seed)
    isz = DTYPE_ITEMSIZE[dtype]
    a = rng.integers(0, 256, math.prod(shape) * isz, dtype=np.uint8).view(f"<u{isz}").reshape(shape)
    whole = fingerprint_partial(a, shape, (0,) * len(shape), shape)
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    if how == "flat":
        cuts = _cuts(rng, a.size)
        for s, e in itertools.pairwise(cuts):
            boxes += [b for b, _ in flat_range_to_boxes(shape, s, e)]
    else:
        dims = {"rows": [0], "cols": [len(shape) - 1], "grid": list(range(len(shape)))}[how]
        per = [_cuts(rng, n) if d in dims else [0, n] for d, n in enumerate(shape)]
        grids = (
            np.array(np.meshgrid(*[range(len(c) - 1) for c in per], indexing="ij")).reshape(len(shape), -1).T
        )
        for idx in grids:
            off = tuple(per[d][i] for d, i in enumerate(idx))
            boxes.append((off, tuple(per[d][i + 1] - per[d][i] for d, i in enumerate(idx))))
    parts = []
    for off, shp in boxes:
        sl = tuple(slice(o, o + n) for o, n in zip(off, shp, strict=True))
        parts.append(fingerprint_partial(np.ascontiguousarray(a[sl]), shape, off, shp))
    rng.shuffle(parts)
    assert combine_partials(parts) == whole
    # replicas are written once: a partition never counts a box twice, and counting one twice differs
    if len(parts) > 1 and a.any():
        assert combine_partials([*parts, parts[0]]) != whole or parts[0] == 0


# ------------------------------------------------------------------ structured changes


def _change(a: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray | None:
    """A structured change of ``a`` (unsigned words), or None when it would change nothing."""
    b = a.copy()
    flat = b.reshape(-1)
    bits = a.dtype.itemsize * 8
    top = np.array(1 << (bits - 1), dtype=a.dtype)
    n = flat.size
    if kind == "sign_flip":
        flat[int(rng.integers(n))] ^= top
    elif kind == "sign_flips":
        k = int(rng.integers(2, max(3, min(n, 9))))
        flat[rng.choice(n, size=min(k, n), replace=False)] ^= top
    elif kind == "high_bits":
        k = max(1, min(n, int(rng.integers(1, 6))))
        pattern = np.array(((1 << bits) - 1) ^ ((1 << (bits // 2)) - 1), dtype=a.dtype)
        flat[rng.choice(n, size=k, replace=False)] ^= pattern
    elif kind == "swap":
        i, j = rng.choice(n, size=2, replace=False) if n > 1 else (0, 0)
        flat[i], flat[j] = flat[j], flat[i]
    elif kind == "perm_rows" and b.ndim >= 1 and b.shape[0] > 1:
        b = b[rng.permutation(b.shape[0])]
    elif kind == "perm_cols" and b.ndim >= 1 and b.shape[-1] > 1:
        b = b[..., rng.permutation(b.shape[-1])]
    elif kind == "transpose" and b.ndim == 2 and b.shape[0] == b.shape[1]:
        b = np.ascontiguousarray(b.T)
    elif kind == "roll":
        b = np.roll(b, 1)
    elif kind == "add_sub":  # +d at one place, -d at another (mod the word size)
        if n < 2:
            return None
        i, j = rng.choice(n, size=2, replace=False)
        d = int(rng.integers(1, 1 << bits, dtype=np.uint64)) if bits < 64 else int(rng.integers(1, 2**63))
        flat[i] = (int(flat[i]) + d) % (1 << bits)
        flat[j] = (int(flat[j]) - d) % (1 << bits)
    else:
        return None
    return b if not np.array_equal(b, a) else None


CHANGES = [
    "sign_flip",
    "sign_flips",
    "high_bits",
    "swap",
    "perm_rows",
    "perm_cols",
    "transpose",
    "roll",
    "add_sub",
]


@settings(max_examples=400, deadline=None)
@given(
    st.sampled_from(sorted(DTYPE_ITEMSIZE)),
    st.sampled_from(CHANGES),
    st.lists(st.integers(1, 40), min_size=0, max_size=3),
    st.integers(0, 2**32 - 1),
    st.sampled_from(["random", "zeros", "equal"]),
)
def test_structured_changes_change_the_fingerprint(
    dtype: str, kind: str, shape_list: list[int], seed: int, fill: str
) -> None:
    shape = tuple(shape_list)
    if kind == "transpose" and len(shape) == 2:
        shape = (shape[0], shape[0])
    rng = np.random.default_rng(seed)
    isz = DTYPE_ITEMSIZE[dtype]
    n = math.prod(shape)
    a = rng.integers(0, 256, n * isz, dtype=np.uint8).view(f"<u{isz}").reshape(shape)
    if fill == "zeros":
        a = np.zeros_like(a)
    elif fill == "equal":  # every element the same but one: permutations rarely change these
        a = np.full_like(a, 0x3F)
        a.reshape(-1)[int(rng.integers(n))] ^= 0x11
    b = _change(a, kind, rng)
    if b is None:
        return
    fa = fingerprint_of_array("t", dtype, a.tobytes(), shape)
    fb = fingerprint_of_array("t", dtype, b.tobytes(), shape)
    assert fa != fb, (dtype, kind, shape)


@pytest.mark.parametrize("dtype", ["F64", "I64", "U64"])
def test_two_sign_flips_of_64_bit_words_collide_in_v1_not_in_v2(dtype: str) -> None:
    """v1's weights are odd, so 2^63 times any of them is 2^63 mod 2^64: any two sign flips cancel."""
    rng = np.random.default_rng(11)
    a = rng.integers(0, 2**63, (8, 9), dtype=np.uint64)
    b = a.copy()
    b[1, 2] ^= np.uint64(1 << 63)
    b[6, 7] ^= np.uint64(1 << 63)
    v1 = [fingerprint_v1("t", dtype, x.tobytes(), a.shape) for x in (a, b)]
    v2 = [fingerprint_of_array("t", dtype, x.tobytes(), a.shape) for x in (a, b)]
    assert v1[0] == v1[1]
    assert v2[0] != v2[1]


def _flip_deltas(a: np.ndarray, version: int) -> np.ndarray:
    """The partial value that flipping each element's sign adds (uint64, mod the version's modulus).

    Both versions are linear in their words or limbs: flipping the sign of element e adds
    +-(the partial of the sign bit alone at e), + when the bit was 0. Computed for all elements
    at once from the weights; a sample is checked against the public partial API below."""
    rows, cols = a.shape
    r = np.repeat(np.arange(rows, dtype=np.uint64), cols)
    c = np.tile(np.arange(cols, dtype=np.uint64), rows)
    neg = (a.reshape(-1) >> np.uint32(31)).astype(bool)
    if version == 1:
        w = (upgrade._mix64(r) | np.uint64(1)) * (upgrade._mix64(c ^ upgrade._COL_KEY) | np.uint64(1))
        d = w << np.uint64(31)  # wraps mod 2^64 like the sum
        return np.where(neg, np.uint64(0) - d, d)
    i = (r * np.uint64(cols) + c) * np.uint64(2) + np.uint64(1)  # the high limb holds the sign
    pos = i & np.uint64(hashing.G - 1)
    wh1, wh2 = hashing._weights(i >> np.uint64(hashing.GBITS), hashing.SEED_H)
    d1 = (wh1 * hashing._BL1[pos]) % np.uint64(hashing.P1) * np.uint64(0x8000) % np.uint64(hashing.P1)
    d2 = (wh2 * hashing._BL2[pos]) % np.uint64(hashing.P2) * np.uint64(0x8000) % np.uint64(hashing.P2)
    d1 = np.where(neg, (np.uint64(hashing.P1) - d1) % np.uint64(hashing.P1), d1)
    d2 = np.where(neg, (np.uint64(hashing.P2) - d2) % np.uint64(hashing.P2), d2)
    # CRT, vectorised: x = d1 + p1 * ((d2 - d1) * inv(p1) mod p2); every product < 2^64
    t = (d2 + np.uint64(hashing.P2) - d1 % np.uint64(hashing.P2)) % np.uint64(hashing.P2)
    t = t * np.uint64(hashing._INV_P1_MOD_P2) % np.uint64(hashing.P2)
    return d1 + np.uint64(hashing.P1) * t


def _birthday_pair(a: np.ndarray, version: int) -> tuple[int, int] | None:
    """Two elements whose sign flips cancel in the fingerprint sum, if any."""
    d = _flip_deltas(a, version)
    rng = np.random.default_rng(0)
    for e in rng.choice(d.size, 64, replace=False):  # the vectorised deltas are the API's deltas
        r, c = divmod(int(e), a.shape[1])
        sign = np.array([1 << 31], dtype="<u4")
        part = v1_partial if version == 1 else fingerprint_partial
        p = part(sign, a.shape, (r, c), (1, 1))
        modulus = 1 << 64 if version == 1 else hashing.MODULUS
        assert int(d[e]) == (p if not int(a[r, c]) >> 31 else -p) % modulus
    modulus_u = np.uint64(0) if version == 1 else np.uint64(hashing.MODULUS)
    neg = (modulus_u - d) if version == 1 else (modulus_u - d) % modulus_u
    _common, ia, ib = np.intersect1d(d, neg, return_indices=True)
    for x, y in zip(ia, ib, strict=True):
        if x != y:
            return int(x), int(y)
    return None


@pytest.mark.parametrize("seed", [2026, 7])
def test_birthday_search_for_a_colliding_sign_flip_pair(seed: int) -> None:
    """In a 512 x 512 F32 tensor a birthday search finds two sign flips that v1 cannot see
    (about 2^-33 per pair, 2^35 pairs); the same search over v2 (about 2^-62 per pair) finds none."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((512, 512)).astype(np.float32).view("<u4")
    pair = _birthday_pair(a, version=1)
    assert pair is not None
    b = a.copy().reshape(-1)
    b[list(pair)] ^= np.uint32(1 << 31)
    b = b.reshape(a.shape)
    assert fingerprint_v1("w", "F32", a.tobytes(), a.shape) == fingerprint_v1(
        "w", "F32", b.tobytes(), a.shape
    )
    assert fingerprint_of_array("w", "F32", a.tobytes(), a.shape) != fingerprint_of_array(
        "w", "F32", b.tobytes(), a.shape
    )
    assert _birthday_pair(a, version=2) is None


def test_finalize_binds_name_dtype_shape_and_both_sums() -> None:
    base = finalize_fingerprint("w", "F32", (3, 4), hashing.encode(1, 2))
    assert finalize_fingerprint("v", "F32", (3, 4), hashing.encode(1, 2)) != base
    assert finalize_fingerprint("w", "I32", (3, 4), hashing.encode(1, 2)) != base
    assert finalize_fingerprint("w", "F32", (4, 3), hashing.encode(1, 2)) != base
    assert finalize_fingerprint("w", "F32", (3, 4), hashing.encode(2, 2)) != base
    assert finalize_fingerprint("w", "F32", (3, 4), hashing.encode(1, 3)) != base
    assert finalize_fingerprint("w", "F32", (3, 4), hashing.encode(1, 2) + hashing.MODULUS) == base
