"""Which modules ExpertParallelPlugin shards as stacked experts (no process group needed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from unickpt.errors import UnsupportedError
from unickpt.plugins.ep import ExpertParallelPlugin, find_expert_modules


# Their own modules: the experts' stacked layout and the router are what expert parallelism splits.
class Stacked(nn.Module):
    def __init__(self, n: int = 4, bias: bool = False) -> None:
        super().__init__()
        self.num_experts = n
        self.gate_up_proj = nn.Parameter(torch.zeros(n, 6, 3))
        self.down_proj = nn.Parameter(torch.zeros(n, 3, 3))
        if bias:
            self.down_proj_bias = nn.Parameter(torch.zeros(n, 3))

    def forward(self, hidden_states: Any, top_k_index: Any, top_k_weights: Any) -> Any:
        return hidden_states


class Router(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.num_experts = n
        self.weight = nn.Parameter(torch.zeros(n, 3))


class Block(nn.Module):
    def __init__(self, bias: bool = False) -> None:
        super().__init__()
        self.gate = Router()
        self.experts = Stacked(bias=bias)
        self.shared = nn.Linear(3, 3)


def _mixtral() -> nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM

    cfg = MixtralConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=8,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=4,
    )
    return MixtralForCausalLM(cfg)


def test_default_search_finds_stacked_experts_not_routers() -> None:
    model = nn.ModuleDict({"a": Block(), "b": Block(bias=True)})
    assert find_expert_modules(model) == ["a.experts", "b.experts"]
    assert find_expert_modules(_mixtral()) == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]


def test_named_experts_by_fqn_or_class() -> None:
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    assert find_expert_modules(_mixtral(), [MixtralExperts]) == [
        "model.layers.0.mlp.experts",
        "model.layers.1.mlp.experts",
    ]
    assert find_expert_modules(nn.ModuleDict({"a": Block()}), ["a.experts"]) == ["a.experts"]


def test_named_modules_that_do_not_fit_are_refused() -> None:
    model = nn.ModuleDict({"a": Block()})
    with pytest.raises(UnsupportedError, match=r"names modules the model does not have: \['a.nope'\]"):
        find_expert_modules(model, ["a.nope"])
    with pytest.raises(
        UnsupportedError, match=r"'a.shared' \(Linear\) has no positive integer attribute num_experts"
    ):
        find_expert_modules(model, ["a.shared"])
    with pytest.raises(
        UnsupportedError, match=r"'a' \(Block\) has no positive integer attribute num_experts"
    ):
        find_expert_modules(model, ["a"])
    bad = Stacked()
    bad.extra = nn.Parameter(torch.zeros(3, 3))
    with pytest.raises(
        UnsupportedError,
        match=r"'x' \(Stacked\): parameters \['extra \(3, 3\)'\] are not stacked over its num_experts=4",
    ):
        find_expert_modules(nn.ModuleDict({"x": bad}), ["x"])
    router = nn.ModuleDict({"r": Router()})
    with pytest.raises(UnsupportedError, match=r"'r' \(Router\): forward takes 1 arguments"):
        find_expert_modules(router, ["r"])


@pytest.mark.parametrize("bad", [0, -1, True, 2.0])
def test_ep_size_must_be_a_positive_integer(bad: Any) -> None:
    with pytest.raises(
        UnsupportedError, match=rf"ExpertParallelPlugin\(ep_size={bad!r}\): a positive integer"
    ):
        ExpertParallelPlugin(ep_size=bad)
