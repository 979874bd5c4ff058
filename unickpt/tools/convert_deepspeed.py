"""Import a DeepSpeed ZeRO (stage 1, 2 or 3) checkpoint: fp32 master weights, Adam moments, groups.

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

ZeRO-3 writes one ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` per rank (the module holds
empty placeholders there) and, per rank, ``fp32_flat_groups``: its part of every parameter,
each parameter split into ``world size`` equal parts (``ceil(numel / ws)``, the last one
padded), one after the other in ``param_shapes`` order across the sub-groups. A parameter is
its parts gathered from every rank in rank order, cut to its size; the moments likewise.

The model checkpoint holds the **fp32 master weights** (what ``zero_to_fp32`` gives: the
exact values training continues from; the 16-bit copies of a bf16/fp16 run in the model
states file are their rounding), buffers from the module state (floating ones as fp32, as
``zero_to_fp32`` does), frozen parameters, and tied (shared) parameters under every name.
Files are read only through :mod:`unickpt.tools.deepspeed_read` (no code from them runs).
A bf16 run's ``bf16_zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` (DeepSpeed's ``BF16_Optimizer``,
used for bf16 with ZeRO stage 1) holds the stage 1 layout without a ``zero_stage`` entry and is
read as stage 1. A universal checkpoint (``ds_to_universal``'s ``<tag>_universal/``: whole
tensors per parameter under ``zero/<name>/``) is read by :func:`_read_universal`.
Tensor/pipeline parallel checkpoints (``mp_rank_01`` ...) are refused with
:class:`UnsupportedError`.
"""

from __future__ import annotations

import functools
import math
import posixpath
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from unickpt._logging import get_logger
from unickpt.errors import (
    CheckpointFormatError,
    IncompleteCheckpointError,
    UnickptError,
    UnsafePathError,
    UnsupportedError,
)
from unickpt.spec.naming import shown
from unickpt.store.storage import (
    confined_location,
    is_dir_location,
    is_file_location,
    join_location,
    list_location,
    open_file_location,
)

if TYPE_CHECKING:
    from unickpt.store.publish import Sink

__all__ = ["DeepSpeedCheckpoint", "read_deepspeed", "write_deepspeed"]

logger = get_logger(__name__)

_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.+-]*$")
# ``bf16_zero_pp_rank_...``: DeepSpeed's BF16_Optimizer (bf16 with ZeRO stage 1 or none), whose
# files hold the ZeRO-1 layout (flat fp32 partitions per group) without a ``zero_stage`` entry.
_OPTIM = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
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
    """The ``<tag>/`` directory of the checkpoint ``src`` (``tag``, else the ``latest`` file's, else
    the ``latest_universal`` file's: a directory holding only a universal checkpoint), or ``src``
    itself when it already holds the rank files."""
    tag_file = join_location(src, "latest")
    if tag is None:
        if any(_OPTIM.match(n) for n in _listdir(src)) or _is_universal(src):
            return src
        latest = confined_location(src, "latest", src, "the tag file")
        if not is_file_location(latest):
            latest = confined_location(src, "latest_universal", src, "the tag file")
            tag_file = join_location(src, "latest_universal")
        if not is_file_location(latest):
            raise IncompleteCheckpointError(
                f"{src} is not a DeepSpeed checkpoint: no 'latest' or 'latest_universal' file and no "
                "*_optim_states.pt files"
            )
        with open_file_location(latest) as f:
            tag = f.read(4096).decode("utf-8", "replace").strip()
    if not _TAG.match(tag):
        raise UnsafePathError(f"{tag_file}: checkpoint tag {shown(tag[:300])} is not a plain directory name")
    step_dir = confined_location(src, tag, tag_file, "checkpoint tag")
    if not is_dir_location(step_dir):
        raise IncompleteCheckpointError(f"{src}: the tag {shown(tag)} names no directory")
    return step_dir


def _listdir(d: str) -> list[str]:
    return list_location(d)


def _rank_files(step_dir: str) -> tuple[list[str], list[str]]:
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
            optim[int(m.group(1))] = confined_location(step_dir, n, step_dir, "optimizer file")
        elif n.endswith("_optim_states.pt"):
            raise UnsupportedError(f"{step_dir}: {n} is not a ZeRO or BF16_Optimizer optimizer file")
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
    ranks = [optim[r] for r in range(len(optim))]
    if "mp_rank_00_model_states.pt" in names:  # stage 1/2: one model states file
        return [
            confined_location(step_dir, "mp_rank_00_model_states.pt", step_dir, "model states file")
        ], ranks
    z3 = [
        confined_location(
            step_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", step_dir, "model states file"
        )
        for r in range(len(optim))
    ]
    listed = set(names)
    if not all(posixpath.basename(f) in listed for f in z3):
        raise IncompleteCheckpointError(
            f"{step_dir}: no mp_rank_00_model_states.pt, nor zero_pp_rank_<r>_mp_rank_00_model_states.pt "
            f"for each of the {len(optim)} ranks"
        )
    return z3, ranks


def _get(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise CheckpointFormatError(f"{where}: no {shown(key)} (not a DeepSpeed ZeRO checkpoint file)")
    return d[key]


def read_deepspeed(src: str, tag: str | None = None) -> DeepSpeedCheckpoint:
    """Reassemble the ZeRO checkpoint ``src`` (its ``latest`` tag, or ``tag``) per FQN.

    Everything is read into memory (about twice the size of the checkpoint files at the peak).
    Files whose contents do not have DeepSpeed's structure raise ``CheckpointFormatError``."""
    try:
        return _read(src, tag)
    except UnickptError:
        raise
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError, ArithmeticError) as e:
        raise CheckpointFormatError(
            f"{src}: not a readable DeepSpeed ZeRO checkpoint ({type(e).__name__}: {e})"
        ) from None


def _read(src: str, tag: str | None) -> DeepSpeedCheckpoint:
    from unickpt.io.tensors import normalize_name
    from unickpt.tools.deepspeed_read import load_deepspeed_file

    step_dir = find_step_dir(src, tag)
    if _is_universal(step_dir):
        return _read_universal(step_dir)
    model_paths, optim_paths = _rank_files(step_dir)
    models = [load_deepspeed_file(p) for p in model_paths]
    ms, model_path = models[0], model_paths[0]
    module = _get(ms, "module", model_path)
    param_shapes = _get(ms, "param_shapes", model_path)
    if not isinstance(module, dict) or not isinstance(param_shapes, list):
        raise CheckpointFormatError(f"{model_path}: 'module' or 'param_shapes' has the wrong type")
    out = DeepSpeedCheckpoint()
    _take_model_states(out, ms, module)

    osds = [_get(load_deepspeed_file(p), _OSD, p) for p in optim_paths]
    bf16 = posixpath.basename(optim_paths[0]).startswith("bf16_")
    if any(posixpath.basename(p).startswith("bf16_") != bf16 for p in optim_paths):
        raise CheckpointFormatError(
            f"{step_dir}: mixes bf16_zero_pp_rank_* and zero_pp_rank_* optimizer files"
        )
    # BF16_Optimizer partitions like ZeRO stage 1 and records no stage.
    stage = 1 if bf16 and "zero_stage" not in osds[0] else int(_get(osds[0], "zero_stage", optim_paths[0]))
    if stage not in (1, 2, 3) or (stage == 3) != (len(models) > 1 or "zero_pp" in model_path):
        raise CheckpointFormatError(
            f"{optim_paths[0]}: ZeRO stage {stage} does not match the model states files"
        )
    out.zero_stage = stage
    counts = _get(osds[0], "partition_count", optim_paths[0])
    ws = max(counts) if isinstance(counts, list) else int(counts)
    if ws != len(osds):
        raise IncompleteCheckpointError(
            f"{step_dir}: the checkpoint was written by {ws} ranks but holds {len(osds)} optimizer files"
        )
    out.world_size = ws
    frozen = ms.get("frozen_param_shapes") or {}
    for name, shape in frozen.items():
        frags = [m.get("frozen_param_fragments", {}).get(name) for m in models]
        if any(f is None for f in frags):
            raise CheckpointFormatError(
                f"{step_dir}: frozen parameter {shown(name)} has no fragment on every rank"
            )
        dims = _shape(shape, model_path, f"frozen parameter {shown(name)}")
        out.model[name] = _cat(frags)[: math.prod(dims)].view(dims).clone()
    merged = (
        _zero3(osds, optim_paths, param_shapes, ws)
        if stage == 3
        else _zero12(osds, optim_paths, param_shapes, ws)
    )
    for params, hyper in merged:
        fqns = []
        for name, weight, state in params:
            fqn = normalize_name(name)
            fqns.append(fqn)
            out.model[fqn] = weight
            out.state[fqn] = state
        out.param_groups.append({**hyper, "params": fqns})
    for a, b in (ms.get("shared_params") or {}).items():
        if b in out.model:
            out.model[a] = out.model[b]
    return out


def _take_model_states(out: DeepSpeedCheckpoint, ms: dict[str, Any], module: dict[str, Any]) -> None:
    """What a model states file gives besides the parameters: the engine's step counters, its
    LR scheduler's state and the module's buffers (floating ones as fp32, as ``zero_to_fp32``)."""
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


def _is_universal(step_dir: str) -> bool:
    """A universal checkpoint step (``ds_to_universal``'s ``<tag>_universal/``)."""
    return is_file_location(join_location(step_dir, "zero/optimizer_state.pt"))


def _read_universal(step_dir: str) -> DeepSpeedCheckpoint:
    """A DeepSpeed universal checkpoint (UCP: what ``deepspeed.checkpoint.ds_to_universal``
    writes): ``mp_rank_00_model_states.pt`` (module buffers, ``param_shapes`` per group, step
    counters), ``zero/optimizer_state.pt`` (the param groups' hyperparameters) and, per parameter,
    ``zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt`` (``{"param": the whole tensor, "cat_dim": ...}``)
    and ``step.pt``: whole tensors, whatever the world size that trained."""
    import torch

    from unickpt.io.tensors import normalize_name
    from unickpt.tools.deepspeed_read import load_deepspeed_file, load_deepspeed_tensor

    model_path = join_location(step_dir, "mp_rank_00_model_states.pt")
    ms = load_deepspeed_file(model_path)
    module = _get(ms, "module", model_path)
    param_shapes = _get(ms, "param_shapes", model_path)
    if not isinstance(module, dict) or not isinstance(param_shapes, list):
        raise CheckpointFormatError(f"{model_path}: 'module' or 'param_shapes' has the wrong type")
    optim_path = join_location(step_dir, "zero/optimizer_state.pt")
    osd = load_deepspeed_file(optim_path)
    groups = _get(osd, "param_groups", optim_path)
    if not isinstance(groups, list) or len(groups) != len(param_shapes):
        raise CheckpointFormatError(
            f"{optim_path}: {len(groups) if isinstance(groups, list) else 'no'} param groups for the "
            f"{len(param_shapes)} groups of {model_path}"
        )
    out = DeepSpeedCheckpoint()
    out.zero_stage = int(osd.get("zero_stage", 1))
    out.world_size = 1  # a universal checkpoint holds whole tensors: it reads like one rank's
    _take_model_states(out, ms, module)
    for gi, shapes in enumerate(param_shapes):
        if not isinstance(shapes, dict):
            raise CheckpointFormatError(
                f"{model_path}: param_shapes[{gi}] is not a mapping of names to shapes"
            )
        fqns = []
        for name, shape in shapes.items():
            if not isinstance(name, str) or not _TAG.match(name) or ".." in name:
                raise UnsafePathError(
                    f"{model_path}: parameter name {shown(name)} is not a plain directory name"
                )
            shape = [int(x) for x in shape]
            where = join_location(step_dir, f"zero/{name}")
            tensors: dict[str, Any] = {}
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                f = join_location(where, f"{key}.pt")
                got = load_deepspeed_file(f).get("param")
                if not isinstance(got, torch.Tensor) or list(got.shape) != shape:
                    raise CheckpointFormatError(
                        f"{f}: expected the parameter's whole tensor of shape {shape} under 'param', found "
                        f"{list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}"
                    )
                tensors[key] = got
            state: dict[str, Any] = {"exp_avg": tensors["exp_avg"], "exp_avg_sq": tensors["exp_avg_sq"]}
            step_file = join_location(where, "step.pt")
            if is_file_location(step_file):
                state["step"] = load_deepspeed_tensor(step_file)
            fqn = normalize_name(name)
            fqns.append(fqn)
            out.model[fqn] = tensors["fp32"].float()
            out.state[fqn] = state
        out.param_groups.append({**_hyper({"param_groups": groups}, gi), "params": fqns})
    for a, b in (ms.get("shared_params") or {}).items():
        if b in out.model:
            out.model[a] = out.model[b]
    return out


_Group = tuple[list[tuple[str, Any, dict[str, Any]]], dict[str, Any]]  # [(name, weight, state)], hyper


#: Most dims of a parameter shape, and the largest extent of one, accepted from a DeepSpeed file.
_MAX_NDIM = 64
_MAX_EXTENT = (1 << 62) - 1


def _shape(shape: Any, where: str, what: str) -> list[int]:
    """A shape recorded in a DeepSpeed file (``param_shapes``, ``frozen_param_shapes``) as a list
    of ints, checked before anything is sized from it."""
    dims = list(shape) if isinstance(shape, (list, tuple)) or type(shape).__name__ == "Size" else None
    if (
        dims is None
        or len(dims) > _MAX_NDIM
        or not all(type(x) is int and 0 <= x <= _MAX_EXTENT for x in dims)
    ):
        raise CheckpointFormatError(
            f"{where}: the shape of {what} is {shape!r:.200}; expected at most {_MAX_NDIM} integers "
            f"in 0..2**62-1"
        )
    return dims


def _cat(parts: list[Any]) -> Any:
    import torch

    return torch.cat([p.reshape(-1) for p in parts])


def _split_state(
    states: list[dict[str, Any]], lengths: list[int], where: list[str], what: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Per state key with a flat tensor (the moments), the ranks' tensors cut to ``lengths`` (a
    list in rank order); and the other (scalar) values, rank 0's."""
    import torch

    flat: dict[str, Any] = {}
    scalars: dict[str, Any] = {}
    for key, v in states[0].items():
        if not (isinstance(v, torch.Tensor) and v.dim() > 0):
            scalars[key] = v
            continue
        parts = []
        for st, n, path in zip(states, lengths, where, strict=True):
            t = st.get(key)
            if not isinstance(t, torch.Tensor) or t.numel() < n:
                raise CheckpointFormatError(
                    f"{path}: optimizer state {shown(key)} of {what} is shorter than its {n}-element fp32 partition"
                )
            parts.append(t.reshape(-1)[:n])
        flat[key] = parts
    return flat, scalars


def _param_state(moments: dict[str, Any], scalars: dict[str, Any], cut: Any) -> dict[str, Any]:
    import torch

    st = {k: cut(v) for k, v in moments.items()}
    st.update({k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in scalars.items()})
    return st


def _zero12(osds: list[Any], paths: list[str], param_shapes: list[Any], ws: int) -> list[_Group]:
    """Stage 1/2: each group's flat vector is the ranks' pieces end to end; parameters lie in it
    one after the other (plus their alignment padding)."""
    paddings = osds[0].get("param_alignment_paddings")
    base0 = _get(osds[0], "base_optimizer_state", paths[0])
    out: list[_Group] = []
    for gi, shapes in enumerate(param_shapes):
        pieces = [_get(o, "single_partition_of_fp32_groups", p)[gi] for o, p in zip(osds, paths, strict=True)]
        flat = _cat(pieces).float()
        states = [_group_state(o["base_optimizer_state"], gi, p) for o, p in zip(osds, paths, strict=True)]
        parts, scalars = _split_state(states, [x.numel() for x in pieces], paths, f"group {gi}")
        moments = {k: _cat(v) for k, v in parts.items()}
        pads = paddings[gi] if isinstance(paddings, list) else [0] * len(shapes)
        if len(pads) != len(shapes):
            raise CheckpointFormatError(
                f"{paths[0]}: {len(pads)} alignment paddings for {len(shapes)} parameters"
            )
        offset = 0
        params = []
        for (name, shape), pad in zip(shapes.items(), pads, strict=True):
            shape = _shape(shape, paths[0], f"parameter {shown(name)} of group {gi}")
            n = math.prod(shape)
            if offset + n > flat.numel():
                raise CheckpointFormatError(
                    f"{paths[0]}: parameter {shown(name)} of group {gi} ends past the group's {flat.numel()} elements"
                )

            def cut(v: Any, o: int = offset, n: int = n, shape: list[int] = shape) -> Any:
                return v.narrow(0, o, n).view(shape).clone()

            params.append((name, cut(flat), _param_state(moments, scalars, cut)))
            if type(pad) is not int or not 0 <= pad <= flat.numel():
                raise CheckpointFormatError(
                    f"{paths[0]}: alignment padding {shown(pad)} of parameter {shown(name)} of group {gi} is not an "
                    f"integer in 0..{flat.numel()}"
                )
            offset += n + pad
        align = 2 * ws  # ZeRO-2 pads each group to a multiple of 2 x world size (zero_to_fp32's check)
        if -(-offset // align) != -(-flat.numel() // align):
            raise CheckpointFormatError(
                f"{paths[0]}: group {gi} holds {flat.numel()} elements but its parameters take {offset}"
            )
        out.append((params, _hyper(base0, gi)))
    return out


def _zero3(osds: list[Any], paths: list[str], param_shapes: list[Any], ws: int) -> list[_Group]:
    """Stage 3: every parameter is split into ``ws`` equal parts (the last padded); each rank's
    sub-group vectors, end to end, hold its part of every parameter in ``param_shapes`` order."""
    subs = [_get(o, "fp32_flat_groups", p) for o, p in zip(osds, paths, strict=True)]
    base0 = _get(osds[0], "optimizer_state_dict", paths[0])
    n_sub = len(subs[0])
    if any(len(x) != n_sub for x in subs):
        raise CheckpointFormatError(f"{paths[0]}: ranks hold different numbers of sub-groups")
    rank_flat = [_cat(x).float() for x in subs]
    states = [
        [_group_state(o["optimizer_state_dict"], i, p) for i in range(n_sub)]
        for o, p in zip(osds, paths, strict=True)
    ]
    # per sub-group: each rank's moments cut to its fp32 piece; then per rank, the sub-groups end to end
    cuts = [
        _split_state([st[i] for st in states], [x[i].numel() for x in subs], paths, f"sub-group {i}")
        for i in range(n_sub)
    ]
    scalars = cuts[0][1] if cuts else {}
    rank_moments = (
        [{k: _cat([c[0][k][r] for c in cuts]) for k in cuts[0][0]} for r in range(ws)] if cuts else []
    )
    keys = list(cuts[0][0]) if cuts else []
    bounds = [0]
    for x in subs[0]:
        bounds.append(bounds[-1] + x.numel())
    offset = 0
    out: list[_Group] = []
    for shapes in param_shapes:
        first = offset
        params = []
        for name, shape in shapes.items():
            shape = _shape(shape, paths[0], f"parameter {shown(name)}")
            n = math.prod(shape)
            part = -(-n // ws)
            if offset + part > rank_flat[0].numel():
                raise CheckpointFormatError(
                    f"{paths[0]}: parameter {shown(name)} ends past the rank's fp32 partition"
                )

            def cut(
                vs: list[Any], o: int = offset, part: int = part, n: int = n, shape: list[int] = shape
            ) -> Any:
                return _cat([v.narrow(0, o, part) for v in vs])[:n].view(shape).clone()

            weight = cut(rank_flat)
            st = _param_state({k: [m[k] for m in rank_moments] for k in keys}, scalars, cut)
            params.append((name, weight, st))
            offset += part
        sub = max(i for i in range(n_sub) if bounds[i] <= first) if n_sub else 0
        out.append((params, _hyper(base0, sub)))
    if offset * ws != sum(x.numel() for x in rank_flat):
        raise CheckpointFormatError(
            f"{paths[0]}: the ranks hold {sum(x.numel() for x in rank_flat)} elements but the parameters take {offset * ws}"
        )
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
    ck: DeepSpeedCheckpoint,
    model_out: Sink,
    optim_out: Sink,
    side_out: Sink,
    *,
    shard_bytes: int,
    created_by: str,
    progress: Callable[[int], object] | None = None,
) -> None:
    """Write the model checkpoint into ``model_out`` and the optimizer checkpoint into
    ``optim_out``, plus ``lr_scheduler.json`` into ``side_out`` when the engine saved a
    scheduler: parts of a tool's output (``store.publish.output_sink``; one sink for all three,
    or a run step's ``model/``, ``optimizer/`` and the step itself). ``progress(n)`` is told the
    bytes of each tensor written (:func:`checkpoint_bytes` in all)."""
    import torch

    from unickpt.io.jsonstate import to_json_value
    from unickpt.io.side_files import lr_scheduler_json
    from unickpt.spec.index import LayoutInfo
    from unickpt.spec.naming import optimizer_tensor_name
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
        progress=progress,
    )
    write(model_out, {n: td(t, n) for n, t in ck.model.items()})
    tensors: dict[str, TensorData] = {}
    param_state: dict[str, dict[str, Any]] = {}
    for fqn, st in ck.state.items():
        for key, v in st.items():
            if isinstance(v, torch.Tensor):
                name = optimizer_tensor_name(fqn, key)
                tensors[name] = td(v, name, {"param": fqn, "state": key})
            else:
                param_state.setdefault(fqn, {})[key] = to_json_value(v, f"state[{shown(fqn)}][{shown(key)}]")
    groups = [
        {k: to_json_value(v, f"param_groups[{i}][{shown(k)}]") for k, v in g.items()}
        for i, g in enumerate(ck.param_groups)
    ]
    write(
        optim_out,
        tensors,
        kind="optimizer",
        block_extras={"param_groups": groups, "param_state": param_state},
    )
    if ck.lr_scheduler is not None:
        side_out.put("lr_scheduler.json", lr_scheduler_json(ck.lr_scheduler))


def checkpoint_bytes(ck: DeepSpeedCheckpoint) -> int:
    """The bytes of the tensors :func:`write_deepspeed` writes (model and optimizer state)."""
    import torch

    tensors = list(ck.model.values()) + [v for st in ck.state.values() for v in st.values()]
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def convert_deepspeed(
    src: str,
    out: str,
    *,
    target: str,
    step: int | None,
    shard_bytes: int,
    created_by: str,
    progress: bool = False,
) -> str:
    """``convert --from deepspeed``: ``out`` holds the model and optimizer checkpoints (and
    ``lr_scheduler.json``), or with ``target="run"`` is a ``CheckpointManager`` directory whose
    ``step-<N>`` (``step``, else the engine's ``global_steps``) holds them, with the engine's
    step counters as the extra state ``train_state``; written through the tool's one output
    (``store.publish.output_sink``: a local directory or an object-store prefix).
    ``progress``: a byte bar on stderr."""
    from unickpt.spec.naming import HF_SIDE_FILES
    from unickpt.store.publish import output_sink
    from unickpt.tools._common import read_side_files
    from unickpt.tools._progress import progress_bar

    ck = read_deepspeed(src)
    bar = progress_bar(checkpoint_bytes(ck), "convert --from deepspeed", progress)
    if target != "run":
        with output_sink(out) as sink, bar as update:
            write_deepspeed(
                ck, sink, sink, sink, shard_bytes=shard_bytes, created_by=created_by, progress=update
            )
            # A Hugging Face Trainer's checkpoint-<N>/ holds the model's config and tokenizer
            # beside DeepSpeed's latest and global_step<N>/.
            for fname, data in read_side_files(src, HF_SIDE_FILES):
                sink.put(fname, data)
        return out
    from unickpt.ckpt.run_layout import write_step

    n = step if step is not None else ck.step
    if n is None:
        raise CheckpointFormatError(f"{src}: holds no global_steps; give the step number (--step N)")

    def fill(stage: Sink) -> None:
        write_deepspeed(
            ck,
            stage.within("model"),
            stage.within("optimizer"),
            stage,
            shard_bytes=shard_bytes,
            created_by=created_by,
            progress=update,
        )

    train = {"train_state": dict(ck.train_state)} if ck.train_state else {}
    with output_sink(out) as run, bar as update:
        write_step(run, int(n), fill, extra=train, world_size=ck.world_size, plugin="deepspeed")
    return out
