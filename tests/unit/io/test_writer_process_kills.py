"""The writer process of async saves SIGKILLed at every file-system step of a save.

``tests/writerkill/sitecustomize.py``, first on ``sys.path`` (the writer's ``PYTHONPATH`` is
built from it), counts the writer's os-level file-system steps under the test's directory and
kills the writer with SIGKILL before the step numbered ``k`` (a control file says ``k``). A first
save counts the steps (N); then for each ``k`` an async save over a committed checkpoint is
killed at step ``k`` and, on the real tree:

- ``wait()`` raises ``WriterDiedError`` naming SIGKILL;
- either the previous checkpoint loads bit-exact and the error says nothing of this save was
  committed, or (killed after the commit point) the new checkpoint loads bit-exact and the error
  says it was committed before the writer died;
- the next async save of the same ``CheckpointIO`` / ``CheckpointManager`` commits and loads
  bit-exact;
- steps of every kind the save makes were killed at (a search that never kills at a rename
  cannot fail).

By default every step of a ``CheckpointIO`` save is killed at, and of a manager's step the first
step of each kind, the steps that publish the step itself (its ``COMMIT``, the rename of its
staging directory, ``latest``, the fsyncs of the run directory) and a stride of the others;
``-m slow`` kills at every step of both.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from unickpt.errors import IncompleteCheckpointError
from unickpt.io import GeneralCheckpointIO
from unickpt.io.writer_process import WriterDiedError
from unickpt.manager import CheckpointManager
from unickpt.wrappers import OptimizerWrapper

pytestmark = [pytest.mark.timeout(600), pytest.mark.long]

HOOK_DIR = Path(__file__).resolve().parents[2] / "writerkill"
PUBLISH = {
    "rename",
    "replace",
    "exchange",
    "unlink",
    "remove",
    "rmdir",
    "mkdir",
    "fsync",
    "fdatasync",
    "link",
}
STRIDE = 9
NOT_COMMITTED = (
    "before the save was committed; nothing of this save was committed (the previous checkpoint is untouched)"
)
REMOVED = (
    "before the save was committed; nothing of this save was committed, and the previous checkpoint there "
    "is no longer committed either"
)
COMMITTED = "after the save was committed; this save's checkpoint was committed before the writer died"


@dataclass
class Killer:
    control: Path
    oplog: Path

    def set(self, k: int, token: str) -> None:
        tmp = self.control.with_suffix(".tmp")
        tmp.write_text(f"{k} {token}")
        tmp.replace(self.control)

    def ops(self, token: str) -> list[tuple[str, str]]:
        out = []
        for line in self.oplog.read_text().splitlines():
            parts = line.split(" ", 3)
            if parts[0] == token:
                out.append((parts[2], parts[3]))
        return out

    def killed(self, token: str) -> tuple[str, str]:
        hits = [
            ln.split(" ", 4) for ln in self.oplog.read_text().splitlines() if ln.startswith(f"KILL {token} ")
        ]
        assert len(hits) == 1, hits
        return hits[0][3], hits[0][4]


@pytest.fixture
def killer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Killer]:
    k = Killer(tmp_path / "control", tmp_path / "oplog")
    k.set(0, "none")
    k.oplog.write_text("")
    root = tmp_path / "root"
    root.mkdir()
    monkeypatch.setenv("UNICKPT_TEST_WRITER_CONTROL", str(k.control))
    monkeypatch.setenv("UNICKPT_TEST_WRITER_OPLOG", str(k.oplog))
    monkeypatch.setenv("UNICKPT_TEST_WRITER_ROOT", str(root))
    monkeypatch.syspath_prepend(str(HOOK_DIR))
    yield k


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _state(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def _same(m: torch.nn.Module, expected: dict[str, torch.Tensor]) -> bool:
    got = m.state_dict()
    return sorted(got) == sorted(expected) and all(
        got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in expected.items()
    )


def _bump(m: torch.nn.Module, by: float) -> None:
    with torch.no_grad():
        for p in m.parameters():
            p.add_(by)


def _chosen(ops: list[tuple[str, str]], full: bool, every: bool) -> list[int]:
    """Step numbers (from 1) to kill at: all (``full``, or ``every``), else the first step of each
    kind, every step that publishes (renames, exchanges, unlinks, rmdirs, mkdirs, fsyncs) outside
    the files of the parts, and a stride of the rest."""
    if full or every:
        return list(range(1, len(ops) + 1))
    first: dict[str, int] = {}
    for i, (kind, _) in enumerate(ops, 1):
        first.setdefault(kind, i)
    top = {i for i, (kind, where) in enumerate(ops, 1) if kind in PUBLISH and where.count("/") <= 1}
    return sorted(top | set(first.values()) | set(range(1, len(ops) + 1, STRIDE)))


def _kinds_hit(ops: list[tuple[str, str]], killed: set[str]) -> None:
    assert killed == {kind for kind, _ in ops}, (sorted(killed), sorted({kind for kind, _ in ops}))
    assert killed & {"rename", "replace", "exchange"}, killed  # the commit point itself was killed at


def _io_search(tmp_path: Path, killer: Killer, full: bool) -> None:
    root = tmp_path / "root"
    io = GeneralCheckpointIO()
    m = _model(0)
    fresh = _model(99)
    # Warm the writer, then count the steps of an async save over a committed checkpoint.
    io.save_model(m, root / "count", shard=True)
    killer.set(0, "warm")
    io.save_model(m, root / "count", shard=True, use_async=True)
    io.wait()
    _bump(m, 1.0)
    killer.set(0, "count")
    io.save_model(m, root / "count", shard=True, use_async=True)
    io.wait()
    ops = killer.ops("count")
    assert len(ops) > 10, ops
    killed: set[str] = set()
    outcomes = {"committed": 0, "not committed": 0, "removed": 0}
    for k in _chosen(ops, full, every=False):
        d = root / f"k{k}"
        _bump(m, 1.0)
        io.save_model(m, d, shard=True)  # the previous checkpoint, committed
        previous = _state(m)
        _bump(m, 1.0)
        new = _state(m)
        killer.set(k, f"k{k}")
        io.save_model(m, d, shard=True, use_async=True)
        with pytest.raises(WriterDiedError, match=r"\(pid \d+\) killed by SIGKILL") as e:
            io.wait()
        kind, where = killer.killed(f"k{k}")
        killed.add(kind)
        msg = str(e.value)
        try:
            io.load_model(fresh, d)
        except IncompleteCheckpointError as gone:
            # Between the removal of the previous index and the rename of the new one (the
            # documented window of a save in place, store.publish.commit_directory).
            assert "holds no committed model checkpoint" in str(gone)
            assert REMOVED in msg, (k, kind, where, msg)
            assert not (d / "model.safetensors.index.json").exists()
            outcomes["removed"] += 1
        else:
            if _same(fresh, previous):
                assert NOT_COMMITTED in msg, (k, kind, where, msg)
                outcomes["not committed"] += 1
            else:
                assert _same(fresh, new), (k, kind, where)
                assert COMMITTED in msg, (k, kind, where, msg)
                outcomes["committed"] += 1
        # The next async save of the same object commits (over whatever the kill left).
        killer.set(0, f"r{k}")
        _bump(m, 1.0)
        after = _state(m)
        io.save_model(m, d, shard=True, use_async=True)
        io.wait()
        io.load_model(fresh, d)
        assert _same(fresh, after), (k, kind, where)
    io.close()
    _kinds_hit(ops, killed)
    assert all(outcomes.values()), outcomes


def _manager_search(tmp_path: Path, killer: Killer, full: bool) -> None:
    run = tmp_path / "root" / "run"
    m = _model(0)
    opt = OptimizerWrapper(torch.optim.Adam(m.parameters(), lr=0.1), m)

    def train() -> None:
        m(torch.ones(2, 8)).sum().backward()
        opt.step()
        opt.zero_grad()

    def check(step: int, expected: dict[str, torch.Tensor], opt_expected: dict[str, torch.Tensor]) -> None:
        fresh = _model(77)
        fopt = OptimizerWrapper(torch.optim.Adam(fresh.parameters(), lr=0.1), fresh)
        assert CheckpointManager(run).load(fresh, fopt, resume_from_checkpoint=step) == step
        assert _same(fresh, expected), step
        got = {f"{i}.{n}": v for i, s in fopt.state_dict()["state"].items() for n, v in s.items()}
        assert sorted(got) == sorted(opt_expected) and all(
            torch.equal(got[k], v) for k, v in opt_expected.items()
        )

    def opt_state() -> dict[str, torch.Tensor]:
        return {f"{i}.{n}": v.clone() for i, s in opt.state_dict()["state"].items() for n, v in s.items()}

    mgr = CheckpointManager(run, save_steps=1, keep_last=None, async_save=True)
    train()
    killer.set(0, "warm")
    assert mgr.save(1, m, opt)
    mgr.wait()
    train()
    killer.set(0, "count")
    assert mgr.save(2, m, opt)
    mgr.wait()
    ops = killer.ops("count")
    assert len(ops) > 10, ops
    step = 2
    killed: set[str] = set()
    outcomes = {"committed": 0, "not committed": 0}
    for k in _chosen(ops, full, every=False):
        previous = step
        train()
        step += 1
        new, new_opt = _state(m), opt_state()
        killer.set(k, f"k{k}")
        assert mgr.save(step, m, opt)
        with pytest.raises(WriterDiedError, match=r"\(pid \d+\) killed by SIGKILL") as e:
            mgr.wait()
        kind, where = killer.killed(f"k{k}")
        killed.add(kind)
        msg = str(e.value)
        steps = mgr.all_steps()
        if step in steps:
            assert COMMITTED in msg, (k, kind, where, msg)
            check(step, new, new_opt)
            outcomes["committed"] += 1
        else:
            assert NOT_COMMITTED in msg, (k, kind, where, msg)
            assert steps[-1] == previous and mgr.latest_step() == previous, (k, kind, where, steps)
            outcomes["not committed"] += 1
        killer.set(0, f"r{k}")
        train()
        step += 1
        after, after_opt = _state(m), opt_state()
        assert mgr.save(step, m, opt)
        mgr.wait()
        assert mgr.latest_step() == step
        check(step, after, after_opt)
    mgr.close()
    _kinds_hit(ops, killed)
    assert outcomes["committed"] and outcomes["not committed"], outcomes


def test_io_async_save_killed_at_its_steps(tmp_path: Path, killer: Killer) -> None:
    _io_search(tmp_path, killer, full=False)


def test_manager_async_save_killed_at_its_steps(tmp_path: Path, killer: Killer) -> None:
    _manager_search(tmp_path, killer, full=False)


@pytest.mark.slow
def test_io_async_save_killed_at_every_step(tmp_path: Path, killer: Killer) -> None:
    _io_search(tmp_path, killer, full=True)


@pytest.mark.slow
def test_manager_async_save_killed_at_every_step(tmp_path: Path, killer: Killer) -> None:
    _manager_search(tmp_path, killer, full=True)
