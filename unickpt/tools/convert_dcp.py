"""Import a DCP checkpoint: its tensors alone (:func:`dcp_tensors`), or a whole DCP / torchtitan
training checkpoint: model, optimizer, LR scheduler, train state (:func:`import_training`).

Recognised layouts (the flat DCP keys, as ``.metadata`` records them):

- ``dcp.save({"model": msd, "optim": osd, ...})`` of ``get_state_dict(model, optimizer)``:
  ``model.<fqn>``, ``optim.state.<fqn>.<key>``, ``optim.param_groups.<i>.<hyper>`` (with
  ``params``, the FQNs of group ``i``). ``optimizer`` is accepted for ``optim``.
- torchtitan's ``CheckpointManager`` (``step-<N>/``): model tensors at the top level under
  their FQNs, ``optimizer.state.<fqn>.<key>`` and per-parameter hyperparameters
  ``optimizer.param_groups.<fqn>.<hyper>`` (torchtitan's flat optimizer state dict, also what
  ``StateDictOptions(flatten_optimizer_state_dict=True)`` gives), ``lr_scheduler.*``,
  ``train_state.step``/``ntokens_seen``, and ``dataloader.*`` (torchtitan pickles the loader
  state itself: it is never unpickled, and skipped with a warning).
- ``lr_scheduler.*`` / ``train_state.*``: any scheduler ``state_dict`` and train state of
  numbers, strings and containers.

Everything is read through :mod:`unickpt.tools.dcp_read` (no code from the checkpoint runs).
Tensors are streamed a batch at a time into the writer; peak memory is about one batch
(256 MiB) plus the largest tensor.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from unickpt._logging import get_logger
from unickpt.errors import CheckpointFormatError
from unickpt.spec.naming import shown

if TYPE_CHECKING:
    import numpy as np

    from unickpt.store.publish import Sink
    from unickpt.tools._write import TensorData

__all__ = [
    "BATCH_BYTES",
    "DcpLayout",
    "LazyTensors",
    "classify",
    "dcp_tensors",
    "import_training",
    "read_train_state",
    "writer_ranks",
]

logger = get_logger(__name__)

_OPTIM = ("optim", "optimizer")
_SCHED = ("lr_scheduler", "lr_schedulers", "scheduler")
_TRAIN = ("train_state",)
_LOADER = ("dataloader",)
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


@dataclasses.dataclass
class DcpLayout:
    """Where each part of a training checkpoint lives among the flat DCP keys."""

    model: dict[str, str] = dataclasses.field(default_factory=dict)  # fqn -> key
    optim_tensors: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)  # (fqn, state) -> key
    optim_values: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)  # non-tensor state
    groups: dict[int, dict[str, str]] = dataclasses.field(default_factory=dict)  # i -> {hyper: key}
    flat_groups: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)  # fqn -> {hyper: key}
    scheduler: dict[str, str] = dataclasses.field(default_factory=dict)  # field -> key
    train_state: dict[str, str] = dataclasses.field(default_factory=dict)
    skipped: list[str] = dataclasses.field(default_factory=list)
    flavour: str = "dcp"

    @property
    def is_training(self) -> bool:
        return bool(self.optim_tensors or self.optim_values or self.groups or self.flat_groups) or bool(
            self.scheduler or self.train_state
        )


def _split_fqn(rest: str, fqns: list[str], key: str) -> tuple[str, str]:
    """``"<fqn>.<name>"`` -> (fqn, name), using the model's FQNs (longest match) to find the cut."""
    best = max((f for f in fqns if rest.startswith(f + ".")), key=len, default=None)
    if best is not None:
        return best, rest[len(best) + 1 :]
    if "." not in rest:
        raise CheckpointFormatError(
            f"DCP key {shown(key)}: cannot tell the parameter FQN from the state name"
        )
    fqn, name = rest.rsplit(".", 1)
    return fqn, name


def classify(md: Any) -> DcpLayout:
    """Sort the entries of DCP metadata ``md`` into model, optimizer, scheduler and train state."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    lay = DcpLayout()
    paths: dict[str, tuple[Any, ...]] = {}
    planner = md.planner_data if isinstance(md.planner_data, dict) else {}
    for key in md.state_dict_metadata:
        p = planner.get(key)
        # Without planner_data (the nested paths), split off the first component only; the
        # flattened optimizer keys are then cut with the model's FQNs below.
        paths[key] = tuple(p) if isinstance(p, (tuple, list)) and p else tuple(key.split(".", 1))
    nested_model = any(p[0] == "model" and len(p) == 2 for p in paths.values())
    flat_optim: list[tuple[str, str, bool]] = []
    for key, p in paths.items():
        is_tensor = isinstance(md.state_dict_metadata[key], TensorStorageMetadata)
        head = p[0]
        rest = [str(x) for x in p[1:]]
        if head in _OPTIM and rest:
            if rest[0] == "state" and len(rest) == 3:
                (lay.optim_tensors if is_tensor else lay.optim_values)[(rest[1], rest[2])] = key
            elif rest[0] == "param_groups" and len(rest) == 3 and rest[1].isdigit():
                lay.groups.setdefault(int(rest[1]), {})[rest[2]] = key
            elif len(rest) == 1 and rest[0].startswith(("state.", "param_groups.")):
                flat_optim.append((key, rest[0], is_tensor))
            else:
                lay.skipped.append(key)
        elif head in _SCHED and rest:
            lay.scheduler[".".join(rest)] = key
        elif head in _TRAIN and rest:
            lay.train_state[".".join(rest)] = key
        elif head in _LOADER:
            lay.skipped.append(key)
        elif nested_model:
            if head == "model" and len(p) == 2 and is_tensor:
                lay.model[str(p[1])] = key
            else:
                lay.skipped.append(key)
        elif is_tensor:
            lay.model[".".join(str(x) for x in p)] = key
        else:
            lay.skipped.append(key)
    fqns = sorted(lay.model)
    indexed = {r for _, r, _ in flat_optim if r.startswith("param_groups.") and r.endswith(".params")}
    for key, rest_s, is_tensor in flat_optim:
        kind, _, tail = rest_s.partition(".")
        seg, _, hyper = tail.partition(".")
        if kind == "param_groups" and seg.isdigit() and f"param_groups.{seg}.params" in indexed:
            lay.groups.setdefault(int(seg), {})[hyper] = key  # get_state_dict groups, paths not recorded
            continue
        fqn, name = _split_fqn(tail, fqns, key)
        if kind == "state":
            (lay.optim_tensors if is_tensor else lay.optim_values)[(fqn, name)] = key
        else:
            lay.flat_groups.setdefault(fqn, {})[name] = key
    if lay.flat_groups:  # per-parameter hyperparameters: torchtitan's flat optimizer state dict
        lay.flavour = "torchtitan"
    return lay


def writer_ranks(md: Any) -> int:
    ranks = set()
    for info in md.storage_data.values():
        m = _RANK_FILE.match(os.path.basename(str(getattr(info, "relative_path", ""))))
        if m:
            ranks.add(int(m.group(1)))
    return max(1, len(ranks))


def _param_groups(lay: DcpLayout, values: dict[str, Any]) -> list[dict[str, Any]]:
    from unickpt.io.jsonstate import to_json_value

    out: list[dict[str, Any]] = []
    if lay.groups:
        for i in sorted(lay.groups):
            g = lay.groups[i]
            if "params" not in g:
                raise CheckpointFormatError(
                    f"DCP param group {i} has no 'params' entry (the FQNs of its parameters)"
                )
            params = values[g["params"]]
            if not isinstance(params, list) or not all(isinstance(x, str) for x in params):
                raise CheckpointFormatError(
                    f"DCP key {shown(g['params'])}: expected the list of parameter FQNs of group {i}, got "
                    f"{type(params).__name__}; save get_state_dict(model, optimizer) (FQN-keyed), not optimizer.state_dict()"
                )
            hyper = {
                k: to_json_value(values[key], f"param_groups[{i}][{shown(k)}]")
                for k, key in g.items()
                if k != "params"
            }
            out.append({**hyper, "params": list(params)})
        return out
    # torchtitan: hyperparameters per parameter; parameters with equal ones form a group.
    by_hyper: dict[str, dict[str, Any]] = {}
    for fqn, g in lay.flat_groups.items():
        hyper = {
            k: to_json_value(values[key], f"param_groups[{shown(fqn)}][{shown(k)}]")
            for k, key in sorted(g.items())
        }
        sig = json.dumps(hyper, sort_keys=True)
        by_hyper.setdefault(sig, {**hyper, "params": []})["params"].append(fqn)
    return list(by_hyper.values())


# Tensors are read from DCP in batches of about this many bytes (one dcp.load call each).
BATCH_BYTES = 256 << 20


class LazyTensors:
    """Loads tensors on demand in order, ``batch`` at a time, dropping each once handed out."""

    def __init__(self, order: list[tuple[str, int]], load: Callable[[list[str]], dict[str, Any]]) -> None:
        self.order = order
        self.load = load
        self.cache: dict[str, Any] = {}
        self.pos = {n: i for i, (n, _) in enumerate(order)}

    def get(self, name: str) -> np.ndarray:
        from unickpt.tools._torch import tensor_bytes

        if name not in self.cache:
            i = self.pos[name]
            batch: list[str] = []
            size = 0
            while i < len(self.order) and (not batch or size + self.order[i][1] <= BATCH_BYTES):
                batch.append(self.order[i][0])
                size += self.order[i][1]
                i += 1
            self.cache.update(self.load(batch))
        return tensor_bytes(self.cache.pop(name))

    def getter(self, name: str) -> Callable[[], np.ndarray]:
        """A function returning ``name``'s bytes when called (the writer calls it in file order)."""
        return lambda: self.get(name)


def dcp_tensors(src: str, strip_prefix: str | None, md: Any) -> tuple[dict[str, TensorData], list[str]]:
    """The tensors of a DCP checkpoint as the writer's input (``strip_prefix``: only the keys under
    it, named without it), each loaded when written; and the keys of the non-tensor entries skipped."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from unickpt.tools._torch import st_of
    from unickpt.tools._write import SliceData, TensorData
    from unickpt.tools.dcp_read import load_entries

    specs: dict[str, tuple[str, Any, list[int]]] = {}
    skipped = []
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            skipped.append(key)
            continue
        name = key
        if strip_prefix:
            if not key.startswith(strip_prefix):
                continue
            name = key[len(strip_prefix) :]
        dtype = meta.properties.dtype
        specs[name] = (key, dtype, list(meta.size))
    if skipped:
        logger.warning("skipped %d non-tensor DCP entries (never loaded): %s", len(skipped), skipped[:10])

    def load(names: list[str]) -> dict[str, Any]:
        got = load_entries(src, [specs[n][0] for n in names], md)
        return {n: got[specs[n][0]] for n in names}

    order = [(n, math.prod(s) * dt.itemsize) for n, (_, dt, s) in specs.items()]
    lazy = LazyTensors(order, load)
    tensors = {}
    for n, (_, dt, shape) in specs.items():
        tensors[n] = TensorData(st_of(dt, n), shape, [SliceData([0] * len(shape), shape, lazy.getter(n))])
    return tensors, skipped


def import_training(
    src: str,
    md: Any,
    lay: DcpLayout,
    model_out: Sink,
    optim_out: Sink,
    side_out: Sink,
    *,
    shard_bytes: int,
    created_by: str,
    progress: bool = False,
) -> None:
    """Write the model checkpoint of the classified checkpoint into ``model_out``, its optimizer
    checkpoint (``param_groups`` and ``param_state`` included) into ``optim_out`` and
    ``lr_scheduler.json`` into ``side_out``: parts of a tool's output
    (``store.publish.output_sink``; one sink for all three, or a run step's ``model/``,
    ``optimizer/`` and the step itself), under a byte progress bar (``progress``).

    ``train_state.*`` is not written here (see :func:`read_train_state`).
    """
    from unickpt.spec.index import LayoutInfo
    from unickpt.tools._progress import progress_bar
    from unickpt.tools._torch import st_of
    from unickpt.tools._write import SliceData, TensorData
    from unickpt.tools.dcp_read import load_entries, tensor_specs

    if lay.skipped:
        logger.warning(
            "skipped %d DCP entries unickpt does not import: %s", len(lay.skipped), lay.skipped[:10]
        )
    value_keys = (
        list(lay.optim_values.values())
        + [k for g in lay.groups.values() for k in g.values()]
        + [k for g in lay.flat_groups.values() for k in g.values()]
        + list(lay.scheduler.values())
    )
    values = load_entries(src, value_keys, md) if value_keys else {}
    specs = tensor_specs(md)
    wanted = set(lay.model.values()) | set(lay.optim_tensors.values())
    order = [(k, math.prod(s) * dt.itemsize) for k, (dt, s) in specs.items() if k in wanted]
    lazy = LazyTensors(order, lambda keys: load_entries(src, keys, md))

    def tensor(key: str, name: str, extras: dict[str, Any] | None = None) -> TensorData:
        dt, shape = specs[key]
        return TensorData(
            st_of(dt, name), shape, [SliceData([0] * len(shape), shape, lazy.getter(key))], extras or {}
        )

    layout = LayoutInfo(plugin=lay.flavour, world_size=writer_ranks(md))
    with progress_bar(sum(n for _, n in order), "convert --from dcp", progress) as update:
        _write_parts(
            src,
            lay,
            values,
            tensor,
            layout,
            (model_out, optim_out, side_out),
            shard_bytes,
            created_by,
            update,
        )


def _write_parts(
    src: str,
    lay: DcpLayout,
    values: dict[str, Any],
    tensor: Callable[..., Any],
    layout: Any,
    outs: tuple[Sink, Sink, Sink],
    shard_bytes: int,
    created_by: str,
    update: Callable[[int], object],
) -> None:
    """The model, optimizer and scheduler files of :func:`import_training`."""
    from unickpt.io.jsonstate import to_json_value
    from unickpt.io.side_files import lr_scheduler_json
    from unickpt.spec.naming import optimizer_tensor_name
    from unickpt.tools._write import write_checkpoint

    model_out, optim_out, side_out = outs
    if lay.model:
        write_checkpoint(
            model_out,
            {fqn: tensor(key, fqn) for fqn, key in lay.model.items()},
            sliced=False,
            max_shard_bytes=shard_bytes,
            layout=layout,
            created_by=created_by,
            progress=update,
        )
    groups = _param_groups(lay, values)
    if lay.optim_tensors or groups:
        known = {f for g in groups for f in g["params"]}
        param_state: dict[str, dict[str, Any]] = {}
        for (fqn, k), key in lay.optim_values.items():
            param_state.setdefault(fqn, {})[k] = to_json_value(
                values[key], f"state[{shown(fqn)}][{shown(k)}]"
            )
        opt_tensors = {}
        for (fqn, k), key in lay.optim_tensors.items():
            name = optimizer_tensor_name(fqn, k)
            opt_tensors[name] = tensor(key, name, {"param": fqn, "state": k})
        orphans = sorted({f for f, _ in lay.optim_tensors} | set(param_state)) if groups else []
        orphans = [f for f in orphans if f not in known]
        if orphans:
            raise CheckpointFormatError(
                f"{src}: optimizer state for {len(orphans)} parameter(s) that no param group lists, e.g. {orphans[:3]}"
            )
        write_checkpoint(
            optim_out,
            opt_tensors,
            kind="optimizer",
            sliced=False,
            max_shard_bytes=shard_bytes,
            layout=layout,
            block_extras={"param_groups": groups, "param_state": param_state},
            created_by=created_by,
            progress=update,
        )
    if lay.scheduler:
        state = _nest({f: values[k] for f, k in lay.scheduler.items()})
        if set(state) == {"last_epoch"} and groups:
            # torchtitan saves only last_epoch of its LambdaLR; torch's LambdaLR.load_state_dict
            # also needs lr_lambdas, which its state_dict() stores as None for plain functions.
            state["lr_lambdas"] = [None] * len(groups)
        side_out.put("lr_scheduler.json", lr_scheduler_json(state))


def read_train_state(src: str, md: Any, lay: DcpLayout) -> dict[str, Any]:
    """The ``train_state.*`` entries (torchtitan: ``step``, ``ntokens_seen``) as plain JSON values."""
    from unickpt.io.jsonstate import to_json_value
    from unickpt.tools.dcp_read import load_entries

    if not lay.train_state:
        return {}
    values = load_entries(src, list(lay.train_state.values()), md)
    for k, v in values.items():
        if hasattr(v, "numel") and v.numel() == 1:  # a 0-dim tensor step counter
            values[k] = v.item()
    return _nest({f: to_json_value(values[k], f"train_state.{f}") for f, k in lay.train_state.items()})


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """Scheduler fields saved nested (``a.b``) back into dicts."""
    out: dict[str, Any] = {}
    for k, v in flat.items():
        parts = k.split(".")
        d = out
        for p in parts[:-1]:
            d = d.setdefault(p, {})
        d[parts[-1]] = v
    return out
