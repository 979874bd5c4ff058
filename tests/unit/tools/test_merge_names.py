"""merge warns when the merged names are not what config.json's architecture loads (a PEFT run):
``from_pretrained`` would otherwise ignore the LoRA tensors and initialise the base ones at
random, silently. Checked against real transformers and peft models."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from unickpt import GeneralCheckpointIO, merge_checkpoint
from unickpt.tools.merge import ArchitectureMismatchWarning


def _llama(tied: bool = False) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_a_plain_model_merges_without_a_warning(tmp_path: Path, tied: bool) -> None:
    from transformers import AutoModelForCausalLM

    m = _llama(tied)
    GeneralCheckpointIO().save_model(m, str(tmp_path / "ck"), shard=True, gather_dtensor=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ArchitectureMismatchWarning)
        merge_checkpoint(tmp_path / "ck", tmp_path / "hf")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    for k, v in m.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k


def test_a_peft_run_is_warned_about(tmp_path: Path) -> None:
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(_llama(), peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"]))
    GeneralCheckpointIO().save_model(model, str(tmp_path / "ck"), shard=True, gather_dtensor=False)
    assert (tmp_path / "ck" / "config.json").exists()
    with pytest.warns(ArchitectureMismatchWarning) as got:
        merge_checkpoint(tmp_path / "ck", tmp_path / "hf")
    text = str(got[0].message)
    assert "29 tensor(s) that LlamaForCausalLM has no parameter for ('base_model.model." in text
    assert "20 parameter(s) of LlamaForCausalLM the checkpoint lacks ('model.embed_tokens.weight'" in text
    assert "which from_pretrained initialises at random" in text and "the names are a PeftModel's" in text
