"""``unickpt convert --to deepspeed``: a unickpt checkpoint as a DeepSpeed universal checkpoint (UCP).

``OUT`` is a DeepSpeed checkpoint directory, laid out as DeepSpeed's ``ds_to_universal`` writes
one (DeepSpeed 0.19.8's ``deepspeed/checkpoint/ds_to_universal.py``), so that an engine configured
with ``"checkpoint": {"load_universal": true}`` resumes from it with ``engine.load_checkpoint(OUT)``
at any data-parallel world size, under ZeRO stage 1 or 2:

- ``latest_universal``: the tag, ``global_step<N>_universal``;
- ``<tag>/mp_rank_00_model_states.pt``: what the engine reads besides the optimizer: the step
  counters (``global_steps``, ``skipped_steps``, ``global_samples`` when known), the LR
  scheduler's state (``lr_scheduler``, from ``lr_scheduler.json``, else None), ``dp_world_size``
  and ``mp_world_size`` (1: the tensors are whole), and for readers of the layout the module's
  ``state_dict`` (``module``: every model tensor in its dtype, tied names included),
  ``buffer_names`` (the model tensors no param group lists), ``param_shapes`` (per param group,
  its parameters' names and shapes in the group's order) and ``shared_params`` (tied names);
- ``<tag>/zero/optimizer_state.pt``: the param groups' hyperparameters (each group's ``params``
  is its index, as DeepSpeed records them) and ``ds_version``;
- ``<tag>/zero/<fqn>/fp32.pt``: ``{"param": the fp32 master weight, "cat_dim": 0}``, and likewise
  ``exp_avg.pt``, ``exp_avg_sq.pt`` (every per-element optimizer state tensor, in the parameter's
  shape) and ``step.pt`` (the step tensor itself), for every parameter a param group lists; a
  floating buffer gets its ``fp32.pt`` too, as ``ds_to_universal`` writes it.

The fp32 master weights are the model checkpoint's tensors as fp32 (exact for an fp32 checkpoint;
a bf16 checkpoint's weights widened). ``N`` (``global_steps``) is ``step`` when given, else the
engine counters a run converted with ``convert --from deepspeed --to run`` kept in its train
state, else the ``CheckpointManager`` step, else the optimizer's (Adam's) step count, else 0.

Every ``.pt`` file is a ``torch.save`` pickle (DeepSpeed reads no other form) of plain dicts,
lists, numbers, strings, tensors and ``torch.Size`` only: no class of DeepSpeed or unickpt, so
``torch.load(weights_only=True)`` reads every one (the loss scaler, which DeepSpeed pickles as
its own object, is left out: the engine keeps its own). Refused with a clear error, before
anything is written: a checkpoint without an optimizer checkpoint (DeepSpeed restores the
weights through the optimizer's groups), a parameter name that is not a plain directory name,
non-tensor state other than ``step``, state of another size than its parameter, parameters of
one group with different state keys or steps (DeepSpeed keeps one step per group). Every slice
hash is checked while reading; tensors are assembled whole in memory (peak: about the size of
the checkpoint). ``OUT`` is a local directory or an object-store prefix (``store.publish.output_sink``):
every ``.pt`` file is streamed into it as ``torch.save`` writes it (no local copy), and
``latest_universal`` is its commit point, written last; a failure leaves no ``OUT``.
"""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from typing import IO, Any, cast

import torch

from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, UnsupportedError
from unickpt.io.jsonstate import from_json_value
from unickpt.spec.naming import shown
from unickpt.store.publish import Sink, StoreFile, output_sink
from unickpt.store.storage import open_storage
from unickpt.tools._common import checkpoint_parts
from unickpt.tools._progress import progress_bar
from unickpt.tools._torch import full_tensors

__all__ = ["export_deepspeed", "DS_VERSION", "LATEST_UNIVERSAL"]

#: The DeepSpeed release whose universal checkpoint layout is written (recorded as ``ds_version``;
#: DeepSpeed's ZeRO loader requires the entry).
DS_VERSION = "0.19.8"
LATEST_UNIVERSAL = "latest_universal"
MODEL_STATES = "mp_rank_00_model_states.pt"
# A parameter's directory and a state's file name: a plain name, as DeepSpeed's own FQNs are.
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
_KEY = re.compile(r"^[A-Za-z0-9_]+$")
_TRAIN_COUNTERS = ("global_steps", "global_samples", "skipped_steps")


def export_deepspeed(src: str, out: str, *, step: int | None = None, progress: bool = False) -> str:
    """Write the unickpt checkpoint ``src`` as a DeepSpeed universal checkpoint at ``out``
    (see the module docstring); returns ``out``."""
    model_path, optim_path, sched_path, run_step = checkpoint_parts(src)
    if optim_path is None:
        raise IncompleteCheckpointError(
            f"{src}: holds no optimizer checkpoint beside the model; a DeepSpeed universal checkpoint "
            "needs the optimizer's param groups (DeepSpeed restores the weights through them): save "
            "the optimizer too, or load the model alone with load_model"
        )
    with open_checkpoint(model_path, "model") as reader:
        model = full_tensors(reader)
        aliases = dict(reader.block.aliases)
    with open_checkpoint(optim_path, "optimizer") as reader:
        flat = full_tensors(reader)
        groups = reader.block.param_groups or []
        state: dict[str, dict[str, Any]] = {}
        for name, entry in reader.tensors.items():
            if entry.param is not None and entry.state is not None:
                state.setdefault(entry.param, {})[entry.state] = flat[name]
        for fqn, scalars in reader.block.param_state.items():
            for k, v in scalars.items():
                state.setdefault(fqn, {})[k] = from_json_value(v)
    del flat
    plan = _plan(model, groups, state, model_path, optim_path)
    counters = _train_counters(src, run_step)
    if step is not None:
        counters["global_steps"] = step
    elif "global_steps" not in counters:
        counters["global_steps"] = run_step if run_step is not None else _optimizer_step(plan)
    n = int(counters["global_steps"])
    tag = f"global_step{n}_universal"
    sched = None
    if sched_path is not None:
        storage, _ = open_storage(sched_path)
        sched = from_json_value(json.loads(storage.read_bytes(sched_path, limit=64 << 20))["state"])

    grouped = {fqn for fqns, _ in plan for fqn, _ in fqns}
    buffers = [k for k in model if k not in grouped]
    total = sum(_nbytes(t) for fqns, _ in plan for _, files in fqns for t in files.values())
    total += sum(_nbytes(model[b]) for b in buffers if model[b].is_floating_point())
    with output_sink(out) as sink, progress_bar(total, "convert --to deepspeed", progress) as update:
        step_dir = sink.within(tag)
        zero = step_dir.within("zero")
        for fqns, _ in plan:
            for fqn, files in fqns:
                where = zero.within(fqn)
                for key, t in files.items():
                    _save(where, f"{key}.pt", t if key == "step" else {"cat_dim": 0, "param": t})
                    update(_nbytes(t))
        for b in buffers:  # ds_to_universal's fp32.pt for a module entry that is no parameter
            t = model[b]
            if t.is_floating_point() and _NAME.match(b) and ".." not in b:
                _save(zero.within(b), "fp32.pt", {"param": t.float()})
                update(_nbytes(t))
        _save(
            zero,
            "optimizer_state.pt",
            {
                "param_groups": [{**hyper, "params": [gi]} for gi, (_, hyper) in enumerate(plan)],
                "ds_version": DS_VERSION,
            },
        )
        module = OrderedDict(model)
        for alias, target in aliases.items():
            module[alias] = model[target]
        states: dict[str, Any] = {
            "module": module,
            "buffer_names": buffers,
            "optimizer": None,
            "param_shapes": [
                OrderedDict((fqn, torch.Size(files["fp32"].shape)) for fqn, files in fqns) for fqns, _ in plan
            ],
            "frozen_param_shapes": OrderedDict(),
            "shared_params": aliases,
            "frozen_param_fragments": OrderedDict(),
            "lr_scheduler": sched,
            "data_sampler": None,
            "random_ltd": None,
            "skipped_steps": int(counters.get("skipped_steps", 0)),
            "global_steps": n,
            "dp_world_size": 1,
            "mp_world_size": 1,
            "ds_version": DS_VERSION,
        }
        if "global_samples" in counters:
            states["global_samples"] = int(counters["global_samples"])
        _save(step_dir, MODEL_STATES, states)
        # DeepSpeed finds the step through the tag file: the output's commit point, written last.
        sink.commit_later(LATEST_UNIVERSAL, tag.encode())
    return out


_Plan = list[tuple[list[tuple[str, dict[str, torch.Tensor]]], dict[str, Any]]]


def _plan(
    model: dict[str, torch.Tensor],
    groups: list[dict[str, Any]],
    state: dict[str, dict[str, Any]],
    model_path: str,
    optim_path: str,
) -> _Plan:
    """Per param group: its parameters' files (``{"fp32": ..., "exp_avg": ..., "step": ...}``,
    tensors in the parameter's shape) and the group's hyperparameters; checked as the module
    docstring says."""
    if not groups:
        raise CheckpointFormatError(f"{optim_path}: the optimizer checkpoint records no param groups")
    seen: dict[str, int] = {}
    plan: _Plan = []
    for gi, g in enumerate(groups):
        hyper = {k: _group_value(k, v) for k, v in g.items() if k not in ("params", "param_names")}
        params = []
        first: tuple[str, set[str], Any] | None = None
        for fqn in g.get("params", []):
            if fqn in seen:
                raise CheckpointFormatError(
                    f"{optim_path}: parameter {shown(fqn)} is listed by param groups {seen[fqn]} and {gi}"
                )
            seen[fqn] = gi
            if fqn not in model:
                raise CheckpointFormatError(
                    f"{optim_path}: param group {gi} lists {shown(fqn)}, which the model checkpoint "
                    f"{model_path} does not hold"
                )
            if not _NAME.match(fqn) or ".." in fqn:
                raise UnsupportedError(
                    f"{optim_path}: parameter name {shown(fqn)} cannot be a directory of a DeepSpeed universal "
                    "checkpoint (zero/<name>/); only letters, digits and _ . + - are"
                )
            weight = model[fqn]
            files: dict[str, torch.Tensor] = {"fp32": weight.float()}
            for key, v in state.get(fqn, {}).items():
                if key == "step":
                    files["step"] = v if isinstance(v, torch.Tensor) else torch.tensor(float(v))
                    continue
                if not isinstance(v, torch.Tensor):
                    raise UnsupportedError(
                        f"{optim_path}: optimizer state {shown(key)} of {shown(fqn)} is a {type(v).__name__}; a DeepSpeed "
                        "universal checkpoint holds per-element state tensors (and the step) only"
                    )
                if not _KEY.match(key) or key == "fp32":
                    raise UnsupportedError(
                        f"{optim_path}: optimizer state {shown(key)} of {shown(fqn)} cannot be a file name of a DeepSpeed "
                        "universal checkpoint (<key>.pt, fp32 being the weight's)"
                    )
                if v.numel() != weight.numel():
                    raise UnsupportedError(
                        f"{optim_path}: optimizer state {shown(key)} of {shown(fqn)} has {v.numel()} elements, its "
                        f"parameter {weight.numel()}; DeepSpeed restores per-element state only"
                    )
                files[key] = v.reshape(weight.shape)
            keys = set(files) - {"step"}
            step = files.get("step")
            step_value = None if step is None else float(step)
            if first is None:
                first = (fqn, keys, step_value)
            elif keys != first[1] or step_value != first[2]:
                raise UnsupportedError(
                    f"{optim_path}: in param group {gi}, {shown(first[0])} has state {sorted(first[1])} at step "
                    f"{first[2]} but {shown(fqn)} has {sorted(keys)} at step {step_value}; DeepSpeed keeps one "
                    "set of state keys and one step per param group"
                )
            params.append((fqn, files))
        plan.append((params, hyper))
    return plan


def _group_value(k: str, v: Any) -> Any:
    value = from_json_value(v)
    if k == "betas" and isinstance(value, list):
        return tuple(value)
    return value


def _optimizer_step(plan: _Plan) -> int:
    """The optimizer's step count: the largest step of any group (0 when none has stepped)."""
    steps = [float(files["step"]) for fqns, _ in plan for _, files in fqns if "step" in files]
    return int(max(steps)) if steps else 0


def _train_counters(src: str, run_step: int | None) -> dict[str, int]:
    """The engine counters a ``CheckpointManager`` step converted from DeepSpeed keeps in its
    extra state ``train_state`` (``global_steps``, ``global_samples``, ``skipped_steps``)."""
    if run_step is None:
        return {}
    storage, _ = open_storage(src)
    root = src.removeprefix("file://").rstrip("/") or "/"
    path = storage.join(storage.join(root, "train_state"), "rank-00000.json")
    if not storage.exists(path):
        return {}
    try:
        record = json.loads(storage.read_bytes(path, limit=64 << 20))
    except ValueError:  # not JSON: the counters are taken from elsewhere
        return {}
    extra = record.get("extra") if isinstance(record, dict) else None
    train = extra.get("train_state") if isinstance(extra, dict) else None
    if not isinstance(train, dict):
        return {}
    return {k: train[k] for k in _TRAIN_COUNTERS if type(train.get(k)) is int and train[k] >= 0}


def _nbytes(t: torch.Tensor) -> int:
    return int(math.prod(t.shape)) * t.element_size()


def _save(sink: Sink, name: str, obj: Any) -> None:
    """``torch.save`` of plain data streamed into the new file ``name`` of ``sink`` (a failure
    leaves the file open: the output's abort drops it with everything else)."""
    sf = sink.open(name)
    torch.save(obj, cast(IO[bytes], _Stream(sf)))
    sink.close(sf)


class _Stream:
    """The write-only file object ``torch.save`` streams its zip archive into (no seek)."""

    def __init__(self, sf: StoreFile) -> None:
        self.sf = sf

    def write(self, data: bytes) -> int:
        view = memoryview(data).cast("B")
        self.sf.write(view, self.sf.pos)
        return view.nbytes

    def flush(self) -> None:
        """Nothing buffered here: the sink makes the file durable when it is closed."""
