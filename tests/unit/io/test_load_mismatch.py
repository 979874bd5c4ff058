"""A load that does not match its model says what differs in a report of bounded size: each list
(missing, unexpected, mismatched) named up to 20 entries with its count, the names a checkpoint
gives cut, however many there are and however long they are; nothing is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from unickpt import GeneralCheckpointIO
from unickpt.errors import StateMismatchError

LIMIT = 4000  # characters: the path, four headings and up to 20 names per list


def _params(n: int, shape: tuple[int, ...]) -> nn.Module:
    m = nn.Module()
    for i in range(n):
        m.register_parameter(f"p{i:02d}", nn.Parameter(torch.full(shape, float(i))))
    return m


def _refused(model: nn.Module, path: Path) -> str:
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(StateMismatchError) as e:
        GeneralCheckpointIO().load_model(model, str(path))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return str(e.value)


def test_a_thousand_long_unexpected_names_are_counted_and_cut(tmp_path: Path) -> None:
    names = [f"{'x' * 5000}.{i:04d}" for i in range(1000)]
    save_file({n: torch.zeros(2) for n in names}, str(tmp_path / "model.safetensors"))
    msg = _refused(_params(3, (2,)), tmp_path / "model.safetensors")
    assert len(msg) < LIMIT, len(msg)
    assert "missing from the checkpoint (3): ['p00', 'p01', 'p02']" in msg
    assert "in the checkpoint but not in the model (1000): ['xxxx" in msg
    # Each name cut in its middle, the first 16 named, then an ellipsis.
    assert (
        "xxxxxxxxxx...xxxxxxxxxx" in msg and "x.0000'" in msg and ".0015', ...]" in msg and ".0016" not in msg
    )


def test_size_mismatches_past_twenty_are_counted(tmp_path: Path) -> None:
    save_file({f"p{i:02d}": torch.zeros(3) for i in range(30)}, str(tmp_path / "model.safetensors"))
    msg = _refused(_params(30, (2,)), tmp_path / "model.safetensors")
    lines = [ln.strip() for ln in msg.splitlines()]
    shapes = [ln for ln in lines if ln.endswith("checkpoint has shape [3], model has [2]")]
    assert [ln.split(":")[0] for ln in shapes] == [f"p{i:02d}" for i in range(20)]
    assert "(and 10 more)" in lines


def test_a_long_prefix_is_named_cut(tmp_path: Path) -> None:
    head = "P" * 10000
    save_file({f"{head}.p{i:02d}": torch.zeros(2) for i in range(2)}, str(tmp_path / "model.safetensors"))
    msg = _refused(_params(2, (2,)), tmp_path / "model.safetensors")
    assert len(msg) < LIMIT, len(msg)
    assert "the checkpoint's names carry the prefix 'PPPP" in msg
    assert msg.count("... (10000 characters)") == 2 and "... (10001 characters)" in msg
