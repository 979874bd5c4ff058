"""CheckpointManager on one process (booster=None: GeneralCheckpointIO)."""

from __future__ import annotations

import json
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

import unickpt
from unickpt.ckpt.reader import open_checkpoint
from unickpt.data import ResumableDataLoader, wrap_dataloader
from unickpt.errors import CheckpointBusyError, UnsupportedError
from unickpt.manager import CheckpointManager
from unickpt.store.lock import directory_lock
from unickpt.wrappers import OptimizerWrapper


# Its own model: dropout in forward (the restored RNG must replay it) and an int64 buffer the
# training loop updates.
class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(5, 7)
        self.b = torch.nn.Linear(7, 3)
        self.register_buffer("seen", torch.zeros(2, dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.dropout(torch.relu(self.a(x)), 0.2, self.training))


class Counter:
    """An extra state with a tensor and a plain value."""

    def __init__(self) -> None:
        self.n = 0
        self.hist = torch.zeros(3)

    def state_dict(self) -> dict[str, Any]:
        return {"n": self.n, "hist": self.hist.clone(), "pair": (1, "x")}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        assert s["pair"] == (1, "x")
        self.n, self.hist = s["n"], s["hist"]


DATA = [(torch.randn(5, generator=torch.Generator().manual_seed(i)), i % 3) for i in range(26)]


def _setup(seed: int) -> tuple[Net, OptimizerWrapper, Any, ResumableDataLoader]:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    model = Net()
    opt = OptimizerWrapper(torch.optim.AdamW(model.parameters(), lr=1e-2), model)
    sched = torch.optim.lr_scheduler.StepLR(opt.optim, 3, gamma=0.5)
    dl = wrap_dataloader(DataLoader(DATA, batch_size=4, shuffle=True), None)
    return model, opt, sched, dl


def _train(
    mgr: CheckpointManager | None,
    total: int,
    seed: int = 0,
    resume: Any = "latest",
    counter: Counter | None = None,
) -> dict[int, float]:
    """Train to ``total`` steps, saving through ``mgr``; returns {step: loss}."""
    model, opt, sched, dl = _setup(seed)
    counter = counter or Counter()
    step = 0
    if mgr is not None:
        step = mgr.load(model, opt, sched, dl, resume_from_checkpoint=resume, counter=counter)
    losses: dict[int, float] = {}
    while step < total:
        for x, y in dl:
            noise = torch.randn(()) * 1e-3 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
            loss = torch.nn.functional.cross_entropy(model(x), y) + noise
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            step += 1
            counter.n += 1
            counter.hist[step % 3] += 1
            losses[step] = loss.item()
            if mgr is not None:
                mgr.save(step, model, opt, sched, dl, counter=counter)
            if step >= total:
                break
    if mgr is not None:
        mgr.wait()
    return losses


def test_bit_exact_loss_continuation(tmp_path: Path) -> None:
    ref = _train(None, 17)
    mgr = CheckpointManager(tmp_path, save_steps=5, keep_last=2)
    first = _train(mgr, 12)
    assert mgr.all_steps() == [5, 10] and mgr.latest_step() == 10
    # A different seed: everything must come from the checkpoint (weights, RNG, data order).
    counter = Counter()
    rest = _train(CheckpointManager(tmp_path, save_steps=5, keep_last=2), 17, seed=123, counter=counter)
    assert sorted(rest) == list(range(11, 18))
    assert {s: first[s] for s in range(1, 11)} == {s: ref[s] for s in range(1, 11)}
    assert rest == {s: ref[s] for s in range(11, 18)}  # bit for bit
    assert counter.n == 17


def test_retention_and_resume_by_step_latest_none(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt, sched, _ = _setup(0)
    mgr = CheckpointManager(tmp_path, save_steps=2, keep_last=3)
    saved = {}
    for step in range(1, 11):
        with torch.no_grad():
            model.a.weight.add_(1.0)
        saved[step] = model.a.weight.detach().clone()
        assert mgr.save(step, model, opt, sched) == (step % 2 == 0)
    assert mgr.all_steps() == [6, 8, 10] and mgr.latest_step() == 10
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-10", "step-6", "step-8"]
    assert json.loads((tmp_path / "latest").read_text()) == {"step": 10}
    assert mgr.save(11, model, opt, sched, force=True)
    assert mgr.all_steps() == [8, 10, 11]

    m2, o2, s2, _ = _setup(1)
    assert mgr.load(m2, o2, s2, resume_from_checkpoint=None) == 0
    assert mgr.load(m2, o2, s2, resume_from_checkpoint=8) == 8
    assert torch.equal(m2.a.weight, saved[8])
    assert s2.state_dict() == mgr_sched_state(tmp_path / "step-8")
    with caplog.at_level(logging.WARNING, logger="unickpt.manager"):
        assert mgr.load(m2, o2, s2, resume_from_checkpoint=4) == 11
    assert "step 4 is not a committed checkpoint" in caplog.text
    assert mgr.load(m2, o2, s2) == 11
    assert torch.equal(m2.a.weight, saved[10])  # step 11 was forced right after step 10
    assert CheckpointManager(tmp_path / "empty").load(m2, o2) == 0
    with pytest.raises(ValueError):
        mgr.load(m2, o2, resume_from_checkpoint="newest")


def mgr_sched_state(step_dir: Path) -> Any:
    from unickpt.io.jsonstate import from_json_value

    return from_json_value(json.loads((step_dir / "lr_scheduler.json").read_text())["state"])


_SAVE_ID = re.compile(rb'(unickpt_save|save_id)(\\?"\s*:\s*\\?")[0-9a-f]{32}')


def _tree(d: Path) -> dict[str, bytes]:
    """Every file's bytes, with the random save id of each save (index and headers) blanked."""
    return {
        str(p.relative_to(d)): _SAVE_ID.sub(rb"\1\2" + b"0" * 32, p.read_bytes())
        for p in sorted(d.rglob("*"))
        if p.is_file()
    }


@pytest.mark.parametrize("save_hf", [False, True])
def test_sync_and_async_saves_are_identical(tmp_path: Path, save_hf: bool) -> None:
    trees = []
    for mode in (False, True):
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        model, opt, sched, dl = _setup(0)
        for x, y in dl:
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            sched.step()
        mgr = CheckpointManager(tmp_path / str(mode), save_steps=1, async_save=mode, save_hf=save_hf)
        torch.manual_seed(5)
        mgr.save(3, model, opt, sched, dl, counter=Counter())
        if mode:  # training may change the live tensors while the background writes
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(100.0)
        mgr.wait()
        trees.append(_tree(tmp_path / str(mode) / "step-3"))
    assert trees[0].keys() == trees[1].keys()
    assert ("hf/model.safetensors.index.json" in trees[0]) == save_hf
    for k in trees[0]:
        assert trees[0][k] == trees[1][k], k
    with open_checkpoint(tmp_path / "True" / "step-3" / "model") as r:
        assert not r.verify()
        fps = {n: t.fingerprint for n, t in r.tensors.items()}
    if save_hf:
        with open_checkpoint(tmp_path / "True" / "step-3" / "hf") as h:
            assert not h.verify()
            assert {n: t.fingerprint for n, t in h.tensors.items()} == fps


def test_manager_checkpoint_equals_checkpoint_io_save(tmp_path: Path) -> None:
    model, opt, _sched, _ = _setup(0)
    CheckpointManager(tmp_path / "m", save_steps=1).save(1, model, opt)
    io = unickpt.GeneralCheckpointIO()
    io.save_model(model, tmp_path / "io" / "model", shard=True, gather_dtensor=False)
    io.save_optimizer(opt, tmp_path / "io" / "optimizer", shard=True, gather_dtensor=False)
    for kind in ("model", "optimizer"):
        assert _tree(tmp_path / "m" / "step-1" / kind) == _tree(tmp_path / "io" / kind)


def test_staging_dir_of_a_crash_is_ignored_and_cleaned(tmp_path: Path) -> None:
    model, opt, _, _ = _setup(0)
    mgr = CheckpointManager(tmp_path, save_steps=1)
    mgr.save(1, model, opt)
    crashed = tmp_path / ".step-2.staging-0123456789ab"
    (crashed / "model").mkdir(parents=True)
    (crashed / "model" / "model-00001-of-00001.safetensors").write_bytes(b"partial")
    (tmp_path / "step-3").mkdir()  # no COMMIT marker: never a checkpoint
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    assert mgr.load(*_setup(1)[:2], resume_from_checkpoint=3) == 1
    mgr.save(2, model, opt)
    assert not crashed.exists() and mgr.all_steps() == [1, 2]


def test_second_saver_is_refused(tmp_path: Path) -> None:
    model, opt, _, _ = _setup(0)
    mgr = CheckpointManager(tmp_path, save_steps=1)
    tmp_path.mkdir(exist_ok=True)
    with directory_lock(str(tmp_path)), pytest.raises(CheckpointBusyError):
        mgr.save(1, model, opt)
    assert mgr.save(1, model, opt) and mgr.all_steps() == [1]
    # A step saved twice (a resumed run) is replaced atomically.
    with torch.no_grad():
        model.a.bias.fill_(7.0)
    mgr.save(1, model, opt)
    m2, o2, _, _ = _setup(3)
    mgr.load(m2, o2)
    assert torch.equal(m2.a.bias, model.a.bias)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]


def test_async_error_surfaces_at_wait(tmp_path: Path) -> None:
    from unickpt import _faults

    model, opt, _, _ = _setup(0)
    mgr = CheckpointManager(tmp_path, save_steps=1, async_save=True)
    # Armed here, failing in the writer process (the job carries the armed stages).
    with _faults.injected("save.write", 0):
        assert mgr.save(1, model, opt)
        with pytest.raises(_faults.InjectedFault, match=r"injected fault at stage 'save\.write' on rank 0"):
            mgr.wait()
    mgr.wait()  # the error was reported once
    assert mgr.all_steps() == []
    mgr.save(2, model, opt)  # the lock was released and the staging dir is cleaned
    mgr.wait()
    assert mgr.all_steps() == [2] and not [n for n in os.listdir(tmp_path) if n.startswith(".step")]


def test_bad_inputs(tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError, match="fsspec cannot open"):
        CheckpointManager("nosuchprotocol://ckpt")
    with pytest.raises(ValueError, match="fsspec URLs"):
        CheckpointManager(tmp_path, local_cache_dir=tmp_path / "cache")
    with pytest.raises(ValueError):
        CheckpointManager(tmp_path, save_steps=0)
    model, opt, _, _ = _setup(0)
    mgr = CheckpointManager(tmp_path, save_steps=1)
    with pytest.raises(UnsupportedError, match="wrap_dataloader"):
        mgr.save(1, model, opt, dataloader=[1, 2])
    with pytest.raises(UnsupportedError, match="state_dict"):
        mgr.save(1, model, opt, thing=object())
    assert mgr.all_steps() == []
    mgr.save(1, model, opt)
    assert mgr.all_steps() == [1]


def test_hf_config_is_written_beside_the_sliced_model(tmp_path: Path) -> None:
    class Config:
        def to_json_string(self) -> str:
            return '{"model_type": "tiny"}'

    model, opt, _, _ = _setup(0)
    model.config = Config()  # type: ignore[assignment]
    mgr = CheckpointManager(tmp_path, save_steps=1)
    mgr.save(1, model, opt)
    assert json.loads((tmp_path / "step-1" / "model" / "config.json").read_text()) == {"model_type": "tiny"}
    merged = unickpt.merge_checkpoint(tmp_path / "step-1" / "model", tmp_path / "hf")
    assert (Path(merged) / "config.json").exists()


def test_async_snapshots_reuse_their_buffers_and_hold_each_steps_values(tmp_path: Path) -> None:
    model, opt, _, _ = _setup(0)
    mgr = CheckpointManager(tmp_path, save_steps=1, keep_last=0, async_save=True)
    mgr.save(1, model, opt)
    mgr.wait()
    first = {k: v.data_ptr() for k, v in mgr._staging["model"].items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    mgr.save(2, model, opt)
    mgr.wait()
    assert {k: v.data_ptr() for k, v in mgr._staging["model"].items()} == first
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    fresh, _, _, _ = _setup(1)
    CheckpointManager(tmp_path).load(fresh, None, resume_from_checkpoint=2)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, expected[k]), k


class Kept:
    """An extra state whose load_state_dict keeps the tensors it is given (no copy)."""

    def __init__(self) -> None:
        self.ema = torch.zeros(4, 3)
        self.count = torch.zeros((), dtype=torch.int64)
        self.shape_changes = torch.zeros(2)

    def state_dict(self) -> dict[str, Any]:
        return {"ema": self.ema, "inner": [self.count], "grows": self.shape_changes}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.ema, self.count, self.shape_changes = s["ema"], s["inner"][0], s["grows"]


def test_extra_state_tensors_come_back_in_place(tmp_path: Path) -> None:
    m = Net()
    saver = Kept()
    saver.ema.copy_(torch.arange(12.0).reshape(4, 3))
    saver.count.fill_(7)
    saver.shape_changes = torch.ones(5)
    mgr = CheckpointManager(str(tmp_path / "run"), save_steps=1)
    mgr.save(1, m, None, ema=saver)
    fresh = Kept()
    ema, count = fresh.ema, fresh.count
    assert mgr.load(m, None, ema=fresh) == 1
    # The live tensors were loaded into (their device and identity kept), values bit-exact.
    assert fresh.ema is ema and fresh.count is count
    assert torch.equal(ema, torch.arange(12.0).reshape(4, 3)) and int(count) == 7
    # A tensor whose shape changed since cannot be loaded in place: it is handed over as read.
    assert torch.equal(fresh.shape_changes, torch.ones(5))
