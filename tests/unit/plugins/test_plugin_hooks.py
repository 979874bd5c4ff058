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
from unickpt.io.checkpoint_io import FINAL_METHODS, CheckpointIO, HookContext


def _all_io_classes() -> list[type[CheckpointIO]]:
    for info in pkgutil.walk_packages(unickpt.plugins.__path__, "unickpt.plugins."):
        importlib.import_module(info.name)
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


_NEW_PLUGIN = r"""
import sys, tempfile
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from unickpt import Booster, CheckpointIO
from unickpt.plugins import Plugin
from unickpt.plugins._shared import mesh as _mesh
from unickpt.plugins.base import check_optimizer, parameter_fqns, remap_optimizer_params
from unickpt.wrappers import ModelWrapper

class CPCheckpointIO(CheckpointIO):
    plugin_name = "cp"

class CPPlugin(Plugin):
    name = "cp"
    checkpoint_io_class = CPCheckpointIO
    def _parallelize(self, model, optimizer):
        self._mesh = _mesh.build_mesh((self.world_size,), ("cp",))
        check_optimizer(optimizer, model)
        old = parameter_fqns(model)
        parallelize_module(model, self._mesh, {"0": ColwiseParallel()})
        remap_optimizer_params(optimizer, old, model)
        return ModelWrapper(model)

class NoIO(CPPlugin):
    checkpoint_io_class = None

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU())
opt = torch.optim.SGD(model.parameters(), lr=0.1)
crit, loader, sched = object(), object(), object()
plugin = CPPlugin()
booster = Booster(plugin=plugin)
m, o, c, d, s = plugin.configure(model, opt, crit, loader, sched)
assert (o, c, d, s) == (opt, crit, loader, sched), "configure hands the other objects back"
assert type(m) is ModelWrapper and [p for g in opt.param_groups for p in g["params"]][0] is m.unwrap()[0].weight
io = plugin.get_checkpoint_io()
assert type(io) is CPCheckpointIO and plugin.get_checkpoint_io() is io and io.mesh is plugin.device_mesh
out = tempfile.mkdtemp()
io.save_model(m, out + "/m", shard=True, gather_dtensor=False)
fresh = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.ReLU())
plugin.configure(fresh)
io2 = plugin.get_checkpoint_io()
assert io2 is not io, "a new configure builds a new IO for the new mesh"
io2.load_model(fresh, out + "/m", verify=True)
for a, b in zip(model.state_dict().values(), fresh.state_dict().values()):
    assert torch.equal(a.full_tensor(), b.full_tensor())
import json
layout = json.load(open(out + "/m/model.safetensors.index.json"))["unickpt"]["layout"]
assert (layout["plugin"], layout["mesh"], layout["world_size"]) == ("cp", {"cp": 1}, 1), layout
assert plugin.layout() == {"plugin": "cp", "world_size": 1, "mesh": {"cp": 1}, "dp_size": 1}, plugin.layout()
assert CheckpointIO().layout().mesh == {}
try:
    NoIO().get_checkpoint_io()
except NotImplementedError as e:
    assert str(e) == "NoIO names no checkpoint_io_class", e
else:
    sys.exit("a plugin without checkpoint_io_class built an IO")
try:
    type("Half", (Plugin,), {"name": "half"})()
except TypeError as e:
    assert "_parallelize" in str(e), e
else:
    sys.exit("a plugin without _parallelize was built")
print("ok")
"""


def test_a_new_dtensor_plugin_is_a_few_lines(tmp_path: Path) -> None:
    """docs/architecture.md's example plugin, in a one-process world: configure, IO, save, load."""
    import subprocess
    import sys

    script = tmp_path / "cp_plugin.py"
    script.write_text(_NEW_PLUGIN)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_a_world_the_plugin_made_is_destroyed_at_exit(tmp_path: Path) -> None:
    """A one-process world ``ensure_process_group`` made is destroyed at exit, so gloo's threads
    never meet the interpreter's teardown (which aborted such scripts now and then)."""
    import subprocess
    import sys

    script = tmp_path / "own_world.py"
    script.write_text(
        "import atexit, torch, torch.distributed as dist\n"
        "atexit.register(lambda: print('initialized at exit:', dist.is_initialized()))\n"
        "from unickpt import Booster\n"
        "from unickpt.plugins import DDPPlugin\n"
        "Booster(plugin=DDPPlugin()).boost(torch.nn.Linear(2, 2))\n"
        "print('world:', dist.is_initialized())\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == ["world: True", "initialized at exit: False"], done.stdout
