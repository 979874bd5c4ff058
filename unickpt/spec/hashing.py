"""The two hashes of the format (specified in docs/format.md, section "Hashes").

1. Slice hash: xxh3-64 of the exact stored bytes of one slice, as 16 lower-case hex digits.
   Pinpoints bit flips and partial writes to a tensor and a file.

2. Fingerprint: a layout-invariant digest of a whole global tensor that every rank can
   compute from the slices it holds, with no gather: any partition of the tensor into slices
   (blocks, rows, columns, flat ranges, replicas written once) gives partial values that
   :func:`combine_partials` adds up to the same total, which :func:`finalize_fingerprint`
   binds to the tensor's name, dtype and shape.

   Fingerprint v2 (docs/format.md section 5.2) is defined below (its constants, the numpy reference and the partial
   value; section "Fingerprint v2, defined"): two hashes mod the
   primes 2^32 - 5 and 2^32 - 17 over the tensor's 16-bit limbs, so that every fixed nonzero
   change of the data changes it except with probability about 2^-60. Its partial value is one
   int in [0, p_1 p_2) (the pair of sums by the Chinese remainder theorem); partials add mod
   p_1 p_2. (The linear fingerprint v1 of format version 1 lives only in ``tools/upgrade.py``,
   which replaces it.)

   A large block's fingerprint is shared by ``FP_THREADS`` threads (element ranges of the
   block, whose sums add up: the same numbers), the calling thread meanwhile computing the
   block's xxh3, which cannot be split; ``UNICKPT_FP_THREADS`` sets the count.

   Neither hash is cryptographic: they catch accidents (bit rot, truncation, wrong file),
   not an adversary who can write the index too.
"""

from __future__ import annotations

import itertools
import math
import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import ModuleType

import numpy as np
import xxhash

from unickpt.errors import ConfigError
from unickpt.spec.dtypes import itemsize

__all__ = [
    "slice_hash",
    "SliceHasher",
    "fingerprint_partial",
    "hash_block",
    "combine_partials",
    "finalize_fingerprint",
    "fingerprint_of_array",
    "KERNEL",
    "FP_THREADS",
]

# ---------------------------------------------------------------- fingerprint v2, defined
# Fingerprint v2 (docs/format.md, section 5.2): constants, the numpy reference, the partial value.
#
# The tensor's C-order bytes are a flat sequence of limbs (16-bit little-endian words for item
# sizes 2, 4, 8; bytes for 1-byte dtypes). Limb ``i = h * G + l`` (``G = 1024``) is weighted by
# ``bh_k(h) * bl_k(l) mod p_k`` for the primes ``p_1 = 2^32 - 5`` and ``p_2 = 2^32 - 17``:
#
#     H_k = sum over limbs i of bh_k(i // G) * bl_k(i % G) * v_i   (mod p_k)
#
# A block's share is the same sum over its own limbs, so shares of any partition add up. The
# partial value handed around is one int: the pair (H_1 mod p_1, H_2 mod p_2) by the Chinese
# remainder theorem, i.e. the x in [0, p_1 p_2) with x = H_1 (mod p_1) and x = H_2 (mod p_2).
# Adding pairs component-wise is adding these ints mod p_1 p_2 (:func:`add`).
#
# The compiled kernel (``_fp2kernel.c``) computes the same numbers; this section is the
# specification in executable form and the fallback where no C compiler was available.

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


# ---------------------------------------------------------------- the compiled kernel
_native2: ModuleType | None
try:  # the compiled v2 kernel (unickpt/spec/_fp2kernel.c)
    from unickpt.spec import _fp2kernel as _native2
except ImportError:  # pragma: no cover - exercised where no C compiler was available
    _native2 = None

if os.environ.get("UNICKPT_REQUIRE_NATIVE") and _native2 is None:  # pragma: no cover
    raise ImportError("UNICKPT_REQUIRE_NATIVE is set but the fingerprint kernel was not built")

#: Which fingerprint v2 loops run: "avx512-ifma", "avx512", "avx2", "neon" or "scalar" (compiled), or "numpy".
KERNEL: str = _native2.simd() if _native2 is not None else "numpy"


def slice_hash(data: memoryview | bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


class SliceHasher:
    """Streaming xxh3-64 for a slice read or written in chunks."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, data: memoryview | bytes) -> None:
        self._h.update(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def fingerprint_partial(
    words: np.ndarray,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    shape: Sequence[int],
) -> int:
    """Partial value over one box of the global tensor.

    ``words`` holds the box's elements as unsigned integers of the dtype's item size, in
    C order, any array shape with ``prod(shape)`` elements.
    """
    w = np.ascontiguousarray(words).reshape(-1)
    if w.size != math.prod(shape):
        raise ValueError(f"{w.size} words for a block of shape {list(shape)}")
    return hash_block(w, w.dtype.itemsize, global_shape, offsets, shape, xxh3=False)[1]


# Blocks are hashed in chunks of this many bytes, each chunk by both hashes while it is in cache
# (1 to 32 MiB cost the same CPU; larger chunks hand the GIL back and forth less often).
_CHUNK_BYTES = 8 << 20


def _fp_threads() -> int:
    """Threads that compute one large block's fingerprint (the hashing thread included).

    ``UNICKPT_FP_THREADS`` if set; else the cores this process may run on (its CPU affinity,
    shared among the node's ranks by ``LOCAL_WORLD_SIZE``) less one for the thread that
    writes, at most 4 (the kernel then reads at about memory speed).
    """
    env = os.environ.get("UNICKPT_FP_THREADS", "").strip()
    if env:
        if not env.isdigit() or int(env) < 1:
            raise ConfigError(f"UNICKPT_FP_THREADS must be a whole number >= 1, not {env!r}")
        return int(env)
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - no affinity (macOS, Windows)
        cores = os.cpu_count() or 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    ranks = int(local) if local.isdigit() and int(local) > 0 else 1
    return max(1, min(4, cores // ranks - 1))


#: Threads that share one large block's fingerprint (see :func:`_fp_threads`); 1: none.
FP_THREADS: int = _fp_threads()
# A block is split only into parts of at least this many bytes (smaller ones cost more to hand out).
_SPLIT_MIN_BYTES = 4 << 20

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_pool_lock = threading.Lock()


def _helpers(n: int) -> ThreadPoolExecutor:
    """The process's pool of ``n`` fingerprint helper threads (made on first use)."""
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n:  # a smaller one left behind stays usable by its callers
            _pool, _pool_size = ThreadPoolExecutor(max_workers=n, thread_name_prefix="unickpt-fp"), n
        return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's helper threads do not exist there, a new pool is made."""
    global _pool, _pool_size, _pool_lock
    _pool, _pool_size, _pool_lock = None, 0, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def hash_block(
    data: np.ndarray,
    itemsize: int,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    shape: Sequence[int],
    *,
    xxh3: bool = True,
    fingerprint: bool = True,
) -> tuple[str | None, int]:
    """Slice hash and fingerprint partial of one stored block in one pass over its bytes.

    ``data`` is the block's stored bytes (C order, any contiguous array). Returns the xxh3-64
    hex digest (None unless ``xxh3``) and the partial value (0 unless ``fingerprint``).
    """
    raw = memoryview(np.ascontiguousarray(data)).cast("B")  # type: ignore[arg-type]
    n = math.prod(shape)
    if len(raw) != n * itemsize:
        raise ValueError(f"{len(raw)} bytes for a block of shape {list(shape)} with {itemsize}-byte items")
    return _hash_block_v2(raw, itemsize, global_shape, offsets, shape, xxh3, fingerprint and n > 0)


def _hash_block_v2(
    raw: memoryview,
    itemsize: int,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    shape: Sequence[int],
    xxh3: bool,
    fingerprint: bool,
) -> tuple[str | None, int]:
    if not (fingerprint and _native2 is not None):
        digest = slice_hash(raw) if xxh3 else None
        total = partial_numpy(raw, itemsize, global_shape, offsets, shape) if fingerprint else 0
        return digest, total
    args = (tuple(global_shape), tuple(offsets), tuple(shape))
    parts = _parts(len(raw) // itemsize, itemsize, xxh3)
    if parts:
        return _hash_split(raw, itemsize, args, parts, xxh3)
    h = xxhash.xxh3_64() if xxh3 else None
    h1 = h2 = 0
    # Chunks keep each piece in cache for both hashes; the fingerprint alone takes one call.
    step = max(itemsize, _CHUNK_BYTES - _CHUNK_BYTES % itemsize) if h is not None else max(1, len(raw))
    for start in range(0, len(raw), step):
        chunk = raw[start : start + step]
        if h is not None:
            h.update(chunk)
        s1, s2 = _native2.partial(chunk, itemsize, *args, start // itemsize)
        h1, h2 = h1 + s1, h2 + s2
    return (h.hexdigest() if h is not None else None), encode(h1 % P1, h2 % P2)


def _parts(count: int, isz: int, xxh3: bool) -> list[tuple[int, int]]:
    """Element ranges for the helper threads (empty: hash in this thread alone).

    With ``xxh3`` this thread reads the block for the xxh3 (it cannot be split) while the
    helpers, ``FP_THREADS - 1`` of them, share the fingerprint; without, this thread takes
    the first of ``FP_THREADS`` shares. Each share is at least ``_SPLIT_MIN_BYTES``.
    """
    shares = FP_THREADS - 1 if xxh3 else FP_THREADS
    shares = min(shares, count * isz // _SPLIT_MIN_BYTES)
    if shares < (1 if xxh3 else 2):
        return []
    cuts = [count * k // shares for k in range(shares + 1)]
    return list(itertools.pairwise(cuts))


def _hash_split(
    raw: memoryview,
    isz: int,
    args: tuple[Sequence[int], Sequence[int], Sequence[int]],
    parts: list[tuple[int, int]],
    xxh3: bool,
) -> tuple[str | None, int]:
    """The fingerprint of ``parts`` on the helper threads (the kernel releases the GIL), this
    thread computing the xxh3 of the whole block meanwhile, or else the first part. The parts'
    sums add up to the whole block's, so the numbers are the serial ones. The helpers read the
    caller's buffer: no copy."""
    if _native2 is None:  # pragma: no cover - the caller checked
        raise RuntimeError("internal: no fingerprint kernel")
    kernel = _native2.partial
    mine = [] if xxh3 else parts[:1]
    theirs = parts[len(mine) :]
    pool = _helpers(max(1, FP_THREADS - 1))
    futures: list[Future[tuple[int, int]]] = [
        pool.submit(kernel, raw[a * isz : b * isz], isz, args[0], args[1], args[2], a) for a, b in theirs
    ]
    try:
        digest = slice_hash(raw) if xxh3 else None
        h1 = h2 = 0
        for a, b in mine:
            h1, h2 = kernel(raw[a * isz : b * isz], isz, args[0], args[1], args[2], a)
        for f in futures:
            s1, s2 = f.result()
            h1, h2 = h1 + s1, h2 + s2
    finally:  # on any failure, no helper is still reading the buffer when this returns
        for f in futures:
            f.cancel()
        wait(futures)
    return digest, encode(h1 % P1, h2 % P2)


def combine_partials(partials: Iterable[int]) -> int:
    """The sum of partial values of disjoint parts of a tensor."""
    total = 0
    for p in partials:
        total = add(total, p)
    return total


def finalize_fingerprint(name: str, dtype: str, shape: Sequence[int], total: int) -> str:
    """The fingerprint (16 hex digits) of a tensor whose partials add up to ``total``."""
    return finalize(name, dtype, shape, total)


def fingerprint_of_array(name: str, dtype: str, data: bytes | memoryview, shape: Sequence[int]) -> str:
    """Fingerprint of a whole tensor given its raw C-order bytes (tests and offline tools)."""
    words = np.frombuffer(data, dtype=f"<u{itemsize(dtype)}")
    total = fingerprint_partial(words, shape, [0] * len(shape), shape)
    return finalize_fingerprint(name, dtype, shape, total)
