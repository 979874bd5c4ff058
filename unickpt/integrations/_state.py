"""What the trainer integrations share: a dict of tensors as a unickpt checkpoint, JSON state, and
the atomic commit of a whole checkpoint directory.

A trainer hands unickpt plain state dicts (Lightning's checkpoint dict, an optimizer's
``state_dict()``), not modules. ``save_tensors`` writes such a dict through ``GeneralCheckpointIO``
(its documented ``_model_tensors`` hook lists the dict's entries under their own names): Hugging
Face sharded safetensors with unickpt's index, slice hashes and fingerprints, which
``unickpt verify`` checks. ``load_tensors`` reads it back, hash-checked. Non-tensor state is
JSON in the encoding of ``unickpt.io.jsonstate`` (tensors referenced into the safetensors part,
tuples and integer keys kept). Nothing is pickled.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import shutil
import uuid
from typing import Any

import torch

from unickpt.errors import IndexFileError, UnsupportedError
from unickpt.io import GeneralCheckpointIO, HookContext
from unickpt.io.jsonstate import from_json_value, parse_json, to_json_value
from unickpt.io.tensors import torch_dtype
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
    "staging_dir",
    "commit_dir",
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


def write_json(path: str, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` (non-finite floats as ``Infinity``/``NaN``) and make it durable."""
    data = json.dumps(obj, sort_keys=True, allow_nan=True).encode()
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def read_json(path: str, max_bytes: int = 256 << 20) -> Any:
    """JSON from ``path`` as unickpt reads every JSON file (``parse_json``); ``IndexFileError``
    naming the file for anything else."""
    size = os.path.getsize(path)
    if size > max_bytes:
        raise IndexFileError(f"{path}: {size} bytes, more than the {max_bytes} a state file may hold")
    with open(path, "rb") as f:
        return parse_json(f.read(), path)


def staging_dir(path: str) -> str:
    """A fresh hidden directory beside ``path`` to write a checkpoint into before it commits."""
    parent, name = os.path.split(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.unickpt-staging-{uuid.uuid4().hex[:12]}")
    os.makedirs(tmp)
    return tmp


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: str, b: str) -> bool:
    """Swap ``a`` and ``b`` in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"exchanging {a} and {b}: {os.strerror(err)}")


def commit_dir(staged: str, path: str) -> None:
    """Put the fully written directory ``staged`` at ``path`` in one rename: readers see the old
    checkpoint or the new one, never a mix. An existing ``path`` (file or directory) is swapped
    out atomically where the kernel can (Linux), else renamed aside first, and removed after."""
    for root, dirs, _files in os.walk(staged):
        for d in dirs:
            _fsync_dir(os.path.join(root, d))
    _fsync_dir(staged)
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    if not os.path.lexists(path):
        os.rename(staged, path)
        _fsync_dir(parent)
        return
    if _exchange(staged, path):
        _fsync_dir(parent)
        _remove(staged)  # now the old checkpoint
        return
    aside = f"{staged}-old"
    os.rename(path, aside)
    os.rename(staged, path)
    _fsync_dir(parent)
    _remove(aside)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
