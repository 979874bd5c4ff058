"""PPPlugin: pipeline parallelism on ``torch.distributed.pipelining`` (PipelineStage + GPipe/1F1B).

Each rank keeps only its stage of the user's model, *in place*: the modules of other stages are
replaced by ``None`` in their parent (torchtitan's convention), so every remaining parameter keeps
its full-model FQN and checkpoints stay FQN-addressed. The model's ``forward`` must therefore skip
``None`` submodules (``h = self.emb(x) if self.emb is not None else x``; ``for b in self.blocks: if
b is not None: h = b(h)``). Pipeline units are the model's children in registration order,
containers (``ModuleList``/``ModuleDict``/``Sequential``) expanded; ``split_points`` name the units
where a new stage begins, and registration order must be execution order.

Tied weights across stages (an embedding tied to the output head): every stage holding a copy
keeps it; after each pipelined backward the copies' gradients are summed over the pipeline group,
so the copies stay bit-identical. The optimizer state of a tied weight is saved once, under its
first FQN (the one a single-process checkpoint uses), by the earliest stage holding it; later
stages load it from that name. Model weights are saved under each stage's own FQN (the head's
name) and load into any layout because the loader resolves tied names.

Each stage saves its own parameters and optimizer state in parallel through the generic
CheckpointIO; one index covers all stages.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from unickpt.errors import UnsupportedError
from unickpt.io import CheckpointIO
from unickpt.plugins._shared import mesh as _mesh
from unickpt.plugins._shared.pipeline import (
    PipelineRuntime,
    PPCheckpointIO,
    pipeline_units,
    prune_optimizer,
    split_stage,
    tied_shapes_from,
)
from unickpt.plugins.base import Plugin
from unickpt.wrappers import ModelWrapper

__all__ = ["PPCheckpointIO", "PPPlugin", "PipelineRuntime", "pipeline_units", "split_stage"]


class PPPlugin(Plugin):
    """Pipeline parallelism over the whole world (one stage per rank).

    Args:
        pp_size: number of stages (must equal the world size; combine with data or tensor
            parallelism through ``HybridParallelPlugin``).
        split_points: FQNs of the pipeline units where stages 1..pp_size-1 begin.
        num_microbatches: microbatches per batch (default ``pp_size``).
        schedule: ``"1F1B"`` or ``"GPipe"``.
    """

    name = "pp"
    data_parallel = False

    def __init__(
        self,
        pp_size: int,
        split_points: Sequence[str],
        num_microbatches: int | None = None,
        schedule: str = "1F1B",
    ) -> None:
        super().__init__()
        if schedule not in ("1F1B", "GPipe"):
            raise UnsupportedError(f"PPPlugin(schedule={schedule!r}): use '1F1B' or 'GPipe'")
        if schedule == "1F1B" and num_microbatches is not None and num_microbatches < pp_size:
            raise UnsupportedError(
                f"PPPlugin: the 1F1B schedule needs num_microbatches >= pp_size ({num_microbatches} < {pp_size})"
            )
        self.pp_size = pp_size
        self.split_points = list(split_points)
        self.num_microbatches = num_microbatches or pp_size
        self.schedule = schedule
        self.runtime: PipelineRuntime | None = None
        self.canonical: dict[str, str] = {}

    @property
    def stage(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    def _parallelize(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """Keep this rank's stage of ``model`` (in place) and prune the optimizer (every rank)."""
        self._mesh = _mesh.build_mesh((self.pp_size,), ("pp",))
        stage = self._mesh.get_local_rank("pp")
        canonical, tied = split_stage(model, self.split_points, stage, self.pp_size)
        shapes = tied_shapes_from(model, tied, canonical)
        model = model.to(self.device)
        prune_optimizer(optimizer, model)
        self.canonical = canonical
        self.runtime = PipelineRuntime(
            model,
            stage,
            self.pp_size,
            self._mesh.get_group("pp"),
            self.num_microbatches,
            self.schedule,
            tied,
            shapes,
            canonical,
            self.device,
        )
        return ModelWrapper(model)

    def execute_pipeline(
        self, data_iter: Iterator[Any], model: Any, criterion: Callable[..., Any], optimizer: Any
    ) -> torch.Tensor | None:
        """Forward and backward of the next batch through the pipeline (every rank).

        ``next(data_iter)`` is ``(inputs, targets)`` (every stage draws it; only the first uses the
        inputs and the last the targets). Returns the mean microbatch loss on the last stage, None
        elsewhere. Call ``optimizer.step()`` afterwards, as in Colossal-AI.
        """
        del model, optimizer
        if self.runtime is None:
            raise UnsupportedError("execute_pipeline before Booster.boost")
        return self.runtime.run(next(data_iter), criterion)

    def _make_checkpoint_io(self) -> CheckpointIO:
        return PPCheckpointIO(mesh=self._mesh, canonical=self.canonical)
