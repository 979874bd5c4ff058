"""Convert a Colossal-AI sharded optimizer checkpoint into a unickpt optimizer checkpoint.

Colossal-AI's ``GeneralCheckpointIO().save_optimizer(optimizer, dir, shard=True)`` writes
``pytorch_optim.bin.index.json`` (``weight_map``: parameter id -> shard file;
``metadata.param_groups``: the param-group file), the param-group file (the optimizer's
``param_groups`` with integer ``params``) and ``.bin`` shards holding ``{id: {state key:
value}}``. Ids are positions in the optimizer's parameter order (group by group), so turning
them into FQNs needs that order:

- ``model`` a ``torch.nn.Module`` and ``optimizer`` the optimizer rebuilt as in the run (the
  ids are its parameters, in order); an optimizer built from ``model.named_parameters()``
  names its parameters itself (``param_names``);
- ``model`` a ``torch.nn.Module`` alone: its ``named_parameters()`` order (an optimizer built
  on ``model.parameters()``);
- ``model`` a model checkpoint directory (Colossal-AI or Hugging Face, ``.bin`` or
  ``.safetensors``, with or without index): its tensor order, which is the parameter order
  when the model has no buffers and the optimizer was built on ``model.parameters()``.

Every state tensor's shape is checked against the parameter it is mapped to, and the number
of ids against the number of parameters; any disagreement is refused with a
``CheckpointFormatError`` naming the id, the FQN and both shapes (give the model and
optimizer in Python then). Pickled files are read only with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, UnsupportedError
from unickpt.spec.naming import shown
from unickpt.store.publish import read_small_file
from unickpt.store.storage import (
    confined_location,
    is_dir_location,
    is_file_location,
    join_location,
    parent_location,
)

if TYPE_CHECKING:
    from unickpt.store.publish import Sink

__all__ = ["convert_colossalai_optimizer", "parameter_order"]

INDEX = "pytorch_optim.bin.index.json"


def _load_pickle(path: str) -> Any:
    """A Colossal-AI ``.bin`` file, through ``tools.deepspeed_read.load_restricted``
    (``torch.load(weights_only=True)``, zip format only, the object's nesting bounded)."""
    from unickpt.tools.deepspeed_read import load_restricted

    try:
        return load_restricted(path, "Colossal-AI checkpoint")
    except IncompleteCheckpointError:
        raise IncompleteCheckpointError(f"{path}: named by the Colossal-AI index but missing") from None


def _file(directory: str, name: object, idx: str, entry: str) -> str:
    """The path of the file ``name`` that the index ``idx`` names in ``entry``: a plain
    ``.bin``/``.safetensors`` name of ``directory`` (``spec.untrusted``), no link out of it."""
    from unickpt.spec.index import check_file_name

    return confined_location(directory, check_file_name(name, f"{idx}: {entry}"), idx, entry)  # type: ignore[arg-type]


#: Largest index JSON read (a weight_map of 10^5 tensor names is about 10 MB).
_MAX_JSON = 64 << 20


def _read_json(path: str) -> dict[str, Any]:
    from unickpt.spec.untrusted import strict_loads

    try:
        raw = read_small_file(path, limit=_MAX_JSON)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path} is missing") from None
    except OSError as e:  # larger than the limit
        raise CheckpointFormatError(
            f"{path}: over the {_MAX_JSON}-byte limit of an index file ({e})"
        ) from None
    if len(raw) > _MAX_JSON:
        raise CheckpointFormatError(f"{path}: over the {_MAX_JSON}-byte limit of an index file")
    try:
        obj = strict_loads(raw.decode("utf-8"), CheckpointFormatError, path)
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointFormatError(f"{path}: expected a JSON object")
    return obj


def _checkpoint_shapes(model_dir: str) -> list[tuple[str, tuple[int, ...]]]:
    """``(name, shape)`` of every tensor of a model checkpoint directory, in stored order."""
    for idx_name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        idx = join_location(model_dir, idx_name)
        if is_file_location(idx):
            wm = _read_json(idx).get("weight_map")
            if not isinstance(wm, dict):
                raise CheckpointFormatError(f"{idx}: no weight_map object")
            files = {n: _file(model_dir, f, idx, f"weight_map[{shown(n)}]") for n, f in wm.items()}
            break
    else:
        single = [
            f
            for f in ("model.safetensors", "pytorch_model.bin")
            if is_file_location(join_location(model_dir, f))
        ]
        if not single:
            raise IncompleteCheckpointError(
                f"{model_dir}: holds no model checkpoint (no index, model.safetensors or pytorch_model.bin)"
            )
        files = {}
        path = _file(model_dir, single[0], model_dir, "model file")
        for n in _file_shapes(path):
            files[n] = path
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    out = []
    for name, path in files.items():
        if path not in shapes:
            shapes[path] = _file_shapes(path)
        if name not in shapes[path]:
            raise CheckpointFormatError(
                f"{path}: has no tensor {shown(name)} although its index names it there"
            )
        out.append((name, shapes[path][name]))
    return out


def _file_shapes(path: str) -> dict[str, tuple[int, ...]]:
    if path.endswith(".safetensors"):
        from unickpt.ckpt.safetensors_io import read_header

        header = read_header(path)
        return {k: tuple(v.shape) for k, v in header.entries.items()}
    sd = _load_pickle(path)
    if not isinstance(sd, dict):
        raise CheckpointFormatError(f"{path}: holds a {type(sd).__name__}, not a state dict")
    return {str(k): tuple(v.shape) for k, v in sd.items() if hasattr(v, "shape")}


def parameter_order(model: Any, optimizer: Any = None) -> list[tuple[str, tuple[int, ...] | None]]:
    """``(fqn, shape)`` for Colossal-AI's parameter ids 0, 1, 2, ... (see the module docstring)."""
    import torch

    if isinstance(model, (str, os.PathLike)):
        return [(n, s) for n, s in _checkpoint_shapes(os.fspath(model))]
    if not isinstance(model, torch.nn.Module):
        raise UnsupportedError(
            f"model must be a checkpoint directory or a torch.nn.Module, got {type(model).__name__}"
        )
    from unickpt.io.tensors import normalize_name

    named = [(normalize_name(n), p) for n, p in model.named_parameters()]
    if optimizer is None:
        return [(n, tuple(p.shape)) for n, p in named]
    fqn_of = {id(p): n for n, p in named}
    order: list[tuple[str, tuple[int, ...] | None]] = []
    for gi, g in enumerate(optimizer.param_groups):
        names = g.get("param_names")
        for k, p in enumerate(g["params"]):
            fqn = normalize_name(names[k]) if names else fqn_of.get(id(p))
            if fqn is None:
                raise UnsupportedError(
                    f"param group {gi}, parameter {k} (shape {tuple(p.shape)}) is not a parameter of the model"
                )
            order.append((fqn, tuple(p.shape)))
    return order


def convert_colossalai_optimizer(
    src: str,
    out: Sink,
    *,
    model: Any,
    optimizer: Any = None,
    shard_bytes: int,
    created_by: str,
    progress: bool = False,
) -> None:
    """Write the unickpt optimizer checkpoint of the Colossal-AI checkpoint ``src`` into the tool's
    output ``out`` (``store.publish.output_sink``; ``progress``: a byte bar on stderr)."""
    import torch

    from unickpt.io.jsonstate import to_json_value
    from unickpt.spec.dtypes import itemsize
    from unickpt.spec.index import LayoutInfo
    from unickpt.spec.naming import optimizer_tensor_name
    from unickpt.tools._progress import progress_bar
    from unickpt.tools._torch import st_of, tensor_bytes
    from unickpt.tools._write import SliceData, TensorData, write_checkpoint

    idx = join_location(src, INDEX)
    if not is_file_location(idx):
        raise IncompleteCheckpointError(
            f"{src} is not a Colossal-AI sharded optimizer checkpoint: no {INDEX}"
        )
    if model is None:
        sibling = join_location(parent_location(src), "model")
        if not is_dir_location(sibling):
            raise UnsupportedError(
                f"{src}: Colossal-AI optimizer state is keyed by position; give the model (--model DIR, "
                "or model= in Python) to map positions to parameter names"
            )
        model = sibling
    index = _read_json(idx)
    meta_obj = index.get("metadata")
    meta: dict[str, Any] = meta_obj if isinstance(meta_obj, dict) else {}
    wm = index.get("weight_map")
    if not isinstance(wm, dict) or not isinstance(meta.get("param_groups"), str):
        raise CheckpointFormatError(
            f"{idx}: expected weight_map and metadata.param_groups (Colossal-AI's layout)"
        )
    groups = _load_pickle(_file(src, meta["param_groups"], idx, "metadata.param_groups"))
    if not isinstance(groups, list) or not all(
        isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups
    ):
        raise CheckpointFormatError(f"{src}/{meta['param_groups']}: not a list of param groups with 'params'")
    order = parameter_order(model, optimizer)
    n_ids = sum(len(g["params"]) for g in groups)
    if n_ids != len(order):
        raise CheckpointFormatError(
            f"{src}: the optimizer has {n_ids} parameter ids but the model gives {len(order)} parameters; "
            "a model checkpoint with buffers, or an optimizer over a subset of the parameters, needs the "
            "model and optimizer in Python (convert_checkpoint(..., model=module, optimizer=optim))"
        )
    state: dict[int, dict[str, Any]] = {}
    if not all(isinstance(f, str) for f in wm.values()):
        raise CheckpointFormatError(f"{idx}: weight_map must map parameter ids to file names")
    for fname in sorted(set(wm.values())):
        part = _load_pickle(_file(src, fname, idx, f"weight_map file {shown(fname)}"))
        if not isinstance(part, dict):
            raise CheckpointFormatError(f"{src}/{fname}: holds a {type(part).__name__}, not {{id: state}}")
        for k, v in part.items():
            if not isinstance(k, int) or not isinstance(v, dict):
                raise CheckpointFormatError(
                    f"{src}/{fname}: entry {shown(k)} is not an integer id with a state dict"
                )
            state[k] = v
    tensors: dict[str, TensorData] = {}
    param_state: dict[str, dict[str, Any]] = {}
    for pid in sorted(state):
        if not 0 <= pid < len(order):
            raise CheckpointFormatError(
                f"{src}: state for parameter id {pid}, but the optimizer has {len(order)} parameters"
            )
        fqn, shape = order[pid]
        for key, value in state[pid].items():
            if isinstance(value, torch.Tensor):
                if value.dim() > 0 and shape is not None and tuple(value.shape) != shape:
                    raise CheckpointFormatError(
                        f"{src}: state {shown(key)} of parameter id {pid} has shape {tuple(value.shape)}, but id {pid} "
                        f"maps to {shown(fqn)} of shape {shape}: the parameter order differs from the optimizer's; "
                        "give the model and the optimizer in Python"
                    )
                name = optimizer_tensor_name(fqn, str(key))
                tensors[name] = TensorData(
                    st_of(value.dtype, name),
                    list(value.shape),
                    [SliceData([0] * value.dim(), list(value.shape), tensor_bytes(value))],
                    {"param": fqn, "state": str(key)},
                )
            else:
                param_state.setdefault(fqn, {})[str(key)] = to_json_value(
                    value, f"state[{pid}][{shown(key)}]"
                )
    out_groups = []
    for i, g in enumerate(groups):
        hyper = {
            k: to_json_value(v, f"param_groups[{i}][{shown(k)}]")
            for k, v in g.items()
            if k not in ("params", "param_names")
        }
        ids = g["params"]
        if not all(isinstance(x, int) and 0 <= x < len(order) for x in ids):
            raise CheckpointFormatError(
                f"{src}: param group {i} lists ids {ids[:5]}... outside 0..{len(order) - 1}"
            )
        out_groups.append({**hyper, "params": [order[x][0] for x in ids]})
    total = sum(math.prod(t.shape) * itemsize(t.dtype) for t in tensors.values())
    with progress_bar(total, "convert --from colossalai", progress) as update:
        write_checkpoint(
            out,
            tensors,
            kind="optimizer",
            sliced=False,
            max_shard_bytes=shard_bytes,
            layout=LayoutInfo(plugin="colossalai"),
            block_extras={"param_groups": out_groups, "param_state": param_state},
            created_by=created_by,
            progress=update,
        )
