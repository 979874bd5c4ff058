"""The dtype table shared by the on-disk format: safetensors names, item sizes, numpy views.

Tensor bytes are handled as raw little-endian words of the item size (bf16 and fp8 have no
numpy type, and need none: hashing, merging and slicing never interpret values).
"""

from __future__ import annotations

import numpy as np

from unickpt.errors import UnsupportedError

__all__ = ["DTYPE_ITEMSIZE", "itemsize", "word_dtype", "check_dtype"]

# safetensors dtype name -> bytes per element. Sub-byte types (F4, F6 ...) are refused:
# a slice of them need not start on a byte boundary.
DTYPE_ITEMSIZE: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "F64": 8,
    "I64": 8,
    "U64": 8,
}

_WORDS = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<u4"), 8: np.dtype("<u8")}


def check_dtype(name: str, where: str = "") -> str:
    if name not in DTYPE_ITEMSIZE:
        at = f" ({where})" if where else ""
        raise UnsupportedError(
            f"unknown or unsupported dtype {name!r}{at}; supported: {', '.join(sorted(DTYPE_ITEMSIZE))}"
        )
    return name


def itemsize(name: str) -> int:
    return DTYPE_ITEMSIZE[check_dtype(name)]


def word_dtype(name: str) -> np.dtype[np.unsignedinteger]:
    """The unsigned little-endian integer type with the dtype's item size."""
    return _WORDS[itemsize(name)]  # type: ignore[return-value]
