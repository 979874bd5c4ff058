"""Non-tensor state (param_groups, LR schedulers, per-parameter scalars) as plain JSON.

Nothing is pickled. Tuples are stored as lists (loading restores the type of the live value). Small tensors
take a tagged form ``{"__tensor__": {"dtype", "shape", "data"}}``.
Anything else (functions, arbitrary objects) is refused with ``UnsupportedError`` naming it.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from unickpt.errors import UnsupportedError
from unickpt.io.tensors import st_dtype, torch_dtype

__all__ = ["to_json_value", "from_json_value"]

# Tensors inside JSON state are scalars such as a capturable optimizer's lr; large ones
# belong in safetensors files.
_MAX_JSON_TENSOR_ELEMENTS = 4096


def to_json_value(value: Any, where: str) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, (tuple, list)):
        # Tuples (Adam's betas) are stored as lists; loading restores the live value's type.
        return [to_json_value(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise UnsupportedError(f"{where}: dict key {k!r} is neither str nor int")
            out[str(k) if isinstance(k, str) else f"__int__{k}"] = to_json_value(v, f"{where}.{k}")
        return out
    if isinstance(value, torch.Tensor):
        if value.numel() > _MAX_JSON_TENSOR_ELEMENTS:
            raise UnsupportedError(f"{where}: a {value.numel()}-element tensor is too large for JSON state")
        t = value.detach().cpu()
        return {
            "__tensor__": {
                "dtype": st_dtype(t.dtype, where),
                "shape": list(t.shape),
                "data": t.reshape(-1).tolist(),
            }
        }
    if isinstance(value, (torch.dtype, torch.device)):
        return {"__str__": str(value)}
    raise UnsupportedError(
        f"{where}: value of type {type(value).__name__} cannot be stored as JSON "
        "(unickpt never pickles); keep such values out of optimizer/scheduler state"
    )


def from_json_value(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json_value(v) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            spec = value["__tensor__"]
            dt = torch_dtype(spec["dtype"])
            shape = [int(d) for d in spec["shape"]]
            if math.prod(shape) > _MAX_JSON_TENSOR_ELEMENTS:
                raise UnsupportedError("tensor in JSON state is larger than allowed")
            return torch.tensor(spec["data"], dtype=dt).reshape(shape)
        if set(value) == {"__str__"}:
            return value["__str__"]
        out: dict[Any, Any] = {}
        for k, v in value.items():
            key: Any = int(k[7:]) if k.startswith("__int__") and k[7:].lstrip("-").isdigit() else k
            out[key] = from_json_value(v)
        return out
    return value
