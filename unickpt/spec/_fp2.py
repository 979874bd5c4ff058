"""Fingerprint v2 (docs/format.md, section 5.2): constants, the numpy reference, the partial value.

The tensor's C-order bytes are a flat sequence of limbs (16-bit little-endian words for item
sizes 2, 4, 8; bytes for 1-byte dtypes). Limb ``i = h * G + l`` (``G = 1024``) is weighted by
``bh_k(h) * bl_k(l) mod p_k`` for the primes ``p_1 = 2^32 - 5`` and ``p_2 = 2^32 - 17``:

    H_k = sum over limbs i of bh_k(i // G) * bl_k(i % G) * v_i   (mod p_k)

A block's share is the same sum over its own limbs, so shares of any partition add up. The
partial value handed around is one int: the pair (H_1 mod p_1, H_2 mod p_2) by the Chinese
remainder theorem, i.e. the x in [0, p_1 p_2) with x = H_1 (mod p_1) and x = H_2 (mod p_2).
Adding pairs component-wise is adding these ints mod p_1 p_2 (:func:`add`).

The compiled kernel (``_fp2kernel.c``) computes the same numbers; this module is the
specification in executable form and the fallback where no C compiler was available.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import xxhash

P1 = (1 << 32) - 5
P2 = (1 << 32) - 17
MODULUS = P1 * P2
GBITS = 10
G = 1 << GBITS
SEED_L = 0x6A09E667F3BCC909
SEED_H = 0xBB67AE8584CAA73B
#: Domain tag in front of everything the final XXH3-64 reads (a v1 value can never equal it).
TAG = b"unickpt-fingerprint-v2\0"
_INV_P1_MOD_P2 = pow(P1, -1, P2)

# Limbs per numpy step: keeps the uint64 temporaries (about 6 per limb) in the tens of MiB.
_STEP_LIMBS = 1 << 20


def _mix64(x: np.ndarray) -> np.ndarray:
    z = x.astype(np.uint64, copy=True)
    with np.errstate(over="ignore"):
        z += np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
    return z


def _weights(idx: np.ndarray, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Both primes' weights in [1, p_k) of the indices ``idx`` under ``seed``."""
    z = _mix64(idx.astype(np.uint64) ^ np.uint64(seed))
    w1 = np.uint64(1) + (z & np.uint64(0xFFFFFFFF)) % np.uint64(P1 - 1)
    w2 = np.uint64(1) + (z >> np.uint64(32)) % np.uint64(P2 - 1)
    return w1, w2


_BL1, _BL2 = _weights(np.arange(G, dtype=np.uint64), SEED_L)


def encode(h1: int, h2: int) -> int:
    """The partial value of the pair (H_1, H_2)."""
    h1 %= P1
    return h1 + P1 * (((h2 - h1) * _INV_P1_MOD_P2) % P2)


def decode(x: int) -> tuple[int, int]:
    return x % P1, x % P2


def add(a: int, b: int) -> int:
    return (int(a) + int(b)) % MODULUS


def _runs(
    global_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int]
) -> tuple[np.ndarray, int]:
    """Global element index where each of the block's contiguous runs starts, and the run length."""
    k = len(shape) - 1
    while k > 0 and offsets[k] == 0 and shape[k] == global_shape[k]:
        k -= 1
    gstride = [math.prod(global_shape[d + 1 :]) for d in range(len(shape))]
    starts = np.full(1, offsets[k] * gstride[k], dtype=np.uint64)
    for d in range(k):
        idx = np.arange(offsets[d], offsets[d] + shape[d], dtype=np.uint64) * np.uint64(gstride[d])
        starts = np.add.outer(starts, idx).reshape(-1)
    return starts, shape[k] * gstride[k]


def _limb_sums(v: np.ndarray, i: np.ndarray) -> tuple[int, int]:
    """(H_1, H_2) of limbs ``v`` (any uint) at global limb indices ``i`` (uint64), same shape."""
    v = v.reshape(-1).astype(np.uint64)
    i = i.reshape(-1)
    if v.size == 0:
        return 0, 0
    pos = i & np.uint64(G - 1)
    h = i >> np.uint64(GBITS)
    # Segments of equal h (groups; a row break starts a new segment): at most G products each,
    # every product < 2^48, so the uint64 segment sums are exact.
    cut = np.flatnonzero(h[1:] != h[:-1]) + 1
    seg = np.concatenate([np.zeros(1, dtype=np.intp), cut])
    w1, w2 = _weights(h[seg], SEED_H)
    out = []
    for bl, w, p in ((_BL1, w1, P1), (_BL2, w2, P2)):
        s = np.add.reduceat(v * bl[pos], seg) % np.uint64(p)
        out.append(int(((s * w) % np.uint64(p)).sum(dtype=np.uint64)) % p)  # < 2^20 terms < 2^32
    return out[0], out[1]


_BL = np.stack([_BL1, _BL2], axis=1)  # G x 2: both primes' position weights


def _run_sums(v: np.ndarray, i0: int) -> tuple[int, int]:
    """(H_1, H_2) of the limbs ``v`` at global limb indices [i0, i0 + len(v))."""
    head = min(len(v), -i0 % G)
    h1, h2 = _limb_sums(v[:head], np.arange(i0, i0 + head, dtype=np.uint64))
    for m0 in range(head, len(v) - G + 1, _STEP_LIMBS):
        k = min(_STEP_LIMBS, len(v) - m0) // G
        # k whole groups: each row's dot product with the position weights is < 2^58, exact.
        s = v[m0 : m0 + k * G].reshape(k, G).astype(np.uint64) @ _BL
        w1, w2 = _weights(np.arange(k, dtype=np.uint64) + np.uint64((i0 + m0) // G), SEED_H)
        h1 = (h1 + int(((s[:, 0] % np.uint64(P1)) * w1 % np.uint64(P1)).sum(dtype=np.uint64))) % P1
        h2 = (h2 + int(((s[:, 1] % np.uint64(P2)) * w2 % np.uint64(P2)).sum(dtype=np.uint64))) % P2
    tail = head + (len(v) - head) // G * G
    t1, t2 = _limb_sums(v[tail:], np.arange(i0 + tail, i0 + len(v), dtype=np.uint64))
    return (h1 + t1) % P1, (h2 + t2) % P2


def partial_numpy(
    raw: bytes | memoryview,
    itemsize: int,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    shape: Sequence[int],
) -> int:
    """The partial value of a whole block given its stored C-order bytes (numpy reference)."""
    if math.prod(shape) == 0:
        return 0
    if len(global_shape) == 0:
        global_shape, offsets, shape = (1,), (0,), (1,)
    per = 1 if itemsize == 1 else itemsize // 2
    limbs = np.frombuffer(raw, dtype="<u1" if itemsize == 1 else "<u2")
    starts, run = _runs(global_shape, offsets, shape)
    rl = run * per
    grid = limbs.reshape(len(starts), rl)
    h1 = h2 = 0
    if rl >= 4 * G:  # long runs: whole groups as one integer matrix product each
        for r, i0 in enumerate(starts.tolist()):
            s1, s2 = _run_sums(grid[r], i0 * per)
            h1, h2 = (h1 + s1) % P1, (h2 + s2) % P2
        return encode(h1, h2)
    rows = max(1, _STEP_LIMBS // rl)
    c = np.arange(rl, dtype=np.uint64)
    for r0 in range(0, len(starts), rows):
        base = starts[r0 : r0 + rows] * np.uint64(per)
        s1, s2 = _limb_sums(grid[r0 : r0 + rows], np.add.outer(base, c))
        h1, h2 = (h1 + s1) % P1, (h2 + s2) % P2
    return encode(h1, h2)


def finalize(name: str, dtype: str, shape: Sequence[int], total: int) -> str:
    h1, h2 = decode(int(total) % MODULUS)
    h = xxhash.xxh3_64()
    h.update(TAG + name.encode("utf-8") + b"\0" + dtype.encode("ascii") + b"\0")
    h.update(",".join(str(int(d)) for d in shape).encode("ascii") + b"\0")
    h.update(h1.to_bytes(4, "little") + h2.to_bytes(4, "little"))
    return h.hexdigest()
