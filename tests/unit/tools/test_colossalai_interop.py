"""Colossal-AI's sharded safetensors model checkpoints load as Hugging Face loaders read them.

Colossal-AI writes ``metadata.total_size`` in MB as a float; Hugging Face loaders read only
``weight_map``, and so does unickpt for an index without a unickpt block. The committed fixture
(tests/data/colossalai_sharded, made by real Colossal-AI 0.5.0 with
tests/data/make_colossalai_fixture.py) is tested always; the live tests need colossalai beside
torch, installed without touching torch:

    .venv/bin/pip install --no-deps colossalai psutil peft accelerate

and skip, saying so, where it is absent.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from unickpt import GeneralCheckpointIO, IndexFileError
from unickpt.cli.main import main as cli
from unickpt.tools.inspect import format_report, inspect_checkpoint

FIXTURE = Path(__file__).parents[2] / "data" / "colossalai_sharded"
sys.path.insert(0, str(FIXTURE.parent))
from make_colossalai_fixture import model as fixture_model  # noqa: E402


def _hf_reference(d: Path) -> dict[str, torch.Tensor]:
    """What a Hugging Face loader reads: weight_map, then each named tensor from its file."""
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    out = {}
    for name, file in idx["weight_map"].items():
        out[name] = load_file(d / file)[name]
    return out


def test_fixture_is_real_colossalai_output() -> None:
    idx = json.loads((FIXTURE / "model.safetensors.index.json").read_text())
    assert idx["metadata"]["total_size"] == 0.000324249267578125  # MB, a float
    assert "unickpt" not in idx


def test_fixture_loads_bit_exact(tmp_path: Path) -> None:
    ref = _hf_reference(FIXTURE)
    m = fixture_model()
    with torch.no_grad():
        for p in m.state_dict().values():
            p.zero_()
    report = GeneralCheckpointIO().load_model(m, str(FIXTURE))
    assert sorted(report.loaded) == sorted(ref)
    sd = m.state_dict()
    for name, t in ref.items():
        assert torch.equal(sd[name], t), name
    # The same values the model had when Colossal-AI saved it.
    for name, t in fixture_model().state_dict().items():
        assert torch.equal(sd[name], t), name


def test_fixture_matches_huggingface_hub(tmp_path: Path) -> None:
    hub = pytest.importorskip("huggingface_hub")
    m1, m2 = fixture_model(), fixture_model()
    with torch.no_grad():
        for p in (*m1.state_dict().values(), *m2.state_dict().values()):
            p.zero_()
    hub.load_torch_model(m1, str(FIXTURE))
    GeneralCheckpointIO().load_model(m2, str(FIXTURE))
    for (n1, t1), (n2, t2) in zip(m1.state_dict().items(), m2.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(t1, t2), n1


def test_fixture_inspect_and_verify_tell_the_truth(capsys: pytest.CaptureFixture[str]) -> None:
    info = inspect_checkpoint(FIXTURE)
    assert info["unickpt_block"] is False and info["totals"]["tensors"] == 5
    text = format_report(info)
    assert "created by unickpt" not in text and "plugin=general" not in text
    assert "plain Hugging Face" in text
    assert cli(["verify", "-q", str(FIXTURE)]) == 0
    assert cli(["verify", "--require-hashes", str(FIXTURE)]) == 1
    err = capsys.readouterr().err
    assert "5 slice(s) carry no hash" in err


def test_informational_metadata_of_a_plain_index(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    shutil.copytree(FIXTURE, d)
    idx_path = d / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    for md in ({"total_size": "a lot", "format": ["pt", 1]}, {"total_size": -1.5}, [], "x", None):
        idx["metadata"] = md
        idx["written_by"] = {"tool": "colossalai", "nested": [[{"a": 1}]]}
        idx_path.write_text(json.dumps(idx))
        m = fixture_model()
        GeneralCheckpointIO().load_model(m, str(d))
    # Inside a unickpt index the metadata stays strict.
    out = tmp_path / "uni"
    GeneralCheckpointIO().save_model(fixture_model(), str(out), shard=True)
    uidx = out / "model.safetensors.index.json"
    u = json.loads(uidx.read_text())
    u["metadata"]["total_size"] = 0.5
    uidx.write_text(json.dumps(u))
    with pytest.raises(IndexFileError, match=r"model.safetensors.index.json: .*metadata.total_size"):
        GeneralCheckpointIO().load_model(fixture_model(), str(out))


def test_live_colossalai_sharded_save_loads_bit_exact(tmp_path: Path) -> None:
    """Needs colossalai: ``.venv/bin/pip install --no-deps colossalai psutil peft accelerate``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from colossalai.checkpoint_io import GeneralCheckpointIO as ColossalIO
    except ImportError as e:
        pytest.skip(
            f"colossalai is not installed ({e}); pip install --no-deps colossalai psutil peft accelerate"
        )
    torch.manual_seed(3)
    src = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 9, bias=False))
    src.register_buffer("count", torch.tensor([3, 1], dtype=torch.int32))
    for size in (0, 1024):
        d = tmp_path / f"colo-{size}"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ColossalIO().save_model(src, str(d), shard=True, use_safetensors=True, size_per_shard=size)
        assert isinstance(
            json.loads((d / "model.safetensors.index.json").read_text())["metadata"]["total_size"], float
        )
        dst = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 9, bias=False))
        dst.register_buffer("count", torch.zeros(2, dtype=torch.int32))
        GeneralCheckpointIO().load_model(dst, str(d))
        for (n, a), (_, b) in zip(src.state_dict().items(), dst.state_dict().items(), strict=True):
            assert torch.equal(a, b), n
        assert os.path.isfile(d / "model.safetensors.index.json")
