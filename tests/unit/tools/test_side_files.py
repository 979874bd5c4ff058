"""convert and merge carry a Hugging Face model's side files (config, generation config, tokenizer)
from wherever the source has them, so ``from_pretrained`` reads the output like the original."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from unickpt.cli.main import main

DATA = Path(__file__).resolve().parents[2] / "data"
SIDE = {
    "config.json": None,  # filled from the model
    "generation_config.json": b'{"max_new_tokens": 5}',
    "tokenizer.json": b'{"version": "1.0", "model": {}}',
    "tokenizer_config.json": b'{"model_max_length": 16}',
    "special_tokens_map.json": b"{}",
}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    m = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=4, n_positions=16))
    root = tmp_path_factory.mktemp("hf")
    m.save_pretrained(root / "hf")
    return root, m


def _put_side(d: Path, hf: Path) -> dict[str, bytes]:
    want = {n: (v if v is not None else (hf / n).read_bytes()) for n, v in SIDE.items()}
    for n, v in want.items():
        (d / n).write_bytes(v)
    return want


def _check(out: Path, want: dict[str, bytes], model: torch.nn.Module | None) -> None:
    for n, v in want.items():
        assert (out / n).read_bytes() == v, n
    if model is not None:
        from transformers import AutoModelForCausalLM

        loaded = AutoModelForCausalLM.from_pretrained(out)
        for k, v in model.state_dict().items():
            assert torch.equal(loaded.state_dict()[k], v), k


def test_convert_from_dcp_and_a_torchtitan_folder(gpt2: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, m = gpt2
    src = tmp_path / "dcp"
    dcp.save(m.state_dict(), checkpoint_id=str(src), no_dist=True)
    want = _put_side(src, root / "hf")
    assert main(["convert", "-q", "--from", "dcp", str(src), str(tmp_path / "out")]) == 0
    _check(tmp_path / "out", want, m)
    # torchtitan: step-<N>/ DCP directories, the model's files in the folder itself
    titan = tmp_path / "titan"
    dcp.save(m.state_dict(), checkpoint_id=str(titan / "step-5"), no_dist=True)
    want = _put_side(titan, root / "hf")
    assert main(["convert", "-q", "--from", "dcp", str(titan), str(tmp_path / "out2")]) == 0
    _check(tmp_path / "out2", want, m)


def test_convert_from_bin_and_deepspeed(gpt2: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    root, m = gpt2
    bins = tmp_path / "bin"
    bins.mkdir()
    torch.save(m.state_dict(), bins / "pytorch_model.bin")
    want = _put_side(bins, root / "hf")
    assert main(["convert", "-q", "--from", "bin", str(bins / "pytorch_model.bin"), str(tmp_path / "o")]) == 0
    _check(tmp_path / "o", want, m)
    # A Hugging Face Trainer's DeepSpeed checkpoint-<N>/: config and tokenizer beside latest
    ds = tmp_path / "checkpoint-3"
    shutil.copytree(DATA / "deepspeed" / "zero1_ws1" / "ckpt", ds)
    want = _put_side(ds, root / "hf")
    assert main(["convert", "-q", "--from", "deepspeed", str(ds), str(tmp_path / "o2")]) == 0
    _check(tmp_path / "o2", want, None)


def test_merge_carries_them(gpt2: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    from unickpt import GeneralCheckpointIO

    root, m = gpt2
    GeneralCheckpointIO().save_model(m, str(tmp_path / "sliced"), shard=True, gather_dtensor=False)
    want = _put_side(tmp_path / "sliced", root / "hf")
    assert main(["merge", "-q", str(tmp_path / "sliced"), str(tmp_path / "merged")]) == 0
    _check(tmp_path / "merged", want, m)
