"""FSDP2's default units on Hugging Face and PEFT models, in a real 2-rank gloo world.

Each decoder layer (the model's ``_no_split_modules``) is its own ``fully_shard`` unit and the
root keeps the rest, as accelerate and transformers wrap; a ``PeftModel``, whose forward calls
the inner model directly, trains under the default units with the loss of the unsharded model.
"""

from __future__ import annotations

from typing import Any

import pytest
from harness import WorldPool, run_cases

WORLD = 2


def _llama(tied: bool) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(cfg)


def _gpt2() -> Any:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            vocab_size=64,
            n_embd=16,
            n_layer=2,
            n_head=4,
            n_positions=16,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    )


def _lora(base: Any) -> Any:
    from peft import LoraConfig, get_peft_model

    return get_peft_model(
        base, LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    )


def _loss(model: Any, ids: Any) -> Any:
    return model(input_ids=ids, labels=ids).loss


def _case(make: Any, expected_units: list[str]) -> dict[str, Any]:
    import copy

    import torch

    from unickpt.plugins import FSDP2Plugin

    model = make()
    reference = copy.deepcopy(model)
    ids = torch.arange(12).reshape(2, 6) % 64
    want = _loss(reference, ids)
    want.backward()
    plugin = FSDP2Plugin()
    wrapped, *_ = plugin.configure(model)
    assert plugin.units == expected_units, plugin.units
    got = _loss(wrapped, ids)
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    return {"units": plugin.units}


def units_worker() -> dict[str, Any]:
    layers = [f"model.layers.{i}" for i in range(3)]
    peft_layers = [f"base_model.model.model.layers.{i}" for i in range(3)]
    cases = [
        ("llama", lambda: _case(lambda: _llama(tied=False), layers)),
        ("llama_tied", lambda: _case(lambda: _llama(tied=True), layers)),
        ("gpt2", lambda: _case(_gpt2, ["transformer.h.0", "transformer.h.1"])),
        ("peft_lora_llama", lambda: _case(lambda: _lora(_llama(tied=False)), peft_layers)),
    ]
    return run_cases(cases)


@pytest.fixture(scope="module")
def results(world_pool: WorldPool) -> dict[str, Any]:
    pytest.importorskip("peft")
    return world_pool.run(WORLD, "test_fsdp_units_hf:units_worker", timeout=240)[0]  # type: ignore[no-any-return]


@pytest.mark.parametrize("case", ["llama", "llama_tied", "gpt2", "peft_lora_llama"])
def test_default_units_of_hf_models(results: dict[str, Any], case: str) -> None:
    res = results[case]
    if not res.ok:
        pytest.fail(f"case {case} failed:\n{res.error}", pytrace=False)
