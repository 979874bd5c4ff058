"""CheckpointManager data-loss windows: a re-save of an existing step SIGKILLed at every file-system
event, retention and cleanup after it, and the save lock raced by real processes.

After every kill, ``load()`` must restore step N bit-exactly as either the old or the new save (never
start from 0, never lose the step), and a following save + retention must never delete the only copy.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from _reliability import run_child as _run_child
from _reliability import train_state, trained

import unickpt.store.publish as commit_steps
import unickpt.store.publish as stepdirs
from unickpt.errors import CheckpointBusyError, IncompleteCheckpointError, UnickptError
from unickpt.manager import CheckpointManager
from unickpt.store.lock import directory_lock

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
STEP = 4
OLD_SEED, NEW_SEED = 1, 2


EXPECTED = {seed: train_state(*trained(seed)) for seed in (OLD_SEED, NEW_SEED, 3)}


def _loaded(d: Path, **kw: Any) -> tuple[int, int | None]:
    """(step load() returned, the seed whose state it restored bit-exactly or None)."""
    m, opt = trained(99)
    step = CheckpointManager(d, save_steps=1, **kw).load(m, opt)
    got = train_state(m, opt)
    seeds = [s for s, exp in EXPECTED.items() if exp == got]
    return step, seeds[0] if seeds else None


def _save(d: Path, seed: int, step: int = STEP, keep_last: int | None = None) -> None:
    m, opt = trained(seed)
    mgr = CheckpointManager(d, save_steps=1, keep_last=keep_last)
    assert mgr.save(step, m, opt)


def _resave_in_child(d: Path, exchange: bool) -> Callable[[], None]:
    """Re-save step STEP with the NEW model (run in the forked child, under the kill hooks)."""

    def fn() -> None:
        torch.set_num_threads(1)
        if exchange:
            orig = commit_steps.exchange

            def ticked(a: str, b: str) -> bool:
                # The swap is one syscall the hooks do not see: an fsync of the directory (hooked:
                # "before"/"after" events) just before and just after it gives kill points there.
                fd = os.open(os.path.dirname(a), os.O_RDONLY)
                try:
                    os.fsync(fd)
                    ok = orig(a, b)
                    os.fsync(fd)
                finally:
                    os.close(fd)
                return ok

            commit_steps.exchange = ticked  # (install_step, the one caller, looks it up there)
        else:
            commit_steps.exchange = lambda a, b: False  # a filesystem without RENAME_EXCHANGE
        _save(d, NEW_SEED)

    return fn


def _events(fn: Callable[[], None], tmp: Path) -> list[str]:
    log = tmp / "events.json"
    assert _run_child(0, fn, log) == 0
    ev: list[str] = json.loads(log.read_text())
    return ev


def _run_kills(tmp_path: Path, exchange: bool, dense: bool) -> dict[str, int]:
    template = tmp_path / "template"
    _save(template, OLD_SEED, step=STEP - 2)  # an older committed step too
    _save(template, OLD_SEED)
    probe = tmp_path / "probe"
    shutil.copytree(template, probe)
    events = _events(_resave_in_child(probe, exchange), tmp_path)
    assert _loaded(probe) == (STEP, NEW_SEED)
    n = len(events)
    assert n > 40, events
    # Every event from the COMMIT marker on (the commit, the swap, latest, the old copy's removal,
    # retention); every ``stride``-th one before (writing the stage: the old step is not touched).
    commit = next(i for i, e in enumerate(events) if "COMMIT" in e)
    latest = max(i for i, e in enumerate(events) if ".latest.tmp" in e) + 2  # and its directory fsync
    if dense:
        ks = list(range(1, n + 1))
    else:  # the commit window: every other event (before/after pairs), a few before and after it
        ks = sorted(
            set(range(1, commit + 1, commit // 2))
            | set(range(commit + 1, latest + 1, 3))
            | {latest + 1, (latest + n) // 2, n}
        )
    seen = {"old": 0, "new": 0, "kills": 0}
    for k in ks:
        d = tmp_path / f"k{k}"
        shutil.copytree(template, d)
        sig = _run_child(k, _resave_in_child(d, exchange), tmp_path / "log.json")
        assert sig == signal.SIGKILL, f"child not killed at event {k} ({events[k - 1]})"
        seen["kills"] += 1
        step, seed = _loaded(d)
        assert step == STEP, f"kill at {k} ({events[k - 1]}): load() resumed from {step}: {os.listdir(d)}"
        assert seed in (OLD_SEED, NEW_SEED), f"kill at {k} ({events[k - 1]}): step {STEP} is neither save"
        seen["old" if seed == OLD_SEED else "new"] += 1
        # The next save (with retention keeping 2) neither deletes the surviving copy nor keeps debris.
        _save(d, 3, step=STEP + 1, keep_last=2)
        m, opt = trained(99)
        mgr = CheckpointManager(d, save_steps=1, keep_last=2)
        assert mgr.all_steps() == [STEP, STEP + 1]
        assert mgr.load(m, opt, resume_from_checkpoint=STEP) == STEP
        assert train_state(m, opt) == EXPECTED[seed]
        assert sorted(os.listdir(d)) == sorted(["latest", f"step-{STEP}", f"step-{STEP + 1}"]), k
        shutil.rmtree(d)
    assert seen["old"] > 0 and seen["new"] > 0, seen
    print(f"re-save of step {STEP} ({'exchange' if exchange else 'rename aside'}): {n} events, {seen}")
    return seen


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_kill_during_resave_never_loses_the_step(tmp_path: Path, exchange: bool) -> None:
    if exchange and not _exchange_works(tmp_path):
        pytest.skip("the temporary directory's filesystem has no RENAME_EXCHANGE (rename-aside is tested)")
    seen = _run_kills(tmp_path, exchange, dense=False)
    assert seen["kills"] >= 9


@pytest.mark.slow
@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2-exchange", "rename-aside"])
def test_kill_at_every_event_of_a_resave(tmp_path: Path, exchange: bool) -> None:
    seen = _run_kills(tmp_path, exchange, dense=True)
    assert seen["kills"] >= 100


def _exchange_works(tmp: Path) -> bool:
    a, b = tmp / "xa", tmp / "xb"
    a.mkdir()
    b.mkdir()
    (a / "f").write_text("a")
    ok = stepdirs.exchange(str(a), str(b))
    if ok:
        assert (b / "f").read_text() == "a" and not (a / "f").exists()
    shutil.rmtree(a)
    shutil.rmtree(b)
    return ok


# ---------------------------------------------------------------------- cleanup vs a live writer
def _paused_save(target: str, gate: Path, cache: Path | None) -> Callable[[], None]:
    """Child: a manager save of step 1 that stops after writing model and optimizer, until ``gate``."""

    def fn() -> None:
        import unickpt.manager.train_state as manager_mod

        torch.set_num_threads(1)
        orig = manager_mod.write_rank_state

        def paused(*a: Any, **k: Any) -> None:
            (gate.parent / "ready").write_text("")
            while not gate.exists():
                time.sleep(0.005)
            orig(*a, **k)

        manager_mod.write_rank_state = paused
        m, opt = trained(NEW_SEED)
        kw: dict[str, Any] = {} if cache is None else {"local_cache_dir": cache}
        assert CheckpointManager(target, save_steps=1, **kw).save(1, m, opt)

    return fn


def _start(fn: Callable[[], None]) -> int:
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            fn()
        except BaseException:
            code = 1
        os._exit(code)
    return pid


def _wait_ready(tmp: Path, pid: int) -> None:
    end = time.monotonic() + 60
    while not (tmp / "ready").exists():
        assert time.monotonic() < end, "the paused save never started"
        done, status = os.waitpid(pid, os.WNOHANG)
        assert not done, f"the paused save ended early: {status}"
        time.sleep(0.005)


def _stages(root: Path) -> list[str]:
    return sorted(n for n in os.listdir(root) if ".staging-" in n)


def test_cleanup_never_deletes_a_live_writers_stage(tmp_path: Path) -> None:
    d = tmp_path / "ck"
    gate = tmp_path / "go"
    pid = _start(_paused_save(str(d), gate, None))
    try:
        _wait_ready(tmp_path, pid)
        (stage,) = _stages(d)
        m, opt = trained(3)
        with pytest.raises(CheckpointBusyError, match="another save"):
            CheckpointManager(d, save_steps=1).save(2, m, opt)
        stepdirs.clean_work_dirs(str(d))  # even a cleanup without the lock leaves a live owner's stage
        assert _stages(d) == [stage]
        gate.write_text("")
    finally:
        _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert _loaded(d) == (1, NEW_SEED)
    assert sorted(os.listdir(d)) == ["latest", "step-1"]


# ---------------------------------------------------------------------- load() of a damaged or lost step
def test_damaged_latest_step_is_reported_not_skipped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _save(tmp_path, OLD_SEED, step=2)
    _save(tmp_path, NEW_SEED, step=STEP)
    shard = next((tmp_path / f"step-{STEP}" / "model").glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:-8])  # truncated: structural damage, found before any copy
    m, opt = trained(99)
    with pytest.raises(UnickptError) as ei:
        CheckpointManager(tmp_path, save_steps=1).load(m, opt)
    note = " ".join(getattr(ei.value, "__notes__", []))
    assert f"step {STEP}" in note and "resume_from_checkpoint=2" in note
    assert f"step {STEP}" in caplog.text and "resume_from_checkpoint=2" in caplog.text
    m, opt = trained(99)
    assert CheckpointManager(tmp_path, save_steps=1).load(m, opt, resume_from_checkpoint=2) == 2
    assert train_state(m, opt) == EXPECTED[OLD_SEED]


def test_lost_steps_are_an_error_not_a_fresh_start(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _save(tmp_path, OLD_SEED, step=2)
    _save(tmp_path, NEW_SEED, step=STEP)
    os.unlink(tmp_path / f"step-{STEP}" / "COMMIT")
    assert _loaded(tmp_path) == (2, OLD_SEED)
    assert f"'latest' records step {STEP}, which is not committed" in caplog.text
    shutil.rmtree(tmp_path / "step-2")
    with pytest.raises(
        IncompleteCheckpointError, match=f"records a save of step {STEP}, but no committed step"
    ):
        _loaded(tmp_path)
    m, opt = trained(99)
    assert CheckpointManager(tmp_path, save_steps=1).load(m, opt, resume_from_checkpoint=None) == 0


def test_replaced_copy_is_the_step_until_the_new_one_is_committed(tmp_path: Path) -> None:
    """The recovery rule, state by state: an .old copy alone is step N (loaded, kept by retention, moved
    back by the next save); once step-N is committed again, the .old copy is debris."""
    _save(tmp_path, OLD_SEED, step=STEP)
    old = tmp_path / f".step-{STEP}.old-0123456789ab"
    os.rename(tmp_path / f"step-{STEP}", old)
    (tmp_path / f"step-{STEP}").mkdir()  # an uncommitted leftover in the way
    mgr = CheckpointManager(tmp_path, save_steps=1, keep_last=1)
    assert mgr.all_steps() == [STEP] and mgr.latest_step() == STEP
    assert _loaded(tmp_path) == (STEP, OLD_SEED)
    m, opt = trained(3)
    assert mgr.save(STEP + 1, m, opt)  # keep_last=1: step N goes, via its restored step-N
    assert mgr.all_steps() == [STEP + 1] and sorted(os.listdir(tmp_path)) == ["latest", f"step-{STEP + 1}"]
    # Both copies committed: step-N wins, the .old copy is removed by the next save.
    _save(tmp_path, NEW_SEED, step=STEP)
    shutil.copytree(tmp_path / f"step-{STEP}", old)
    (old / "model" / "extra").write_text("")
    assert _loaded(tmp_path, keep_last=None) == (STEP, NEW_SEED)
    _save(tmp_path, 3, step=STEP + 2)
    assert not old.exists()


def test_retention_removes_every_copy_of_a_step(tmp_path: Path) -> None:
    _save(tmp_path, OLD_SEED, step=STEP)
    _save(tmp_path, NEW_SEED, step=STEP + 1)
    old = tmp_path / f".step-{STEP}.old-0123456789ab"
    shutil.copytree(tmp_path / f"step-{STEP}", old)
    stepdirs.remove_step(str(tmp_path), STEP)
    assert sorted(os.listdir(tmp_path)) == ["latest", f"step-{STEP + 1}"]  # no copy left to resurrect
    assert CheckpointManager(tmp_path).all_steps() == [STEP + 1]


def test_filesystem_without_directory_locks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """NFS-like: flock on a directory fails with EBADF. Saves still work (the save lock serialises
    them) and leftovers of killed saves are still removed."""
    import errno
    import fcntl
    import stat

    orig = fcntl.flock

    def flock(fd: int, op: int) -> None:
        if stat.S_ISDIR(os.fstat(fd).st_mode):
            raise OSError(errno.EBADF, "Bad file descriptor")
        orig(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock)
    _save(tmp_path, OLD_SEED, step=2)
    dead = tmp_path / ".step-3.staging-0123456789ab"
    (dead / "model").mkdir(parents=True)
    _save(tmp_path, NEW_SEED, step=3)
    assert not dead.exists()
    assert _loaded(tmp_path) == (3, NEW_SEED)
    with directory_lock(str(tmp_path)), pytest.raises(CheckpointBusyError):
        _save(tmp_path, 3, step=4)  # the save lock (a regular file) still works


def test_async_save_in_flight_keeps_the_lock_until_committed(tmp_path: Path) -> None:
    """A newer save (another manager, same process) cannot commit while an older async save is in
    flight: it is refused; once the async save committed, the newer one commits and wins `latest`."""
    import signal

    m, opt = trained(OLD_SEED)
    slow = CheckpointManager(tmp_path, save_steps=1, async_save=True)
    pid = slow._async.writer.pid  # started by the constructor; stopped, it holds the save in flight
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        assert slow.save(10, m, opt)
        m2, opt2 = trained(NEW_SEED)
        other = CheckpointManager(tmp_path, save_steps=1)
        with pytest.raises(CheckpointBusyError):
            other.save(20, m2, opt2)
    finally:
        os.kill(pid, signal.SIGCONT)
    slow.wait()
    assert other.save(20, m2, opt2)
    assert other.all_steps() == [10, 20] and _loaded(tmp_path) == (20, NEW_SEED)
    m3, opt3 = trained(99)
    assert (
        other.load(m3, opt3, resume_from_checkpoint=10) == 10 and train_state(m3, opt3) == EXPECTED[OLD_SEED]
    )


def _save_in_child(d: Path, seed: int, step: int, keep_last: int | None) -> Callable[[], None]:
    def fn() -> None:
        torch.set_num_threads(1)
        _save(d, seed, step=step, keep_last=keep_last)

    return fn


@pytest.mark.parametrize("dense", [pytest.param(True, marks=pytest.mark.slow), False])
def test_kill_during_the_recovery_of_a_replaced_copy(tmp_path: Path, dense: bool) -> None:
    """State: a re-save without RENAME_EXCHANGE was killed between its two renames (step 4 exists only
    as `.step-4.old-*`, the new copy committed under its staging name). The next save (step 5,
    keep_last=2) restores it first: killed at each of its events, step 4 is never lost."""
    template = tmp_path / "template"
    _save(template, OLD_SEED, step=2)
    _save(template, OLD_SEED)
    probe = tmp_path / "probe"
    shutil.copytree(template, probe)
    events = _events(_resave_in_child(probe, False), tmp_path)
    k_window = events.index(f"after rename step-{STEP}")
    assert _run_child(k_window + 1, _resave_in_child(template, False), tmp_path / "l") == signal.SIGKILL
    names = [x for x in os.listdir(template) if x.startswith(f".step-{STEP}.old-")]
    assert f"step-{STEP}" not in os.listdir(template) and len(names) == 1, os.listdir(template)
    probe2 = tmp_path / "probe2"
    shutil.copytree(template, probe2)
    next_events = _events(_save_in_child(probe2, 3, STEP + 1, 2), tmp_path)
    restore = next_events.index(f"after rename .step-{STEP}.old-{names[0].split('-')[-1]}") + 1
    n = len(next_events)
    ks = range(1, n + 1) if dense else sorted({*range(1, restore + 3), n // 2, n})
    print(f"save restoring a replaced copy: {n} events, {len(ks)} kills")
    for k in ks:
        d = tmp_path / f"k{k}"
        shutil.copytree(template, d)
        assert _run_child(k, _save_in_child(d, 3, STEP + 1, 2), tmp_path / "l") == signal.SIGKILL
        steps = CheckpointManager(d).all_steps()
        assert STEP in steps, (k, next_events[k - 1], sorted(os.listdir(d)))
        m, opt = trained(99)
        assert CheckpointManager(d).load(m, opt, resume_from_checkpoint=STEP) == STEP
        assert train_state(m, opt) == EXPECTED[OLD_SEED], k
        _save(d, NEW_SEED, step=STEP + 2, keep_last=2)
        assert CheckpointManager(d).all_steps()[-1] == STEP + 2
        assert not [x for x in os.listdir(d) if x.startswith(".")], (k, os.listdir(d))
        shutil.rmtree(d)
