"""Helpers of ``CheckpointIO``'s optimizer paths: state initialisation, param-group merging and copying."""

from __future__ import annotations

from typing import Any

import torch

from unickpt import _dist
from unickpt.ckpt.reader import CheckpointReader
from unickpt.errors import DistributedError, StateMismatchError
from unickpt.io.jsonstate import from_json_value
from unickpt.spec.index import UnickptBlock

__all__ = [
    "apply_groups",
    "init_state",
    "merge_groups",
    "optimizer_tensor_name",
    "param_of",
    "same_optimizer_class",
    "state_targets",
]


def optimizer_tensor_name(fqn: str, state_key: str) -> str:
    """Name of one optimizer state tensor in an optimizer checkpoint."""
    return f"state.{fqn}.{state_key}"


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
