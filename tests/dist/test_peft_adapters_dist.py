"""PEFT adapters under FSDP2 (LoRA weights sharded as DTensors) and DDP (replicated), in a real
2-rank gloo world: ``booster.save_adapter`` writes the file peft's own ``save_pretrained`` writes
of the unsharded model (same names, same bytes), ``PeftModel.from_pretrained`` loads it, and
``booster.load_adapter`` puts peft's output and unickpt's, saved under either layout, back into
a sharded or replicated model bit for bit; a sliced ``save_model`` of the FSDP2 run merges
with ``--merge-adapters`` into what ``merge_and_unload`` gives.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from harness import WorldPool, run_cases

WORLD = 2
TIMEOUT_S = 240.0
pytestmark = pytest.mark.timeout(TIMEOUT_S + 60)


def _base() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(cfg)


def _lora(seed: int) -> Any:
    import torch
    from peft import LoraConfig, get_peft_model

    base = _base()
    torch.manual_seed(seed)  # the same on every rank: each builds the same model
    cfg = LoraConfig(
        r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False
    )
    return get_peft_model(base, cfg)


def _plugin(layout: str) -> Any:
    from unickpt.plugins import DDPPlugin, FSDP2Plugin

    return FSDP2Plugin() if layout == "fsdp2" else DDPPlugin()


def _full_adapter(model: Any) -> dict[str, Any]:
    """The LoRA tensors of a (possibly sharded) model, whole, on every rank."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        if "lora_" in n:
            out[n.removeprefix("module.")] = (
                (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            )
    return out


def _equal(a: dict[str, Any], b: dict[str, Any]) -> None:
    import torch

    assert sorted(a) == sorted(b), (sorted(a)[:3], sorted(b)[:3])
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def _save_case(root: str, layout: str) -> dict[str, Any]:
    import copy

    import torch
    import torch.distributed as dist
    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.distributed.tensor import DTensor

    from unickpt import Booster

    model = _lora(seed=1)
    reference = copy.deepcopy(model)
    want = _full_adapter(reference)
    if dist.get_rank() == 0:
        reference.save_pretrained(os.path.join(root, "peer"))
    dist.barrier()
    booster = Booster(plugin=_plugin(layout))
    boosted, *_ = booster.boost(model)
    sharded = [n for n, p in boosted.unwrap().named_parameters() if "lora_" in n and isinstance(p, DTensor)]
    assert (len(sharded) == 8) == (layout == "fsdp2"), sharded
    out = os.path.join(root, layout)
    booster.save_adapter(boosted, out)
    dist.barrier()
    ours = load_file(os.path.join(out, "adapter_model.safetensors"))
    _equal(ours, load_file(os.path.join(root, "peer", "adapter_model.safetensors")))
    loaded = PeftModel.from_pretrained(_base(), out)
    _equal(_full_adapter(loaded), want)
    if layout == "fsdp2":
        # A sliced save of the sharded run, merged offline into the base architecture.
        booster.save_model(boosted, os.path.join(root, "ck"), shard=True, gather_dtensor=False)
        dist.barrier()
        if dist.get_rank() == 0:
            from transformers import AutoModelForCausalLM

            from unickpt import merge_checkpoint

            merge_checkpoint(os.path.join(root, "ck"), os.path.join(root, "hf"), merge_adapters=True)
            got, info = AutoModelForCausalLM.from_pretrained(
                os.path.join(root, "hf"), output_loading_info=True
            )
            assert info["missing_keys"] == set() and info["unexpected_keys"] == set(), info
            merged = copy.deepcopy(reference).merge_and_unload().state_dict()
            gsd = got.state_dict()
            assert sorted(gsd) == sorted(merged)
            assert all(torch.equal(gsd[k], merged[k]) for k in merged)
        dist.barrier()
    return {"sharded": len(sharded)}


def _load_case(root: str, layout: str, source: str) -> None:
    from unickpt import Booster

    want = _full_adapter(_lora(seed=1))
    booster = Booster(plugin=_plugin(layout))
    target, *_ = booster.boost(_lora(seed=2))  # other LoRA weights
    before = _full_adapter(target.unwrap())
    assert any(not (before[k] == want[k]).all() for k in want)
    report = booster.load_adapter(target, os.path.join(root, source), verify=source != "peer")
    assert report.missing == [] and report.unexpected == [] and len(report.loaded) == 8
    _equal(_full_adapter(target.unwrap()), want)


def adapters_worker(root: str) -> dict[str, Any]:
    cases: list[tuple[str, Any]] = [
        ("save fsdp2", lambda: _save_case(root, "fsdp2")),
        ("save ddp", lambda: _save_case(root, "ddp")),
    ]
    for layout in ("fsdp2", "ddp"):
        for source in ("peer", "fsdp2", "ddp"):
            cases.append(
                (
                    f"load {source} into {layout}",
                    lambda layout=layout, source=source: _load_case(root, layout, source),
                )
            )
    return run_cases(cases)


@pytest.fixture(scope="module")
def results(world_pool: WorldPool, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("peft")
    root = str(tmp_path_factory.mktemp("peft"))
    return world_pool.run(WORLD, "test_peft_adapters_dist:adapters_worker", root, timeout=TIMEOUT_S)[0]  # type: ignore[no-any-return]


CASES = ["save fsdp2", "save ddp"] + [
    f"load {s} into {lay}" for lay in ("fsdp2", "ddp") for s in ("peer", "fsdp2", "ddp")
]


@pytest.mark.parametrize("case", CASES)
def test_adapters_under_fsdp2_and_ddp(results: dict[str, Any], case: str) -> None:
    res = results[case]
    if not res.ok:
        pytest.fail(f"case {case} failed:\n{res.error}", pytrace=False)
    if case.startswith("save"):
        assert res.value["sharded"] == (8 if case == "save fsdp2" else 0)
