"""Offline tools that work from checkpoint files alone, with no process group and no torch.

``merge`` (to a plain Hugging Face checkpoint), ``diff`` (by fingerprint, across
parallelisms), ``verify`` (rehash every stored slice), ``inspect`` (a readable summary) and
``convert`` (import DCP directories and pickle ``.bin`` shards). Only ``convert`` and
``merge --dtype`` import torch, lazily, when they need it.
"""

from __future__ import annotations

__all__ = ["merge_checkpoint", "diff_checkpoints", "verify_checkpoint", "inspect_checkpoint"]

from typing import Any


def __getattr__(name: str) -> Any:
    import importlib

    mod = {
        "merge_checkpoint": "unickpt.tools.merge",
        "diff_checkpoints": "unickpt.tools.diff",
        "verify_checkpoint": "unickpt.tools.verify",
        "inspect_checkpoint": "unickpt.tools.inspect",
    }.get(name)
    if mod is None:
        raise AttributeError(f"module 'unickpt.tools' has no attribute {name!r}")
    return getattr(importlib.import_module(mod), name)
