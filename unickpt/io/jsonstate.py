"""Non-tensor state (param_groups, LR schedulers, per-parameter scalars) as plain JSON.

Nothing is pickled. Tuples are stored as lists (loading restores the type of the live value). Small tensors
take a tagged form ``{"__tensor__": {"dtype", "shape", "data"}}``.
Anything else (functions, arbitrary objects) is refused with ``UnsupportedError`` naming it.

Every number keeps its value and its type: an int stays an int at any size a JSON reader takes
(``MAX_JSON_INT_DIGITS``), a float keeps its bits (``-0.0`` too) and ``inf``, ``-inf`` and
``nan`` are written as Python's ``json`` writes them (``Infinity``, ``-Infinity``, ``NaN``),
as Hugging Face's ``trainer_state.json`` holds them; ``json.load`` reads them back.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from unickpt.errors import IndexFileError, UnsupportedError
from unickpt.io.tensors import st_dtype, torch_dtype
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.naming import shown
from unickpt.spec.untrusted import strict_loads

__all__ = ["MAX_JSON_INT_DIGITS", "to_json_value", "from_json_value", "parse_json"]

# Tensors inside JSON state are scalars such as a capturable optimizer's lr; large ones
# belong in safetensors files.
_MAX_JSON_TENSOR_ELEMENTS = 4096
#: The most decimal digits of an int in JSON state: Python's own limit for converting an int to
#: and from text (``sys.get_int_max_str_digits()``'s default), past which ``json.dumps`` fails and
#: ``json.load`` (transformers, unickpt) refuses the number.
MAX_JSON_INT_DIGITS = 4300
_INT_LIMIT = 10**MAX_JSON_INT_DIGITS


def parse_json(raw: bytes, what: str) -> Any:
    """The JSON value in ``raw`` as unickpt reads every JSON file (``strict_loads``: duplicate
    keys, runaway nesting and lone surrogates refused; ``Infinity``/``NaN`` read as floats), or an
    ``IndexFileError`` naming ``what`` (not UTF-8, not JSON)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IndexFileError(f"{what} is not valid JSON (not UTF-8: {e})") from None
    return strict_loads(text, IndexFileError, what)


def to_json_value(value: Any, where: str, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    """The JSON form of ``value`` (``where`` names it in errors).

    With ``tensors`` (the manager's train state, stored beside a safetensors file): every tensor,
    whatever its size, is copied into ``tensors`` and referenced as ``{"__st__": key}``, tuples
    keep their type as ``{"__tuple__": [...]}``, and boolean dict keys are refused.
    """
    if tensors is not None:
        if isinstance(value, torch.Tensor):
            key = f"{where}#{len(tensors)}"
            tensors[key] = value.detach().to("cpu", copy=True).contiguous()
            return {"__st__": key}
        if isinstance(value, tuple):
            return {"__tuple__": [to_json_value(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, int) and not isinstance(value, bool) and not -_INT_LIMIT < value < _INT_LIMIT:
        raise UnsupportedError(
            f"{where}: an integer of {value.bit_length()} bits has more than {MAX_JSON_INT_DIGITS} "
            "decimal digits, more than a JSON reader takes; store it as a string or a tensor"
        )
    if value is None or isinstance(value, (bool, int, str, float)):
        return value  # floats as they are: inf, -inf and nan as the literals Infinity, -Infinity, NaN
    if isinstance(value, (tuple, list)):
        # Tuples (Adam's betas) are stored as lists; loading restores the live value's type.
        return [to_json_value(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        out = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)) or (tensors is not None and isinstance(k, bool)):
                raise UnsupportedError(f"{where}: dict key {shown(k)} is neither str nor int")
            out[str(k) if isinstance(k, str) else f"__int__{k}"] = to_json_value(v, f"{where}.{k}", tensors)
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


# JSON state mirrors a state_dict: a few levels of dicts and lists. Anything deeper is hostile.
MAX_JSON_DEPTH = 64
_TENSOR_FIELDS = {"dtype", "shape", "data"}


def from_json_value(
    value: Any, where: str = "JSON state", tensors: dict[str, torch.Tensor] | None = None
) -> Any:
    """The live value of a JSON state value; ``IndexFileError`` naming ``where`` for malformed input.

    Checks what ``to_json_value`` writes: ``__tensor__`` entries with exactly ``dtype`` (a known
    dtype), ``shape`` (at most 64 non-negative integers, at most 4096 elements) and ``data`` (a
    flat list of that many numbers of the dtype's kind, in its range); ``__str__`` entries holding
    a string; at most ``MAX_JSON_DEPTH`` levels of nesting. With ``tensors`` (what
    ``to_json_value`` filled), ``__st__`` references and ``__tuple__`` entries are restored too.
    """
    return _from_json(value, where, 0, tensors)


def _from_json(value: Any, where: str, depth: int, tensors: dict[str, torch.Tensor] | None = None) -> Any:
    if depth > MAX_JSON_DEPTH:
        raise IndexFileError(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels")
    if isinstance(value, list):
        return [_from_json(v, f"{where}[{i}]", depth + 1, tensors) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if tensors is not None and set(value) == {"__st__"}:
            if value["__st__"] not in tensors:
                raise IndexFileError(
                    f"{where}: tensor {shown(value['__st__'])} is not in the state's tensors"
                )
            return tensors[value["__st__"]].clone()
        if tensors is not None and set(value) == {"__tuple__"} and isinstance(value["__tuple__"], list):
            return tuple(
                _from_json(v, f"{where}[{i}]", depth + 1, tensors) for i, v in enumerate(value["__tuple__"])
            )
        if "__tensor__" in value:
            if set(value) != {"__tensor__"}:
                raise IndexFileError(f"{where}: a '__tensor__' entry must be the only key of its object")
            return _tensor(value["__tensor__"], where)
        if "__str__" in value and set(value) == {"__str__"}:
            if not isinstance(value["__str__"], str):
                raise IndexFileError(
                    f"{where}: '__str__' must hold a string, found {_kind(value['__str__'])}"
                )
            return value["__str__"]
        out: dict[Any, Any] = {}
        for k, v in value.items():
            key: Any = int(k[7:]) if k.startswith("__int__") and k[7:].lstrip("-").isdigit() else k
            if key in out:
                raise IndexFileError(f"{where}: key {shown(k)} names the same entry as another key")
            out[key] = _from_json(v, f"{where}.{k}", depth + 1, tensors)
        return out
    return value


def _kind(v: Any) -> str:
    return "a boolean" if isinstance(v, bool) else f"{type(v).__name__} {shown(str(v)[:40])}"


def _tensor(spec: Any, where: str) -> torch.Tensor:
    at = f"{where}: '__tensor__'"
    if not isinstance(spec, dict) or set(spec) != _TENSOR_FIELDS:
        found = sorted(spec) if isinstance(spec, dict) else _kind(spec)
        raise IndexFileError(f"{at} must have exactly dtype, shape and data; found {found}")
    dtype, shape, data = spec["dtype"], spec["shape"], spec["data"]
    if not isinstance(dtype, str) or dtype not in DTYPE_ITEMSIZE:
        raise IndexFileError(
            f"{at}: unknown dtype {shown(dtype)}; expected one of {', '.join(sorted(DTYPE_ITEMSIZE))}"
        )
    if (
        not isinstance(shape, list)
        or len(shape) > 64
        or not all(
            isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _MAX_JSON_TENSOR_ELEMENTS
            for d in shape
        )
    ):
        raise IndexFileError(
            f"{at}: shape must be a list of at most 64 non-negative integers, found {str(shape)[:80]}"
        )
    numel = math.prod(shape)
    if numel > _MAX_JSON_TENSOR_ELEMENTS:
        raise IndexFileError(
            f"{at}: shape {shape} has {numel} elements; JSON state holds at most {_MAX_JSON_TENSOR_ELEMENTS}"
        )
    if not isinstance(data, list) or len(data) != numel:
        found = f"{len(data)} values" if isinstance(data, list) else _kind(data)
        raise IndexFileError(
            f"{at}: data must be a flat list of {numel} values for shape {shape}, found {found}"
        )
    dt = torch_dtype(dtype)
    for v in data:
        _check_element(v, dt, at)
    try:
        return torch.tensor(data, dtype=dt).reshape(shape)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise IndexFileError(f"{at}: data does not fit {dtype}{shape} ({e})") from None


def _check_element(v: Any, dt: torch.dtype, at: str) -> None:
    if dt == torch.bool:
        ok = isinstance(v, bool)
    elif dt.is_floating_point:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        if ok and isinstance(v, int) and not -(1 << 1024) < v < (1 << 1024):
            ok = False
    else:
        info = torch.iinfo(dt)
        ok = isinstance(v, int) and not isinstance(v, bool) and info.min <= v <= info.max
    if not ok:
        raise IndexFileError(f"{at}: value {_kind(v)} is not a {str(dt).replace('torch.', '')} element")
