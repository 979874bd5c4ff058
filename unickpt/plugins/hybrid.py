"""HybridParallelPlugin: data x pipeline x tensor parallelism on one DeviceMesh ``(dp, pp, tp)``.

torch's components are composed on the named sub-meshes, in this order: the pipeline split
(:func:`unickpt.plugins.pp.split_stage`, in place, FQNs kept), tensor parallelism
(``parallelize_module`` on ``mesh["tp"]``), then data parallelism on ``mesh["dp"]``:

- ``"fsdp2"``: ``fully_shard`` on the units :func:`unickpt.plugins.fsdp2.default_shard_units`
  picks (tied weights stay in one group), then the root. Over TP on the same tensor dimension
  this gives ``(_StridedShard, Shard)`` placements; the CheckpointIO base computes each rank's
  local slice with torch's ``compute_local_shape_and_global_offset`` (one rectangular slice in
  every case the tests cover; the planner's coverage check fails loudly otherwise).

Tensor parallelism needs every sharded dimension divisible by ``tp_size`` (checked at configure
time, ``UnsupportedError``); the dp dimension may split unevenly.
- ``"ddp"``: replicated parameters whose gradients are averaged over ``mesh["dp"]`` after each
  backward (an explicit all-reduce: torch's ``DistributedDataParallel`` does not take DTensor
  parameters).
- ``"zero"``: :class:`unickpt.plugins.zero.ZeroPartition` over ``mesh["dp"]`` (plain parameters
  only: ``tp_size`` must be 1).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from unickpt.errors import UnsupportedError
from unickpt.io import CheckpointIO
from unickpt.plugins._shared import mesh as _mesh
from unickpt.plugins._shared.fsdp_units import default_shard_units
from unickpt.plugins._shared.pipeline import (
    PipelineRuntime,
    PPCheckpointIO,
    prune_optimizer,
    split_stage,
    tied_shapes_from,
)
from unickpt.plugins._shared.zero import ZeroCheckpointIO, ZeroPartition
from unickpt.plugins.base import Plugin, parameter_fqns, remap_optimizer_params
from unickpt.wrappers import ModelWrapper

__all__ = ["HybridCheckpointIO", "HybridParallelPlugin"]


class HybridCheckpointIO(PPCheckpointIO):
    """CheckpointIO of the hybrid plugin: pipeline renaming of tied weights; DTensors are generic."""

    plugin_name = "hybrid"


class HybridZeroCheckpointIO(ZeroCheckpointIO):
    """CheckpointIO of the hybrid plugin with ``dp="zero"`` (flat ranges over the dp sub-mesh)."""

    plugin_name = "hybrid"


class HybridParallelPlugin(Plugin):
    """dp x pp x tp on one mesh; ``dp_size`` is the world size divided by ``tp_size * pp_size``.

    Args:
        tp_size, pp_size: sizes of the tensor- and pipeline-parallel mesh dimensions.
        dp: ``"fsdp2"``, ``"ddp"`` or ``"zero"``.
        tp_plan: as for :class:`unickpt.plugins.TPPlugin` (needed when ``tp_size > 1``).
        split_points, num_microbatches, schedule: as for :class:`unickpt.plugins.PPPlugin`.
        zero_stage: ZeRO stage for ``dp="zero"``.
    """

    name = "hybrid"

    def __init__(
        self,
        tp_size: int = 1,
        pp_size: int = 1,
        dp: str = "fsdp2",
        tp_plan: Mapping[str, Any] | None = None,
        split_points: Sequence[str] | None = None,
        num_microbatches: int | None = None,
        schedule: str = "1F1B",
        zero_stage: int = 1,
    ) -> None:
        super().__init__()
        if dp not in ("fsdp2", "ddp", "zero"):
            raise UnsupportedError(f"HybridParallelPlugin(dp={dp!r}): use 'fsdp2', 'ddp' or 'zero'")
        if tp_size > 1 and not tp_plan:
            raise UnsupportedError("HybridParallelPlugin: tp_size > 1 needs a tp_plan")
        if pp_size > 1 and not split_points:
            raise UnsupportedError("HybridParallelPlugin: pp_size > 1 needs split_points")
        if dp == "zero" and tp_size > 1:
            raise UnsupportedError("HybridParallelPlugin(dp='zero') needs tp_size=1 (plain parameters)")
        self.tp_size, self.pp_size, self.dp = tp_size, pp_size, dp
        self.tp_plan = dict(tp_plan or {})
        self.split_points = list(split_points or [])
        self.num_microbatches = num_microbatches or pp_size
        self.schedule = schedule
        self.zero_stage = zero_stage
        self.runtime: PipelineRuntime | None = None
        self.partition: ZeroPartition | None = None
        self.canonical: dict[str, str] = {}
        self._dp_params: list[nn.Parameter] = []

    @property
    def dp_size(self) -> int:
        return self.world_size // (self.tp_size * self.pp_size)

    @property
    def dp_rank(self) -> int:
        return self._mesh.get_local_rank("dp") if self._mesh is not None else 0

    def _parallelize(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> nn.Module:
        """Split, tensor-parallelise, then data-parallelise ``model`` (every rank)."""
        if self.world_size % (self.tp_size * self.pp_size):
            raise UnsupportedError(
                f"world size {self.world_size} is not a multiple of tp_size*pp_size={self.tp_size * self.pp_size}"
            )
        mesh = _mesh.build_mesh((self.dp_size, self.pp_size, self.tp_size), ("dp", "pp", "tp"))
        self._mesh = mesh
        stage = mesh.get_local_rank("pp")
        canonical: dict[str, str] = {}
        tied: dict[str, list[int]] = {}
        if self.pp_size > 1:
            canonical, tied = split_stage(model, self.split_points, stage, self.pp_size)
            prune_optimizer(optimizer, model)
        shapes = tied_shapes_from(model, tied, canonical) if self.pp_size > 1 else {}
        model = model.to(self.device)
        old = parameter_fqns(model)
        if self.tp_size > 1:
            from torch.distributed.tensor.parallel import parallelize_module

            parallelize_module(model, mesh["tp"], self.tp_plan)
            _check_tp_even(model, self.tp_size)
        dp_mesh = mesh["dp"]
        if self.dp == "fsdp2" and self.dp_size > 1:
            from torch.distributed.fsdp import fully_shard

            # Units as FSDP2Plugin picks them: a unit holding a weight tied to a module outside
            # it (embedding/head) is left to the root, so tied parameters share one group.
            units = default_shard_units(model)
            for unit in sorted(units, key=lambda u: u.count("."), reverse=True):
                fully_shard(model.get_submodule(unit), mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
        remap_optimizer_params(optimizer, old, model)
        if self.dp == "ddp" and self.dp_size > 1:
            self._dp_params = [p for p in model.parameters() if p.requires_grad]
            src = dist.get_global_rank(dp_mesh.get_group(), 0)
            with torch.no_grad():
                for t in [*model.parameters(), *model.buffers()]:
                    local = t.to_local() if hasattr(t, "to_local") else t
                    dist.broadcast(local, src=src, group=dp_mesh.get_group())
        if self.dp == "zero" and optimizer is not None:
            names = {id(p): canonical.get(n, n) for n, p in model.named_parameters()}
            self.partition = ZeroPartition(
                optimizer, names, dp_mesh.get_group(), self.zero_stage, list(model.buffers())
            )
        self.canonical = canonical
        if self.pp_size > 1:
            self.runtime = PipelineRuntime(
                model,
                stage,
                self.pp_size,
                mesh["pp"].get_group(),
                self.num_microbatches,
                self.schedule,
                tied,
                shapes,
                canonical,
                self.device,
            )
        return ModelWrapper(model)

    def _reduce_dp(self) -> None:
        """Average gradients over the dp sub-mesh (``dp="ddp"``; collective over it)."""
        if not self._dp_params or self._mesh is None:
            return
        group = self._mesh["dp"].get_group()
        for p in self._dp_params:
            if p.grad is None:
                continue
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            g.div_(self.dp_size)
            dist.all_reduce(g, group=group)

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        """Back-propagate, then reduce gradients as ``dp`` requires (every rank)."""
        del optimizer
        loss.backward()  # type: ignore[no-untyped-call]
        self._reduce_dp()
        if self.partition is not None and self.zero_stage == 2:
            self.partition.reduce_gradients()

    def execute_pipeline(
        self, data_iter: Iterator[Any], model: Any, criterion: Callable[..., Any], optimizer: Any
    ) -> torch.Tensor | None:
        """Pipelined forward/backward of the next batch, then dp reduction (every rank)."""
        del model, optimizer
        if self.runtime is None:
            raise UnsupportedError("execute_pipeline needs pp_size > 1 (and Booster.boost first)")
        loss = self.runtime.run(next(data_iter), criterion)
        self._reduce_dp()
        return loss

    def _make_checkpoint_io(self) -> CheckpointIO:
        if self.partition is not None:
            return HybridZeroCheckpointIO(mesh=self._mesh, partition=self.partition)
        return HybridCheckpointIO(mesh=self._mesh, canonical=self.canonical)


def _check_tp_even(model: nn.Module, tp_size: int) -> None:
    """Refuse tensor-parallel shards of uneven width (every rank, right after ``parallelize_module``).

    torch's Colwise/Rowwise styles rebuild activations with ``DTensor.from_local``, which assumes
    every tp rank holds the same width: a dimension not divisible by ``tp_size`` fails later in
    the forward pass with a matmul shape mismatch. FSDP2 (the dp dimension) may split unevenly.
    """
    from torch.distributed.tensor import DTensor, Shard

    bad: list[str] = []
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            continue
        for placement in p.placements:
            if isinstance(placement, Shard) and p.shape[placement.dim] % tp_size:
                bad.append(f"{name} {tuple(p.shape)} (dim {placement.dim})")
    if bad:
        raise UnsupportedError(
            f"tensor parallelism over {tp_size} ranks needs every sharded dimension divisible by "
            f"{tp_size}; these are not: {bad[:5]}. Change the model's sizes, tp_size or tp_plan"
        )
