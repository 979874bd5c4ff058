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
