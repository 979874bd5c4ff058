"""Parallelism plugins: each sets a model up with torch's own parallelism and names its CheckpointIO.

Plugins never import each other; each module can be imported on its own.
"""

from __future__ import annotations

from unickpt.plugins.base import Plugin
from unickpt.plugins.ddp import DDPCheckpointIO, DDPPlugin
from unickpt.plugins.ep import ExpertParallelCheckpointIO, ExpertParallelPlugin
from unickpt.plugins.fsdp2 import FSDP2CheckpointIO, FSDP2Plugin
from unickpt.plugins.hybrid import HybridCheckpointIO, HybridParallelPlugin
from unickpt.plugins.pp import PPCheckpointIO, PPPlugin
from unickpt.plugins.tp import TPCheckpointIO, TPPlugin
from unickpt.plugins.zero import ZeroCheckpointIO, ZeroPlugin

__all__ = [
    "DDPCheckpointIO",
    "DDPPlugin",
    "ExpertParallelCheckpointIO",
    "ExpertParallelPlugin",
    "FSDP2CheckpointIO",
    "FSDP2Plugin",
    "HybridCheckpointIO",
    "HybridParallelPlugin",
    "PPCheckpointIO",
    "PPPlugin",
    "Plugin",
    "TPCheckpointIO",
    "TPPlugin",
    "ZeroCheckpointIO",
    "ZeroPlugin",
]
