"""Import a DeepSpeed ZeRO (stage 1 and 2) checkpoint: fp32 master weights, Adam moments, groups.

``engine.save_checkpoint(dir)`` writes ``dir/latest`` (the tag, e.g. ``global_step3``) and
``dir/<tag>/`` holding ``mp_rank_00_model_states.pt`` (the module's ``state_dict`` in the
training dtype, ``param_shapes`` per param group, buffers, frozen and shared parameters, the
step counters) and one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per data-parallel rank.
Each optimizer file holds, per param group, that rank's piece of the group's flat fp32 master
vector (``single_partition_of_fp32_groups``, alignment padding removed), the torch optimizer's
``state_dict`` over those flat pieces (one "parameter" per group: ``exp_avg`` etc. of the same
length plus padding at the end, and the group hyperparameters), and ``param_alignment_paddings``.

The flat vector of a group is the ranks' pieces concatenated in rank order; its parameters lie
in it one after the other in ``param_shapes`` order, each followed by its alignment padding
(as DeepSpeed's ``zero_to_fp32.py`` reads it). The moments are cut from the concatenated
moment pieces at the same offsets, so each parameter FQN gets its ``exp_avg``/``exp_avg_sq``
(and the group's ``step``) back in its own shape.

The model checkpoint holds the **fp32 master weights** (what ``zero_to_fp32`` gives: the
exact values training continues from; the 16-bit copies of a bf16/fp16 run in the model
states file are their rounding), buffers from the module state (floating ones as fp32, as
``zero_to_fp32`` does), frozen parameters, and tied (shared) parameters under every name.
Files are read only through :mod:`unickpt.tools.deepspeed_read` (no code from them runs).
ZeRO stage 3, tensor/pipeline parallel (``mp_rank_01`` ...) and the bf16 optimizer layout
are refused with :class:`UnsupportedError`.
"""

from __future__ import annotations

import functools
import math
import os
import re
from typing import Any

from unickpt._logging import get_logger
from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, UnsafePathError, UnsupportedError

__all__ = ["DeepSpeedCheckpoint", "read_deepspeed", "write_deepspeed"]

logger = get_logger(__name__)

_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
_OPTIM = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL = re.compile(r"^(?:zero_pp_rank_\d+_)?mp_rank_(\d+)_model_states\.pt$")
_OSD = "optimizer_state_dict"


class DeepSpeedCheckpoint:
    """A ZeRO checkpoint reassembled per parameter FQN (all on CPU)."""

    def __init__(self) -> None:
        self.model: dict[str, Any] = {}  # fqn -> tensor (fp32 master weights, buffers, frozen, tied)
        self.state: dict[str, dict[str, Any]] = {}  # fqn -> {exp_avg, exp_avg_sq, step, ...}
        self.param_groups: list[dict[str, Any]] = []  # hyperparameters, params as FQNs
        self.step: int | None = None  # the engine's global_steps
        self.lr_scheduler: dict[str, Any] | None = None
        self.train_state: dict[str, Any] = {}
        self.world_size = 1
        self.zero_stage = 0


def find_step_dir(src: str, tag: str | None = None) -> str:
    """The ``<tag>/`` directory of the checkpoint ``src`` (``tag``, else the ``latest`` file's),
    or ``src`` itself when it already holds the rank files."""
    if tag is None:
        if any(_OPTIM.match(n) for n in _listdir(src)):
            return src
        latest = os.path.join(src, "latest")
        if not os.path.isfile(latest):
            raise IncompleteCheckpointError(
                f"{src} is not a DeepSpeed checkpoint: no 'latest' file and no *_optim_states.pt files"
            )
        with open(latest, "rb") as f:
            tag = f.read(4096).decode("utf-8", "replace").strip()
    if not _TAG.match(tag) or ".." in tag:
        raise UnsafePathError(f"{src}: checkpoint tag {tag!r} is not a plain directory name")
    step_dir = os.path.join(src, tag)
    if not os.path.isdir(step_dir):
        raise IncompleteCheckpointError(f"{src}: the tag {tag!r} names no directory")
    return step_dir


def _listdir(d: str) -> list[str]:
    try:
        return sorted(os.listdir(d))
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{d} does not exist") from None
    except NotADirectoryError:
        raise IncompleteCheckpointError(f"{d} is not a directory") from None


def _rank_files(step_dir: str) -> tuple[str, list[str]]:
    names = _listdir(step_dir)
    optim: dict[int, str] = {}
    for n in names:
        m = _OPTIM.match(n)
        if m:
            if int(m.group(2)) != 0:
                raise UnsupportedError(
                    f"{step_dir}: {n} belongs to model-parallel rank {int(m.group(2))}; only data-parallel "
                    "ZeRO checkpoints (mp_rank_00) are imported"
                )
            optim[int(m.group(1))] = os.path.join(step_dir, n)
        elif n.endswith("_optim_states.pt"):
            raise UnsupportedError(
                f"{step_dir}: {n} is not a ZeRO stage 1/2 optimizer file (bf16 optimizer?)"
            )
    models = [n for n in names if _MODEL.match(n)]
    if any(int(_MODEL.match(n).group(1)) != 0 for n in models):  # type: ignore[union-attr]
        raise UnsupportedError(
            f"{step_dir}: model-parallel checkpoint (mp_rank_01 ...); only mp_rank_00 is imported"
        )
    if not optim:
        raise IncompleteCheckpointError(f"{step_dir}: no zero_pp_rank_*_mp_rank_00_optim_states.pt files")
    if sorted(optim) != list(range(len(optim))):
        raise IncompleteCheckpointError(
            f"{step_dir}: optimizer files for ranks {sorted(optim)}, expected 0..{len(optim) - 1}"
        )
    model = "mp_rank_00_model_states.pt"
    if model not in names:
        if "zero_pp_rank_0_mp_rank_00_model_states.pt" in names:
            raise UnsupportedError(f"{step_dir}: a ZeRO stage 3 checkpoint; unickpt imports stage 1 and 2")
        raise IncompleteCheckpointError(f"{step_dir}: no {model}")
    return os.path.join(step_dir, model), [optim[r] for r in range(len(optim))]


def _get(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CheckpointFormatError(f"{where}: no {key!r} (not a DeepSpeed ZeRO checkpoint file)")
    return d[key]


def read_deepspeed(src: str, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Reassemble the ZeRO checkpoint ``src`` (its ``latest`` tag, or ``tag``) per FQN."""
    import torch

    from unickpt.io.names import normalize_name
    from unickpt.tools.deepspeed_read import load_deepspeed_file

    step_dir = find_step_dir(src, tag)
    model_path, optim_paths = _rank_files(step_dir)
    ms = load_deepspeed_file(model_path)
    module = _get(ms, "module", model_path)
    param_shapes = _get(ms, "param_shapes", model_path)
    if not isinstance(module, dict) or not isinstance(param_shapes, list):
        raise CheckpointFormatError(f"{model_path}: 'module' or 'param_shapes' has the wrong type")
    out = DeepSpeedCheckpoint()
    for k in ("global_steps", "global_samples", "skipped_steps"):
        if isinstance(ms.get(k), int):
            out.train_state[k] = ms[k]
    out.step = out.train_state.get("global_steps")
    if isinstance(ms.get("lr_scheduler"), dict):
        out.lr_scheduler = ms["lr_scheduler"]
    for name in ms.get("buffer_names") or []:
        if name in module:
            v = module[name]
            out.model[name] = v.float() if v.is_floating_point() else v
    for name, t in (ms.get("frozen_param_fragments") or {}).items():
        out.model[name] = t

    osds = [_get(load_deepspeed_file(p), _OSD, p) for p in optim_paths]
    stage = _get(osds[0], "zero_stage", optim_paths[0])
    if int(stage) not in (1, 2):
        raise UnsupportedError(f"{optim_paths[0]}: ZeRO stage {int(stage)}; unickpt imports stage 1 and 2")
    out.zero_stage = int(stage)
    counts = _get(osds[0], "partition_count", optim_paths[0])
    ws = max(counts) if isinstance(counts, list) else int(counts)
    if ws != len(osds):
        raise IncompleteCheckpointError(
            f"{step_dir}: the checkpoint was written by {ws} ranks but holds {len(osds)} optimizer files"
        )
    out.world_size = ws
    paddings = osds[0].get("param_alignment_paddings")
    base0 = _get(osds[0], "base_optimizer_state", optim_paths[0])
    for gi, shapes in enumerate(param_shapes):
        pieces = [
            _get(o, "single_partition_of_fp32_groups", p)[gi] for o, p in zip(osds, optim_paths, strict=True)
        ]
        flat = torch.cat([x.reshape(-1).float() for x in pieces])
        states = [
            _group_state(o["base_optimizer_state"], gi, p) for o, p in zip(osds, optim_paths, strict=True)
        ]
        moments: dict[str, Any] = {}
        scalars: dict[str, Any] = {}
        for key, v in states[0].items():
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                parts = []
                for r, (st, piece) in enumerate(zip(states, pieces, strict=True)):
                    t = st.get(key)
                    if not isinstance(t, torch.Tensor) or t.numel() < piece.numel():
                        raise CheckpointFormatError(
                            f"{optim_paths[r]}: optimizer state {key!r} of group {gi} is shorter than its "
                            f"{piece.numel()}-element fp32 partition"
                        )
                    parts.append(t.reshape(-1)[: piece.numel()])
                moments[key] = torch.cat(parts)
            else:
                scalars[key] = v
        pads = paddings[gi] if isinstance(paddings, list) else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise CheckpointFormatError(
                f"{optim_paths[0]}: {len(pads)} alignment paddings for {len(shapes)} parameters"
            )
        offset = 0
        fqns = []
        for (name, shape), pad in zip(shapes.items(), pads, strict=True):
            shape = [int(x) for x in shape]
            n = math.prod(shape)
            if offset + n > flat.numel():
                raise CheckpointFormatError(
                    f"{step_dir}: parameter {name!r} of group {gi} ends past the group's {flat.numel()} elements"
                )
            fqn = normalize_name(name)
            fqns.append(fqn)
            out.model[fqn] = flat.narrow(0, offset, n).view(shape).clone()
            st = {k: m.narrow(0, offset, n).view(shape).clone() for k, m in moments.items()}
            st.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})
            out.state[fqn] = st
            offset += n + int(pad)
        align = 2 * ws  # ZeRO-2 pads each group to a multiple of 2 x world size (zero_to_fp32's check)
        if math.ceil(offset / align) != math.ceil(flat.numel() / align):
            raise CheckpointFormatError(
                f"{step_dir}: group {gi} holds {flat.numel()} elements but its parameters take {offset}"
            )
        out.param_groups.append({**_hyper(base0, gi), "params": fqns})
    for a, b in (ms.get("shared_params") or {}).items():
        if b in out.model:
            out.model[a] = out.model[b]
    return out


def _group_state(base: Any, gi: int, where: str) -> dict[str, Any]:
    """The optimizer state of group ``gi``'s flat piece (torch's state_dict, or the elastic list)."""
    if isinstance(base, list):
        st = base[gi] if gi < len(base) else None
    else:
        groups = _get(base, "param_groups", where)
        ids = groups[gi].get("params") if gi < len(groups) and isinstance(groups[gi], dict) else None
        if not isinstance(ids, list) or len(ids) != 1:
            raise CheckpointFormatError(f"{where}: param group {gi} is not one flat partition")
        st = _get(base, "state", where).get(ids[0], {})
    if not isinstance(st, dict):
        raise CheckpointFormatError(f"{where}: no optimizer state for param group {gi}")
    return st


def _hyper(base: Any, gi: int) -> dict[str, Any]:
    if isinstance(base, list):  # elastic checkpoint: DeepSpeed stores no group hyperparameters
        logger.warning("DeepSpeed elastic optimizer state holds no hyperparameters for group %d", gi)
        return {}
    g = base["param_groups"][gi]
    return {k: v for k, v in g.items() if k not in ("params", "param_names")}


def write_deepspeed(
    ck: DeepSpeedCheckpoint, model_dir: str, optim_dir: str, *, shard_bytes: int, created_by: str
) -> None:
    """Write the model checkpoint into ``model_dir`` and the optimizer checkpoint into
    ``optim_dir`` (which exist; may be the same directory), plus ``lr_scheduler.json`` beside
    the optimizer when the engine saved a scheduler."""
    import torch

    from unickpt.format.index import LayoutInfo
    from unickpt.io.checkpoint_io import lr_scheduler_json, optimizer_tensor_name
    from unickpt.io.jsonstate import to_json_value
    from unickpt.tools._torch import st_of, tensor_bytes
    from unickpt.tools._write import SliceData, TensorData, write_checkpoint

    def td(t: Any, name: str, extras: dict[str, Any] | None = None) -> TensorData:
        shape = list(t.shape)
        return TensorData(
            st_of(t.dtype, name), shape, [SliceData([0] * len(shape), shape, tensor_bytes(t))], extras or {}
        )

    write = functools.partial(
        write_checkpoint,
        sliced=False,
        max_shard_bytes=shard_bytes,
        layout=LayoutInfo(plugin="deepspeed", world_size=ck.world_size),
        created_by=created_by,
    )
    write(model_dir, {n: td(t, n) for n, t in ck.model.items()})
    tensors: dict[str, TensorData] = {}
    param_state: dict[str, dict[str, Any]] = {}
    for fqn, st in ck.state.items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                name = optimizer_tensor_name(fqn, key)
                tensors[name] = td(v, name, {"param": fqn, "state": key})
            else:
                param_state.setdefault(fqn, {})[key] = to_json_value(v, f"state[{fqn!r}][{key!r}]")
    groups = [
        {k: to_json_value(v, f"param_groups[{i}][{k!r}]") for k, v in g.items()}
        for i, g in enumerate(ck.param_groups)
    ]
    write(
        optim_dir,
        tensors,
        kind="optimizer",
        block_extras={"param_groups": groups, "param_state": param_state},
    )
    if ck.lr_scheduler is not None:
        from unickpt.format.commit import atomic_write_bytes

        atomic_write_bytes(os.path.join(optim_dir, "lr_scheduler.json"), lr_scheduler_json(ck.lr_scheduler))


def convert_deepspeed(
    src: str, out: str, *, target: str, step: int | None, shard_bytes: int, created_by: str
) -> str:
    """``convert --from deepspeed``: ``out`` holds the model and optimizer checkpoints (and
    ``lr_scheduler.json``), or with ``target="run"`` is a ``CheckpointManager`` directory whose
    ``step-<N>`` (``step``, else the engine's ``global_steps``) holds them, with the engine's
    step counters as the extra state ``train_state``."""
    from unickpt.tools._common import staged_output

    ck = read_deepspeed(src)
    if target != "run":
        with staged_output(out) as tmp:
            write_deepspeed(ck, tmp, tmp, shard_bytes=shard_bytes, created_by=created_by)
        return out
    from unickpt.tools.run_layout import write_step

    n = step if step is not None else ck.step
    if n is None:
        raise CheckpointFormatError(f"{src}: holds no global_steps; give the step number (--step N)")

    def fill(stage: str) -> None:
        model_dir, optim_dir = os.path.join(stage, "model"), os.path.join(stage, "optimizer")
        os.makedirs(model_dir)
        os.makedirs(optim_dir)
        write_deepspeed(ck, model_dir, optim_dir, shard_bytes=shard_bytes, created_by=created_by)
        sched = os.path.join(optim_dir, "lr_scheduler.json")
        if os.path.exists(sched):
            os.rename(sched, os.path.join(stage, "lr_scheduler.json"))

    train = {"train_state": dict(ck.train_state)} if ck.train_state else {}
    with staged_output(out) as tmp:
        write_step(tmp, int(n), fill, extra=train, world_size=ck.world_size, plugin="deepspeed")
    return out
