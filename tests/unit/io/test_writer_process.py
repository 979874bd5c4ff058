"""The writer process of async saves (``unickpt/io/writer_process.py``), with real processes.

- a save commits within a bound while the main thread runs a Python-bound loop (the writer
  does not need the training process's GIL);
- a writer killed (SIGKILL) mid-save: ``wait()`` raises ``WriterDiedError`` naming the signal,
  the previous checkpoint stays committed and loads bit-exact, the next save starts a new
  writer and commits;
- the writer is started once and reused (the same pid across saves), and ``close()`` stops it;
- the writer runs at the training process's scheduling priority (a niced writer waits on the run
  queue of a busy training's scheduling group for most of the save);
- a ``memory://`` store, which only this process can reach, is written by a thread.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from unickpt.io import GeneralCheckpointIO
from unickpt.io.writer_process import WriterDiedError
from unickpt.manager import CheckpointManager
from unickpt.store.storage import process_reachable
from unickpt.wrappers import OptimizerWrapper

pytestmark = pytest.mark.timeout(300)


def _model(seed: int, width: int = 64) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Linear(width, width))


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _assert_bits(m: torch.nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = m.state_dict()
    assert sorted(got) == sorted(expected)
    for k, v in expected.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


def _python_loop_until(done: Callable[[], bool], limit_s: float) -> tuple[float, int]:
    """Spin a Python-bound loop (holding the GIL) until ``done()`` or ``limit_s``; (elapsed, iterations)."""
    t0 = time.monotonic()
    n = 0
    x = 0
    while True:
        for i in range(2000):
            x = (x * 31 + i) % 1000003
        n += 1
        if done() or time.monotonic() - t0 > limit_s:
            return time.monotonic() - t0, n


def test_async_save_commits_while_a_python_loop_runs(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    m = _model(0, width=2048)  # 2 x 16 MiB of float32
    io.save_model(m, tmp_path / "warm", shard=True, use_async=True)  # starts the writer
    io.wait()
    pid = io._async.writer.pid
    expected = _state(m)
    index = tmp_path / "m" / "model.safetensors.index.json"
    t0 = time.monotonic()
    io.save_model(m, tmp_path / "m", shard=True, use_async=True)
    blocking = time.monotonic() - t0
    with torch.no_grad():  # training changes the weights while the copy is written
        for p in m.parameters():
            p.add_(1.0)
    elapsed, n = _python_loop_until(index.exists, 60.0)
    assert index.exists(), (
        f"not committed after {elapsed:.1f} s of a Python loop ({n} rounds); blocking {blocking:.2f} s"
    )
    io.wait()
    assert io._async.writer.pid == pid  # the same writer process, reused
    fresh = _model(1, width=2048)
    io.load_model(fresh, tmp_path / "m")
    _assert_bits(fresh, expected)
    io.close()
    assert io._async.writer.pid is None


def _dir_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            with contextlib.suppress(OSError):
                total += os.path.getsize(os.path.join(dirpath, f))
    return total


def test_the_writer_runs_at_the_training_process_priority(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    io.save_model(_model(0), tmp_path / "m", shard=True, use_async=True)
    io.wait()
    pid = io._async.writer.pid
    assert pid is not None
    try:
        assert os.getpriority(os.PRIO_PROCESS, pid) == os.getpriority(os.PRIO_PROCESS, 0)
    finally:
        io.close()


def test_writer_killed_mid_save_reports_at_wait_and_keeps_the_previous_step(tmp_path: Path) -> None:
    m = _model(0, width=2048)
    opt = OptimizerWrapper(torch.optim.SGD(m.parameters(), lr=0.1), m)
    mgr = CheckpointManager(tmp_path, save_steps=1, keep_last=None, async_save=True)
    assert mgr.save(1, m, opt)
    mgr.wait()
    step1 = _state(m)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(1.0)
    pid = mgr._async.writer.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # hold the job until the kill, so that the kill lands mid-save
    assert mgr.save(2, m, opt)
    os.kill(pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    stage = [p for p in tmp_path.iterdir() if p.name.startswith(".step-2")]
    while time.monotonic() < deadline and not (stage and _dir_bytes(stage[0]) > 0):
        time.sleep(0.005)
        stage = [p for p in tmp_path.iterdir() if p.name.startswith(".step-2")]
    assert stage, "the save of step 2 never started"
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WriterDiedError, match=rf"the writer process \(pid {pid}\) killed by SIGKILL") as e:
        mgr.wait()
    assert "the async save step-2: " in str(e.value) and "nothing of this save was committed" in str(e.value)
    mgr.wait()  # reported once
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    fresh = _model(5, width=2048)
    assert CheckpointManager(tmp_path).load(fresh, None, resume_from_checkpoint=1) == 1
    _assert_bits(fresh, step1)
    # The next save starts a new writer, and the killed save's leftovers go.
    step3 = _state(m)
    assert mgr.save(3, m, opt)
    mgr.wait()
    assert mgr._async.writer.pid not in (None, pid)
    assert mgr.all_steps() == [1, 3]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".step")]
    fresh = _model(6, width=2048)
    CheckpointManager(tmp_path).load(fresh, None, resume_from_checkpoint=3)
    _assert_bits(fresh, step3)
    mgr.close()


def test_io_writer_killed_leaves_the_committed_checkpoint_in_place(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    m = _model(0, width=1024)
    io.save_model(m, tmp_path / "m", shard=True, use_async=True)
    io.wait()
    before = _state(m)
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    pid = io._async.writer.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    io.save_model(m, tmp_path / "m", shard=True, use_async=True)  # the same directory, replaced on commit
    os.kill(pid, signal.SIGKILL)
    os.kill(pid, signal.SIGCONT)
    with pytest.raises(WriterDiedError, match="killed by SIGKILL before the save was committed"):
        io.wait()
    fresh = _model(2, width=1024)
    io.load_model(fresh, tmp_path / "m")
    _assert_bits(fresh, before)
    after = _state(m)
    io.save_model(m, tmp_path / "m", shard=True, use_async=True)
    io.wait()
    io.load_model(fresh, tmp_path / "m")
    _assert_bits(fresh, after)
    io.close()


def test_error_in_the_writer_keeps_its_type_and_message(tmp_path: Path) -> None:
    io = GeneralCheckpointIO()
    blocker = tmp_path / "file"
    blocker.write_bytes(b"x")
    io.save_model(_model(0), blocker / "sub" / "m.safetensors", use_async=True)  # a file is in the way
    with pytest.raises(NotADirectoryError, match=str(blocker)):
        io.wait()
    io.close()


def test_memory_stores_are_written_by_a_thread() -> None:
    assert process_reachable("/tmp/x") and process_reachable("file:///tmp/x")
    assert process_reachable("s3://bucket/x")
    assert not process_reachable("memory://x")
    io = GeneralCheckpointIO()
    m = _model(0)
    io.save_model(m, "memory://unickpt-writer-test/m", shard=True, use_async=True)
    io.wait()
    assert io._async.writer.pid is None  # no writer process was started
    fresh = _model(3)
    io.load_model(fresh, "memory://unickpt-writer-test/m")
    _assert_bits(fresh, _state(m))
