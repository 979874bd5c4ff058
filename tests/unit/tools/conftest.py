"""Fixtures shared by the tests of ``unickpt.tools``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from _reliability import dcp_model, dcp_optimizer, dcp_train


class DcpRun(NamedTuple):
    """A DCP training checkpoint at ``src`` (model, optimizer, LR scheduler, ``train_state.step``
    3) and the objects it was saved from."""

    src: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


@pytest.fixture
def dcp_run(tmp_path: Path) -> DcpRun:
    """Three steps of a two-group AdamW run with a StepLR, saved with ``dcp.save`` to
    ``tmp_path/dcp`` under the keys torchtitan uses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = dcp_model()
    opt = dcp_optimizer(m)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        dcp_train(m, opt, 1)
        sched.step()
    msd, osd = get_state_dict(m, opt)
    src = tmp_path / "dcp"
    dcp.save(
        {"model": msd, "optim": osd, "lr_scheduler": sched.state_dict(), "train_state": {"step": 3}},
        checkpoint_id=str(src),
        no_dist=True,
    )
    return DcpRun(src, m, opt, sched)


@pytest.fixture
def fresh_training() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of :func:`dcp_run`'s architecture, zeroed, and its optimizer (no state yet)."""
    m = dcp_model()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    return m, dcp_optimizer(m)
