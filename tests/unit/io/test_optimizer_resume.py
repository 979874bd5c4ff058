"""Optimizer state that is partly absent, and param_groups that lie: one process, real files.

* Parameters that never stepped (frozen but in the optimizer, unused, a whole group without
  gradients, an optimizer saved before its first step) come back without state; the others
  bit-exactly; training resumed from the checkpoint follows the uninterrupted run exactly.
* Hostile ``param_groups`` in the index are refused with ``StateMismatchError`` naming the
  group, key, expectation and finding, before anything changes (asserted on the optimizer's
  state, its groups and the model).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from unickpt import GeneralCheckpointIO, OptimizerWrapper
from unickpt._faults import InjectedFault, injected
from unickpt.errors import IndexFileError, StateMismatchError

OPT_INDEX = "optimizer.safetensors.index.json"


# Its own model: a frozen layer in the optimizer and a layer that never gets a gradient are
# what the resume checks.
class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 5)
        self.frozen = nn.Linear(5, 5)  # requires_grad=False, still in the optimizer
        self.head = nn.Linear(5, 3)
        self.expert = nn.Linear(5, 3)  # never used in forward: no gradient, ever

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.a(x)))


def build(lr: float = 0.05) -> tuple[Net, torch.optim.Optimizer]:
    net = Net()
    net.frozen.requires_grad_(False)
    groups = [
        {"params": [net.a.weight, net.a.bias, net.head.weight, net.head.bias]},
        # a whole group that never steps: frozen and unused parameters only
        {"params": [net.frozen.weight, net.frozen.bias, net.expert.weight, net.expert.bias], "lr": 0.01},
    ]
    return net, torch.optim.AdamW(groups, lr=lr, betas=(0.8, 0.95), weight_decay=0.1)


def train(net: Net, opt: torch.optim.Optimizer, steps: range) -> None:
    for i in steps:
        g = torch.Generator().manual_seed(100 + i)
        opt.zero_grad()
        net(torch.randn(3, 4, generator=g)).square().mean().backward()
        opt.step()


def state_by_name(net: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    names = {id(p): n for n, p in net.named_parameters()}
    return {
        names[id(p)]: {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()}
        for p, st in opt.state.items()
    }


def assert_same_state(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> None:
    assert sorted(a) == sorted(b)
    for n in a:
        assert sorted(a[n]) == sorted(b[n]), n
        for k in a[n]:
            x, y = a[n][k], b[n][k]
            assert x.dtype == y.dtype and x.shape == y.shape, (n, k)
            assert torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8)), (n, k)


def groups_without_params(opt: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_never_stepped_parameters_round_trip_and_resume_exactly(tmp_path: Path, layout: str) -> None:
    io = GeneralCheckpointIO()
    ref_net, ref_opt = build()
    train(ref_net, ref_opt, range(6))  # the uninterrupted run

    net, opt = build()
    train(net, opt, range(3))
    saved = state_by_name(net, opt)
    assert sorted(saved) == ["a.bias", "a.weight", "head.bias", "head.weight"]
    shard = layout == "sharded"
    io.save_model(net, tmp_path / "m", shard=shard)
    io.save_optimizer(OptimizerWrapper(opt, net), tmp_path / "o", shard=shard)
    # saving invented no state for the parameters that never stepped
    assert_same_state(state_by_name(net, opt), saved)

    net2, opt2 = build(lr=0.7)  # different hyperparameters: the checkpoint's win
    io.load_model(net2, tmp_path / "m")
    io.load_optimizer(OptimizerWrapper(opt2, net2), tmp_path / "o")
    assert_same_state(state_by_name(net2, opt2), saved)
    assert groups_without_params(opt2) == groups_without_params(opt)
    train(net2, opt2, range(3, 6))
    for (n, p), q in zip(net2.named_parameters(), ref_net.parameters(), strict=True):
        assert torch.equal(p, q), f"{n} differs from the uninterrupted run"
    assert_same_state(state_by_name(net2, opt2), state_by_name(ref_net, ref_opt))


def test_optimizer_saved_before_its_first_step(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    net, opt = build()
    io.save_optimizer(OptimizerWrapper(opt, net), tmp_path / "o", shard=True)
    assert not opt.state  # no zero-gradient step invented state
    index = json.loads((tmp_path / "o" / OPT_INDEX).read_text())
    assert index["unickpt"]["tensors"] == {}
    net2, opt2 = build(lr=0.3)
    io.load_optimizer(OptimizerWrapper(opt2, net2), tmp_path / "o")
    assert not opt2.state and opt2.param_groups[0]["lr"] == 0.05
    ref_net, ref_opt = build()
    train(ref_net, ref_opt, range(2))
    train(net2, opt2, range(2))
    for p, q in zip(net2.parameters(), ref_net.parameters(), strict=True):
        assert torch.equal(p, q)


def test_partly_stepped_live_optimizer_loads_exactly(tmp_path: Path) -> None:
    """Loading into an optimizer that already holds state for some parameters only."""
    io = GeneralCheckpointIO()
    net, opt = build()
    train(net, opt, range(2))
    io.save_optimizer(OptimizerWrapper(opt, net), tmp_path / "o", shard=True)
    net2, opt2 = build()
    train(net2, opt2, range(5))
    io.load_optimizer(OptimizerWrapper(opt2, net2), tmp_path / "o")
    assert_same_state(state_by_name(net2, opt2), state_by_name(net, opt))


# ---------------------------------------------------------------- hostile param_groups


@pytest.fixture
def saved_optimizer(tmp_path: Path) -> Path:
    net, opt = build()
    train(net, opt, range(2))
    GeneralCheckpointIO().save_optimizer(OptimizerWrapper(opt, net), tmp_path / "o", shard=True)
    return tmp_path / "o"


def _edit_groups(directory: Path, edit: Any) -> None:
    path = directory / OPT_INDEX
    index = json.loads(path.read_text())
    edit(index["unickpt"]["param_groups"])
    path.write_text(json.dumps(index))


def _set(gi: int, key: str, value: Any) -> Any:
    def edit(groups: list[dict[str, Any]]) -> None:
        groups[gi][key] = value

    return edit


def _del(gi: int, key: str) -> Any:
    def edit(groups: list[dict[str, Any]]) -> None:
        del groups[gi][key]

    return edit


def _move_param(src: int, dst: int) -> Any:
    def edit(groups: list[dict[str, Any]]) -> None:
        groups[dst]["params"].append(groups[src]["params"].pop(0))

    return edit


def _dup_param(groups: list[dict[str, Any]]) -> None:
    groups[1]["params"].append(groups[0]["params"][0])


HOSTILE = [
    # (case, edit, message fragments)
    ("lr_string", _set(0, "lr", "abc"), ["param_groups[0]['lr']", "expected a number", "'abc'"]),
    ("lr_nan", _set(0, "lr", math.nan), ["param_groups[0]['lr']", "expected a finite number", "nan"]),
    ("lr_inf", _set(1, "lr", math.inf), ["param_groups[1]['lr']", "finite", "inf"]),
    ("lr_bool", _set(0, "lr", True), ["param_groups[0]['lr']", "expected a number", "True"]),
    ("betas_short", _set(0, "betas", [1]), ["param_groups[0]['betas']", "a list of 2 value(s)", "[1]"]),
    ("betas_strings", _set(0, "betas", ["a", 0.9]), ["['betas']", "a number at index 0"]),
    ("betas_scalar", _set(0, "betas", 0.9), ["['betas']", "a list of 2"]),
    ("amsgrad_int", _set(0, "amsgrad", 1), ["['amsgrad']", "expected a bool", "1"]),
    # Malformed params lists are refused when the index is opened (IndexFileError), before any
    # comparison with the optimizer.
    ("params_int", _set(0, "params", 5), ["param_groups[0].params must be a list of parameter names"]),
    ("params_ints", _set(0, "params", [1, 2]), ["param_groups[0].params", "a list of parameter names"]),
    (
        "params_unknown",
        _set(1, "params", ["nope.weight"]),
        ["['params']", "optimizer's parameters", "nope.weight"],
    ),
    ("params_twice", _dup_param, ["is listed in param_groups[0] and param_groups[1]"]),
    ("unknown_key_nan", _set(0, "warp_factor", math.nan), ["['warp_factor']", "a plain value", "nan"]),
    ("unknown_key_object", _set(0, "warp_factor", {"a": 1}), ["['warp_factor']", "a plain value"]),
    ("group_split", _move_param(0, 1), ["param group 0 is split over saved groups [0, 1]"]),
    (
        "tensor_lr_hostile",
        _set(0, "lr", {"__tensor__": {"dtype": "F32", "shape": "x", "data": []}}),
        ["['lr']"],
    ),
]


@pytest.mark.parametrize("case,edit,fragments", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_param_groups_refused_before_any_change(
    saved_optimizer: Path, case: str, edit: Any, fragments: list[str]
) -> None:
    _edit_groups(saved_optimizer, edit)
    # a live optimizer that has stepped (state to protect) and one that has not
    for steps in (range(1), range(0)):
        net, opt = build(lr=0.3)
        train(net, opt, steps)
        before_state = state_by_name(net, opt)
        before_groups = copy.deepcopy(groups_without_params(opt))
        before_ids = [[id(p) for p in g["params"]] for g in opt.param_groups]
        before_model = {k: v.clone() for k, v in net.state_dict().items()}
        with pytest.raises((StateMismatchError, IndexFileError)) as ei:
            GeneralCheckpointIO().load_optimizer(OptimizerWrapper(opt, net), saved_optimizer)
        msg = str(ei.value)
        for frag in fragments:
            assert frag in msg, f"{case}: {frag!r} not in {msg!r}"
        assert str(saved_optimizer) in msg
        assert_same_state(state_by_name(net, opt), before_state)
        assert groups_without_params(opt) == before_groups
        assert [[id(p) for p in g["params"]] for g in opt.param_groups] == before_ids
        for k, v in net.state_dict().items():
            assert torch.equal(v, before_model[k])


def test_groups_that_do_not_match_the_optimizer(saved_optimizer: Path) -> None:
    """One live group where the checkpoint has two: refused, nothing changed."""
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, betas=(0.8, 0.95), weight_decay=0.1)
    with pytest.raises(StateMismatchError, match=r"split over saved groups \[0, 1\]"):
        GeneralCheckpointIO().load_optimizer(OptimizerWrapper(opt, net), saved_optimizer)
    assert not opt.state


def test_injected_fault_while_applying_leaves_no_invented_state(saved_optimizer: Path) -> None:
    net, opt = build()
    with injected("optimizer.load.apply", 0), pytest.raises(InjectedFault):
        GeneralCheckpointIO().load_optimizer(OptimizerWrapper(opt, net), saved_optimizer)
    assert not opt.state


def test_unused_parameter_state_is_not_loaded_into_a_frozen_one(tmp_path: Path) -> None:
    """Saved with ``frozen`` trainable (it has state), loaded with it frozen: refused, named, nothing invented."""
    io = GeneralCheckpointIO()
    net, opt = build()
    net.frozen.requires_grad_(True)
    train(net, opt, range(2))
    io.save_optimizer(OptimizerWrapper(opt, net), tmp_path / "o", shard=True)
    net2, opt2 = build()
    with pytest.raises(StateMismatchError, match=r"no state slot for 2 parameter\(s\).*frozen\.weight") as ei:
        io.load_optimizer(OptimizerWrapper(opt2, net2), tmp_path / "o")
    assert sorted(ei.value.missing) == ["frozen.bias", "frozen.weight"]
    assert not opt2.state


def test_key_missing_from_the_checkpoint_keeps_the_live_value(
    saved_optimizer: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """torch adds group options over versions: an older checkpoint without one still loads."""
    _edit_groups(saved_optimizer, _del(1, "weight_decay"))
    net, opt = build(lr=0.3)
    opt.param_groups[1]["weight_decay"] = 0.25
    with caplog.at_level("WARNING"):
        GeneralCheckpointIO().load_optimizer(OptimizerWrapper(opt, net), saved_optimizer)
    assert opt.param_groups[1]["weight_decay"] == 0.25  # kept
    assert opt.param_groups[0]["lr"] == 0.05 and opt.param_groups[1]["lr"] == 0.01  # from the checkpoint
    assert "param_groups[1] has no 'weight_decay'; the optimizer keeps its own value 0.25" in caplog.text


def test_scheduler_keys_of_the_saved_groups_are_kept(tmp_path: Path) -> None:
    """A checkpoint saved with an LR scheduler attached carries ``initial_lr`` in its groups; a fresh
    optimizer (no scheduler yet) takes it, as torch's own load_state_dict does, so a scheduler
    created afterwards with ``last_epoch`` resumes."""
    net, opt = build(lr=0.3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    train(net, opt, range(2))
    sched.step()
    GeneralCheckpointIO().save_optimizer(OptimizerWrapper(opt, net), tmp_path / "o", shard=True)
    net2, opt2 = build(lr=0.3)
    assert "initial_lr" not in opt2.param_groups[0]
    GeneralCheckpointIO().load_optimizer(OptimizerWrapper(opt2, net2), tmp_path / "o")
    assert [g["initial_lr"] for g in opt2.param_groups] == [g["initial_lr"] for g in opt.param_groups]
    assert [g["lr"] for g in opt2.param_groups] == [g["lr"] for g in opt.param_groups]
    torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5, last_epoch=0)  # needs initial_lr
