"""``unickpt convert --to colossalai``: a unickpt checkpoint as Colossal-AI's ``GeneralCheckpointIO`` reads it.

``OUT`` holds:

- ``model/``: the merged model (Hugging Face sharded safetensors, what ``unickpt merge`` writes),
  which Colossal-AI's ``load_model(model, "OUT/model")`` reads;
- ``optimizer/``: Colossal-AI's sharded optimizer layout with safetensors shards (what its
  ``save_optimizer(..., shard=True, use_async=True)`` writes): ``optimizer.safetensors.index.json``
  naming ``pytorch_optim_group.bin`` (the param groups, parameters as integer ids in the
  optimizer's order) and the shards, whose keys are ``state.<id>.<key>``; read by
  ``load_optimizer(optimizer, "OUT/optimizer")``;
- ``lr_scheduler.pt``, when the source has ``lr_scheduler.json``: the scheduler's state dict, as
  Colossal-AI's ``load_lr_scheduler`` reads it.

The group file and the scheduler file are ``torch.save`` pickles of plain lists, dicts and numbers
(Colossal-AI reads no other form); they hold no tensor and no class, so ``torch.load`` reads them
with ``weights_only=True``. Every tensor is in safetensors files. Per-parameter state that is not a
tensor (kept in a unickpt index's ``param_state``) has only a pickled form in Colossal-AI's files,
so it is refused. Every slice hash is checked while reading. ``OUT`` is a local directory or an
object-store prefix, written through one ``store.publish.Sink`` (``output_sink``): the indexes
are its commit points, written last; a failure leaves no ``OUT``.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch

from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import UnsupportedError
from unickpt.io.jsonstate import from_json_value
from unickpt.spec.naming import shard_name, shown
from unickpt.store.publish import Sink, output_sink
from unickpt.store.storage import open_storage
from unickpt.tools._common import checkpoint_parts
from unickpt.tools._progress import progress_bar
from unickpt.tools._torch import full_tensors

__all__ = ["export_colossalai"]

GROUP_FILE = "pytorch_optim_group.bin"
INDEX_FILE = "optimizer.safetensors.index.json"


def export_colossalai(src: str, out: str, *, max_shard_bytes: int, progress: bool = False) -> str:
    """Write the unickpt checkpoint ``src`` for Colossal-AI at ``out`` (see the module docstring).

    ``progress``: byte bars on stderr, ``merge``'s for the model, then one for the optimizer state."""
    from unickpt.tools.merge import merge_checkpoint

    model_path, optim_path, sched_path, _step = checkpoint_parts(src)
    with output_sink(out) as sink:
        merge_checkpoint(model_path, sink.within("model"), max_shard_size=max_shard_bytes, progress=progress)
        if optim_path is not None:
            _write_optimizer(optim_path, sink.within("optimizer"), max_shard_bytes, progress)
        if sched_path is not None:
            storage, _ = open_storage(sched_path)
            state = from_json_value(json.loads(storage.read_bytes(sched_path, limit=64 << 20))["state"])
            sink.put("lr_scheduler.pt", _pickled(state))
    return out


def _write_optimizer(optim_path: str, out: Sink, max_shard_bytes: int, progress: bool) -> None:
    from safetensors.torch import save

    with open_checkpoint(optim_path, "optimizer") as reader:
        flat = full_tensors(reader)
        groups = reader.block.param_groups or []
        if reader.block.param_state:
            fqn, scalars = next(iter(reader.block.param_state.items()))
            raise UnsupportedError(
                f"{optim_path}: parameter {shown(fqn)} has non-tensor optimizer state {sorted(scalars)}, which "
                "Colossal-AI's optimizer files hold only as pickles; unickpt writes no pickled state"
            )
        ids: dict[str, int] = {}
        saved_groups = []
        for g in groups:
            hyper = {k: from_json_value(v) for k, v in g.items() if k != "params"}
            if isinstance(hyper.get("betas"), list):
                hyper["betas"] = tuple(hyper["betas"])
            saved_groups.append({**hyper, "params": [ids.setdefault(f, len(ids)) for f in g["params"]]})
        state: dict[int, dict[str, torch.Tensor]] = {}
        for name, entry in reader.tensors.items():
            if entry.param is None or entry.state is None:
                continue
            if entry.param not in ids:
                raise UnsupportedError(
                    f"{optim_path}: optimizer state of {shown(entry.param)}, which no param group lists"
                )
            state.setdefault(ids[entry.param], {})[entry.state] = flat[name]
    out.put(GROUP_FILE, _pickled(saved_groups))
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for pid in sorted(state):
        nbytes = sum(t.numel() * t.element_size() for t in state[pid].values())
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        for k, t in state[pid].items():
            shards[-1][f"state.{pid}.{k}"] = t.contiguous()
        size += nbytes
    weight_map: dict[str, str] = {}
    total = 0
    all_bytes = sum(t.numel() * t.element_size() for shard in shards for t in shard.values())
    with progress_bar(all_bytes, "convert --to colossalai", progress) as update:
        for i, shard in enumerate(shards):
            fname = shard_name("optimizer", i + 1, len(shards))
            # safetensors' bytes of the shard, streamed into the output (made durable as it closes)
            data = save(shard, metadata={"format": "pt"})
            sf = out.open(fname)
            sf.write(memoryview(data), 0)
            out.close(sf)
            del data
            for key, t in shard.items():
                weight_map[key.split(".")[1]] = fname
                total += t.numel() * t.element_size()
                update(t.numel() * t.element_size())
    index = {"metadata": {"total_size": total, "param_groups": GROUP_FILE}, "weight_map": weight_map}
    # Colossal-AI's loader starts from the index: the optimizer's commit point, written last.
    out.commit_later(INDEX_FILE, json.dumps(index, indent=2).encode())


def _pickled(obj: Any) -> bytes:
    """``torch.save``'s bytes of plain data (lists, dicts, numbers, strings: no tensor)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()
