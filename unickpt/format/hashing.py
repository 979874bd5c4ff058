"""The two hashes of the format (specified in docs/format.md, section "Hashes").

1. Slice hash: xxh3-64 of the exact stored bytes of one slice, as 16 lower-case hex digits.
   Pinpoints bit flips and partial writes to a tensor and a file.

2. Fingerprint: a layout-invariant digest of a whole global tensor that every rank can
   compute from the slices it holds, with no gather: any partition of the tensor into slices
   (blocks, rows, columns, flat ranges, replicas written once) gives partial values that
   :func:`combine_partials` adds up to the same total, which :func:`finalize_fingerprint`
   binds to the tensor's name, dtype and shape.

   Version 2 (written by every save; ``unickpt.format_version`` 2) is defined in ``_fp2.py``
   and docs/format.md section 5.2: two hashes mod the primes 2^32 - 5 and 2^32 - 17 over the
   tensor's 16-bit limbs, so that every fixed nonzero change of the data changes it except with
   probability about 2^-60. Its partial value is one int in [0, p_1 p_2) (the pair of sums by
   the Chinese remainder theorem); partials add mod p_1 p_2.

   Version 1 (legacy, for indexes with ``format_version`` 1) is the linear form

       S = sum over elements (r, c) of a_r * b_c * w[r, c]   (mod 2^64)
       a_r = mix64(r) | 1,  b_c = mix64(c XOR 0xD1B54A32D192ED03) | 1

   over the raw element bits w; partials add mod 2^64. Changes in high bits cancel (two sign
   flips of a 64-bit tensor always collide), which is why version 2 exists. It is kept only to
   verify version 1 checkpoints: a v1 fingerprint is only ever compared with a v1 fingerprint.

   Every function takes ``version`` (default :data:`FINGERPRINT_VERSION`, i.e. 2); use
   :func:`fingerprint_version` to map an index's ``format_version`` to it.

   Neither hash is cryptographic: they catch accidents (bit rot, truncation, wrong file),
   not an adversary who can write the index too.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from types import ModuleType

import numpy as np
import xxhash

from unickpt.errors import ConfigError
from unickpt.format import _fp2
from unickpt.format.dtypes import itemsize

__all__ = [
    "FINGERPRINT_VERSION",
    "fingerprint_version",
    "slice_hash",
    "SliceHasher",
    "fingerprint_partial",
    "hash_block",
    "combine_partials",
    "finalize_fingerprint",
    "fingerprint_of_array",
    "KERNEL",
]

_native: ModuleType | None
try:  # the compiled kernel (unickpt/format/_fpkernel.c); optional, same numbers as numpy
    from unickpt.format import _fpkernel as _native
except ImportError:  # pragma: no cover - exercised where no C compiler was available
    _native = None

_native2: ModuleType | None
try:  # the compiled v2 kernel (unickpt/format/_fp2kernel.c)
    from unickpt.format import _fp2kernel as _native2
except ImportError:  # pragma: no cover - exercised where no C compiler was available
    _native2 = None

if os.environ.get("UNICKPT_REQUIRE_NATIVE") and (_native is None or _native2 is None):  # pragma: no cover
    raise ImportError("UNICKPT_REQUIRE_NATIVE is set but the fingerprint kernels were not built")

#: Which fingerprint v2 kernel runs: "avx2" or "scalar" (compiled), or "numpy".
KERNEL: str = _native2.simd() if _native2 is not None else "numpy"

#: The fingerprint every save writes (docs/format.md section 5.2).
FINGERPRINT_VERSION = 2


def fingerprint_version(format_version: int) -> int:
    """The fingerprint algorithm of an index with this ``unickpt.format_version``."""
    return 1 if format_version <= 1 else 2


def _check_version(version: int) -> None:
    if version not in (1, 2):
        raise ConfigError(f"unknown fingerprint version {version!r} (known: 1, 2)")


_MASK = (1 << 64) - 1
_COL_KEY = np.uint64(0xD1B54A32D192ED03)
# Rows are processed in blocks of about this many elements to keep the uint64 temporaries
# in cache-sized pieces instead of 8x the slice size.
_BLOCK_ELEMS = 1 << 18


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


# The splitmix64 finalizer: one definition for both fingerprint versions.
_mix64 = _fp2._mix64


def _row_indices(global_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """Global row numbers (row = all dims but the last) of a box, in the box's row order."""
    lead_g = list(global_shape[:-1])
    lead_o = list(offsets[:-1])
    lead_s = list(shape[:-1])
    rows = np.zeros(1, dtype=np.uint64)
    stride = 1
    strides = []
    for d in reversed(lead_g):
        strides.append(stride)
        stride *= d
    strides.reverse()
    for o, s, st in zip(lead_o, lead_s, strides, strict=True):
        idx = (np.arange(o, o + s, dtype=np.uint64) * np.uint64(st)).astype(np.uint64)
        rows = np.add.outer(rows, idx).reshape(-1)
    return rows


def fingerprint_partial(
    words: np.ndarray,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    shape: Sequence[int],
    *,
    version: int = FINGERPRINT_VERSION,
) -> int:
    """Partial value over one box of the global tensor.

    ``words`` holds the box's elements as unsigned integers of the dtype's item size, in
    C order, any array shape with ``prod(shape)`` elements.
    """
    w = np.ascontiguousarray(words).reshape(-1)
    if w.size != math.prod(shape):
        raise ValueError(f"{w.size} words for a block of shape {list(shape)}")
    return hash_block(w, w.dtype.itemsize, global_shape, offsets, shape, xxh3=False, version=version)[1]


def _partial_numpy(
    words: np.ndarray, global_shape: Sequence[int], offsets: Sequence[int], shape: Sequence[int]
) -> int:
    """The numpy reference of fingerprint v1 (used where the v1 kernel is not built)."""
    if math.prod(shape) == 0:
        return 0
    if len(global_shape) == 0:
        global_shape, offsets, shape = (1,), (0,), (1,)
    cols = shape[-1]
    w2 = np.ascontiguousarray(words).reshape(-1, cols)
    a = _mix64(_row_indices(global_shape, offsets, shape)) | np.uint64(1)
    c = np.arange(offsets[-1], offsets[-1] + cols, dtype=np.uint64) ^ _COL_KEY
    b = _mix64(c) | np.uint64(1)
    total = 0
    step = max(1, _BLOCK_ELEMS // max(cols, 1))
    with np.errstate(over="ignore"):
        for r0 in range(0, w2.shape[0], step):
            # einsum widens each word to uint64 inside its loop: no uint64 copy of the block,
            # about twice as fast as astype + multiply + sum. Sums wrap mod 2^64 as specified.
            inner = np.einsum("ij,j->i", w2[r0 : r0 + step], b, dtype=np.uint64, casting="unsafe")
            inner *= a[r0 : r0 + step]
            total = (total + int(inner.sum(dtype=np.uint64))) & _MASK
    return total


# Blocks are hashed in chunks of this many bytes, each chunk by both hashes while it is in cache.
_CHUNK_BYTES = 1 << 20


def hash_block(
    data: np.ndarray,
    itemsize: int,
    global_shape: Sequence[int],
    offsets: Sequence[int],
    shape: Sequence[int],
    *,
    xxh3: bool = True,
    fingerprint: bool = True,
    version: int = FINGERPRINT_VERSION,
) -> tuple[str | None, int]:
    """Slice hash and fingerprint partial of one stored block in one pass over its bytes.

    ``data`` is the block's stored bytes (C order, any contiguous array). Returns the xxh3-64
    hex digest (None unless ``xxh3``) and the partial value (0 unless ``fingerprint``).
    """
    _check_version(version)
    raw = memoryview(np.ascontiguousarray(data)).cast("B")  # type: ignore[arg-type]
    n = math.prod(shape)
    if len(raw) != n * itemsize:
        raise ValueError(f"{len(raw)} bytes for a block of shape {list(shape)} with {itemsize}-byte items")
    fingerprint = fingerprint and n > 0
    if version == 2:
        return _hash_block_v2(raw, itemsize, global_shape, offsets, shape, xxh3, fingerprint)
    if not (fingerprint and _native is not None):
        digest = slice_hash(raw) if xxh3 else None
        total = 0
        if fingerprint:
            words = np.frombuffer(raw, dtype=f"<u{itemsize}")
            total = _partial_numpy(words, global_shape, offsets, shape)
        return digest, total
    if len(global_shape) == 0:
        global_shape, offsets, shape = (1,), (0,), (1,)
    lead = (tuple(global_shape[:-1]), tuple(offsets[:-1]), tuple(shape[:-1]), offsets[-1], shape[-1])
    h = xxhash.xxh3_64() if xxh3 else None
    total = 0
    step = max(itemsize, _CHUNK_BYTES - _CHUNK_BYTES % itemsize)
    # Keeps the block's column weights from one chunk to the next.
    workspace = bytearray(_native.table_bytes(shape[-1]))
    for start in range(0, len(raw), step):
        chunk = raw[start : start + step]
        if h is not None:
            h.update(chunk)
        total += _native.partial(chunk, itemsize, *lead, start // itemsize, workspace)
    return (h.hexdigest() if h is not None else None), total & _MASK


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
        total = _fp2.partial_numpy(raw, itemsize, global_shape, offsets, shape) if fingerprint else 0
        return digest, total
    h = xxhash.xxh3_64() if xxh3 else None
    h1 = h2 = 0
    # Chunks keep each piece in cache for both hashes; the fingerprint alone takes one call.
    step = max(itemsize, _CHUNK_BYTES - _CHUNK_BYTES % itemsize) if h is not None else max(1, len(raw))
    args = (tuple(global_shape), tuple(offsets), tuple(shape))
    for start in range(0, len(raw), step):
        chunk = raw[start : start + step]
        if h is not None:
            h.update(chunk)
        s1, s2 = _native2.partial(chunk, itemsize, *args, start // itemsize)
        h1, h2 = h1 + s1, h2 + s2
    return (h.hexdigest() if h is not None else None), _fp2.encode(h1 % _fp2.P1, h2 % _fp2.P2)


def combine_partials(partials: Iterable[int], *, version: int = FINGERPRINT_VERSION) -> int:
    """The sum of partial values (of one version) of disjoint parts of a tensor."""
    _check_version(version)
    total = 0
    for p in partials:
        total = (total + int(p)) & _MASK if version == 1 else _fp2.add(total, p)
    return total


def finalize_fingerprint(
    name: str, dtype: str, shape: Sequence[int], total: int, *, version: int = FINGERPRINT_VERSION
) -> str:
    """The fingerprint (16 hex digits) of a tensor whose partials add up to ``total``."""
    _check_version(version)
    if version == 2:
        return _fp2.finalize(name, dtype, shape, total)
    h = xxhash.xxh3_64()
    h.update(name.encode("utf-8") + b"\0" + dtype.encode("ascii") + b"\0")
    h.update(",".join(str(int(d)) for d in shape).encode("ascii") + b"\0")
    h.update(int(total & _MASK).to_bytes(8, "little"))
    return h.hexdigest()


def fingerprint_of_array(
    name: str,
    dtype: str,
    data: bytes | memoryview,
    shape: Sequence[int],
    *,
    version: int = FINGERPRINT_VERSION,
) -> str:
    """Fingerprint of a whole tensor given its raw C-order bytes (tests and offline tools)."""
    words = np.frombuffer(data, dtype=f"<u{itemsize(dtype)}")
    total = fingerprint_partial(words, shape, [0] * len(shape), shape, version=version)
    return finalize_fingerprint(name, dtype, shape, total, version=version)
