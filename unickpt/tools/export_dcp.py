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
import os
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


def _has(directory: str, kind: str) -> bool:
    if is_url(directory):
        storage, _ = open_storage(directory)
        return any(storage.exists(f"{directory}/{n}") for n in (index_name(kind), single_name(kind)))
    return os.path.isfile(os.path.join(directory, index_name(kind))) or os.path.isfile(
        os.path.join(directory, single_name(kind))
    )


def _parts(src: str) -> tuple[str, str | None, str | None, int | None]:
    """(model path, optimizer path or None, scheduler file or None, step or None)."""
    if is_url(src):  # a checkpoint directory on a store (manager steps are read from local runs)
        src = src.rstrip("/")
        if not _has(src, "model"):
            raise IncompleteCheckpointError(f"{src} holds no committed model checkpoint to export")
        sched = f"{src}/lr_scheduler.json"
        has_sched = open_storage(src)[0].exists(sched)
        return src, (src if _has(src, "optimizer") else None), (sched if has_sched else None), None
    if os.path.isfile(src):
        return src, None, None, None
    step: int | None = None
    if os.path.isdir(os.path.join(src, "model")) and os.path.isfile(os.path.join(src, "COMMIT")):
        try:
            with open(os.path.join(src, "COMMIT"), "rb") as f:
                step = int(json.loads(f.read())["step"])
        except (OSError, ValueError, KeyError, TypeError):
            step = None
        model_dir, optim_dir = os.path.join(src, "model"), os.path.join(src, "optimizer")
        sched = os.path.join(src, "lr_scheduler.json")
        return (
            model_dir,
            optim_dir if os.path.isdir(optim_dir) and _has(optim_dir, "optimizer") else None,
            sched if os.path.isfile(sched) else None,
            step,
        )
    if not _has(src, "model"):
        raise IncompleteCheckpointError(f"{src} holds no committed model checkpoint to export")
    sched = os.path.join(src, "lr_scheduler.json")
    return src, (src if _has(src, "optimizer") else None), (sched if os.path.isfile(sched) else None), None


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
