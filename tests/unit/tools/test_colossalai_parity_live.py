"""The same calls through real Colossal-AI and through unickpt read each other's model files.

Needs colossalai beside torch, installed without touching torch::

    .venv/bin/pip install --no-deps colossalai psutil peft accelerate

Skipped, with the reason, where it is absent (``make test`` does not depend on it).
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from unickpt import GeneralCheckpointIO


def _colossal_io() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from colossalai.checkpoint_io import GeneralCheckpointIO as ColossalIO
    except Exception as e:  # ImportError, or a missing dependency of colossalai
        pytest.skip(f"colossalai is not importable here ({type(e).__name__}: {e})")
    return ColossalIO()


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2))


def _same(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("layout", ["dir", "file", "sharded"])
def test_colossalai_loads_what_unickpt_saves_with_use_safetensors(tmp_path: Path, layout: str) -> None:
    cio = _colossal_io()
    src = _model(0)
    path = {"dir": tmp_path / "d", "file": tmp_path / "w.safetensors", "sharded": tmp_path / "s"}[layout]
    io = GeneralCheckpointIO()
    io.save_model(
        src, path, shard=layout == "sharded", size_per_shard=0.0001, use_safetensors=True, use_async=True
    )
    io._sync_io()  # another library reads the files: wait for the background write
    dst = _model(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cio.load_model(dst, str(path))
    _same(src, dst)


def test_one_temporary_file_written_in_turn_by_colossalai_and_unickpt() -> None:
    cio = _colossal_io()
    src = _model(0)
    # Colossal-AI writes safetensors only to a path ending in .safetensors.
    with tempfile.NamedTemporaryFile(suffix=".safetensors") as f:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cio.save_model(src, f.name, use_safetensors=True)
        dst = _model(1)
        GeneralCheckpointIO().load_model(dst, f.name)
        _same(src, dst)
        # And unickpt saves onto the same file, which Colossal-AI's loader then reads again.
        GeneralCheckpointIO().save_model(_model(2), f.name, use_safetensors=True)
        dst2 = _model(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cio.load_model(dst2, f.name)
        _same(_model(2), dst2)


@pytest.mark.parametrize("layout", ["sliced", "gathered"])
def test_convert_to_colossalai_is_read_by_colossalai(
    tmp_path: Path, layout: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``unickpt convert --to colossalai``: Colossal-AI's own load_model, load_optimizer and
    load_lr_scheduler restore the model, AdamW (two groups) and the scheduler bit for bit.

    Colossal-AI's CPU accelerator refuses the device synchronisation its optimizer loader ends
    each shard with; on CPU there is nothing to wait for, so that call alone is made a no-op."""
    from unickpt import OptimizerWrapper
    from unickpt.cli.main import main

    cio = _colossal_io()
    from colossalai.accelerator import get_accelerator

    monkeypatch.setattr(type(get_accelerator()), "synchronize", lambda self, device=None: None)
    m = _model(0)
    groups = [
        {"params": [m[0].weight, m[2].weight], "weight_decay": 0.1},
        {"params": [m[0].bias, m[1].weight, m[1].bias, m[2].bias], "weight_decay": 0.0, "lr": 5e-4},
    ]
    opt = torch.optim.AdamW(groups, lr=1e-3, betas=(0.8, 0.95))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for i in range(3):
        m(torch.randn(5, 4, generator=torch.Generator().manual_seed(i))).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    io = GeneralCheckpointIO()
    gather = layout == "gathered"
    io.save_model(m, str(tmp_path / "ck" / "model"), shard=True, gather_dtensor=gather, size_per_shard=0.0001)
    io.save_optimizer(
        OptimizerWrapper(opt, m), str(tmp_path / "ck" / "optimizer"), shard=True, gather_dtensor=gather
    )
    io.save_lr_scheduler(sched, str(tmp_path / "ck" / "lr_scheduler.json"))
    out = tmp_path / "colossal"
    assert main(["convert", "-q", "--to", "colossalai", str(tmp_path / "ck"), str(out)]) == 0
    m2 = _model(1)
    opt2 = torch.optim.AdamW(
        [
            {"params": [m2[0].weight, m2[2].weight], "weight_decay": 0.0},
            {"params": [m2[0].bias, m2[1].weight, m2[1].bias, m2[2].bias], "weight_decay": 0.0},
        ]
    )
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cio.load_model(m2, str(out / "model"))
        cio.load_optimizer(opt2, str(out / "optimizer"))
        cio.load_lr_scheduler(sched2, str(out / "lr_scheduler.pt"))
    _same(m, m2)
    assert sched2.state_dict() == sched.state_dict()
    for ga, gb in zip(opt.param_groups, opt2.param_groups, strict=True):
        assert {k: v for k, v in ga.items() if k != "params"} == {
            k: v for k, v in gb.items() if k != "params"
        }
    for pa, pb in zip(
        [p for g in opt.param_groups for p in g["params"]],
        [p for g in opt2.param_groups for p in g["params"]],
        strict=True,
    ):
        sa, sb = opt.state[pa], opt2.state[pb]
        assert sa.keys() == sb.keys()
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
    # No tensor is pickled: every tensor lives in safetensors files.
    pickled = sorted(
        p.name for p in out.rglob("*") if p.is_file() and not p.name.endswith((".safetensors", ".json"))
    )
    assert pickled == ["lr_scheduler.pt", "pytorch_optim_group.bin"]
    for name in pickled:
        found = next(out.rglob(name))
        assert not any(isinstance(x, torch.Tensor) for x in _walk(torch.load(found, weights_only=True)))


def _walk(obj: Any) -> list[Any]:
    if isinstance(obj, dict):
        return [y for v in obj.values() for y in _walk(v)]
    if isinstance(obj, (list, tuple)):
        return [y for v in obj for y in _walk(v)]
    return [obj]
