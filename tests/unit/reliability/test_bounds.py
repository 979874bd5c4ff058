"""Counts in unickpt's own files are bounded by what their bytes can hold, before anything is built.

tests/data/make_counts.py scales every count, size, extent and length field of each of our file
kinds to extremes (10^9, 2^62 - 1, negative, 10^6-item lists, megabyte-long strings, 10^5 tiny
entries): the index in both forms of its slices (listed and compact), compact grids, boxes and file
ids, single-file headers and their unickpt block, data-file headers, ``latest``, ``COMMIT``,
hashes files and train state. Each case must be answered with its exact class (or read as
nothing, for the run records that are optional), with a message naming the file and the field,
within 2 s of CPU and 200 MB of resident memory added at peak; a sample goes through the CLI, measured in the child.
A bigger sweep of values with UNICKPT_FUZZ_EXAMPLES set.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import unickpt.errors as errors
from unickpt.ckpt import run_layout as rl
from unickpt.ckpt.reader import open_checkpoint
from unickpt.tools.diff import diff_checkpoints
from unickpt.tools.inspect import inspect_checkpoint
from unickpt.tools.merge import merge_checkpoint
from unickpt.tools.run import verify_run
from unickpt.tools.verify import verify_checkpoint

DATA = Path(__file__).resolve().parents[2] / "data"
_spec = importlib.util.spec_from_file_location("make_counts", DATA / "make_counts.py")
assert _spec and _spec.loader
MC = importlib.util.module_from_spec(_spec)
sys.modules["make_counts"] = MC
_spec.loader.exec_module(MC)

BIG = bool(os.environ.get("UNICKPT_FUZZ_EXAMPLES"))
SECONDS = 2.0
PEAK = 200 << 20
INDEX_CASES = {c.name: c for c in MC.index_cases(BIG)}
FILE_CASES = {c.name: c for c in MC.single_cases() + MC.data_cases()}
RUN_CASES = {c.name: c for c in MC.run_cases()}
_LIBC = ctypes.CDLL(None)


def _memory() -> tuple[int, int]:
    """(resident bytes now, the resident high-water mark) of this process."""
    got = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                got[line[:5]] = int(line.split()[1]) << 10
    return got["VmRSS"], got["VmHWM"]


@contextlib.contextmanager
def bounded(what: str, seconds: float = SECONDS, peak: int = PEAK) -> Iterator[None]:
    """The block runs in ``seconds`` of this process's CPU time (other processes' load does not
    count) and adds at most ``peak`` bytes of resident memory at its peak (the process's
    high-water mark, reset before the block: numpy's, torch's and the allocator's pages all
    count, and measuring costs no CPU, where tracing every allocation would multiply the CPU
    time the bound is on); the address space is capped meanwhile, so that a regression fails
    fast instead of swapping."""
    gc.collect()
    _LIBC.malloc_trim(0)  # freed heap goes back to the system: the block's pages count anew
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    base, _ = _memory()
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        vm = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    cap = vm + (4 << 30)
    resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    t0 = time.process_time()
    try:
        yield
    finally:
        elapsed = time.process_time() - t0
        _, high = _memory()
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    top = high - base
    assert elapsed < seconds, f"{what}: {elapsed:.2f} s of CPU"
    assert top < peak, f"{what}: {top / 2**20:.0f} MB resident added at peak"


def _answer(fn: Any, *args: Any, **kw: Any) -> tuple[str, str]:
    """(the class name of what ``fn`` raised, or "ok"; its message)."""
    try:
        fn(*args, **kw)
    except errors.UnickptError as e:
        return type(e).__name__, str(e)
    return "ok", ""


def _verify(path: Path) -> None:
    report = verify_checkpoint(path)
    if report:  # integrity failures are answers too, but none of these cases should give one
        raise AssertionError(f"verify reported failures instead of refusing: {list(report)[:3]}")


def _check(case: Any, got: tuple[str, str], want: str, where: Path) -> None:
    cls, msg = got
    assert cls == want, (case.name, msg[:500])
    if want != "ok":
        assert str(where) in msg, (case.name, msg[:300])  # names the file
        assert len(msg) < 4000, (case.name, len(msg))  # readable, whatever the file holds
        if case.field is not None and cls == case.error:
            assert case.field in msg, (case.name, msg[:500])  # names the field


@pytest.mark.parametrize("name", sorted(INDEX_CASES))
def test_index_counts_bounded(name: str, tmp_path: Path) -> None:
    case = INDEX_CASES[name]
    d = case.build(tmp_path / "ck")
    index = d / MC.INDEX
    with bounded(f"{name}: open_checkpoint + inspect"):
        got = _answer(lambda: (open_checkpoint(d).close(), inspect_checkpoint(d)))
    _check(case, got, case.error, index)
    with bounded(f"{name}: verify"):
        got = _answer(_verify, d)
    want = case.verify or case.error
    cls, msg = got
    # verify reads the headers: a lie about a slice may surface as the file's HeaderError first
    if want == "HeaderError" and cls == "HeaderError":
        assert MC.FILES[0] in msg or MC.FILES[1] in msg, msg[:300]
        assert len(msg) < 4000, len(msg)
    else:
        _check(case, got, want, index)


@pytest.mark.parametrize("name", sorted(FILE_CASES))
def test_header_counts_bounded(name: str, tmp_path: Path) -> None:
    case = FILE_CASES[name]
    p = case.build(tmp_path / "ck")
    where = p if case.kind == "single" else p / MC.FILES[0]
    with bounded(f"{name}: open_checkpoint + inspect + verify"):
        got = _answer(lambda: (open_checkpoint(p).close(), inspect_checkpoint(p), _verify(p)))
    _check(case, got, case.error, where if case.error in ("HeaderError",) or case.kind == "single" else p)


# Through every tool: one hostile count of each kind that opens (the file-size and header
# bounds) and one refused at parse time, for each version form.
TOOL_CASES = [
    "v5-grid-1000000000",
    "v5-grid-cells-past-file",
    "v5-boxes-many",
    "v2-slices-many",
    "v5-grid-2d-4611686018427387903",
    "v2-shape-1000000000",
]


@pytest.mark.parametrize("name", TOOL_CASES)
def test_every_tool_bounded(name: str, tmp_path: Path) -> None:
    import torch
    from torch import nn

    from unickpt import GeneralCheckpointIO

    case = INDEX_CASES[name]
    d = case.build(tmp_path / "ck")
    control = MC.write_checkpoint(tmp_path / "control", MC.base_index(5))
    want = case.verify or case.error
    refused = (want, "HeaderError", "IndexFileError")

    # Its own model: the control checkpoint's tensors (w F32[4,3], n I64[4], tests/data/make_counts.py).
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4, 3))
            self.register_buffer("n", torch.zeros(4, dtype=torch.int64))

    m = M()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with bounded(f"{name}: diff, diff --deep, merge, load_model", seconds=4 * SECONDS):
        for deep in (False, True):
            cls, msg = _answer(diff_checkpoints, d, control, deep=deep)
            # without --deep only the indexes are compared: an index that opens may differ
            assert cls in refused or (cls == "ok" and not deep), (deep, msg[:300])
        cls, msg = _answer(merge_checkpoint, d, tmp_path / "merged")
        assert cls in refused, msg[:300]
        assert not (tmp_path / "merged").exists()
        cls, msg = _answer(GeneralCheckpointIO().load_model, m, d)
        assert cls in (*refused, "StateMismatchError"), msg[:300]
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_bounds_name_the_file_and_its_room(tmp_path: Path) -> None:
    """The refusals of the three places a bound is checked, word for word in their key parts."""
    d = INDEX_CASES["v5-grid-1000000000"].build(tmp_path / "a")
    with pytest.raises(errors.IndexFileError) as ei:
        open_checkpoint(d)
    msg = str(ei.value)
    assert "unickpt.tensors['w'].grid: declares 1000000000 slice(s)" in msg and MC.FILES[0] in msg
    assert "at most 2000000 entries" in msg
    d = INDEX_CASES["v5-grid-cells-past-file"].build(tmp_path / "b")
    with pytest.raises(
        errors.IndexFileError, match=r"100000 slice\(s\) in data file .*hold at most \d+ header"
    ):
        inspect_checkpoint(d)
    with (
        open_checkpoint(d) as r,
        pytest.raises(errors.IndexFileError, match=r"its \d+ bytes|whose \d+ bytes"),
    ):
        r.validate_structure()


def test_control_checkpoints_are_valid(tmp_path: Path) -> None:
    """The base of every case is a sound checkpoint in each version's form (the cases fail for
    their edit alone)."""
    for v in MC.VERSIONS:
        d = MC.write_checkpoint(tmp_path / f"v{v}", MC.base_index(v))
        report = verify_checkpoint(d)
        assert list(report) == [], v
        info = inspect_checkpoint(d)
        assert info["totals"]["slices"] == 3, v


# ------------------------------------------------------------------ run records


@pytest.mark.parametrize("name", sorted(RUN_CASES))
def test_run_record_counts_bounded(name: str, tmp_path: Path) -> None:
    case = RUN_CASES[name]
    run = case.build(tmp_path / "run")
    with bounded(f"{name}: latest, COMMIT, verify_run"):
        latest = rl.read_latest(run)
        steps = rl.latest_step(run)
        commit = rl.read_commit(run / "step-5")
        results = verify_run(run)
    assert steps == 5  # the committed step, whatever the record says
    if case.kind == "latest":
        assert latest is None, latest  # a record that names no step is no record
    else:
        assert isinstance(commit, dict)
        failures = [f for r in results for f in r.failures]
        if "world" in name and "negative" not in name:
            assert any("world_size" in f and "COMMIT" in f for f in failures), failures[:3]
            assert len(failures) < 20, len(failures)  # counted, never listed rank by rank
        if name in ("commit-deep", "commit-over-limit"):
            assert commit == {} and any("unreadable" in f for f in failures), failures[:3]


@pytest.mark.parametrize("name", [c[0] for c in MC.hashes_cases()])
def test_hashes_file_counts_bounded(name: str, tmp_path: Path) -> None:
    make, want = next((m, w) for n, m, w in MC.hashes_cases() if n == name)
    raw = make()
    run = MC._run(tmp_path / "run")
    ts = run / "step-5" / rl.TRAIN_STATE_DIR
    ts.mkdir()
    h = ts / "rank-00000.hashes.json"
    h.write_bytes(raw)
    with bounded(f"hashes {name}"):
        results = verify_run(run)
    failures = [f for r in results for f in r.failures]
    assert any(str(h) in f for f in failures) and any(want in f for f in failures), failures[:3]
    assert len(failures) < 20 and all(len(f) < 4000 for f in failures), (len(failures), failures[:1])


def _train_state(tmp_path: Path) -> tuple[Path, Path, dict[str, Any]]:
    from unickpt.manager import train_state

    step = tmp_path / "step-5"
    js, tensors = train_state.capture(5, 0, 1, None, {})
    train_state.write_rank_state(str(step), 0, js, tensors)
    path = step / rl.TRAIN_STATE_DIR / "rank-00000.json"
    return step, path, json.loads(path.read_bytes())


@pytest.mark.parametrize("name", [c[0] for c in MC.train_state_cases()])
def test_train_state_counts_bounded(name: str, tmp_path: Path) -> None:
    import random

    import numpy as np
    import torch

    from unickpt.manager import train_state

    edit, field = next((e, f) for n, e, f in MC.train_state_cases() if n == name)
    step, path, js = _train_state(tmp_path)
    new = edit(js)
    path.write_bytes(new if isinstance(new, bytes) else json.dumps(new).encode())
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    with bounded(f"train state {name}"):
        cls, msg = _answer(train_state.restore, str(step), 5, 0, 1, None, {})
    if field == "ok":
        assert cls == "ok", msg
        return
    assert cls == "IndexFileError", msg[:300]
    assert str(path) in msg and field in msg and len(msg) < 4000, msg[:300]
    assert random.getstate() == states[0]  # nothing restored from a refused state
    assert (np.random.get_state()[1] == states[1][1]).all()
    assert torch.equal(torch.get_rng_state(), states[2])


# ------------------------------------------------------------------ the CLI, measured in the child

CLI_CASES = ["v5-grid-1000000000", "v5-grid-cells-past-file", "v5-files-many"]


def _cli(*argv: str) -> tuple[int, str, int]:
    """(exit code, stderr, the child's peak RSS in bytes) of ``python -m unickpt argv``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.Popen(
        [sys.executable, "-m", "unickpt", *argv], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env
    )
    assert p.stderr is not None
    with p.stderr:
        err = p.stderr.read().decode()
    _, status, usage = os.wait4(p.pid, 0)
    p.returncode = os.waitstatus_to_exitcode(status)
    return p.returncode, err, usage.ru_maxrss * 1024


def test_cli_sample_bounded(tmp_path: Path) -> None:
    control = MC.write_checkpoint(tmp_path / "control", MC.base_index(5))
    code, err, base = _cli("verify", str(control))
    assert code == 0, err
    for name in CLI_CASES:
        d = INDEX_CASES[name].build(tmp_path / name)
        for cmd in ("inspect", "verify"):
            t0 = time.monotonic()
            code, err, rss = _cli(cmd, str(d))
            elapsed = time.monotonic() - t0
            assert code == 2 and err.count("\n") == 1 and "IndexFileError" not in err, (name, cmd, err)
            assert str(d) in err and ("grid" in err or "slice" in err), (name, cmd, err)
            assert rss < base + PEAK, (name, cmd, rss / 2**20, base / 2**20)
            assert elapsed < 30, (name, cmd, elapsed)  # the interpreter starts in a few seconds


def test_case_counts() -> None:
    counts = MC.count_all(BIG)
    print(json.dumps(counts))
    # the index cases of each form of version 5 (listed and compact slices): about 31 each
    assert counts["index"] >= 60 and sum(counts.values()) >= 130, counts


def test_bounded_sees_what_a_block_allocates() -> None:
    """The memory bound measures: 300 MB touched inside the block fails it, even where the same
    amount was allocated and freed just before (the allocator's pages are handed back first)."""
    import numpy as np

    warm = np.ones(300 << 20, dtype=np.uint8)
    del warm
    with pytest.raises(AssertionError, match="MB resident added at peak"), bounded("allocation"):
        block = np.ones(300 << 20, dtype=np.uint8)
        del block
