"""What one rank writes for one step, captured in the foreground of a save.

For an async save the slices this rank writes (``io/stage.py``: not the replicas another rank
writes) are copied to CPU buffers (reused from one save to the next: one
save is in flight at most) so that training may change the live ones while a background thread
writes the copy.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt.io.hf_rows import row_snapshot
from unickpt.io.side_files import hf_config_files, lr_scheduler_json
from unickpt.io.stage import stage_written
from unickpt.io.tensors import SavePayload
from unickpt.manager import train_state

__all__ = ["Payload", "capture"]


@dataclasses.dataclass
class Payload:
    """Everything one rank writes for one step (tensors already copied for an async save)."""

    step: int
    stage: str
    model: SavePayload
    optimizer: SavePayload | None
    scheduler: bytes | None  # lr_scheduler.json contents
    train_state: dict[str, Any]
    state_tensors: dict[str, torch.Tensor]
    hf_config: dict[str, str]
    target: str = ""  # fsspec URLs: the prefix uploaded into (``step-<N>`` or a replacement copy)


def capture(
    io: Any,
    step: int,
    stage: str,
    model: torch.nn.Module,
    optimizer: Any,
    lr_scheduler: Any,
    dataloader: Any,
    extra_states: dict[str, Any],
    staging: dict[str, dict[tuple[str, int], torch.Tensor]] | None,
    rows: bool = False,
) -> Payload:
    """Collective over ``io.group``: plan the step's tensors and take this rank's state.

    ``staging``: the CPU buffers to copy the tensors into (async saves), ``None`` to write the
    live tensors (synchronous saves). ``rows``: the model is written as Hugging Face files
    (``save_hf``), so an async copy takes column-sharded tensors as row slices.
    """
    group = io.group
    err: BaseException | None = None
    optim_plan = None
    sched = None
    state: dict[str, Any] = {}
    state_tensors: dict[str, torch.Tensor] = {}
    hf_config: dict[str, str] = {}
    # Collective, and agreed inside: not part of the local phase below.
    model_plan = io.plan_model(model)
    if staging is not None and rows:  # collective: column-sharded DTensors as row slices (io/hf_rows.py)
        model_plan = dataclasses.replace(
            model_plan, slices=row_snapshot(model_plan.tensors, model_plan.slices)
        )
    try:
        maybe_fail("manager.capture")
        if lr_scheduler is not None:
            sched = lr_scheduler_json(lr_scheduler.state_dict())
        state, state_tensors = train_state.capture(
            step, _dist.rank(group), _dist.world_size(group), dataloader, extra_states
        )
        hf_config = hf_config_files(io.unwrap_model(model))
    except BaseException as e:
        err = e
    _dist.agree(err, f"capturing the state of step {step}", group)
    replicas = getattr(io, "check_replicas", "warn") != "off"
    if staging is not None:  # collective: only the slices this rank writes are copied
        model_plan = stage_written(
            model_plan, staging.setdefault("model", {}), group, replicas=replicas, model=model
        )
    # Optimizer planning gathers param groups from every rank: always in the foreground.
    if optimizer is not None:
        optim_plan = io.plan_optimizer(optimizer)
        if staging is not None:
            optim_plan = stage_written(
                optim_plan, staging.setdefault("optimizer", {}), group, replicas=replicas
            )
    if model_plan is None:  # pragma: no cover - agree() raised already
        raise RuntimeError("internal: no model plan after a successful capture")
    return Payload(step, stage, model_plan, optim_plan, sched, state, state_tensors, hf_config)
