"""Colossal-AI's calling conventions at the edges: existing files and directories, pathlib
paths, ``prefix``, ``size_per_shard`` edge values, ``strict=False``, positional arguments.

Where Colossal-AI (installed beside torch) is importable, the same call through its
``GeneralCheckpointIO`` is made first and must succeed too, so the test shows both libraries
accept it.
"""

from __future__ import annotations

import os
import stat
import tempfile
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from unickpt import GeneralCheckpointIO
from unickpt.errors import ConfigError, StateMismatchError


def _colossal() -> Any:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from colossalai.checkpoint_io import GeneralCheckpointIO as ColossalIO
    except Exception:  # absent here: the unickpt half still runs
        return None
    return ColossalIO()


def _model(seed: int = 0, extra: bool = False) -> nn.Module:
    torch.manual_seed(seed)
    layers = [nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2)] + ([nn.Linear(2, 2)] if extra else [])
    return nn.Sequential(*layers)


def _optim(m: nn.Module) -> torch.optim.Optimizer:
    o = torch.optim.AdamW(list(m.named_parameters()), lr=1e-2)
    m(torch.randn(2, 4)).sum().backward()
    o.step()
    return o


def _sched(o: torch.optim.Optimizer, step_size: int = 3) -> Any:
    return torch.optim.lr_scheduler.StepLR(o, step_size)


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same_model(a: nn.Module, b: nn.Module, names: list[str] | None = None) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    for k in names or list(sa):
        assert _bits(sa[k]) == _bits(sb[k]), k


def _same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    for sa, sb in zip(a.state.values(), b.state.values(), strict=True):
        assert sa.keys() == sb.keys()
        for k in sa:
            assert _bits(torch.as_tensor(sa[k])) == _bits(torch.as_tensor(sb[k])), k


@pytest.mark.parametrize("suffix", ["", ".pt", ".json"])
@pytest.mark.parametrize("as_path", [False, True])
def test_save_lr_scheduler_onto_an_existing_file_replaces_it(
    tmp_path: Path, suffix: str, as_path: bool
) -> None:
    cio = _colossal()
    s = _sched(_optim(_model()), step_size=7)
    with tempfile.NamedTemporaryFile(dir=tmp_path, suffix=suffix) as f:
        target: Any = Path(f.name) if as_path else f.name
        if cio is not None:
            cio.save_lr_scheduler(s, target)
        os.chmod(f.name, 0o640)
        got = GeneralCheckpointIO().save_lr_scheduler(s, target)
        assert got == f.name
        assert sorted(os.listdir(tmp_path)) == [os.path.basename(f.name)]
        assert stat.S_IMODE(os.stat(f.name).st_mode) == 0o640
        s2 = _sched(_optim(_model()), step_size=1)
        GeneralCheckpointIO().load_lr_scheduler(s2, target)
        assert s2.state_dict() == s.state_dict()
        # Saved again onto the same file (Colossal-AI's tests do save, load, save).
        GeneralCheckpointIO().save_lr_scheduler(s2, target)
        assert sorted(os.listdir(tmp_path)) == [os.path.basename(f.name)]


def test_save_lr_scheduler_into_a_directory(tmp_path: Path) -> None:
    s = _sched(_optim(_model()))
    assert GeneralCheckpointIO().save_lr_scheduler(s, tmp_path) == str(tmp_path / "lr_scheduler.json")
    s2 = _sched(_optim(_model()), step_size=1)
    GeneralCheckpointIO().load_lr_scheduler(s2, tmp_path)
    assert s2.state_dict() == s.state_dict()


@pytest.mark.parametrize("kind", ["model", "optimizer"])
@pytest.mark.parametrize("where", ["existing-file", "existing-dir", "pathlib-file"])
def test_unsharded_saves_onto_existing_paths(tmp_path: Path, kind: str, where: str) -> None:
    m = _model(0)
    o = _optim(m)
    io = GeneralCheckpointIO()
    name = "model.safetensors" if kind == "model" else "optimizer.safetensors"
    target: Any
    if where == "existing-file":
        target = tmp_path / "ckpt.bin"
        target.write_bytes(b"an older file")
        os.chmod(target, 0o600)
        target = str(target)
    elif where == "existing-dir":
        target = tmp_path / "d"
        target.mkdir()
    else:
        target = tmp_path / name
    save = io.save_model if kind == "model" else io.save_optimizer
    obj = m if kind == "model" else o
    got = save(obj, target, shard=False)
    expect = os.path.join(target, name) if where == "existing-dir" else os.fspath(target)
    assert got == expect and os.path.isfile(expect)
    if where == "existing-file":
        assert stat.S_IMODE(os.stat(expect).st_mode) == 0o600
    m2 = _model(5)
    o2 = _optim(m2)
    if kind == "model":
        io.load_model(m2, target, verify=True)
        _same_model(m, m2)
    else:
        io.load_optimizer(o2, target, verify=True)
        _same_optim(o, o2)


@pytest.mark.parametrize("bad", [None, "10", float("nan"), 0, -1, [1]])
def test_size_per_shard_that_is_not_a_positive_number_is_a_config_error(tmp_path: Path, bad: Any) -> None:
    io = GeneralCheckpointIO()
    for call in (
        lambda: io.save_model(_model(), tmp_path / "m", shard=True, size_per_shard=bad),
        lambda: io.save_optimizer(_optim(_model()), tmp_path / "o", shard=True, size_per_shard=bad),
        lambda: io.save_model(_model(), tmp_path / "a", shard=True, size_per_shard=bad, use_async=True),
    ):
        with pytest.raises(ConfigError, match=r"size_per_shard must be a positive number of MB .*got"):
            call()
    assert not (tmp_path / "m").exists() and not (tmp_path / "o").exists() and not (tmp_path / "a").exists()


@pytest.mark.parametrize(("size", "files"), [(float("inf"), 1), (True, 1), (1e-5, 6)])
def test_size_per_shard_edge_values_that_colossalai_accepts(tmp_path: Path, size: Any, files: int) -> None:
    cio = _colossal()
    m = _model()
    if cio is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cio.save_model(m, str(tmp_path / "c"), shard=True, size_per_shard=size, use_safetensors=True)
    io = GeneralCheckpointIO()
    io.save_model(m, tmp_path / "u", shard=True, size_per_shard=size)
    shards = [n for n in os.listdir(tmp_path / "u") if n.endswith(".safetensors")]
    assert len(shards) == files
    m2 = _model(3)
    io.load_model(m2, tmp_path / "u", verify=True)
    _same_model(m, m2)


def test_prefix_that_is_not_a_string_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="prefix must be a string or None, got int 5"):
        GeneralCheckpointIO().save_model(_model(), tmp_path / "m", shard=True, prefix=5)  # type: ignore[arg-type]
    assert not (tmp_path / "m").exists()


def test_saved_with_prefix_loaded_without_names_the_prefix(tmp_path: Path) -> None:
    m = _model()
    io = GeneralCheckpointIO()
    io.save_model(m, tmp_path / "m", shard=True, prefix="pre")
    m2 = _model(4)
    with pytest.raises(
        StateMismatchError, match=r"prefix 'pre\.' \(saved with prefix='pre'\): load with prefix='pre'"
    ):
        io.load_model(m2, tmp_path / "m")
    io.load_model(m2, tmp_path / "m", prefix="pre")
    _same_model(m, m2)


def test_load_optimizer_takes_colossalai_positional_prefix(tmp_path: Path) -> None:
    m = _model()
    o = _optim(m)
    io = GeneralCheckpointIO()
    io.save_optimizer(o, tmp_path / "o", shard=True, prefix="pre")
    o2 = _optim(_model(4))
    io.load_optimizer(o2, tmp_path / "o", "pre")  # Colossal-AI: load_optimizer(optimizer, checkpoint, prefix)
    _same_optim(o, o2)


@pytest.mark.parametrize("direction", ["model-has-more", "checkpoint-has-more"])
def test_load_model_strict_false(tmp_path: Path, direction: str) -> None:
    cio = _colossal()
    src = _model(0, extra=direction == "checkpoint-has-more")
    path = tmp_path / "m.safetensors"
    GeneralCheckpointIO().save_model(src, path)
    dst = _model(9, extra=direction == "model-has-more")
    keep = {k: v.clone() for k, v in dst.state_dict().items()}
    if cio is not None:  # Colossal-AI takes a str path
        probe = _model(9, extra=direction == "model-has-more")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cio.load_model(probe, str(path), strict=False)
    with pytest.raises(StateMismatchError, match=r"3\.weight"):
        GeneralCheckpointIO().load_model(dst, path)
    report = GeneralCheckpointIO().load_model(dst, path, strict=False)
    common = [k for k in dst.state_dict() if not k.startswith("3.")]
    _same_model(src, dst, common)
    if direction == "model-has-more":
        assert sorted(report.missing_keys) == ["3.bias", "3.weight"]
        for k in ("3.weight", "3.bias"):
            assert _bits(dst.state_dict()[k]) == _bits(keep[k])
    else:
        assert sorted(report.unexpected_keys) == ["3.bias", "3.weight"]
