"""Checkpoint names are FQNs in the user's unwrapped model, whatever wraps it.

Wrappers add prefixes or infixes to ``state_dict`` keys: DDP (``module.`` at the root),
``torch.compile`` (``_orig_mod.``), activation checkpointing (``_checkpoint_wrapped_module.``),
FSDP1 (``_fsdp_wrapped_module.``). None of them reaches a file, and none stops a load.
"""

from __future__ import annotations

import torch

from unickpt.wrappers import ModelWrapper

__all__ = ["WRAPPER_INFIXES", "unwrap_model", "normalize_name", "apply_prefix"]

WRAPPER_INFIXES = ("_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module")


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """Strip root wrappers: unickpt's ModelWrapper, DDP, torch.compile's OptimizedModule."""
    from torch.nn.parallel import DistributedDataParallel

    seen = 0
    while seen < 32:
        seen += 1
        if isinstance(model, ModelWrapper):
            model = model.unwrap()
        elif isinstance(model, DistributedDataParallel):
            model = model.module  # type: ignore[assignment]
        elif type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
            model = model._orig_mod  # type: ignore[assignment]
        else:
            break
    return model


def normalize_name(name: str) -> str:
    parts = [p for p in name.split(".") if p not in WRAPPER_INFIXES]
    return ".".join(parts)


def apply_prefix(prefix: str | None) -> str:
    """Colossal-AI style ``prefix``: prepended to every saved name (a '.' is added if missing)."""
    if prefix is not None and not isinstance(prefix, str):
        from unickpt.errors import ConfigError

        raise ConfigError(f"prefix must be a string or None, got {type(prefix).__name__} {prefix!r}")
    if not prefix:
        return ""
    return prefix if prefix.endswith(".") else prefix + "."
