"""An optimizer's state in a checkpoint: keyed by parameter FQN, saved as a payload, checked and
put back on load.

Optimizer state is saved keyed by parameter FQN (``state.<fqn>.<key>`` tensors, scalars and
``param_groups`` as JSON in the block), so it loads under any layout. ``CheckpointIO``'s
``plan_optimizer`` lists the state through its hooks and turns it into a payload here
(:func:`optimizer_payload`); its ``load_optimizer`` fills a template of
the same form (:func:`state_targets`), with the state initialised, param groups merged and
copied by the helpers below.

**Parameter names that torch keeps.** ``torch.optim.Optimizer(model.named_parameters())``
stores each group's names under ``param_groups[i]["param_names"]``. unickpt keys optimizer
state by parameter FQN, which normally needs the model (``OptimizerWrapper`` or
``Booster.boost``); with these names a bare optimizer is enough. When the model is known too,
the names must be its FQNs.

**The saved ``param_groups`` validated against the live optimizer, before any change.** The
saved groups are JSON written by anyone; their values end up as the optimizer's
hyperparameters. A value of the wrong type (``lr: "abc"``), a non-finite number where the live
one is finite (``lr: NaN``), a tuple of the wrong length (``betas: [1]``), a ``params`` that is
not a list of names, or groups that do not match the optimizer's would be accepted and break
training later; a key the optimizer's groups lack must hold a plain finite value (an LR
scheduler's ``initial_lr`` is kept, as torch keeps it). ``validate_param_groups`` refuses each
of them with a ``StateMismatchError`` naming the group, the key, what was expected and what was
found. A key the checkpoint lacks keeps the live value (logged): torch adds group options over
versions, and an older checkpoint must still load.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch

from unickpt import _dist
from unickpt._logging import get_logger
from unickpt.ckpt.reader import CheckpointReader
from unickpt.errors import DistributedError, StateMismatchError
from unickpt.io.jsonstate import from_json_value, to_json_value
from unickpt.io.tensors import LocalSlice, SavePayload, normalize_name
from unickpt.spec.index import UnickptBlock
from unickpt.spec.naming import optimizer_tensor_name

__all__ = [
    "model_from_param_names",
    "check_param_names",
    "validate_param_groups",
    "apply_groups",
    "init_state",
    "merge_groups",
    "param_of",
    "same_optimizer_class",
    "state_targets",
    "merge_optimizer_extras",
    "optimizer_payload",
]


def _named(optim: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]] | None:
    """``(name, parameter)`` for every parameter, or ``None`` if any group lacks ``param_names``."""
    out: list[tuple[str, torch.Tensor]] = []
    for i, g in enumerate(optim.param_groups):
        names = g.get("param_names")
        if names is None:
            return None
        params = g["params"]
        if len(names) != len(params):
            raise StateMismatchError(
                f"param_groups[{i}] of the optimizer lists {len(names)} param_names for {len(params)} "
                "parameters (its groups were changed after it was built); pass the optimizer "
                "Booster.boost returned, or unickpt.OptimizerWrapper(optimizer, model)"
            )
        out.extend((normalize_name(str(n)), p) for n, p in zip(names, params, strict=True))
    return out


def model_from_param_names(optim: torch.optim.Optimizer) -> torch.nn.Module | None:
    """A module whose ``named_parameters()`` are the optimizer's parameters under their saved names.

    ``None`` when the optimizer was built from bare parameters. The module holds the very
    parameter objects (no copy), nested as the dotted names say, so that torch's optimizer
    state-dict helpers find each one under its FQN.
    """
    named = _named(optim)
    if named is None:
        return None
    root = torch.nn.Module()
    seen: dict[str, int] = {}
    for name, p in named:
        if name in seen and seen[name] != id(p):
            raise StateMismatchError(
                f"the optimizer's param_names name two different tensors {name!r}; "
                "build it from one model's named_parameters()"
            )
        seen[name] = id(p)
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = torch.nn.Module()
                mod.add_module(part, child)
            mod = child
        if not isinstance(p, torch.nn.Parameter):
            raise StateMismatchError(f"optimizer entry {name!r} is a {type(p).__name__}, not a Parameter")
        mod.register_parameter(leaf, p)
    return root


def check_param_names(optim: torch.optim.Optimizer, state_parameters: list[tuple[str, Any]]) -> None:
    """Every ``param_names`` entry must be the model's FQN of the same parameter.

    ``state_parameters``: the IO's ``(fqn, tensor)`` pairs. Parameters the model does not list
    (a plugin's flat shards) are not checked; a name that differs raises ``StateMismatchError``.
    """
    named = _named(optim)
    if named is None:
        return
    fqn_of = {id(t): fqn for fqn, t in state_parameters}
    wrong = [(n, fqn_of[id(p)]) for n, p in named if id(p) in fqn_of and fqn_of[id(p)] != n]
    if wrong:
        shown = ", ".join(f"{n!r} is {f!r} in the model" for n, f in wrong[:3])
        raise StateMismatchError(
            f"the optimizer's param_names do not match the model's parameter names for {len(wrong)} "
            f"parameter(s): {shown}. Build the optimizer from the same model's named_parameters() "
            "(not a sub-module's), or from model.parameters()"
        )


logger = get_logger(__name__)


def _fail(where: str, gi: int | str, key: str, expected: str, found: Any) -> StateMismatchError:
    text = repr(found)
    if len(text) > 80:
        text = text[:77] + "..."
    return StateMismatchError(
        f"{where}: param_groups[{gi}][{key!r}]: expected {expected}, found {text}",
        mismatched=[f"param_groups[{gi}].{key}"],
    )


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _plain(v: Any, depth: int = 0) -> bool:
    if v is None or isinstance(v, (bool, str)):
        return True
    if _is_number(v):
        return math.isfinite(v)
    if isinstance(v, list) and depth == 0:
        return all(_plain(x, 1) for x in v)
    return False


def _check_value(live: Any, found: Any, path: str) -> str | None:
    """None if ``found`` can stand for ``live``; otherwise what was expected."""
    if isinstance(live, bool):
        return None if isinstance(found, bool) else "a bool"
    if isinstance(live, int):
        return None if isinstance(found, int) and not isinstance(found, bool) else "an int"
    if isinstance(live, float):
        if not _is_number(found):
            return "a number"
        if math.isfinite(live) and not math.isfinite(found):
            return "a finite number"
        return None
    if isinstance(live, str):
        return None if isinstance(found, str) else "a string"
    if live is None:
        # An unset option (torch's foreach/fused/capturable defaults): a scalar or nothing.
        return None if found is None or isinstance(found, (bool, int, float, str)) else "null or a scalar"
    if isinstance(live, (tuple, list)):
        if not isinstance(found, list) or len(found) != len(live):
            return f"a list of {len(live)} value(s) like {list(live)!r}"
        for i, (a, b) in enumerate(zip(live, found, strict=True)):
            why = _check_value(a, b, f"{path}[{i}]")
            if why is not None:
                return f"{why} at index {i}"
        return None
    if isinstance(live, torch.Tensor):
        if _is_number(found) and live.numel() == 1:
            found = torch.tensor(found)
        if not isinstance(found, torch.Tensor) or tuple(found.shape) != tuple(live.shape):
            return f"a tensor of shape {list(live.shape)}"
        if live.is_floating_point():
            if not found.is_floating_point() and found.dtype != torch.bool:
                found = found.double()
            if bool(torch.isfinite(live).all()) and not bool(torch.isfinite(found.double()).all()):
                return "finite values"
        return None
    if isinstance(live, dict):
        return None if isinstance(found, dict) else "an object"
    return None


def validate_param_groups(
    saved: Any,
    live: Sequence[dict[str, Any]],
    *,
    prefix: str,
    known: Collection[str] | None,
    where: str,
) -> None:
    """Refuse ``saved`` (the checkpoint's JSON groups) unless it fits ``live``.

    ``live`` are the optimizer's groups with ``params`` as FQN lists (this rank's parameters);
    ``known`` every FQN any rank's optimizer holds (``None``: skip that check). Saved names
    carry ``prefix``. Raises ``StateMismatchError``; returns nothing and changes nothing.
    """
    if not isinstance(saved, list):
        raise _fail(where, "*", "param_groups", "a list of groups", saved)
    owner: dict[str, int] = {}
    for gi, g in enumerate(saved):
        if not isinstance(g, dict):
            raise _fail(where, gi, "*", "an object", g)
        params = g.get("params")
        if not isinstance(params, list) or not all(isinstance(f, str) for f in params):
            raise _fail(where, gi, "params", "a list of parameter names", params)
        for f in params:
            if f in owner:
                raise _fail(
                    where, gi, "params", f"each parameter in one group ({f!r} is also in group {owner[f]})", f
                )
            owner[f] = gi
            if known is not None and f not in known:
                raise _fail(where, gi, "params", "names of the optimizer's parameters", f)
    for li, lg in enumerate(live):
        names = [prefix + f for f in lg["params"]]
        if not names:
            continue
        homes = {owner.get(f) for f in names}
        if None in homes:
            lost = [f for f in names if f not in owner]
            raise StateMismatchError(
                f"{where}: the optimizer's param group {li} holds {len(lost)} parameter(s) that no saved "
                f"group names, e.g. {lost[:3]}; the checkpoint's param_groups do not match this optimizer",
                missing=lost,
            )
        if len(homes) > 1:
            raise StateMismatchError(
                f"{where}: the optimizer's param group {li} is split over saved groups "
                f"{sorted(h for h in homes if h is not None)}; the checkpoint's param_groups do not match "
                "this optimizer",
                mismatched=[f"param_groups[{li}]"],
            )
        home = homes.pop()
        if home is None:  # never: a group of saved params has a home
            raise RuntimeError(f"{where}: param group {li} has no saved group")
        gi = home
        sg = saved[gi]
        want = set(lg) - {"params"}
        have = set(sg) - {"params"}
        # A key the optimizer's groups lack is kept, as torch keeps it (an LR scheduler's
        # ``initial_lr``, options of another torch version), when it is a plain finite value: the
        # optimizer ignores it, but a scheduler created later may read it.
        for key in sorted(have - want):
            if not _plain(sg[key]):
                raise _fail(
                    where,
                    gi,
                    key,
                    "a plain value (finite number, bool, string, null or a list of them) for a key the "
                    "optimizer's groups do not have",
                    sg[key],
                )
        # A key the checkpoint lacks (torch adds group options over versions, e.g. AdamW's
        # decoupled_weight_decay) keeps the live value: refusing would strand every older checkpoint.
        for key in sorted(want - have):
            logger.warning(
                "%s: param_groups[%s] has no %r; the optimizer keeps its own value %r",
                where,
                gi,
                key,
                lg[key],
            )
        for key in sorted(want & have):
            try:
                found = from_json_value(sg[key])
            except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as e:
                raise _fail(where, gi, key, "a valid JSON state value", f"{type(e).__name__}: {e}") from None
            why = _check_value(lg[key], found, key)
            if why is not None:
                raise _fail(where, gi, key, why, sg[key])


def state_targets(
    template: dict[str, Any],
    block: UnickptBlock,
    prefix: str,
    saved_params: set[str],
    fqns: list[str],
    where: str,
) -> dict[str, torch.Tensor]:
    """Keep the template's state of the parameters the checkpoint holds state for; return its tensors by name.

    Scalar (non-tensor) state is filled from the checkpoint here. ``fqns`` are the optimizer's
    parameters; one the checkpoint holds tensors for but the template has no state slot for
    (another optimizer class, or a parameter frozen since the save) is refused.
    """
    p = prefix
    template["state"] = {f: st for f, st in template["state"].items() if p + f in saved_params}
    with_tensors = {e.param for e in block.tensors.values() if e.param is not None}
    unfilled = [f for f in fqns if p + f in with_tensors and f not in template["state"]]
    if unfilled:
        raise StateMismatchError(
            f"{where}: the optimizer has no state slot for {len(unfilled)} parameter(s) "
            f"the checkpoint holds state for, e.g. {unfilled[:3]}; is it the same optimizer class, "
            "and are these parameters trainable (requires_grad) as when it was saved?",
            missing=unfilled,
        )
    targets: dict[str, torch.Tensor] = {}
    for fqn, st in template["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                targets[optimizer_tensor_name(p + fqn, k)] = v
            elif p + fqn in block.param_state and k in block.param_state[p + fqn]:
                st[k] = from_json_value(
                    block.param_state[p + fqn][k], f"{where}: param_state[{p + fqn!r}][{k!r}]"
                )
    return targets


def same_optimizer_class(optim: torch.optim.Optimizer, group: Any) -> None:
    """Collective: refuse, on every rank, optimizers of different classes on different ranks."""
    names = _dist.all_gather_object(f"{type(optim).__module__}.{type(optim).__qualname__}", group)
    if len(set(names)) > 1:
        by_class: dict[str, list[int]] = {}
        for r, n in enumerate(names):
            by_class.setdefault(n, []).append(r)
        desc = "; ".join(f"ranks {rs}: {n}" for n, rs in by_class.items())
        raise DistributedError(f"the ranks hold optimizers of different classes ({desc})")


def init_state(optim: torch.optim.Optimizer) -> None:
    """Give every trainable parameter without state its state tensors: a zero-gradient step at lr 0.

    torch's own initialisation (inside ``get_optimizer_state_dict``) silently does nothing when
    any parameter already has a gradient or any state exists, and a load would then find no
    state to fill. Parameters that have state keep it untouched (their gradient is ``None``
    during the step, so the optimizer skips them). The user's gradients are put back
    afterwards; parameters do not move (lr is 0).
    """
    params = [p for g in optim.param_groups for p in g["params"] if p.requires_grad]
    if all(optim.state.get(p) for p in params):
        return
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optim.param_groups]
    try:
        for p in params:
            p.grad = None if optim.state.get(p) else torch.zeros_like(p)
        for g in optim.param_groups:
            if "lr" in g:
                g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
        optim.step()
    finally:
        for g, lr in zip(optim.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad


def param_of(reader: CheckpointReader, name: str) -> str | None:
    e = reader.tensors.get(name)
    return e.param if e is not None else None


def merge_groups(all_groups: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    merged: list[dict[str, Any]] = []
    for groups in all_groups:
        for i, g in enumerate(groups):
            if i >= len(merged):
                merged.append(dict(g, params=list(g["params"])))
                continue
            have = set(merged[i]["params"])
            merged[i]["params"].extend(f for f in g["params"] if f not in have)
    return merged


def apply_groups(groups: list[dict[str, Any]], saved: list[dict[str, Any]], prefix: str) -> None:
    """Copy each saved group's hyperparameters into the live group holding the same parameters."""
    owner: dict[str, dict[str, Any]] = {}
    for g in saved:
        for f in g.get("params", []):
            owner[f] = g
    for g in groups:
        src = next((owner[prefix + f] for f in g["params"] if prefix + f in owner), None)
        if src is None:
            continue
        for k, v in src.items():
            if k == "params":
                continue
            value = from_json_value(v)
            if isinstance(g.get(k), tuple) and isinstance(value, list):
                value = tuple(value)
            g[k] = value


def optimizer_payload(
    osd: dict[str, Any],
    p: str,
    slices_of: Callable[[dict[str, torch.Tensor]], dict[str, list[LocalSlice]]],
) -> SavePayload:
    """This rank's payload of the FQN-keyed state ``osd`` (``{"state": ..., "param_groups": ...}``).

    ``p``: the prefix of every FQN (``apply_prefix``'s form). Tensor state becomes the tensors
    ``state.<fqn>.<key>`` (their slices from ``slices_of``), anything else JSON in the block's
    ``param_state``; a value JSON cannot hold raises ``UnsupportedError`` naming it.
    """
    tensors: dict[str, torch.Tensor] = {}
    extras: dict[str, dict[str, Any]] = {}
    param_state: dict[str, dict[str, Any]] = {}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                name = optimizer_tensor_name(p + fqn, k)
                tensors[name] = v
                extras[name] = {"param": p + fqn, "state": k}
            else:
                param_state.setdefault(p + fqn, {})[k] = to_json_value(v, f"state[{fqn!r}][{k!r}]")
    groups = [
        {
            **{
                k: to_json_value(v, f"param_groups[{i}][{k!r}]")
                for k, v in g.items()
                if k not in ("params", "param_names")  # the FQNs are "params" already
            },
            "params": [p + f for f in g["params"]],
        }
        for i, g in enumerate(osd["param_groups"])
    ]
    return SavePayload(
        "optimizer",
        tensors,
        slices_of(tensors),
        entry_extras=extras,
        block_extras={"param_groups": groups, "param_state": param_state},
    )


def merge_optimizer_extras(
    all_groups: list[list[dict[str, Any]]], all_scalars: list[dict[str, dict[str, Any]]]
) -> dict[str, Any]:
    """The block extras of an optimizer save from every rank's ``param_groups`` and scalar state
    (pipeline stages each know part of every group)."""
    merged_scalars: dict[str, dict[str, Any]] = {}
    for ps in all_scalars:
        merged_scalars.update(ps)
    return {"param_groups": merge_groups(all_groups), "param_state": merged_scalars}
