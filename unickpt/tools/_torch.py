"""The torch side of the tools (imported lazily: only ``merge --dtype`` and ``convert`` need torch)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from unickpt.ckpt.reader import CheckpointReader
from unickpt.errors import IntegrityError, UnsupportedError
from unickpt.io.tensors import torch_dtype

__all__ = ["st_of", "torch_of", "tensor_bytes", "from_bytes"]

_PAIRS = [
    ("bool", "BOOL"),
    ("uint8", "U8"),
    ("int8", "I8"),
    ("int16", "I16"),
    ("int32", "I32"),
    ("int64", "I64"),
    ("float16", "F16"),
    ("bfloat16", "BF16"),
    ("float32", "F32"),
    ("float64", "F64"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e8m0fnu", "F8_E8M0"),
    ("uint16", "U16"),
    ("uint32", "U32"),
    ("uint64", "U64"),
]
_TO_ST: dict[Any, str] = {getattr(torch, t): s for t, s in _PAIRS if hasattr(torch, t)}
_TO_TORCH: dict[str, Any] = {s: t for t, s in _TO_ST.items()}


def st_of(dtype: torch.dtype, where: str = "") -> str:
    try:
        return _TO_ST[dtype]
    except KeyError:
        raise UnsupportedError(f"{where}: dtype {dtype} cannot be stored in safetensors") from None


def torch_of(name: str) -> torch.dtype:
    try:
        dt: torch.dtype = _TO_TORCH[name]
        return dt
    except KeyError:
        raise UnsupportedError(f"dtype {name} has no torch equivalent in this torch build") from None


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The raw C-order bytes of a CPU tensor, as a uint8 numpy array (no copy when contiguous)."""
    flat = t.detach().cpu().contiguous().reshape(-1)
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def from_bytes(buf: np.ndarray, dtype: str, shape: list[int]) -> torch.Tensor:
    """A tensor viewing the raw bytes ``buf`` (uint8) as ``dtype`` of ``shape``."""
    t = torch.from_numpy(buf.reshape(-1)).view(torch_of(dtype))
    return t.reshape(shape)


def full_tensors(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Every tensor of ``reader`` whole, as torch tensors; every slice hash checked first."""
    failures = reader.verify()
    if failures:
        raise IntegrityError(failures, reader.index_path or reader.directory)
    out: dict[str, torch.Tensor] = {}
    for name, entry in reader.tensors.items():
        dt = torch_dtype(entry.dtype)
        full = torch.empty(tuple(entry.shape), dtype=dt)
        table = entry.table
        for k in range(len(table)):
            offsets, shape = table.box(k)
            raw = bytearray(reader.read_key(table.file(k), table.key(k)))
            data = torch.frombuffer(raw, dtype=dt).reshape(shape) if raw else torch.empty(shape, dtype=dt)
            full[tuple(slice(o, o + n) for o, n in zip(offsets, shape, strict=True))] = data
        out[name] = full
    return out
