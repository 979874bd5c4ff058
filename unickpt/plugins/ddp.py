"""DDPPlugin: torch ``DistributedDataParallel`` over the whole world.

Parameters stay plain replicated tensors; the CheckpointIO base writes each of them once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

from unickpt.io import CheckpointIO
from unickpt.plugins._shared import mesh as _mesh
from unickpt.plugins.base import Plugin
from unickpt.wrappers import ModelWrapper

__all__ = ["DDPCheckpointIO", "DDPModelWrapper", "DDPPlugin"]


class DDPCheckpointIO(CheckpointIO):
    """CheckpointIO for models set up by :class:`DDPPlugin` (the base class does all the work)."""

    plugin_name = "ddp"
    replicated_everywhere = True


class DDPModelWrapper(ModelWrapper):
    """Holds the ``DistributedDataParallel`` module; ``unwrap()`` returns the user's model."""

    def unwrap(self) -> torch.nn.Module:
        inner: torch.nn.Module = self.module
        while isinstance(inner, (ModelWrapper, DistributedDataParallel)):
            inner = inner.module
        return inner


class DDPPlugin(Plugin):
    """Data parallelism with torch ``DistributedDataParallel``.

    ``ddp_kwargs`` go to ``DistributedDataParallel`` unchanged (``find_unused_parameters``,
    ``broadcast_buffers``, ``gradient_as_bucket_view`` ...). The process group is
    initialised from the torchrun environment if needed.
    """

    name = "ddp"
    checkpoint_io_class = DDPCheckpointIO

    def __init__(self, **ddp_kwargs: Any) -> None:
        super().__init__()
        self.ddp_kwargs = ddp_kwargs

    def _parallelize(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> torch.nn.Module:
        """Wrap ``model`` in DDP (every rank; DDP broadcasts rank 0's parameters and buffers)."""
        self._mesh = _mesh.build_mesh((self.world_size,), ("dp",))
        device = self.device
        model = model.to(device)
        kwargs = dict(self.ddp_kwargs)
        if device.type == "cuda":
            kwargs.setdefault("device_ids", [device.index])
        # DDP keeps the parameter objects, so the optimizer needs no remapping.
        ddp = DistributedDataParallel(model, **kwargs)
        return DDPModelWrapper(ddp)
