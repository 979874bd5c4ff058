"""Parameter names that torch keeps in an optimizer built from ``model.named_parameters()``.

``torch.optim.Optimizer(model.named_parameters())`` stores each group's names under
``param_groups[i]["param_names"]``. unickpt keys optimizer state by parameter FQN, which
normally needs the model (``OptimizerWrapper`` or ``Booster.boost``); with these names a bare
optimizer is enough. When the model is known too, the names must be its FQNs.
"""

from __future__ import annotations

from typing import Any

import torch

from unickpt.errors import StateMismatchError
from unickpt.io.tensors import normalize_name

__all__ = ["model_from_param_names", "check_param_names"]


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
