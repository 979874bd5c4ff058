"""TPPlugin: torch tensor parallelism (``parallelize_module``) over a one-dimensional ``tp`` mesh.

Modules named in ``tp_plan`` get DTensor parameters (``ColwiseParallel``: ``Shard(0)`` weight
and bias; ``RowwiseParallel``: ``Shard(1)`` weight, ``Replicate()`` bias). Parameters outside
the plan stay plain tensors, replicated on every rank. Every rank must see the same batch.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from unickpt.errors import UnsupportedError
from unickpt.io import CheckpointIO
from unickpt.plugins._shared import mesh as _mesh
from unickpt.plugins.base import (
    Plugin,
    check_optimizer,
    parameter_fqns,
    remap_optimizer_params,
)
from unickpt.wrappers import ModelWrapper

__all__ = ["TPCheckpointIO", "TPPlugin"]


class TPCheckpointIO(CheckpointIO):
    """CheckpointIO for models set up by :class:`TPPlugin` (the base class does all the work)."""

    plugin_name = "tp"


class TPPlugin(Plugin):
    """Tensor parallelism with torch's ``parallelize_module``.

    Args:
        tp_plan: module FQN (torch's plan syntax, ``*`` wildcards allowed) -> parallel style,
            e.g. ``{"ff.up": ColwiseParallel(), "ff.down": RowwiseParallel()}``.
    """

    name = "tp"
    data_parallel = False
    checkpoint_io_class = TPCheckpointIO

    def __init__(self, tp_plan: Mapping[str, ParallelStyle]) -> None:
        super().__init__()
        bad = [k for k, v in tp_plan.items() if not isinstance(v, ParallelStyle)]
        if bad:
            raise UnsupportedError(
                f"TPPlugin(tp_plan=...): {bad} map to something other than a torch ParallelStyle "
                "(ColwiseParallel(), RowwiseParallel(), SequenceParallel() ...)"
            )
        self.tp_plan = dict(tp_plan)

    def _parallelize(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> torch.nn.Module:
        """Apply ``tp_plan`` with ``parallelize_module`` (every rank, same model on each)."""
        self._mesh = _mesh.build_mesh((self.world_size,), ("tp",))
        model = model.to(self.device)
        check_optimizer(optimizer, model)
        old_fqns = parameter_fqns(model)
        parallelize_module(model, self._mesh, self.tp_plan)
        remap_optimizer_params(optimizer, old_fqns, model)
        return ModelWrapper(model)
