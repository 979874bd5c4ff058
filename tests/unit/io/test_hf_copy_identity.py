"""Files handed to the user (the manager's ``hf/`` copy, merge and convert outputs) share no
identity (inode, hard link, symlink) with the files the library relies on: editing any of them
in place leaves the training checkpoint verifying and loading bit-exact."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch
from _reliability import MLP

import unickpt
from unickpt import merge_checkpoint, verify_checkpoint
from unickpt.manager import CheckpointManager
from unickpt.tools.convert import convert_checkpoint
from unickpt.tools.run import verify_run


def _setup() -> tuple[MLP, torch.optim.Optimizer]:
    torch.manual_seed(3)
    m = MLP(40, 70, 30)
    opt = torch.optim.AdamW(list(m.named_parameters()), lr=1e-2)
    m.b(m.a(torch.randn(4, 40))).square().sum().backward()
    opt.step()
    return m, opt


def _files(d: Path) -> dict[str, Path]:
    return {str(p.relative_to(d)): p for p in sorted(d.rglob("*")) if p.is_file() or p.is_symlink()}


def _digests(d: Path) -> dict[str, str]:
    return {k: hashlib.sha256(p.read_bytes()).hexdigest() for k, p in _files(d).items()}


def _bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _edit_every_file(d: Path) -> int:
    """Flip a byte of every file in place (``r+b``), then truncate it to half: both write through links."""
    n = 0
    for p in _files(d).values():
        size = p.stat().st_size
        with open(p, "r+b") as f:
            f.seek(size // 2)
            b = f.read(1)
            f.seek(size // 2)
            f.write(bytes([b[0] ^ 0xFF]) if b else b"x")
        os.truncate(p, max(1, size // 2))
        n += 1
    return n


def _assert_own_identity(user: Path, library: list[Path]) -> None:
    lib_inodes = {(p.stat().st_dev, p.stat().st_ino) for d in library for p in _files(d).values()}
    for name, p in _files(user).items():
        assert not p.is_symlink(), name
        st = p.stat()
        assert st.st_nlink == 1, (name, st.st_nlink)
        assert (st.st_dev, st.st_ino) not in lib_inodes, name
    for d in library:
        for name, p in _files(d).items():
            assert not p.is_symlink() and p.stat().st_nlink == 1, name


@pytest.mark.parametrize("async_save", [False, True])
def test_editing_the_manager_hf_copy_leaves_the_step_intact(tmp_path: Path, async_save: bool) -> None:
    model, opt = _setup()
    want_model = {k: _bits(v) for k, v in model.state_dict().items()}
    want_optim = {
        (k, s): _bits(torch.as_tensor(v))
        for k, st in zip([n for n, _ in model.named_parameters()], opt.state.values(), strict=True)
        for s, v in st.items()
    }
    mgr = CheckpointManager(tmp_path / "run", save_steps=1, save_hf=True, async_save=async_save)
    mgr.save(1, model, opt)
    mgr.wait()
    step = tmp_path / "run" / "step-1"
    hf = step / "hf"
    assert (hf / "model.safetensors.index.json").is_file() or (hf / "model.safetensors").is_file()
    library = [step / "model", step / "optimizer", step / "train_state"]
    _assert_own_identity(hf, library)
    before = {str(d): _digests(d) for d in library}

    edited = _edit_every_file(hf)
    assert edited >= 2

    assert {str(d): _digests(d) for d in library} == before
    assert verify_checkpoint(step / "model") == []
    assert verify_checkpoint(step / "optimizer", kind="optimizer") == []
    parts = {r.part: r.failures for r in verify_run(tmp_path / "run")}
    assert parts["model"] == [] and parts["optimizer"] == []
    assert parts["hf"], "the edited hf copy must fail its own verification"

    fresh, fopt = MLP(40, 70, 30), None
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fopt = torch.optim.AdamW(list(fresh.named_parameters()), lr=1e-2)
    assert CheckpointManager(tmp_path / "run", save_steps=1).load(fresh, fopt) == 1
    assert {k: _bits(v) for k, v in fresh.state_dict().items()} == want_model
    got_optim = {
        (k, s): _bits(torch.as_tensor(v))
        for k, st in zip([n for n, _ in fresh.named_parameters()], fopt.state.values(), strict=True)
        for s, v in st.items()
    }
    assert got_optim == want_optim


@pytest.mark.parametrize("layout", ["single", "sharded", "sliced"])
def test_editing_a_merge_output_leaves_its_source_intact(tmp_path: Path, layout: str) -> None:
    model, _ = _setup()
    src = tmp_path / "src"
    unickpt.GeneralCheckpointIO().save_model(
        model, src, shard=layout != "single", gather_dtensor=layout != "sliced", size_per_shard=0.01
    )
    before = _digests(src)
    out = tmp_path / "out"
    merge_checkpoint(src if layout != "single" else src / "model.safetensors", out, max_shard_size="8KB")
    _assert_own_identity(out, [src])
    assert _edit_every_file(out) >= 1
    assert _digests(src) == before
    assert verify_checkpoint(src if layout != "single" else src / "model.safetensors") == []


def test_editing_a_convert_output_leaves_its_source_intact(tmp_path: Path) -> None:
    model, _ = _setup()
    src = tmp_path / "src"
    unickpt.GeneralCheckpointIO().save_model(model, src, shard=True, gather_dtensor=True, size_per_shard=0.01)
    before = _digests(src)
    out = tmp_path / "dcp"
    convert_checkpoint(src, out, source="unickpt", target="dcp")
    _assert_own_identity(out, [src])
    assert _edit_every_file(out) >= 1
    assert _digests(src) == before
    assert verify_checkpoint(src) == []
