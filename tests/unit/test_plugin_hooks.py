"""Plugins customise CheckpointIO through private hooks only: the public methods are final."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from pathlib import Path
from typing import Any

import pytest
import torch

import unickpt.plugins
from unickpt.io.checkpoint_io import CheckpointIO
from unickpt.io.hooks import FINAL_METHODS, HookContext


def _all_io_classes() -> list[type[CheckpointIO]]:
    for info in pkgutil.walk_packages(unickpt.plugins.__path__, "unickpt.plugins."):
        importlib.import_module(info.name)
    importlib.import_module("unickpt.io.general")
    out: list[type[CheckpointIO]] = []
    todo = [CheckpointIO]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub.__module__.startswith("unickpt."):
                out.append(sub)
                todo.append(sub)
    return out


def test_every_plugin_io_is_found() -> None:
    names = {cls.__name__ for cls in _all_io_classes()}
    assert {
        "DDPCheckpointIO",
        "FSDP2CheckpointIO",
        "TPCheckpointIO",
        "PPCheckpointIO",
        "ZeroCheckpointIO",
        "HybridCheckpointIO",
        "HybridZeroCheckpointIO",
        "GeneralCheckpointIO",
    } <= names


@pytest.mark.parametrize("cls", _all_io_classes(), ids=lambda c: c.__name__)
def test_no_plugin_overrides_a_public_method(cls: type[CheckpointIO]) -> None:
    for klass in cls.__mro__:
        if klass is CheckpointIO or not issubclass(klass, CheckpointIO):
            continue
        assert not [name for name in FINAL_METHODS if name in vars(klass)], klass
        # Every other public method is inherited too: plugins add private hooks only.
        public = [n for n, v in vars(klass).items() if not n.startswith("_") and inspect.isfunction(v)]
        assert not public, f"{klass.__name__} defines public methods {public}"


@pytest.mark.parametrize("cls", _all_io_classes(), ids=lambda c: c.__name__)
def test_no_per_call_state_on_the_io(cls: type[CheckpointIO]) -> None:
    io = cls() if "partition" not in inspect.signature(cls).parameters else cls(partition=None)
    assert not [k for k in vars(io) if k in ("_gather", "_saving", "_loading", "_flat", "_keep")]
    assert not [k for k in vars(io) if k.startswith("_loading") or k.startswith("_placeholders")]


@pytest.mark.parametrize("name", FINAL_METHODS)
def test_overriding_a_public_method_is_refused(name: str) -> None:
    with pytest.raises(TypeError, match="final"):
        type("Bad", (CheckpointIO,), {name: lambda self, *a, **k: None})


def test_hook_context_is_frozen() -> None:
    ctx = HookContext("model", saving=True, model=torch.nn.Linear(1, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.saving = False  # type: ignore[misc]
    with pytest.raises(Exception, match="optimizer"):
        _ = ctx.optim


def test_every_save_path_hands_the_hooks_its_context(tmp_path: Path) -> None:
    from unickpt import GeneralCheckpointIO, OptimizerWrapper

    seen: list[HookContext] = []

    class Recording(GeneralCheckpointIO):
        def _optimizer_state(self, ctx: HookContext) -> dict[str, Any]:
            seen.append(ctx)
            return super()._optimizer_state(ctx)

    model = torch.nn.Linear(3, 2)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    optim.step()
    io, wrapped = Recording(), OptimizerWrapper(optim, model)
    io.save_optimizer(wrapped, tmp_path / "a", shard=True, gather_dtensor=False)
    io.plan_optimizer(wrapped)  # CheckpointManager's path
    io.save_optimizer(wrapped, tmp_path / "b")
    io.load_optimizer(wrapped, tmp_path / "b")
    assert [(c.kind, c.saving, c.gather, c.shard) for c in seen] == [
        ("optimizer", True, False, True),
        ("optimizer", True, False, True),
        ("optimizer", True, True, False),
        ("optimizer", False, False, True),
    ]
    assert all(c.model is model and c.optimizer is optim for c in seen)
    assert len({id(c) for c in seen}) == 4  # one context per call
