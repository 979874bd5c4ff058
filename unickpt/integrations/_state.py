"""What the trainer integrations share: a dict of tensors as a unickpt checkpoint, and JSON state.

A trainer hands unickpt plain state dicts (Lightning's checkpoint dict, an optimizer's
``state_dict()``), not modules. ``save_tensors`` writes such a dict through ``GeneralCheckpointIO``
(its documented ``_model_tensors`` hook lists the dict's entries under their own names): Hugging
Face sharded safetensors with unickpt's index, slice hashes and fingerprints, which
``unickpt verify`` checks. ``load_tensors`` reads it back, hash-checked. Non-tensor state is
JSON in the encoding of ``unickpt.io.jsonstate`` (tensors referenced into the safetensors part,
tuples and integer keys kept). Nothing is pickled. A checkpoint of several such parts is
published as one by ``store.publish.PartsOutput``; small files go through the store's small-file
writer and reader: paths and URLs alike.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from unickpt.errors import IndexFileError, UnsupportedError
from unickpt.io import GeneralCheckpointIO, HookContext
from unickpt.io.jsonstate import from_json_value, parse_json, to_json_value
from unickpt.io.tensors import torch_dtype
from unickpt.store.publish import read_small_file, write_small_file
from unickpt.tools import inspect_checkpoint

__all__ = [
    "local_group",
    "general_io",
    "save_tensors",
    "load_tensors",
    "encode_state",
    "decode_state",
    "write_json",
    "read_json",
    "state_json",
    "parse_state",
]


class _Tensors(torch.nn.Module):
    """A holder for a dict of tensors, handed to ``GeneralCheckpointIO`` as its model."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.entries = tensors


class _DictCheckpointIO(GeneralCheckpointIO):
    """``GeneralCheckpointIO`` over a dict of tensors: the dict's keys are the checkpoint names, verbatim."""

    def _model_tensors(self, ctx: HookContext) -> dict[str, torch.Tensor]:
        holder = ctx.model
        if not isinstance(holder, _Tensors):
            raise UnsupportedError(f"expected a dict of tensors, found {type(holder).__name__}")
        return dict(holder.entries)


_LOCAL_GROUPS: dict[int, Any] = {}


def local_group() -> Any:
    """A process group of this process alone, or None outside a process group.

    Trainers save from their main process only (Lightning's ``Strategy.save_checkpoint``, the
    ``Trainer``'s ``should_save``) and load on every process independently: unickpt's calls then
    run over this one-process group, never waiting for ranks that do not call them.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    rank = dist.get_rank()
    if rank not in _LOCAL_GROUPS:
        _LOCAL_GROUPS[rank] = dist.new_group([rank], backend="gloo", use_local_synchronization=True)
    return _LOCAL_GROUPS[rank]


def general_io(**kwargs: Any) -> GeneralCheckpointIO:
    """A ``GeneralCheckpointIO`` over this process alone (see ``local_group``)."""
    return GeneralCheckpointIO(group=local_group(), **kwargs)


def _io(hashes: bool = True, fingerprints: bool = True) -> GeneralCheckpointIO:
    return _DictCheckpointIO(group=local_group(), hashes=hashes, fingerprints=fingerprints)


def save_tensors(
    tensors: dict[str, torch.Tensor],
    path: str,
    *,
    size_per_shard: int = 1024,
    hashes: bool = True,
    fingerprints: bool = True,
) -> str:
    """Write ``tensors`` (global tensors, one process) as a sharded unickpt checkpoint in directory ``path``."""
    bad = sorted(k for k, v in tensors.items() if not isinstance(v, torch.Tensor))
    if bad:
        raise UnsupportedError(f"{path}: entries {bad[:5]} are not tensors")
    return _io(hashes, fingerprints).save_model(
        _Tensors(tensors), path, shard=True, gather_dtensor=True, size_per_shard=size_per_shard
    )


def load_tensors(path: str, *, verify: bool = True, device: Any = None) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``, by name (``verify``: rehash every slice read)."""
    info = inspect_checkpoint(path)
    targets: dict[str, torch.Tensor] = {}
    for name, entry in info["tensors"].items():
        shape = [int(d) for d in entry["shape"]]
        targets[name] = torch.empty(shape, dtype=torch_dtype(entry["dtype"]))
    _io().load_model(_Tensors(targets), path, strict=True, verify=verify)
    if device is not None:
        targets = {k: v.to(device) for k, v in targets.items()}
    return targets


def encode_state(state: Any, where: str) -> tuple[Any, dict[str, torch.Tensor]]:
    """``state`` as (JSON value, tensors it references); tensors become ``{"__st__": key}``.

    Non-finite floats (Lightning's ``ModelCheckpoint`` keeps ``inf`` scores) stay floats: they
    are written as the literals ``Infinity``, ``-Infinity`` and ``NaN``, as every JSON file of
    unickpt writes them (docs/format.md)."""
    tensors: dict[str, torch.Tensor] = {}
    return to_json_value(state, where, tensors), tensors


def decode_state(js: Any, tensors: dict[str, torch.Tensor], where: str) -> Any:
    """The state ``encode_state`` described, tensors taken from ``tensors``."""
    return from_json_value(js, where, tensors)


def write_json(location: str, obj: Any) -> None:
    """Write ``obj`` as JSON (non-finite floats as ``Infinity``/``NaN``) to ``location``, a path or
    a URL, whole and durably (``store.publish.write_small_file``)."""
    write_small_file(location, json.dumps(obj, sort_keys=True, allow_nan=True).encode())


def read_json(location: str, max_bytes: int = 256 << 20) -> Any:
    """JSON from ``location`` (a path or a URL) as unickpt reads every JSON file (``parse_json``);
    ``IndexFileError`` naming the file for anything else."""
    try:
        return parse_json(read_small_file(location, limit=max_bytes), location)
    except ValueError as e:  # larger than max_bytes
        raise IndexFileError(
            f"{location}: more than the {max_bytes} bytes a state file may hold ({e})"
        ) from None


def state_json(obj: Any) -> bytes:
    """``obj`` as the bytes of a JSON state file (as :func:`write_json` writes them)."""
    return json.dumps(obj, sort_keys=True, allow_nan=True).encode()


def parse_state(raw: bytes, where: str) -> Any:
    """A JSON state file's bytes as :func:`read_json` reads them."""
    return parse_json(raw, where)
