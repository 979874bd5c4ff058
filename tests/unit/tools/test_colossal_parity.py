"""Colossal-AI call sequences, verbatim: use_async / use_safetensors, named optimizers, file paths.

The sequences are those of Colossal-AI 0.5's ``GeneralCheckpointIO`` tests and Booster docs
(``save_model(model, tempfile.name, use_safetensors=..., use_async=...)``, then
``_sync_d2h(); _sync_io()``, then loading back). Colossal-AI itself is not needed.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from _reliability import Tied
from safetensors import safe_open

from unickpt import (
    Booster,
    GeneralCheckpointIO,
    OptimizerWrapper,
    StateMismatchError,
    UnickptError,
    UnsupportedError,
)
from unickpt.io.write_strategy import SafetensorsOnlyWarning


def fresh(seed: int) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def trained(seed: int = 0) -> tuple[Tied, torch.optim.Optimizer]:
    m = fresh(seed)
    opt = torch.optim.AdamW(m.named_parameters(), lr=1e-3, weight_decay=0.05)
    for _ in range(2):
        m(torch.tensor([1, 2, 3])).backward()
        opt.step()
        opt.zero_grad()
    return m, opt


def assert_same_model(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def assert_same_optim(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    s1, s2 = a.state_dict(), b.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys() and s1["state"]
    for i in s1["state"]:
        for k in s1["state"][i]:
            assert torch.equal(s1["state"][i][k], s2["state"][i][k]), (i, k)


# ---------------------------------------------------------------------- Colossal-AI's sequences
@pytest.mark.parametrize("use_async", [False, True])
@pytest.mark.parametrize("use_safetensors", [True, False])
def test_unsharded_sequence_of_colossalai_tests(use_safetensors: bool, use_async: bool) -> None:
    """Colossal-AI's test_unsharded_checkpoint, call for call (temporary files, not directories)."""
    model, optimizer = trained()
    model_ckpt_tempfile = tempfile.NamedTemporaryFile()  # noqa: SIM115 (verbatim Colossal-AI)
    optimizer_ckpt_tempfile = tempfile.NamedTemporaryFile()  # noqa: SIM115
    ckpt_io = GeneralCheckpointIO()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ckpt_io.save_model(
            model, model_ckpt_tempfile.name, use_safetensors=use_safetensors, use_async=use_async
        )
    ckpt_io.save_optimizer(optimizer, optimizer_ckpt_tempfile.name, use_async=use_async)
    ckpt_io._sync_d2h()
    ckpt_io._sync_io()
    assert [w.category for w in caught] == ([] if use_safetensors else [SafetensorsOnlyWarning])

    new_model, _ = trained(seed=1)
    new_optimizer = torch.optim.AdamW(new_model.named_parameters(), lr=9.0)
    ckpt_io.load_model(new_model, model_ckpt_tempfile.name)
    ckpt_io.load_optimizer(new_optimizer, optimizer_ckpt_tempfile.name)
    assert_same_model(model, new_model)
    assert_same_optim(optimizer, new_optimizer)
    # Each is one safetensors file; the optimizer's JSON part is in its header metadata.
    with safe_open(optimizer_ckpt_tempfile.name, "pt") as f:
        block = json.loads(f.metadata()["unickpt"])
    assert block["kind"] == "optimizer"
    assert block["param_groups"][0]["params"] == ["emb.weight", "proj.weight", "proj.bias"]
    assert block["param_groups"][0]["weight_decay"] == 0.05 and "param_names" not in block["param_groups"][0]
    # Format version 3: slices name their files by index into the block's table.
    assert (
        block["files"] == ["optimizer.safetensors"]
        and block["tensors"]["state.proj.weight.exp_avg"]["file"] == 0
    )


@pytest.mark.parametrize("use_async", [False, True])
def test_sharded_sequence_with_booster(tmp_path: Path, use_async: bool) -> None:
    """Booster: boost an optimizer built from named_parameters(), sharded async saves, load back."""
    booster = Booster()
    model, optimizer = trained()
    model, optimizer, *_ = booster.boost(model, optimizer)
    booster.save_model(
        model, str(tmp_path / "m"), shard=True, size_per_shard=1, use_safetensors=True, use_async=use_async
    )
    sched = torch.optim.lr_scheduler.StepLR(optimizer.optim, 3)
    booster.save_optimizer(optimizer, str(tmp_path / "o"), shard=True, size_per_shard=1, use_async=use_async)
    booster.save_lr_scheduler(sched, str(tmp_path / "s"))  # waits for the async optimizer save
    booster.checkpoint_io._sync_io()
    assert (tmp_path / "m" / "model.safetensors.index.json").is_file()
    new_model, _ = trained(seed=1)
    new_opt = torch.optim.AdamW(new_model.named_parameters(), lr=9.0)
    new_model2, new_opt2, *_ = Booster().boost(new_model, new_opt)
    new_sched = torch.optim.lr_scheduler.StepLR(new_opt, 3)
    booster.load_lr_scheduler(new_sched, str(tmp_path / "s"))
    booster.load_model(new_model2, str(tmp_path / "m"), low_cpu_mem_mode=False, num_threads=4)
    booster.load_optimizer(new_opt2, str(tmp_path / "o"), low_cpu_mem_mode=False, num_threads=4)
    assert_same_model(model.unwrap(), new_model)
    assert_same_optim(optimizer.optim, new_opt)


# ---------------------------------------------------------------------- use_async semantics
def _stop_writer(io: GeneralCheckpointIO) -> int:
    """Start ``io``'s writer process and stop it (SIGSTOP): its saves wait until it is continued."""
    io._async.writer.ensure(io.group)
    pid = io._async.writer.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    return pid


def test_async_save_writes_the_values_of_the_moment_it_was_called(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model, _ = trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    pid = _stop_writer(io)
    try:
        path = io.save_model(model, tmp_path / "m", use_async=True)
        assert path == str(tmp_path / "m" / "model.safetensors")
        assert io._async.pending and not os.path.exists(path)
        with torch.no_grad():  # training goes on while the save is being written
            for p in model.parameters():
                p.add_(1.0)
    finally:
        os.kill(pid, signal.SIGCONT)
    io.wait()
    assert os.path.isfile(path)
    new_model = fresh(5)
    io.load_model(new_model, path)
    for k, v in new_model.state_dict().items():
        assert torch.equal(v, expected[k]), k


def test_a_following_load_or_save_waits_for_the_async_save(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model, opt = trained()
    pid = _stop_writer(io)
    io.save_model(model, tmp_path / "m", shard=True, gather_dtensor=False, use_async=True)
    threading.Timer(0.3, os.kill, (pid, signal.SIGCONT)).start()
    t0 = time.monotonic()
    new_model = fresh(3)
    io.load_model(new_model, tmp_path / "m")  # would find no index if it did not wait
    assert time.monotonic() - t0 >= 0.25
    assert_same_model(model, new_model)
    os.kill(pid, signal.SIGSTOP)
    io.save_optimizer(opt, tmp_path / "o", use_async=True)
    threading.Timer(0.3, os.kill, (pid, signal.SIGCONT)).start()
    t0 = time.monotonic()
    io.save_optimizer(opt, tmp_path / "o2")  # waits for the async one first
    assert time.monotonic() - t0 >= 0.25
    assert (tmp_path / "o" / "optimizer.safetensors").is_file()
    assert (tmp_path / "o2" / "optimizer.safetensors").is_file()


def test_async_error_is_raised_by_the_next_wait_once(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model, _ = trained()
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    io.save_model(model, blocker / "sub" / "m.safetensors", use_async=True)  # its directory cannot exist
    with pytest.raises(NotADirectoryError):
        io.wait()
    io.wait()  # reported once
    io.save_model(model, tmp_path / "ok", use_async=True)
    io.wait()
    assert (tmp_path / "ok" / "model.safetensors").is_file()


def test_async_bad_arguments_raise_at_the_call(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model, _ = trained()
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"")
    with pytest.raises(UnickptError, match="a sharded or sliced checkpoint is a directory"):
        io.save_model(model, f, shard=True, use_async=True)
    with pytest.raises(ValueError, match="size_per_shard must be a positive number"):
        io.save_model(model, tmp_path / "d", shard=True, size_per_shard=0, use_async=True)
    assert not io._async.pending


def test_use_safetensors_false_is_explained(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    model, _ = trained()
    with pytest.warns(
        SafetensorsOnlyWarning, match=r"unickpt always writes safetensors \(never pickled \.bin"
    ) as rec:
        io.save_model(model, tmp_path / "m", use_safetensors=False)
    assert rec[0].filename == __file__  # points at the caller's line
    assert (tmp_path / "m" / "model.safetensors").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        io.save_model(model, tmp_path / "m2", use_safetensors=True)
        Booster().save_model(model, str(tmp_path / "m3"))


# ---------------------------------------------------------------------- named optimizers
def test_plain_named_optimizer_round_trips_every_layout(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    _model, opt = trained()
    for shard, gather in [(False, True), (True, True), (True, False)]:
        path = io.save_optimizer(opt, tmp_path / f"o{shard}{gather}", shard=shard, gather_dtensor=gather)
        m2 = fresh(1)
        opt2 = torch.optim.AdamW(m2.parameters(), lr=9.0)  # bare parameters: the wrapper is needed
        io.load_optimizer(OptimizerWrapper(opt2, m2), path)
        s1, s2 = opt.state_dict(), opt2.state_dict()
        for i in s1["state"]:
            for k in s1["state"][i]:
                assert torch.equal(s1["state"][i][k], s2["state"][i][k])
        assert s2["param_groups"][0]["weight_decay"] == 0.05 and "param_names" not in s2["param_groups"][0]


def test_bare_parameter_optimizer_still_needs_the_wrapper(tmp_path: Path) -> None:
    m = fresh(0)
    with pytest.raises(UnsupportedError, match=r"or an optimizer built from model\.named_parameters\(\)"):
        GeneralCheckpointIO().save_optimizer(torch.optim.AdamW(m.parameters()), tmp_path / "o")


def test_param_names_that_are_not_the_models_fqns_are_refused(tmp_path: Path) -> None:
    m = fresh(0)
    sub_opt = torch.optim.AdamW(m.proj.named_parameters())  # names "weight", "bias"
    msg = r"param_names do not match the model's parameter names for 2 parameter\(s\): 'weight' is 'proj.weight'"
    with pytest.raises(StateMismatchError, match=msg):
        GeneralCheckpointIO().save_optimizer(OptimizerWrapper(sub_opt, m), tmp_path / "o")
    with pytest.raises(StateMismatchError, match=msg):
        Booster().boost(m, sub_opt)
    # Without the model, the names are what the optimizer says.
    path = GeneralCheckpointIO().save_optimizer(sub_opt, tmp_path / "o", shard=True)
    idx = json.loads(Path(path, "optimizer.safetensors.index.json").read_text())
    assert idx["unickpt"]["param_groups"][0]["params"] == ["weight", "bias"]


# ---------------------------------------------------------------------- saving onto a file
def test_unsharded_save_replaces_an_existing_file_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = GeneralCheckpointIO()
    _model, opt = trained()
    target = tmp_path / "ckpt.bin"
    target.write_bytes(b"old contents")
    io.save_optimizer(opt, target)
    first = target.read_bytes()
    with safe_open(str(target), "pt") as f:
        assert json.loads(f.metadata()["unickpt"])["kind"] == "optimizer"
        assert "state.proj.weight.exp_avg" in list(f.keys())
    # A save that fails before its rename leaves the previous file whole, and no temporary file.
    real_replace = os.replace

    def failing_replace(src: str, dst: str) -> None:
        if os.fspath(dst) == str(target):
            raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", failing_replace)
    opt.param_groups[0]["lr"] = 0.5
    with pytest.raises(OSError, match="No space left"):
        io.save_optimizer(opt, target)
    monkeypatch.setattr(os, "replace", real_replace)
    assert target.read_bytes() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.bin"]
    # The file form and the directory form both load.
    io.save_optimizer(opt, tmp_path / "dir")
    for src in (target, tmp_path / "dir", tmp_path / "dir" / "optimizer.safetensors"):
        m2 = fresh(1)
        opt2 = torch.optim.AdamW(m2.named_parameters(), lr=9.0)
        io.load_optimizer(opt2, src)
        assert opt2.param_groups[0]["lr"] == (1e-3 if src == target else 0.5)


def test_sharded_save_onto_a_file_is_refused(tmp_path: Path) -> None:
    _model, opt = trained()
    with (
        tempfile.NamedTemporaryFile(dir=tmp_path) as f,
        pytest.raises(
            UnickptError, match="a sharded or sliced checkpoint is a directory; pass a directory path"
        ),
    ):
        GeneralCheckpointIO().save_optimizer(opt, f.name, shard=True)


def test_booster_accepts_the_torch_optimizer_it_boosted(tmp_path: Path) -> None:
    """booster.save_optimizer(opt) with the user's own optimizer object (bare parameters even)."""
    booster = Booster()
    m = fresh(0)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)  # no param_names
    model, _wrapped, *_ = booster.boost(m, opt)
    model(torch.tensor([1, 2])).backward()
    opt.step()
    booster.save_optimizer(opt, str(tmp_path / "o"), shard=True)
    with pytest.raises(UnsupportedError):  # the IO alone cannot name its state
        booster.checkpoint_io.save_optimizer(opt, tmp_path / "o2")
    m2 = fresh(1)
    opt2 = torch.optim.AdamW(m2.parameters(), lr=9.0)
    b2 = Booster()
    b2.boost(m2, opt2)
    b2.load_optimizer(opt2, str(tmp_path / "o"))
    assert_same_optim(opt, opt2)


@pytest.mark.parametrize("gather", [True, False])
def test_async_snapshot_buffers_are_reused_and_each_save_keeps_its_values(
    tmp_path: Path, gather: bool
) -> None:
    io = GeneralCheckpointIO()
    model, _ = trained()
    first = {k: v.clone() for k, v in model.state_dict().items()}
    io.save_model(model, tmp_path / "a", shard=not gather, gather_dtensor=gather, use_async=True)
    io.wait()
    from unickpt.io.pinned import POOL

    def buffers() -> dict[object, int]:
        return {k: t.data_ptr() for s in POOL.sets() if s.tag == "model" for k, t in s.items()}

    bufs = buffers()
    with torch.no_grad():
        model.proj.weight.mul_(-2.0)
    io.save_model(model, tmp_path / "b", shard=not gather, gather_dtensor=gather, use_async=True)
    io.wait()
    assert buffers() == bufs
    for path, want in ((tmp_path / "a", first), (tmp_path / "b", model.state_dict())):
        got = fresh(7)
        io.load_model(got, path)
        for k, v in got.state_dict().items():
            assert torch.equal(v, want[k]), (path, k)
