"""CheckpointManager in a real 2-process DDP world: SIGKILL at random moments, resume exactly."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unickpt.ckpt.reader import open_checkpoint
from unickpt.manager import CheckpointManager

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
WORLD = 2
TOTAL = 24
pytestmark = pytest.mark.timeout(300)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _spawn(script: str, world: int, args: list[str], log: Path) -> list[subprocess.Popen[bytes]]:
    """Start ``world`` ranks of ``script`` with torchrun-style variables; stderr to ``LOG.err<rank>``."""
    port = _port()
    procs = []
    for rank in range(world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(REPO),
        )
        with open(f"{log}.err{rank}", "ab") as err:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(HERE / script), *args],
                    env=env,
                    cwd=str(REPO),
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                    start_new_session=True,
                )
            )
    return procs


def _launch(ckpt: Path, async_save: bool, log: Path) -> list[subprocess.Popen[bytes]]:
    args = [str(ckpt), str(TOTAL), str(int(async_save)), str(log)]
    return _spawn("_manager_worker.py", WORLD, args, log)


def _kill(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGKILL)
    for p in procs:
        p.wait(timeout=30)


def _finish(procs: list[subprocess.Popen[bytes]], log: Path, timeout: float = 150) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _kill(procs)
            pytest.fail(f"world timed out; stderr: {Path(f'{log}.err0').read_text()[-3000:]}")
    if any(p.returncode != 0 for p in procs):
        errs = "\n".join(Path(f"{log}.err{r}").read_text()[-3000:] for r in range(len(procs)))
        pytest.fail(f"a rank failed: {[p.returncode for p in procs]}\n{errs}")


def _losses(log: Path) -> list[dict[int, str]]:
    """Per rank: {step: loss hex}; a step run again after a resume overwrites the earlier value."""
    out = []
    for r in range(WORLD):
        d: dict[int, str] = {}
        for line in Path(f"{log}.rank{r}").read_text().splitlines():
            a, b = line.split()
            if a != "resume":
                d[int(a)] = b
        out.append(d)
    return out


def _resumes(log: Path) -> list[int]:
    lines = Path(f"{log}.rank0").read_text().splitlines()
    return [int(line.split()[1]) for line in lines if line.startswith("resume")]


def _step_lines(log: Path) -> int:
    path = Path(f"{log}.rank0")
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if not line.startswith("resume"))


def _wait_for_steps(
    log: Path, lines: int, procs: list[subprocess.Popen[bytes]], timeout: float = 120
) -> None:
    deadline = time.monotonic() + timeout
    while _step_lines(log) < lines and time.monotonic() < deadline:
        if all(p.poll() is not None for p in procs):
            return
        time.sleep(0.05)


def _check_committed(ckpt: Path) -> int | None:
    mgr_steps = CheckpointManager(ckpt).all_steps()
    for step in mgr_steps:
        for kind in ("model", "optimizer"):
            with open_checkpoint(ckpt / f"step-{step}" / kind, kind) as r:
                r.validate_structure()
                assert r.verify() == [], (step, kind)
    return mgr_steps[-1] if mgr_steps else None


def test_kill_and_resume_matches_uninterrupted_run(tmp_path: Path) -> None:
    ref_log = tmp_path / "ref"
    procs = _launch(tmp_path / "ref_ckpt", False, ref_log)
    _finish(procs, ref_log)
    ref = _losses(ref_log)
    assert all(sorted(r) == list(range(1, TOTAL + 1)) for r in ref)
    assert ref[0] != ref[1]  # ranks see different batches

    rng = random.Random(1234)
    ckpt, log = tmp_path / "ckpt", tmp_path / "run"
    kills = 0
    for _ in range(3):
        before = _step_lines(log)
        procs = _launch(ckpt, True, log)
        # Kill at a random moment after this run has made progress (k new steps, then a random
        # fraction of a step), so the kill lands mid-training however fast the machine is.
        _wait_for_steps(log, before + rng.randint(1, 4), procs)
        time.sleep(rng.uniform(0.0, 0.4))
        if all(p.poll() is not None for p in procs):
            break
        _kill(procs)
        kills += 1
        latest = _check_committed(ckpt)
        assert not (latest is None and (ckpt / "latest").exists())
    procs = _launch(ckpt, True, log)
    _finish(procs, log)
    assert kills >= 1
    assert _check_committed(ckpt) == TOTAL
    got = _losses(log)
    assert got == ref  # every step's loss, on every rank, bit for bit
    resumes = _resumes(log)
    assert resumes[0] == 0 and all(s % 2 == 0 for s in resumes)
    assert not [n for n in os.listdir(ckpt) if n.startswith(".step-")]


def _run(script: str, world: int, args: list[str], log: Path) -> None:
    _finish(_spawn(script, world, args, log), log)


def _seen(log: Path, world: int) -> list[int]:
    ids: list[int] = []
    for r in range(world):
        for line in Path(f"{log}.rank{r}").read_text().splitlines():
            ids.extend(int(v) for v in line.split()[1:])
    return ids


def test_resume_from_dp4_to_dp2_sees_every_sample_of_the_epoch_once(tmp_path: Path) -> None:
    """DDP x4 trains 3 steps (24 of 40 samples), saves; DDP x2 resumes and finishes the epoch."""
    ckpt = tmp_path / "ckpt"
    _run("_dp_resize_worker.py", 4, [str(ckpt), "3", str(tmp_path / "dp4")], tmp_path / "dp4")
    first = _seen(tmp_path / "dp4", 4)
    assert len(first) == 24
    _run("_dp_resize_worker.py", 2, [str(ckpt), "0", str(tmp_path / "dp2")], tmp_path / "dp2")
    second = _seen(tmp_path / "dp2", 2)
    assert len(second) == 16  # 4 more steps of 2 ranks x 2 samples
    assert sorted(first + second) == list(range(40))  # none skipped, none repeated
    assert CheckpointManager(ckpt).all_steps() == [3, 7]
