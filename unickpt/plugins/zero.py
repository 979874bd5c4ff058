"""ZeroPlugin: ZeRO stage 1/2 data parallelism on a flat-buffer partition (Colossal-AI / DeepSpeed style).

Parameters stay plain tensors, replicated on every data-parallel rank. The parameters of each
optimizer param group are laid end to end, per dtype, in one flat buffer ("bucket"); the buffer
is padded to a multiple of the data-parallel size and cut into equal contiguous ranges, one per
rank. Each rank's optimizer updates only its range: the user's torch optimizer is kept (so LR
schedulers built on it stay valid) and its param groups are pointed at one 1-D "shard"
parameter per bucket. A parameter's optimizer state may therefore be split mid-tensor across
ranks; :class:`ZeroCheckpointIO` describes each rank's piece of each state tensor as boxes of the
global (parameter-shaped) tensor with :func:`unickpt.spec.boxes.flat_range_to_boxes`, and the
generic planner, writer and loader do the rest. Checkpoints are keyed by parameter FQN exactly as
under the other plugins, so they load at any other DP size and into/from any plugin.

Stage 1: gradients are all-reduced whole when the optimizer steps (DDP-like), then each rank keeps
its range. Stage 2: ``booster.backward`` reduce-scatters the gradients right after the backward
pass and frees the full gradients, so between backward and step each rank holds only its range.
After every step the updated ranges are all-gathered back into the replicated parameters.

Why not torch's ``ZeroRedundancyOptimizer``: it partitions whole parameters, so a rank's state is
never a mid-tensor range, and its ``state_dict`` consolidates everything on one rank (integer
keyed). The flat partition balances memory to within one element and its checkpoint is written
by every rank in parallel with no gather.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from unickpt.errors import UnsupportedError
from unickpt.io import CheckpointIO
from unickpt.plugins._shared import mesh as _mesh
from unickpt.plugins._shared.zero import ZeroCheckpointIO, ZeroPartition
from unickpt.plugins.base import Plugin
from unickpt.wrappers import ModelWrapper

__all__ = ["ZeroCheckpointIO", "ZeroPartition", "ZeroPlugin"]


class ZeroPlugin(Plugin):
    """ZeRO data parallelism (stage 1: optimizer states partitioned; stage 2: gradients too).

    Args:
        stage: 1 or 2.
    """

    name = "zero"

    def __init__(self, stage: int = 1) -> None:
        super().__init__()
        if stage not in (1, 2):
            raise UnsupportedError(
                f"ZeroPlugin(stage={stage}): only stages 1 and 2 exist here (use FSDP2 for 3)"
            )
        self.stage = stage
        self.partition: ZeroPartition | None = None

    def _parallelize(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """Broadcast rank 0's parameters and buffers, partition the optimizer (every rank)."""
        self._mesh = _mesh.build_mesh((self.world_size,), ("dp",))
        model = model.to(self.device)
        group = self._mesh.get_group()
        if self.world_size > 1:
            with torch.no_grad():
                for buf in model.buffers():
                    dist.broadcast(buf, src=0, group=group)
        if optimizer is not None:
            names = {id(p): n for n, p in model.named_parameters()}
            self.partition = ZeroPartition(optimizer, names, group, self.stage, list(model.buffers()))
        return ModelWrapper(model)

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        """Back-propagate; stage 2 then reduce-scatters the gradients at once (every rank)."""
        del optimizer
        loss.backward()  # type: ignore[no-untyped-call]
        if self.stage == 2 and self.partition is not None:
            self.partition.reduce_gradients()

    def _make_checkpoint_io(self) -> CheckpointIO:
        return ZeroCheckpointIO(mesh=self._mesh, partition=self.partition)
