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
import warnings
from typing import Any

from unickpt.ckpt.reader import open_checkpoint
from unickpt.io.jsonstate import from_json_value
from unickpt.store.publish import output_sink
from unickpt.store.storage import open_storage
from unickpt.tools._common import checkpoint_parts
from unickpt.tools._torch import full_tensors

__all__ = ["export_dcp"]


def _group_value(k: str, v: Any) -> Any:
    value = from_json_value(v)
    if k == "betas" and isinstance(value, list):
        return tuple(value)
    return value


def export_dcp(src: str, out: str) -> str:
    """Write the unickpt checkpoint ``src`` as a DCP checkpoint at ``out`` (see the module docstring)."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    model_path, optim_path, sched_path, step = checkpoint_parts(src)
    sd: dict[str, Any] = {}
    with open_checkpoint(model_path, "model") as reader:
        msd = full_tensors(reader)
        for alias, target in reader.block.aliases.items():
            msd[alias] = msd[target]
    sd["model"] = msd
    if optim_path is not None:
        with open_checkpoint(optim_path, "optimizer") as reader:
            flat = full_tensors(reader)
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
    with output_sink(out) as sink, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming ... a single process"
        local = sink.storage.local_path(sink.root)
        # Where the output has OS paths, torch's file writer; else its fsspec writer (.metadata last).
        writer = FileSystemWriter(local, sync_files=True) if local is not None else _fsspec_writer(sink.url)
        try:
            dcp_save(sd, storage_writer=writer, no_dist=True)
        except BaseException:
            for name in sink.storage.listdir(sink.root):  # the output held nothing before
                sink.track(name)
            raise
    return out.rstrip("/") if local is None else out


def _fsspec_writer(url: str) -> Any:
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(url)
