"""The byte progress bar of merge, verify and diff --deep: each bar ends exactly at its total."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from unickpt import GeneralCheckpointIO, diff_checkpoints, merge_checkpoint, verify_checkpoint

BARS: list[Any] = []


class _Bar:
    """Stands in for tqdm: records what a tool asks of its bar."""

    def __init__(self, **kw: Any) -> None:
        self.kw, self.done, self.closed = kw, 0, False
        BARS.append(self)

    def __enter__(self) -> _Bar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True

    def update(self, n: int) -> None:
        self.done += n


@pytest.fixture
def bars(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", _Bar)
    BARS.clear()
    return BARS


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))


def test_each_tool_fills_its_bar_exactly(tmp_path: Path, bars: list[Any]) -> None:
    a = GeneralCheckpointIO().save_model(_model(0), tmp_path / "a", shard=True, gather_dtensor=False)
    b = GeneralCheckpointIO().save_model(_model(1), tmp_path / "b", shard=True, gather_dtensor=False)
    nbytes = (7 * 5 + 5 + 5 * 3 + 3) * 4
    assert verify_checkpoint(a, progress=True) == []
    merge_checkpoint(a, tmp_path / "m", progress=True)
    report = diff_checkpoints(a, b, deep=True, progress=True)
    assert len(report.changed) == 4
    # verify and merge read every byte once; diff --deep reads both sides twice (sum, compare).
    assert [(x.kw["desc"], x.kw["total"], x.done, x.closed) for x in bars] == [
        ("verify", nbytes, nbytes, True),
        ("merge", nbytes, nbytes, True),
        ("diff --deep", 4 * nbytes, 4 * nbytes, True),
    ]
    assert all(x.kw["unit"] == "B" and x.kw["leave"] is False for x in bars)


def test_no_bar_without_progress(tmp_path: Path, bars: list[Any]) -> None:
    a = GeneralCheckpointIO().save_model(_model(0), tmp_path / "a", shard=True, gather_dtensor=False)
    assert verify_checkpoint(a) == []
    merge_checkpoint(a, tmp_path / "m")
    assert diff_checkpoints(a, a, deep=True).changed == []
    assert diff_checkpoints(a, a, progress=True).changed == []  # nothing is read: no bar
    assert bars == []


def test_a_hidden_bar_does_not_import_tqdm() -> None:
    code = (
        "import sys\nfrom unickpt.tools._progress import progress_bar\n"
        "with progress_bar(10, 'x', False) as update:\n    update(10)\n"
        "assert 'tqdm' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
