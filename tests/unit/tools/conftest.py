"""Fixtures shared by the tests of ``unickpt.tools``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch


class DcpRun(NamedTuple):
    """A DCP training checkpoint at ``src`` (model, optimizer, LR scheduler, ``train_state.step``
    3) and the objects it was saved from."""

    src: Path
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any


def _model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 3))


def _optim(m: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        [
            {"params": [m[0].weight, m[2].weight], "lr": 1e-2},
            {"params": [m[0].bias, m[1].weight, m[1].bias, m[2].bias], "lr": 3e-3, "weight_decay": 0.0},
        ],
        betas=(0.85, 0.97),
    )


def _train(m: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, seed: int = 11) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        m(torch.randn(3, 5, generator=g)).square().sum().backward()
        opt.step()
        opt.zero_grad()


@pytest.fixture
def dcp_run(tmp_path: Path) -> DcpRun:
    """Three steps of a two-group AdamW run with a StepLR, saved with ``dcp.save`` to
    ``tmp_path/dcp`` under the keys torchtitan uses."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    m = _model()
    opt = _optim(m)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(3):
        _train(m, opt, 1)
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
    m = _model()
    with torch.no_grad():
        for p in m.parameters():
            p.zero_()
    return m, _optim(m)
