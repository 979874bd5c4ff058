"""Thin wrappers that the Booster hands back, so checkpoint IO knows what belongs together.

``OptimizerWrapper`` remembers the model an optimizer updates: optimizer state is saved
keyed by parameter FQN, and only the model knows the FQNs.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["ModelWrapper", "OptimizerWrapper", "unwrap_optimizer"]


class ModelWrapper(torch.nn.Module):
    """A module wrapping the user's model; ``unwrap()`` returns the user's model."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def unwrap(self) -> torch.nn.Module:
        inner = self.module
        while isinstance(inner, ModelWrapper):
            inner = inner.module
        return inner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class OptimizerWrapper:
    """An optimizer plus the model whose parameters it updates.

    Behaves like the optimizer (``step``, ``zero_grad``, ``param_groups``, ``state`` ...).
    """

    def __init__(self, optim: torch.optim.Optimizer, model: torch.nn.Module) -> None:
        self.optim = optim
        self.model = model

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optim.param_groups

    @property
    def state(self) -> Any:
        return self.optim.state

    def step(self, *args: Any, **kwargs: Any) -> Any:
        return self.optim.step(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optim.zero_grad(set_to_none=set_to_none)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def state_dict(self) -> dict[str, Any]:
        return self.optim.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optim.load_state_dict(state_dict)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found normally: forward to the optimizer.
        if name in ("optim", "model"):
            raise AttributeError(name)
        return getattr(self.optim, name)


def unwrap_optimizer(optimizer: Any) -> tuple[torch.optim.Optimizer, torch.nn.Module | None]:
    """Return ``(torch optimizer, model or None)`` for an optimizer or an ``OptimizerWrapper``."""
    model = None
    while isinstance(optimizer, OptimizerWrapper):
        model = model or optimizer.model
        optimizer = optimizer.optim
    return optimizer, model
