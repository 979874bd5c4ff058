"""The byte progress bar of merge, verify, diff --deep and convert: each bar ends exactly at its total."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from unickpt import (
    GeneralCheckpointIO,
    OptimizerWrapper,
    diff_checkpoints,
    merge_checkpoint,
    verify_checkpoint,
)

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


DATA = Path(__file__).resolve().parents[2] / "data"


def _tensor_bytes(directory: Path, kind: str) -> int:
    from unickpt.ckpt.reader import open_checkpoint
    from unickpt.spec.dtypes import itemsize

    with open_checkpoint(str(directory), kind) as r:
        return sum(math.prod(e.shape) * itemsize(e.dtype) for e in r.tensors.values())


def test_conversions_fill_their_bars_exactly(tmp_path: Path, bars: list[Any]) -> None:
    """convert --from deepspeed (also --to run), --from colossalai, --to colossalai and --to
    deepspeed: one bar each (--to colossalai: merge's for the model, then the optimizer's), each
    ending at its total: the bytes of the tensors the output holds."""
    from unickpt.cli.main import main

    ds = tmp_path / "ds"
    assert (
        main(["convert", "--from", "deepspeed", str(DATA / "deepspeed" / "zero2_ws2" / "ckpt"), str(ds)]) == 0
    )
    ds_bytes = _tensor_bytes(ds, "model") + _tensor_bytes(ds, "optimizer")
    run = tmp_path / "run"
    assert (
        main(
            [
                "convert",
                "--from",
                "deepspeed",
                "--to",
                "run",
                str(DATA / "deepspeed" / "zero2_ws2" / "ckpt"),
                str(run),
            ]
        )
        == 0
    )
    colo = tmp_path / "colo"
    assert (
        main(
            [
                "convert",
                "--from",
                "colossalai",
                str(DATA / "colossalai" / "one_group" / "optimizer"),
                str(colo),
            ]
        )
        == 0
    )
    colo_bytes = _tensor_bytes(colo, "optimizer")
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.LayerNorm(6), torch.nn.Linear(6, 3))
    m.register_buffer("scale", torch.ones(3))
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(2, 4)).sum().backward()
    opt.step()
    io = GeneralCheckpointIO()
    io.save_model(m, str(tmp_path / "ck" / "model"), shard=True, gather_dtensor=True)
    io.save_optimizer(
        OptimizerWrapper(opt, m), str(tmp_path / "ck" / "optimizer"), shard=True, gather_dtensor=True
    )
    model_bytes = _tensor_bytes(tmp_path / "ck" / "model", "model")
    state_bytes = _tensor_bytes(tmp_path / "ck" / "optimizer", "optimizer")
    assert main(["convert", "--to", "colossalai", str(tmp_path / "ck"), str(tmp_path / "to_colo")]) == 0
    ucp = tmp_path / "ucp"
    assert main(["convert", "--to", "deepspeed", str(tmp_path / "ck"), str(ucp)]) == 0
    # every tensor in the universal checkpoint's per-parameter files
    ucp_bytes = 0
    for f in (ucp / "global_step1_universal" / "zero").glob("*/*.pt"):
        obj = torch.load(f, weights_only=True)
        t = obj if isinstance(obj, torch.Tensor) else obj["param"]
        ucp_bytes += t.numel() * t.element_size()
    # the model (fp32 weights, the buffer) once, plus the optimizer's state
    assert ucp_bytes == model_bytes + state_bytes
    assert [(x.kw["desc"], x.kw["total"], x.done, x.closed) for x in bars] == [
        ("convert --from deepspeed", ds_bytes, ds_bytes, True),
        ("convert --from deepspeed", ds_bytes, ds_bytes, True),
        ("convert --from colossalai", colo_bytes, colo_bytes, True),
        ("merge", model_bytes, model_bytes, True),
        ("convert --to colossalai", state_bytes, state_bytes, True),
        ("convert --to deepspeed", ucp_bytes, ucp_bytes, True),
    ]
    assert all(x.kw["unit"] == "B" and x.kw["leave"] is False for x in bars)


def test_bin_and_dcp_conversions_count_their_last_tensor(tmp_path: Path, bars: list[Any]) -> None:
    """The writer takes no block past the last: the bar is told each tensor as it is handed over."""
    import torch.distributed.checkpoint as dcp

    from unickpt.cli.main import main

    sd = {"a": torch.ones(5, 3), "b": torch.zeros(7, dtype=torch.bfloat16)}
    nbytes = 5 * 3 * 4 + 7 * 2
    (tmp_path / "bin").mkdir()
    torch.save(sd, tmp_path / "bin" / "pytorch_model.bin")
    dcp.save(sd, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert main(["convert", "--from", "bin", str(tmp_path / "bin"), str(tmp_path / "o1")]) == 0
    assert main(["convert", "--from", "dcp", str(tmp_path / "dcp"), str(tmp_path / "o2")]) == 0
    assert [(x.kw["desc"], x.kw["total"], x.done, x.closed) for x in bars] == [
        ("convert --from bin", nbytes, nbytes, True),
        ("convert --from dcp", nbytes, nbytes, True),
    ]


def test_conversions_are_silent_under_quiet(
    tmp_path: Path, bars: list[Any], capsys: pytest.CaptureFixture[str]
) -> None:
    from unickpt.cli.main import main

    m = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    opt.step()
    io = GeneralCheckpointIO()
    io.save_model(m, str(tmp_path / "ck" / "model"), shard=True, gather_dtensor=True)
    io.save_optimizer(
        OptimizerWrapper(opt, m), str(tmp_path / "ck" / "optimizer"), shard=True, gather_dtensor=True
    )
    capsys.readouterr()
    for i, args in enumerate(
        [
            ["--from", "deepspeed", str(DATA / "deepspeed" / "zero1_ws2" / "ckpt")],
            ["--from", "deepspeed", "--to", "run", str(DATA / "deepspeed" / "zero1_ws2" / "ckpt")],
            ["--from", "colossalai", str(DATA / "colossalai" / "one_group" / "optimizer")],
            ["--to", "colossalai", str(tmp_path / "ck")],
            ["--to", "deepspeed", str(tmp_path / "ck")],
        ]
    ):
        assert main(["convert", "-q", *args, str(tmp_path / f"out{i}")]) == 0
    assert bars == []
    assert capsys.readouterr() == ("", "")
