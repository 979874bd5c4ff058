"""The save lock (``directory_lock``) raced by real processes, with holders killed while holding it.

Every holder appends ``A <pid>`` (acquired) and ``R <pid>`` (about to release) or ``K <pid>`` (about
to SIGKILL itself while holding) to a shared log with ``O_APPEND``; the log must read as one holder
at a time. A killed holder leaves the lock file behind (the old "stale lock" of a dead pid): the next
save must get the lock without a takeover race. A checker that holds the lock sees a directory
checkpoint exactly as one writer committed it: never a mix.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from _reliability import Tiny, same_state, save_checkpoint, snapshot

from unickpt import GeneralCheckpointIO
from unickpt.ckpt.reader import open_checkpoint
from unickpt.errors import CheckpointBusyError
from unickpt.store.lock import LOCK_NAME, directory_lock

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")


def _log(path: Path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{line}\n".encode())
    finally:
        os.close(fd)


def _fork(fn: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException as e:  # reported through the exit code and the log
            code = 1
            with open(f"/tmp/unickpt-lock-test-{os.getpid()}.err", "w") as f:
                f.write(repr(e))
        os._exit(code)
    return pid


def _wait_all(pids: list[int], timeout: float) -> None:
    end = time.monotonic() + timeout
    for pid in pids:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"worker {pid}: status {status}"
                break
            if time.monotonic() > end:
                for p in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGKILL)
                raise AssertionError("lock workers did not finish in time (a hang)")
            time.sleep(0.005)


def _hold_and_die(d: Path, log: Path) -> None:
    """A grandchild that takes the lock and SIGKILLs itself while holding it."""
    pid = os.fork()
    if pid == 0:
        try:
            with directory_lock(str(d)):
                _log(log, f"A {os.getpid()}")
                _log(log, f"K {os.getpid()}")
                os.kill(os.getpid(), signal.SIGKILL)
        except CheckpointBusyError:
            pass
        os._exit(0)
    os.waitpid(pid, 0)


def _lock_worker(d: Path, log: Path, iters: int, seed: int, start: float) -> Callable[[], None]:
    def fn() -> None:
        rnd = random.Random(seed)
        while time.time() < start:
            time.sleep(0.0005)
        for _ in range(iters):
            if rnd.random() < 0.15:
                _hold_and_die(d, log)
                continue
            try:
                with directory_lock(str(d)):
                    me = os.getpid()
                    _log(log, f"A {me}")
                    if rnd.random() < 0.5:
                        time.sleep(rnd.random() * 0.0005)
                    _log(log, f"R {me}")
            except CheckpointBusyError:
                _log(log, f"B {os.getpid()}")

    return fn


def _check_log(log: Path) -> dict[str, int]:
    holder = None
    counts = {"A": 0, "R": 0, "K": 0, "B": 0}
    for n, line in enumerate(log.read_text().splitlines()):
        kind, pid = line.split()
        counts[kind] += 1
        if kind == "A":
            assert holder is None, f"line {n}: {pid} acquired the lock while {holder} held it"
            holder = pid
        elif kind in "RK":
            assert holder == pid, f"line {n}: {pid} released a lock held by {holder}"
            holder = None
    return counts


def _race(tmp_path: Path, workers: int, iters: int) -> dict[str, int]:
    d = tmp_path / "ck"
    d.mkdir()
    log = tmp_path / "log"
    start = time.time() + 0.3
    pids = [_fork(_lock_worker(d, log, iters, seed, start)) for seed in range(workers)]
    _wait_all(pids, timeout=60 + 0.2 * iters)
    counts = _check_log(log)
    assert counts["K"] >= 1 and counts["B"] >= 1, counts  # kills happened and the workers did collide
    assert counts["A"] == counts["R"] + counts["K"]
    print(f"lock race, {workers} workers x {iters}: {counts}")
    # Nobody holds it now: a new holder gets it, and it leaves no lock file behind.
    with directory_lock(str(d)):
        pass
    assert not (d / LOCK_NAME).exists()
    return counts


def _stampede_worker(d: Path, log: Path, rounds: int, start: float, period: float) -> Callable[[], None]:
    """Every round, at the same instant as the other workers, try to take the lock a killed holder left."""

    def fn() -> None:
        unlink = os.unlink

        def slow_unlink(*a: Any, **k: Any) -> None:
            time.sleep(0.001)  # widen every window between looking at the lock file and changing it
            unlink(*a, **k)

        os.unlink = slow_unlink
        for r in range(rounds):
            t = start + r * period
            while time.time() < t:
                pass  # spin: every worker starts within microseconds of the others
            try:
                with directory_lock(str(d)):
                    _log(log, f"A {os.getpid()}")
                    time.sleep(0.002)
                    _log(log, f"R {os.getpid()}")
            except CheckpointBusyError:
                _log(log, f"B {os.getpid()}")

    return fn


def _stampede(tmp_path: Path, workers: int, rounds: int) -> dict[str, int]:
    """Rounds: a holder is killed while holding the lock, then every worker rushes to take it over."""
    d = tmp_path / "ck"
    d.mkdir(parents=True)
    log = tmp_path / "log"
    period = 0.03
    start = time.time() + 0.3
    pids = [_fork(_stampede_worker(d, log, rounds, start, period)) for _ in range(workers)]
    try:
        for r in range(rounds):
            while time.time() < start + (r - 0.5) * period:
                time.sleep(0.0005)
            _hold_and_die(d, log)  # the lock file is left behind, naming a dead pid
    finally:
        _wait_all(pids, timeout=60 + 0.1 * rounds)
    counts = _check_log(log)
    assert counts["A"] == counts["R"] + counts["K"]
    assert counts["B"] >= rounds // 4, counts  # the workers did collide
    print(f"lock stampede, {workers} workers x {rounds} rounds: {counts}")
    return counts


def test_lock_takeover_stampede_after_killed_holders(tmp_path: Path) -> None:
    counts = _stampede(tmp_path, 4, rounds=30)
    # Most rounds: a holder killed holding the lock, then a worker took it over (timing on a loaded
    # machine can make a round miss, hence the margins).
    assert counts["K"] >= 15 and counts["A"] - counts["K"] >= 15, counts


def test_lock_is_never_held_twice_with_killed_holders(tmp_path: Path) -> None:
    counts = _race(tmp_path, 3, iters=80)
    assert counts["A"] >= 60


@pytest.mark.slow
def test_lock_is_never_held_twice_long_run(tmp_path: Path) -> None:
    counts = _race(tmp_path, 4, iters=1000)
    assert counts["A"] >= 1000
    counts = _stampede(tmp_path / "stampede", 4, rounds=1000)
    assert counts["A"] - counts["K"] >= 500


def test_lock_refuses_a_second_holder_in_one_process(tmp_path: Path) -> None:
    busy = pytest.raises(CheckpointBusyError, match=r"another save: its lock .*\.unickpt\.lock is held")
    with directory_lock(str(tmp_path)):
        with busy, directory_lock(str(tmp_path)):
            pass
        assert (tmp_path / LOCK_NAME).exists()  # the refused attempt did not remove the holder's file
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_left_by_a_killed_holder_is_free(tmp_path: Path) -> None:
    log = tmp_path / "log"
    _hold_and_die(tmp_path, log)
    assert (tmp_path / LOCK_NAME).exists()  # left behind, with the dead pid in it
    assert log.read_text().split()[0] == "A"
    with directory_lock(str(tmp_path)):
        assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"


def test_busy_error_names_the_live_holder(tmp_path: Path) -> None:
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        with directory_lock(str(tmp_path)):
            os.write(w, b"x")
            time.sleep(30)
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
        with pytest.raises(CheckpointBusyError, match=f"held by pid {pid}"), directory_lock(str(tmp_path)):
            pass
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(r)
    with directory_lock(str(tmp_path)):  # freed by the kernel when the holder died
        pass


def _save_worker(d: Path, seed: int, iters: int, start: float, log: Path) -> Callable[[], None]:
    """Saves Tiny(seed) in place into ``d``; some saves are SIGKILLed partway (in a grandchild)."""

    def fn() -> None:
        import torch

        torch.set_num_threads(1)
        rnd = random.Random(seed)
        while time.time() < start:
            time.sleep(0.0005)
        for _ in range(iters):
            kill = rnd.random() < 0.3
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    if kill:
                        _arm_random_kill(rnd.randint(1, 40))
                    save_checkpoint(d, seed)
                    _log(log, f"S {seed}")
                except CheckpointBusyError:
                    _log(log, f"B {seed}")
                except BaseException:
                    code = 1
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            assert os.WIFSIGNALED(status) or os.WEXITSTATUS(status) == 0, status

    return fn


def _arm_random_kill(k: int) -> None:
    state = {"n": 0}
    orig = os.fsync

    def fsync(fd: int) -> None:
        state["n"] += 1
        if state["n"] == k:
            os.kill(os.getpid(), signal.SIGKILL)
        orig(fd)

    os.fsync = fsync  # type: ignore[assignment]


def _checker(d: Path, until: float, log: Path) -> Callable[[], None]:
    """Under the lock, the directory is a committed checkpoint of one seed, bit-exact, or none yet."""

    def fn() -> None:
        import torch

        torch.set_num_threads(1)
        while time.time() < until:
            try:
                with directory_lock(str(d)):
                    if not (d / "model.safetensors.index.json").exists():
                        continue
                    r = open_checkpoint(d)
                    assert r.verify() == [], "a committed checkpoint fails verify under the lock"
                    m = Tiny(99)
                    GeneralCheckpointIO().load_model(m, str(d), verify=True)
                    seeds = [s for s in (1, 2, 3) if same_state(m, snapshot(Tiny(s)))]
                    assert len(seeds) == 1, "a mixed checkpoint under the lock"
                    _log(log, f"C {seeds[0]}")
            except CheckpointBusyError:
                pass
            time.sleep(0.02)  # leave the lock to the savers most of the time

    return fn


def test_racing_savers_with_kills_never_commit_a_mix(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    d.mkdir()
    log = tmp_path / "log"
    start = time.time() + 0.5
    pids = [_fork(_save_worker(d, seed, 6, start, log)) for seed in (1, 2, 3)]
    pids.append(_fork(_checker(d, start + 3, log)))
    _wait_all(pids, timeout=120)
    lines = log.read_text().split("\n")
    checks = [x for x in lines if x.startswith("C ")]
    saves = [x for x in lines if x.startswith("S ")]
    assert len(saves) >= 2 and len(checks) >= 5, (len(saves), len(checks))
    assert any(x.startswith("B ") for x in lines), "the saves never collided: the test proved nothing"
    print(
        f"racing savers: {len(saves)} committed, {sum(x.startswith('B ') for x in lines)} refused, {len(checks)} checks"
    )
    save_checkpoint(d, 3)
    m = Tiny(99)
    GeneralCheckpointIO().load_model(m, str(d), verify=True)
    assert same_state(m, snapshot(Tiny(3)))
    assert not (d / LOCK_NAME).exists()
