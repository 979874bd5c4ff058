"""Pipeline stages, schedules and their CheckpointIO (shared by the PP and hybrid plugins).

The public names are re-exported by ``unickpt.plugins.pp``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from unickpt.errors import UnsupportedError
from unickpt.io import CheckpointIO, HookContext
from unickpt.io.tensors import is_dtensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

_CONTAINERS = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def pipeline_units(model: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """The model's pipeline units in registration order: children, with containers expanded."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if child is None:
            continue
        fqn = f"{prefix}{name}"
        if isinstance(child, _CONTAINERS):
            out.extend(pipeline_units(child, fqn + "."))
        else:
            out.append((fqn, child))
    return out


def _stage_of_units(units: Sequence[str], split_points: Sequence[str], num_stages: int) -> dict[str, int]:
    if len(split_points) != num_stages - 1:
        raise UnsupportedError(
            f"{num_stages} pipeline stages need {num_stages - 1} split points, got {list(split_points)}"
        )
    index = {u: i for i, u in enumerate(units)}
    starts = []
    for sp in split_points:
        if sp not in index:
            raise UnsupportedError(f"split point {sp!r} is not a pipeline unit; units are {list(units)}")
        starts.append(index[sp])
    if starts != sorted(set(starts)) or (starts and starts[0] == 0):
        raise UnsupportedError(f"split points {list(split_points)} must be distinct units in model order")
    stage_of: dict[str, int] = {}
    stage = 0
    for i, u in enumerate(units):
        while stage < len(starts) and i >= starts[stage]:
            stage += 1
        stage_of[u] = stage
    return stage_of


def split_stage(
    model: nn.Module, split_points: Sequence[str], stage: int, num_stages: int
) -> tuple[dict[str, str], dict[str, list[int]]]:
    """Remove, in place, every pipeline unit outside ``stage``; return tie information.

    Returns ``(canonical, tied_stages)``: ``canonical`` maps each remaining parameter FQN that is a
    later copy of a weight tied across stages to the weight's first FQN; ``tied_stages`` maps each
    cross-stage tied weight's first FQN to the stages holding a copy.
    """
    if any(True for _ in model.named_parameters(recurse=False)) or any(
        True for _ in model.named_buffers(recurse=False)
    ):
        raise UnsupportedError(
            "PPPlugin: the root module holds parameters or buffers; move them into a child"
        )
    units = pipeline_units(model)
    stage_of = _stage_of_units([u for u, _ in units], split_points, num_stages)
    names_of: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(n)

    def unit_of(fqn: str) -> str:
        return next(u for u, _ in units if fqn.startswith(u + "."))

    tied_stages: dict[str, list[int]] = {}
    canonical: dict[str, str] = {}
    for names in names_of.values():
        stages = sorted({stage_of[unit_of(n)] for n in names})
        if len(stages) < 2:
            continue
        first = names[0]
        tied_stages[first] = stages
        for n in names:
            if stage_of[unit_of(n)] == stage and stage != stage_of[unit_of(first)]:
                canonical[n] = first
    for fqn, _ in units:
        if stage_of[fqn] != stage:
            parent_name, _, attr = fqn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, None)
    return canonical, tied_stages


class PipelineRuntime:
    """A stage of a pipelined model plus its schedule (built lazily with the criterion).

    All ranks of the pipeline group call :meth:`run` together.
    """

    def __init__(
        self,
        module: nn.Module,
        stage: int,
        num_stages: int,
        group: ProcessGroup | None,
        num_microbatches: int,
        schedule: str,
        tied_stages: dict[str, list[int]],
        tied_shapes: dict[str, tuple[torch.Size, torch.dtype]],
        canonical: dict[str, str],
        device: torch.device,
    ) -> None:
        if schedule not in ("1F1B", "GPipe"):
            raise UnsupportedError(f"schedule must be '1F1B' or 'GPipe', got {schedule!r}")
        self.module = module
        self.stage = stage
        self.num_stages = num_stages
        self.group = group
        self.num_microbatches = num_microbatches
        self.schedule_name = schedule
        self.tied_stages = tied_stages
        self.tied_shapes = tied_shapes
        self.canonical = canonical
        self.device = device
        self._schedule: Any = None
        self._criterion: Any = None
        self._local_shapes: dict[str, tuple[torch.Size, torch.dtype]] | None = None

    def _get_schedule(self, criterion: Callable[..., Any]) -> Any:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        if self._schedule is None or self._criterion is not criterion:
            stage = PipelineStage(self.module, self.stage, self.num_stages, self.device, group=self.group)
            cls = Schedule1F1B if self.schedule_name == "1F1B" else ScheduleGPipe
            self._schedule = cls(stage, self.num_microbatches, loss_fn=criterion)
            self._criterion = criterion
        return self._schedule

    def run(self, batch: Any, criterion: Callable[..., Any]) -> torch.Tensor | None:
        """Forward and backward of one batch ``(inputs, targets)``; the mean loss on the last stage."""
        inputs, targets = batch
        schedule = self._get_schedule(criterion)
        first, last = self.stage == 0, self.stage == self.num_stages - 1
        losses: list[torch.Tensor] = []
        args = (inputs.to(self.device),) if first else ()
        kwargs: dict[str, Any] = {}
        if last:
            kwargs = {"target": targets.to(self.device), "losses": losses}
        schedule.step(*args, **kwargs)
        self.sync_tied_gradients()
        if last:
            return torch.stack([x.detach() for x in losses]).mean()
        return None

    def sync_tied_gradients(self) -> None:
        """Sum the gradients of weights tied across stages over the pipeline group (collective).

        Under FSDP2 (hybrid) the copies are DTensors sharded alike on every stage's dp sub-mesh,
        and a rank's pipeline group joins the ranks at the same dp/tp coordinates: their local
        shards hold the same slice, so the local shards are summed.
        """
        if not self.tied_stages:
            return
        local = {self.canonical.get(n, n): p for n, p in self.module.named_parameters()}
        shapes = self._local_tied_shapes(local)
        for first in sorted(self.tied_stages):
            shape, dtype = shapes[first]
            p: Any = local.get(first)
            grad: Any = p.grad if p is not None and p.grad is not None else None
            if grad is not None:
                buf = grad.to_local() if is_dtensor(grad) else grad
            else:
                buf = torch.zeros(shape, dtype=dtype, device=self.device)
            dist.all_reduce(buf, group=self.group)
            if p is not None and grad is None:
                if is_dtensor(p):
                    from torch.distributed.tensor import DTensor

                    p.grad = DTensor.from_local(
                        buf, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                    )
                else:
                    p.grad = buf

    def _local_tied_shapes(self, local: dict[str, nn.Parameter]) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """This rank's shard shape of every cross-stage tied weight (all-gathered once when sharded)."""
        if self._local_shapes is not None:
            return self._local_shapes
        mine = {
            f: (p.to_local().shape, p.dtype)  # type: ignore[attr-defined]
            for f, p in local.items()
            if f in self.tied_stages and is_dtensor(p)
        }
        flags: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(flags, mine, group=self.group)
        shapes = dict(self.tied_shapes)
        for part in flags:
            shapes.update(part)
        self._local_shapes = shapes
        return shapes


class PPCheckpointIO(CheckpointIO):
    """CheckpointIO of a pipeline stage: tied copies' optimizer state goes by the weight's first FQN."""

    plugin_name = "pp"

    def __init__(
        self,
        mesh: DeviceMesh | None = None,
        group: ProcessGroup | None = None,
        *,
        canonical: dict[str, str] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(mesh, group, **options)
        self.canonical = dict(canonical or {})

    def _state_parameters(self, model: nn.Module) -> list[tuple[str, torch.Tensor]]:
        return [(self.canonical.get(n, n), p) for n, p in super()._state_parameters(model)]

    def _optimizer_state(self, ctx: HookContext) -> dict[str, Any]:
        """The stage's FQN-keyed state; tied copies renamed to the first FQN (dropped when saving)."""
        osd = super()._optimizer_state(ctx)
        state: dict[str, Any] = {}
        for fqn, st in osd["state"].items():
            if fqn in self.canonical:
                if ctx.saving:
                    continue
                fqn = self.canonical[fqn]
            state[fqn] = st
        groups = []
        for g in osd["param_groups"]:
            params = [
                self.canonical.get(f, f) for f in g["params"] if not (ctx.saving and f in self.canonical)
            ]
            groups.append(dict(g, params=params))
        return {"state": state, "param_groups": groups}

    def _set_optimizer_state(self, ctx: HookContext, osd: dict[str, Any]) -> None:
        """Rename tied weights back to this stage's FQN, then torch's ``set_optimizer_state_dict``."""
        back = {v: k for k, v in self.canonical.items()}
        osd = {
            "state": {back.get(f, f): st for f, st in osd["state"].items()},
            "param_groups": [
                dict(g, params=[back.get(f, f) for f in g["params"]]) for g in osd["param_groups"]
            ],
        }
        super()._set_optimizer_state(ctx, osd)


def _all_gather_objects(obj: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def prune_optimizer(optimizer: torch.optim.Optimizer | None, module: nn.Module) -> None:
    """Drop from ``optimizer``'s groups the parameters no longer in ``module`` (other stages)."""
    if optimizer is None:
        return
    if any(len(s) for s in optimizer.state.values()):
        raise UnsupportedError("the optimizer already holds state: pass a fresh optimizer to Booster.boost")
    keep = {id(p) for p in module.parameters()}
    for g in optimizer.param_groups:
        if "param_names" in g:  # built from named_parameters(): the names follow their parameters
            g["param_names"] = [
                n for n, p in zip(g["param_names"], g["params"], strict=True) if id(p) in keep
            ]
        g["params"] = [p for p in g["params"] if id(p) in keep]


def tied_shapes_from(
    model: nn.Module, tied: dict[str, list[int]], canonical: dict[str, str]
) -> dict[str, tuple[torch.Size, torch.dtype]]:
    """Shapes of the cross-stage tied weights, from whichever copy this stage still holds.

    Every stage knows every tied weight's shape: shapes are all-gathered from the holders.
    """
    local = {canonical.get(n, n): (p.shape, p.dtype) for n, p in model.named_parameters()}
    mine = {n: local[n] for n in tied if n in local}
    out: dict[str, tuple[torch.Size, torch.dtype]] = {}
    if dist.is_initialized() and dist.get_world_size() > 1:
        for part in _all_gather_objects(mine, None):
            out.update(part)
    else:
        out = mine
    return out
