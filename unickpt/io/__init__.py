"""Checkpoint IO: ``CheckpointIO``, its single-process case, and what a plugin's hooks work with.

A plugin's ``CheckpointIO`` subclass implements hooks that receive a ``HookContext`` and describe
the ``LocalSlice`` objects a rank holds; loads return a ``LoadReport``. What only the manager
and the tools use (``SavePayload``, the side-file helpers) is imported from its module.
"""

from unickpt.io.checkpoint_io import CheckpointIO, GeneralCheckpointIO, HookContext
from unickpt.io.load import LoadReport
from unickpt.io.tensors import LocalSlice

__all__ = [
    "CheckpointIO",
    "GeneralCheckpointIO",
    "HookContext",
    "LoadReport",
    "LocalSlice",
]
