"""unickpt inspect / verify as library functions."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unickpt import GeneralCheckpointIO, verify_checkpoint
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import HeaderError, IncompleteCheckpointError
from unickpt.tools.inspect import format_report, inspect_checkpoint


def _save(tmp_path: Path, **kw: bool) -> Path:
    torch.manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return Path(GeneralCheckpointIO().save_model(m, tmp_path / "c", **kw))


@pytest.mark.parametrize("shard,gather", [(False, True), (True, True), (True, False)])
def test_inspect_lists_everything(tmp_path: Path, shard: bool, gather: bool) -> None:
    p = _save(tmp_path, shard=shard, gather_dtensor=gather)
    info = inspect_checkpoint(p, slices=True)
    assert info["kind"] == "model" and info["layout"]["gathered"] == gather
    short = inspect_checkpoint(p)  # without slices=True: a preview of each tensor's first slices
    assert all("slices" not in e for e in short["tensors"].values())
    assert [e["slice_preview"] for e in short["tensors"].values()] == [
        e["slices"][:4] for e in info["tensors"].values()
    ]
    assert set(info["tensors"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    w = info["tensors"]["0.weight"]
    assert w["dtype"] == "F32" and w["shape"] == [3, 4] and w["bytes"] == 48 and w["num_slices"] == 1
    assert w["fingerprint"] and w["slices"][0]["xxh3"]
    assert info["totals"]["bytes"] == (12 + 3 + 6 + 2) * 4
    text = format_report(info, verbose=True)
    assert "0.weight" in text and "xxh3=" in text and "fingerprint" in text


def test_verify_finds_flipped_byte_naming_tensor_and_file(tmp_path: Path) -> None:
    p = _save(tmp_path, shard=True, gather_dtensor=False)
    assert verify_checkpoint(p) == []
    r = open_checkpoint(p)
    s = r.tensors["1.weight"].slices[0]
    path, off, _ = r.key_location(s.file, s.key)
    r.close()
    with open(path, "r+b") as f:
        f.seek(off + 2)
        f.write(b"\x7f")
    failures = verify_checkpoint(p, progress=True)
    assert [(x.tensor, x.file) for x in failures] == [("1.weight", s.file)]


def test_verify_unusable_inputs_raise(tmp_path: Path) -> None:
    with pytest.raises(IncompleteCheckpointError):
        verify_checkpoint(tmp_path / "nothing")
    p = _save(tmp_path, shard=True, gather_dtensor=True)
    data = next(f for f in p.iterdir() if f.name.startswith("model-"))
    data.write_bytes(data.read_bytes()[:-4])  # truncated: the header no longer tiles the data
    with pytest.raises(HeaderError):
        verify_checkpoint(p)
