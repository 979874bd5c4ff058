"""CheckpointIO is one class on its hooks; what is a concept of its own is a module it calls."""

from __future__ import annotations

import inspect
import os
import pickle

import pytest
import torch

from unickpt.errors import ConfigError, UnickptError
from unickpt.io import GeneralCheckpointIO
from unickpt.io.async_save import AsyncSaves
from unickpt.io.checkpoint_io import FINAL_METHODS, CheckpointHooks, CheckpointIO, HookContext
from unickpt.io.save import WriteSpec

HOOKS = {
    "unwrap_model",
    "_model_tensors",
    "_local_slices",
    "_after_load",
    "_optimizer_state",
    "_set_optimizer_state",
    "_state_parameters",
}


def test_checkpoint_io_is_one_class_on_its_hooks() -> None:
    assert CheckpointIO.__mro__ == (CheckpointIO, CheckpointHooks, object)
    assert GeneralCheckpointIO.__mro__[1:] == CheckpointIO.__mro__


def test_the_public_api_is_the_class_own() -> None:
    own = vars(CheckpointIO)
    assert [name for name in FINAL_METHODS if name not in own] == []
    public = {n for n, v in inspect.getmembers(CheckpointIO) if not n.startswith("_") and callable(v)}
    assert public - set(own) == {"unwrap_model"}  # the one public hook
    # Colossal-AI's names for wait/synchronize, beside them.
    assert {"_sync_io", "_sync_d2h"} <= set(own)


def test_the_hooks_are_hooks_only() -> None:
    defined = {n for n, v in vars(CheckpointHooks).items() if inspect.isfunction(v)}
    assert defined == HOOKS
    assert not set(HOOKS) & set(vars(CheckpointIO)), "CheckpointIO overrides a default hook"


def _hooks_refer_to() -> tuple[set[str], set[str]]:
    """The modules the hooks' code takes names from (``CheckpointHooks``, ``HookContext`` and the
    module's functions they call, followed), and the modules it imports inside them."""
    import ast
    import types

    import unickpt.io.checkpoint_io as cio

    origins: set[str] = set()
    imported: set[str] = set()
    todo: list[object] = [CheckpointHooks, HookContext]
    seen: set[str] = set()
    while todo:
        obj = todo.pop()
        for node in ast.walk(ast.parse(inspect.getsource(obj))):  # type: ignore[arg-type]
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(a.name for a in node.names)
            elif isinstance(node, ast.Name) and node.id in vars(cio) and node.id not in seen:
                seen.add(node.id)
                value = vars(cio)[node.id]
                if isinstance(value, types.ModuleType):
                    origins.add(value.__name__)
                elif getattr(value, "__module__", None) == cio.__name__:
                    todo.append(value)  # the hooks' own, or a helper of theirs: what it refers to counts
                elif inspect.isfunction(value) or inspect.isclass(value):
                    origins.add(value.__module__)
    return origins, imported


def test_the_hooks_hold_no_io() -> None:
    """The hooks' code refers only to the errors, the tensors' names and bytes, the optimizer
    template and torch, and imports only torch's state dicts: no collectives, no save or load
    engine, no reader or storage, though ``CheckpointIO`` beside them uses all of those."""
    origins, imported = _hooks_refer_to()
    assert {m for m in origins if m.startswith("unickpt")} == {
        "unickpt.errors",
        "unickpt.io.optimizer",
        "unickpt.io.tensors",
    }
    assert imported == {"torch.distributed.checkpoint.state_dict"}


def test_write_spec_is_the_io_options_without_the_io() -> None:
    io = GeneralCheckpointIO(hashes=False, fsync=False, check_replicas="raise")
    spec = io.write_spec("optimizer", True, False, 7)
    assert isinstance(spec, WriteSpec)
    assert (spec.options.kind, spec.options.shard, spec.options.gather) == ("optimizer", True, False)
    assert (spec.options.size_per_shard_mb, spec.options.hashes, spec.options.fsync) == (7.0, False, False)
    assert (spec.check_replicas, spec.everywhere) == ("raise", False)
    assert pickle.loads(pickle.dumps(spec)) == spec
    with pytest.raises(ConfigError, match=r"size_per_shard must be a positive number of MB .* got 0"):
        io.write_spec("model", True, False, 0)


def test_async_saves_writes_a_payload_without_the_io(tmp_path: os.PathLike[str]) -> None:
    """``AsyncSaves.save`` is the background save on its own: given a WriteSpec and a payload."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    io = GeneralCheckpointIO()
    spec = io.write_spec("model", True, False, 1024)
    payload = io.plan_model(model)
    want = {k: v.detach().clone() for k, v in model.state_dict().items()}
    saves = AsyncSaves()
    try:
        done: list[str] = []
        path = saves.save(spec, payload, "memory://cio-class/step", None, after=done.append)
        with torch.no_grad():  # the copy was taken before save() returned
            model.weight.fill_(7.0)
        saves.wait()
        assert done == [path] == ["memory://cio-class/step"]
        fresh = torch.nn.Linear(5, 3)
        GeneralCheckpointIO().load_model(fresh, path)
        for k, v in fresh.state_dict().items():
            assert torch.equal(v, want[k]), k
        with pytest.raises(UnickptError, match=r"a sharded or sliced checkpoint is a directory"):
            saves.save(spec, payload, os.path.join(os.fspath(tmp_path), "x.safetensors"), None)
    finally:
        saves.close()
