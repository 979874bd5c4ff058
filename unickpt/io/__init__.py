"""Checkpoint IO: the CheckpointIO base class and its single-process implementation."""

from unickpt.io.checkpoint_io import (
    CheckpointIO,
    SavePayload,
    hf_config_files,
    lr_scheduler_json,
    optimizer_tensor_name,
)
from unickpt.io.general import GeneralCheckpointIO
from unickpt.io.load import LoadReport
from unickpt.io.tensors import LocalSlice

__all__ = [
    "CheckpointIO",
    "GeneralCheckpointIO",
    "LoadReport",
    "LocalSlice",
    "SavePayload",
    "hf_config_files",
    "lr_scheduler_json",
    "optimizer_tensor_name",
]
