"""``unickpt convert --from unickpt --to dcp``: write a unickpt checkpoint back out as DCP.

The output is what ``dcp.save(get_state_dict(model, optimizer))`` writes, wrapped the usual
way: ``{"model": {fqn: tensor}, "optim": {"state": {fqn: {key: value}}, "param_groups":
[... "params": [fqn, ...]]}}``, plus ``"lr_scheduler"`` (the scheduler's state dict) and
``"train_state": {"step": N}`` when ``SRC`` is a ``CheckpointManager`` step. So
``dcp.load({"model": msd, "optim": osd}, checkpoint_id=OUT)`` followed by
``set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)`` restores it,
in one process or in any FSDP2 / TP world.

``SRC`` is a model checkpoint directory (an optimizer checkpoint in the same directory is
exported too), a single ``model.safetensors``, or a manager ``step-<N>/`` directory
(``model/``, ``optimizer/``, ``lr_scheduler.json``). Every slice hash is checked while
reading. Tensors are assembled whole in memory (DCP's writer takes the whole state dict at
once): peak memory is about the size of the checkpoint. An ``OUT`` URL (an empty prefix) is
written in place by torch's ``FsspecWriter``, ``.metadata`` last; a failure removes what it wrote. JSON state loses tuple-ness; a
group's ``betas`` comes back as a tuple, other lists stay lists (torch's optimizers accept both).
"""

from __future__ import annotations

import json
import posixpath
import warnings
from typing import Any

import torch

from unickpt.errors import IncompleteCheckpointError, IntegrityError
from unickpt.format.naming import index_name, single_name
from unickpt.format.reader import CheckpointReader, open_checkpoint
from unickpt.format.storage import is_url, open_storage
from unickpt.io.jsonstate import from_json_value
from unickpt.io.tensors import torch_dtype
from unickpt.tools._common import staged_output
from unickpt.tools._store_out import store_output

__all__ = ["export_dcp"]


def _full_tensors(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    failures = reader.verify()
    if failures:
        raise IntegrityError(failures, reader.index_path or reader.directory)
    out: dict[str, torch.Tensor] = {}
    for name, entry in reader.tensors.items():
        dt = torch_dtype(entry.dtype)
        full = torch.empty(tuple(entry.shape), dtype=dt)
        for s in entry.slices:
            raw = bytearray(reader.read_slice(s))
            data = (
                torch.frombuffer(raw, dtype=dt).reshape(tuple(s.shape))
                if raw
                else torch.empty(tuple(s.shape), dtype=dt)
            )
            idx = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.shape, strict=True))
            full[idx] = data
        out[name] = full
    return out


def _parts(src: str) -> tuple[str, str | None, str | None, int | None]:
    """(model path, optimizer path or None, scheduler file or None, step or None) of ``src``.

    ``src`` is a model checkpoint (a directory, possibly holding the optimizer checkpoint too, or
    a single file), a directory holding ``model/`` (and ``optimizer/``, ``lr_scheduler.json``: the
    layout the README saves, or a manager ``step-<N>/``, whose ``COMMIT`` gives the step), or
    ``<dir>/model`` of such a directory, whose ``optimizer/`` and ``lr_scheduler.json`` beside it
    come along. Local paths and URLs alike, through the storage layer.
    """
    storage, _ = open_storage(src)
    # The storage's paths are the location as given (a URL keeps its scheme), "/"-separated.
    root = src.removeprefix("file://").rstrip("/") or "/"

    def has(directory: str, kind: str) -> bool:
        return any(storage.exists(storage.join(directory, n)) for n in (index_name(kind), single_name(kind)))

    def optional(path: str, kind: str | None) -> str | None:
        found = storage.exists(path) if kind is None else has(path, kind)
        return path if found else None

    names = storage.listdir(root)
    if not names:
        if not storage.exists(root):
            raise IncompleteCheckpointError(f"{src}: nothing there to export")
        return root, None, None, None  # a single model file
    step: int | None = None
    if has(root, "model"):
        parent = posixpath.dirname(root)
        beside = posixpath.basename(root) == "model"
        optim = optional(root, "optimizer") or (
            optional(storage.join(parent, "optimizer"), "optimizer") if beside else None
        )
        sched = optional(storage.join(root, "lr_scheduler.json"), None) or (
            optional(storage.join(parent, "lr_scheduler.json"), None) if beside else None
        )
        return root, optim, sched, None
    if "model" in names and has(storage.join(root, "model"), "model"):
        if "COMMIT" in names:  # a CheckpointManager step
            try:
                step = int(
                    json.loads(storage.read_bytes(storage.join(root, "COMMIT"), limit=1 << 20))["step"]
                )
            except (OSError, ValueError, KeyError, TypeError):
                step = None
        return (
            storage.join(root, "model"),
            optional(storage.join(root, "optimizer"), "optimizer"),
            optional(storage.join(root, "lr_scheduler.json"), None),
            step,
        )
    raise IncompleteCheckpointError(
        f"{src} holds no committed model checkpoint to export (neither {index_name('model')} nor "
        f"{single_name('model')}, nor a model/ directory holding one)"
    )


def _group_value(k: str, v: Any) -> Any:
    value = from_json_value(v)
    if k == "betas" and isinstance(value, list):
        return tuple(value)
    return value


def export_dcp(src: str, out: str) -> str:
    """Write the unickpt checkpoint ``src`` as a DCP checkpoint at ``out`` (see the module docstring)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    model_path, optim_path, sched_path, step = _parts(src)
    sd: dict[str, Any] = {}
    with open_checkpoint(model_path, "model") as reader:
        msd = _full_tensors(reader)
        for alias, target in reader.block.aliases.items():
            msd[alias] = msd[target]
    sd["model"] = msd
    if optim_path is not None:
        with open_checkpoint(optim_path, "optimizer") as reader:
            flat = _full_tensors(reader)
            state: dict[str, dict[str, Any]] = {}
            for name, entry in reader.tensors.items():
                if entry.param is None or entry.state is None:
                    continue
                state.setdefault(entry.param, {})[entry.state] = flat[name]
            for fqn, st in reader.block.param_state.items():
                for k, v in st.items():
                    state.setdefault(fqn, {})[k] = from_json_value(v)
            groups = [
                {k: (list(v) if k == "params" else _group_value(k, v)) for k, v in g.items()}
                for g in (reader.block.param_groups or [])
            ]
        sd["optim"] = {"state": state, "param_groups": groups}
    if sched_path is not None:
        storage, _ = open_storage(sched_path)
        obj = json.loads(storage.read_bytes(sched_path, limit=64 << 20))
        sd["lr_scheduler"] = from_json_value(obj["state"])
    if step is not None:
        sd["train_state"] = {"step": step}
    if is_url(out):  # written in place by torch's fsspec writer, .metadata last
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        with store_output(out) as sink, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            try:
                dcp_save(sd, storage_writer=FsspecWriter(sink.url), no_dist=True)
            except BaseException:
                for name in sink.storage.listdir(sink.root):  # the prefix held nothing before
                    sink.track(name)
                raise
        return out.rstrip("/")
    with staged_output(out) as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        dcp_save(sd, storage_writer=FileSystemWriter(tmp, sync_files=True), no_dist=True)
    return out
