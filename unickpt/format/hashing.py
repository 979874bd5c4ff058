"""The two hashes of the format (specified in docs/format.md, section "Hashes").

1. Slice hash: xxh3-64 of the exact stored bytes of one slice, as 16 lower-case hex digits.
   Pinpoints bit flips and partial writes to a tensor and a file.

2. Fingerprint: a layout-invariant digest of a whole global tensor that every rank can
   compute from the slices it holds, with no gather: any partition of the tensor into slices
   (blocks, rows, columns, flat ranges, replicas written once) gives partial values that
   :func:`combine_partials` adds up to the same total, which :func:`finalize_fingerprint`
   binds to the tensor's name, dtype and shape.

   Fingerprint v2 (docs/format.md section 5.2) is defined in ``_fp2.py``: two hashes mod the
   primes 2^32 - 5 and 2^32 - 17 over the tensor's 16-bit limbs, so that every fixed nonzero
   change of the data changes it except with probability about 2^-60. Its partial value is one
   int in [0, p_1 p_2) (the pair of sums by the Chinese remainder theorem); partials add mod
   p_1 p_2. (The linear fingerprint v1 of format version 1 lives only in ``tools/upgrade.py``,
   which replaces it.)

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

from unickpt.format import _fp2
from unickpt.format.dtypes import itemsize

__all__ = [
    "slice_hash",
    "SliceHasher",
    "fingerprint_partial",
    "hash_block",
    "combine_partials",
    "finalize_fingerprint",
    "fingerprint_of_array",
    "KERNEL",
]

_native2: ModuleType | None
try:  # the compiled v2 kernel (unickpt/format/_fp2kernel.c)
    from unickpt.format import _fp2kernel as _native2
except ImportError:  # pragma: no cover - exercised where no C compiler was available
    _native2 = None

if os.environ.get("UNICKPT_REQUIRE_NATIVE") and _native2 is None:  # pragma: no cover
    raise ImportError("UNICKPT_REQUIRE_NATIVE is set but the fingerprint kernel was not built")

#: Which fingerprint v2 loops run: "avx512-ifma", "avx512", "avx2" or "scalar" (compiled), or "numpy".
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


def combine_partials(partials: Iterable[int]) -> int:
    """The sum of partial values of disjoint parts of a tensor."""
    total = 0
    for p in partials:
        total = _fp2.add(total, p)
    return total


def finalize_fingerprint(name: str, dtype: str, shape: Sequence[int], total: int) -> str:
    """The fingerprint (16 hex digits) of a tensor whose partials add up to ``total``."""
    return _fp2.finalize(name, dtype, shape, total)


def fingerprint_of_array(name: str, dtype: str, data: bytes | memoryview, shape: Sequence[int]) -> str:
    """Fingerprint of a whole tensor given its raw C-order bytes (tests and offline tools)."""
    words = np.frombuffer(data, dtype=f"<u{itemsize(dtype)}")
    total = fingerprint_partial(words, shape, [0] * len(shape), shape)
    return finalize_fingerprint(name, dtype, shape, total)
