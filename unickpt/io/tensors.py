"""The torch side of the format: the names of a model's tensors, dtype names, raw bytes of
tensors, the local slices of DTensors, and what one rank saves (``SavePayload``: its tensors
and the local slices it holds).

Checkpoint names are FQNs in the user's unwrapped model, whatever wraps it. Wrappers add
prefixes or infixes to ``state_dict`` keys: DDP (``module.`` at the root), ``torch.compile``
(``_orig_mod.``), activation checkpointing (``_checkpoint_wrapped_module.``), FSDP1
(``_fsdp_wrapped_module.``). None of them reaches a file, and none stops a load.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from unickpt.errors import UnsupportedError
from unickpt.wrappers import ModelWrapper

__all__ = [
    "WRAPPER_INFIXES",
    "unwrap_model",
    "normalize_name",
    "apply_prefix",
    "TORCH_TO_ST",
    "ST_TO_TORCH",
    "st_dtype",
    "torch_dtype",
    "LocalSlice",
    "SavePayload",
    "SliceKey",
    "Staged",
    "as_bytes",
    "is_dtensor",
    "local_slices",
    "global_shape",
    "mesh_dims",
]

# ---------------------------------------------------------------------------- names
WRAPPER_INFIXES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip root wrappers: unickpt's ModelWrapper, DDP, torch.compile's OptimizedModule."""
    from torch.nn.parallel import DistributedDataParallel

    seen = 0
    while seen < 32:
        seen += 1
        if isinstance(model, ModelWrapper):
            model = model.unwrap()
        elif isinstance(model, DistributedDataParallel):
            model = model.module  # type: ignore[assignment]
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            break
    return model


def normalize_name(name: str) -> str:
    parts = [p for p in name.split(".") if p not in WRAPPER_INFIXES]
    return ".".join(parts)


def apply_prefix(prefix: str | None) -> str:
    """Colossal-AI style ``prefix``: prepended to every saved name (a '.' is added if missing)."""
    if prefix is not None and not isinstance(prefix, str):
        from unickpt.errors import ConfigError

        raise ConfigError(f"prefix must be a string or None, got {type(prefix).__name__} {prefix!r}")
    if not prefix:
        return ""
    return prefix if prefix.endswith(".") else prefix + "."


# ---------------------------------------------------------------------------- dtypes, bytes, local slices
TORCH_TO_ST: dict[torch.dtype, str] = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.int32: "I32",
    torch.int64: "I64",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _st in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"), ("float8_e8m0fnu", "F8_E8M0")):
    if hasattr(torch, _name):
        TORCH_TO_ST[getattr(torch, _name)] = _st
ST_TO_TORCH = {v: k for k, v in TORCH_TO_ST.items()}


def st_dtype(dtype: torch.dtype, where: str = "") -> str:
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        at = f" for {where}" if where else ""
        raise UnsupportedError(f"dtype {dtype}{at} cannot be stored in safetensors") from None


def torch_dtype(name: str) -> torch.dtype:
    try:
        return ST_TO_TORCH[name]
    except KeyError:
        raise UnsupportedError(f"dtype {name} has no torch equivalent in this torch build") from None


def is_dtensor(t: Any) -> bool:
    # No DTensor can exist unless its module was imported: do not import it (and sympy with
    # it, seconds on a busy machine) just to learn that a plain tensor is plain.
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)


def global_shape(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(int(d) for d in t.shape)


@dataclass
class LocalSlice:
    """A local slice: one rectangular piece of a global tensor that this rank holds, to save or load.

    Its box is ``offsets`` (where its first element sits in the global tensor) and ``shape``.
    ``tensor`` is the local data (any device, any strides), either of ``shape`` or, for a piece
    cut from a flat buffer (ZeRO), a 1-D run of ``prod(shape)`` elements, reshaped when written.
    """

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.tensor.element_size()

    def meta(self) -> tuple[str, str, tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return (self.name, self.dtype, self.global_shape, self.offsets, self.shape)


# A slice's box: (tensor name, offsets, shape).
SliceKey = tuple[str, tuple[int, ...], tuple[int, ...]]


@dataclass(frozen=True)
class Staged:
    """What the copy of a ``SavePayload`` into CPU memory holds (``io/stage.py``).

    ``nbytes``: the bytes copied. ``replicated``: the boxes several ranks hold (the only ones the
    replica check digests), ``None`` when every local slice was copied and the check must find
    them itself. ``digests``: xxh3-64 of the replicated slices this rank holds but does not
    write, taken from the live tensors before the save returned (they were not copied).
    """

    nbytes: int
    replicated: frozenset[SliceKey] | None = None
    digests: dict[SliceKey, str] = field(default_factory=dict)


@dataclass
class SavePayload:
    """What one rank saves in one checkpoint: its tensors, the local slices it holds, and the extras.

    ``CheckpointIO.plan_model``/``plan_optimizer`` build it from live objects;
    ``io.stage.stage_written`` copies the slices this rank writes to CPU memory (an async save
    writes the copy while training goes on); ``CheckpointIO.write`` saves it.
    """

    kind: str
    tensors: dict[str, torch.Tensor]
    slices: dict[str, list[LocalSlice]]
    aliases: dict[str, str] = field(default_factory=dict)
    entry_extras: dict[str, dict[str, Any]] = field(default_factory=dict)
    block_extras: dict[str, Any] = field(default_factory=dict)
    # Set on a copy in CPU memory (``io.stage.stage_written``): the slices are not the live tensors.
    staged: Staged | None = None


def mesh_dims(mesh: Any) -> dict[str, int]:
    """A ``DeviceMesh``'s dimensions by name (``dim0``, ``dim1`` ... where it names none), as the index records them."""
    if mesh is None:
        return {}
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(mesh.ndim))
    return {str(n): int(s) for n, s in zip(names, mesh.shape, strict=True)}


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A tensor's elements in C order as a uint8 numpy array (a copy only when needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    return t.view(torch.uint8).numpy()


def local_slices(name: str, t: torch.Tensor) -> list[LocalSlice]:
    """The local slices of the global tensor ``name`` that this rank holds, for a DTensor or plain tensor.

    A plain tensor is the whole tensor (replicated: the planner picks one rank to write it).
    A DTensor's box is computed from its mesh and placements; ``Partial`` placements are
    refused because the values are not reduced yet.
    """
    dtype = st_dtype(t.dtype, name)
    if not is_dtensor(t):
        shape = global_shape(t)
        return [LocalSlice(name, dtype, shape, (0,) * len(shape), shape, t)]
    from torch.distributed.tensor import Partial

    if any(isinstance(p, Partial) for p in t.placements):  # type: ignore[attr-defined]
        raise UnsupportedError(
            f"tensor {name!r} has a Partial placement (unreduced values); reduce it before saving"
        )
    local = t.to_local()  # type: ignore[attr-defined]
    gshape = global_shape(t)
    lshape, offset = _local_box(gshape, t.device_mesh, t.placements)  # type: ignore[attr-defined]
    if tuple(local.shape) != tuple(lshape):
        raise UnsupportedError(
            f"tensor {name!r}: local shard shape {tuple(local.shape)} does not match the computed "
            f"{tuple(lshape)} for placements {t.placements}"  # type: ignore[attr-defined]
        )
    if math.prod(lshape) == 0:
        return []
    return [LocalSlice(name, dtype, gshape, offset, lshape, local)]


# (global shape, placements, id(mesh)) -> (mesh, local shape, offsets) of this rank: a training
# run saves the same DTensors every time, and torch's computation costs ~0.1 ms per tensor. An
# entry holds its mesh, so the id names no other mesh while the entry is kept.
_BOXES: dict[tuple[Any, ...], tuple[Any, tuple[int, ...], tuple[int, ...]]] = {}
_BOXES_KEPT = 1 << 14


def _local_box(
    gshape: tuple[int, ...], mesh: Any, placements: Any
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """This rank's box of a DTensor (``compute_local_shape_and_global_offset``), kept per layout."""
    key: tuple[Any, ...] | None = (gshape, tuple(placements), id(mesh))
    try:
        hit = _BOXES.get(key)  # type: ignore[arg-type]
    except TypeError:  # a placement that cannot be hashed: computed every time
        hit = key = None
    if hit is not None and hit[0] is mesh:
        return hit[1], hit[2]
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    lshape, offset = compute_local_shape_and_global_offset(gshape, mesh, placements)
    box = (tuple(int(s) for s in lshape), tuple(int(o) for o in offset))
    if key is not None:
        if len(_BOXES) >= _BOXES_KEPT:
            _BOXES.clear()
        _BOXES[key] = (mesh, *box)
    return box
