"""The optimizer state as a save payload: FQN-keyed tensors, scalars and ``param_groups`` as JSON.

Optimizer state is saved keyed by parameter FQN (``state.<fqn>.<key>`` tensors, scalars and
``param_groups`` as JSON in the block), so it loads under any layout. ``CheckpointIO``'s
``plan_optimizer`` lists the state through its hooks and turns it into a payload here; its
``load_optimizer`` fills a template of the same form (``optim_state.state_targets``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from unickpt.io.jsonstate import to_json_value
from unickpt.io.optim_state import merge_groups, optimizer_tensor_name
from unickpt.io.payload import SavePayload
from unickpt.io.tensors import LocalSlice

__all__ = ["merge_optimizer_extras", "optimizer_payload"]


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
