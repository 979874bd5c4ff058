"""unickpt convert: torch DCP directories and pytorch_model*.bin shards into unickpt checkpoints."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from unickpt import GeneralCheckpointIO, diff_checkpoints, merge_checkpoint, verify_checkpoint
from unickpt.ckpt.reader import open_checkpoint
from unickpt.cli.main import main
from unickpt.errors import IncompleteCheckpointError, UnsupportedError


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    m = torch.nn.Sequential(torch.nn.Linear(7, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
    m[2].to(torch.bfloat16)
    m[1].running_var.uniform_()
    return m


def _assert_same(m: torch.nn.Module, ckpt: Path) -> None:
    m2 = _model()
    for p in m2.parameters():
        p.data.zero_()
    GeneralCheckpointIO().load_model(m2, ckpt, verify=True)
    for (k, v), v2 in zip(m.state_dict().items(), m2.state_dict().values(), strict=True):
        assert v.dtype == v2.dtype and torch.equal(v, v2), k


def test_dcp_to_unickpt(tmp_path: Path) -> None:
    m = _model()
    src = tmp_path / "dcp"
    dcp.save({"model": m.state_dict(), "step": 7}, checkpoint_id=str(src), no_dist=True)
    out = tmp_path / "u"
    convert_out = main(["convert", "-q", "--from", "dcp", str(src), str(out), "--strip-prefix", "model."])
    assert convert_out == 0
    assert verify_checkpoint(out) == []
    r = open_checkpoint(out)
    assert set(r.tensors) == set(m.state_dict()) and all(t.fingerprint for t in r.tensors.values())
    _assert_same(m, out)
    # The imported checkpoint diffs identical to a native save of the same weights.
    GeneralCheckpointIO().save_model(m, tmp_path / "native", shard=True, gather_dtensor=False)
    assert diff_checkpoints(out, tmp_path / "native").identical
    merge_checkpoint(out, tmp_path / "merged")
    assert diff_checkpoints(tmp_path / "merged", tmp_path / "native").identical


def test_dcp_without_prefix_keeps_full_names_and_small_shards(tmp_path: Path) -> None:
    from unickpt.tools.convert import convert_checkpoint

    m = _model()
    src = tmp_path / "dcp"
    dcp.save({"model": m.state_dict()}, checkpoint_id=str(src), no_dist=True)
    out = convert_checkpoint(src, tmp_path / "u", source="dcp", max_shard_size=100)
    r = open_checkpoint(out)
    assert set(r.tensors) == {"model." + k for k in m.state_dict()}
    assert len(r.files) > 1
    idx = json.loads((Path(out) / "model.safetensors.index.json").read_text())
    assert set(idx["weight_map"].values()) == set(r.files)


def test_not_dcp_refused(tmp_path: Path) -> None:
    from unickpt.tools.convert import convert_checkpoint

    (tmp_path / "empty").mkdir()
    with pytest.raises(IncompleteCheckpointError):
        convert_checkpoint(tmp_path / "empty", tmp_path / "o", source="dcp")
    assert not (tmp_path / "o").exists()
    assert main(["convert", "--from", "dcp", str(tmp_path / "empty"), str(tmp_path / "o")]) == 2


def test_bin_shards_with_index(tmp_path: Path) -> None:
    from unickpt.tools.convert import convert_checkpoint

    m = _model()
    sd = m.state_dict()
    names = list(sd)
    src = tmp_path / "bin"
    src.mkdir()
    half = len(names) // 2
    wm = {}
    for i, part in enumerate((names[:half], names[half:])):
        fn = f"pytorch_model-0000{i + 1}-of-00002.bin"
        torch.save({k: sd[k] for k in part}, src / fn)
        wm.update(dict.fromkeys(part, fn))
    (src / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (src / "config.json").write_text('{"model_type": "toy"}')
    out = convert_checkpoint(src, tmp_path / "u", source="bin", target="hf")
    assert (Path(out) / "config.json").read_text() == '{"model_type": "toy"}'
    _assert_same(m, Path(out))


def test_bin_with_pickled_object_refused(tmp_path: Path) -> None:
    from unickpt.tools.convert import convert_checkpoint

    src = tmp_path / "bin"
    src.mkdir()
    torch.save({"w": torch.ones(2), "evil": Path("/etc")}, src / "pytorch_model.bin")
    with pytest.raises(UnsupportedError, match="weights_only"):
        convert_checkpoint(src, tmp_path / "u", source="bin")
    assert not (tmp_path / "u").exists()
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".u")]
