"""unickpt: one checkpoint format for every parallelism.

Save under one parallel layout and world size, load under any other; merge offline into a
Hugging Face checkpoint; verify and diff checkpoints by hash from their index files.
"""

from __future__ import annotations

from typing import Any

from unickpt.errors import (
    CheckpointBusyError,
    CheckpointChangedError,
    CheckpointFormatError,
    ConfigError,
    DistributedError,
    HeaderError,
    IncompleteCheckpointError,
    IndexFileError,
    IntegrityError,
    OutputExistsError,
    StateMismatchError,
    StorageError,
    UnickptError,
    UnsafePathError,
    UnsupportedError,
)

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "Booster",
    "CheckpointIO",
    "GeneralCheckpointIO",
    "LoadReport",
    "ModelWrapper",
    "OptimizerWrapper",
    "CheckpointManager",
    "merge_checkpoint",
    "diff_checkpoints",
    "verify_checkpoint",
    "UnickptError",
    "CheckpointFormatError",
    "IndexFileError",
    "HeaderError",
    "UnsafePathError",
    "IncompleteCheckpointError",
    "IntegrityError",
    "StateMismatchError",
    "UnsupportedError",
    "DistributedError",
    "CheckpointBusyError",
    "CheckpointChangedError",
    "OutputExistsError",
    "ConfigError",
    "StorageError",
]

# Heavy parts (torch, torch.distributed) load on first use, so `unickpt` and its CLI start fast.
_LAZY = {
    "Booster": "unickpt.booster",
    "CheckpointIO": "unickpt.io",
    "GeneralCheckpointIO": "unickpt.io",
    "LoadReport": "unickpt.io",
    "ModelWrapper": "unickpt.wrappers",
    "OptimizerWrapper": "unickpt.wrappers",
    "CheckpointManager": "unickpt.manager",
    "merge_checkpoint": "unickpt.tools.merge",
    "diff_checkpoints": "unickpt.tools.diff",
    "verify_checkpoint": "unickpt.tools.verify",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'unickpt' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
