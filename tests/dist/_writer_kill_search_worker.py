"""Worker side of test_writer_kill's search: one rank's writer process SIGKILLed at its k-th
file-system step of an async manager save, in a world of 2 (DDP).

Each rank's writer loads ``tests/writerkill/sitecustomize.py`` (first on ``sys.path``, so on the
writer's ``PYTHONPATH``) with a control file and an operation log of its own. A first async save
counts every rank's steps; the ranks exchange the counts, so that each computes the same plan:
for each rank, the steps to kill its writer at (the last step on every rank, and the first step
of each kind that stages or publishes on one rank, the ranks taking the kinds in turn; every step
of every rank with ``full``). For each case:

- the victim's ``wait()`` raises ``WriterDiedError`` naming SIGKILL, and says whether the step
  was committed; every rank's ``wait()`` returns or raises within 60 s (no rank hangs on the
  dead writer);
- every rank then sees the same committed steps, and they agree with the victim's message: the
  new step committed (and loads bit-exact on every rank), or not committed and the previous step
  still the latest, loading bit-exact;
- the next async save (a new world of writers) commits on every rank and loads bit-exact.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from _writer_kill_worker import build_model, check_step, state_of
from harness import run_cases

from unickpt import Booster, CheckpointManager
from unickpt.io.writer_process import WriterDiedError
from unickpt.plugins.ddp import DDPPlugin

HOOK_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "writerkill")
COMMITTED = "this save's checkpoint was committed before the writer died"
NOT_COMMITTED = "nothing of this save was committed (the previous checkpoint is untouched)"
DEFAULT_KINDS = ("open", "open()", "pwrite", "fsync", "rename", "replace", "exchange")


class _Killer:
    def __init__(self, control: str, oplog: str) -> None:
        self.control, self.oplog = control, oplog

    def set(self, k: int, token: str) -> None:
        with open(self.control + ".tmp", "w") as f:
            f.write(f"{k} {token}")
        os.replace(self.control + ".tmp", self.control)

    def ops(self, token: str) -> list[tuple[str, str]]:
        with open(self.oplog) as f:
            lines = f.read().splitlines()
        return [(p[2], p[3]) for p in (ln.split(" ", 3) for ln in lines) if p[0] == token]

    def killed(self, token: str) -> str:
        with open(self.oplog) as f:
            hits = [ln.split(" ", 4) for ln in f.read().splitlines() if ln.startswith(f"KILL {token} ")]
        assert len(hits) == 1, hits
        return hits[0][3]


def _plan(every: list[list[tuple[str, str]]], full: bool) -> list[list[int]]:
    """For each rank, the steps to kill its writer at: every step (``full``), else the last step
    of the save (after its commit) on every rank, and the first step of each publishing kind (the
    staged files' creation, data writes, fsyncs, renames) on one rank, the ranks taking the kinds
    in turn among those whose writer reaches them."""
    if full:
        return [list(range(1, len(ops) + 1)) for ops in every]
    first: list[dict[str, int]] = [{} for _ in every]
    for rank, ops in enumerate(every):
        for i, (kind, _) in enumerate(ops, 1):
            if kind in DEFAULT_KINDS:
                first[rank].setdefault(kind, i)
    plan = [{len(ops)} for ops in every]
    for turn, kind in enumerate(sorted({k for f in first for k in f})):
        ranks = [r for r in range(len(every)) if kind in first[r]]
        rank = ranks[turn % len(ranks)]
        plan[rank].add(first[rank][kind])
    return [sorted(p) for p in plan]


def _search(root: str, full: bool) -> dict[str, Any]:
    rank = dist.get_rank()
    base = os.path.join(root, "tree")
    run = os.path.join(base, "run")
    os.makedirs(base, exist_ok=True)
    killer = _Killer(os.path.join(root, f"control-{rank}"), os.path.join(root, f"oplog-{rank}"))
    killer.set(0, "none")
    open(killer.oplog, "w").close()
    os.environ["UNICKPT_TEST_WRITER_CONTROL"] = killer.control
    os.environ["UNICKPT_TEST_WRITER_OPLOG"] = killer.oplog
    os.environ["UNICKPT_TEST_WRITER_ROOT"] = base
    sys.path.insert(0, HOOK_DIR)
    try:
        net, opt = build_model(0)
        booster = Booster(DDPPlugin())
        model, optim, *_ = booster.boost(net, opt)
        mgr = CheckpointManager(run, booster, save_steps=1, keep_last=None, async_save=True)

        def bump() -> dict[str, torch.Tensor]:
            with torch.no_grad():
                for p in net.parameters():
                    p.add_(1.0)
            return state_of(net)

        killer.set(0, "warm")
        mgr.save(1, model, optim)
        mgr.wait()
        bump()
        killer.set(0, "count")
        mgr.save(2, model, optim)
        mgr.wait()
        every: list[list[tuple[str, str]]] = [[] for _ in range(dist.get_world_size())]
        dist.all_gather_object(every, killer.ops("count"))
        assert all(len(o) > 0 for o in every), [len(o) for o in every]
        step, states = 2, {2: state_of(net)}
        report: dict[str, Any] = {"ops": [len(o) for o in every], "cases": 0, "committed": 0, "not": 0}
        killed: set[str] = set()
        for victim, kills in enumerate(_plan(every, full)):
            for k in kills:
                previous = step
                step += 1
                states[step] = bump()
                token = f"k{victim}-{k}"
                killer.set(k if rank == victim else 0, token)
                dist.barrier()
                mgr.save(step, model, optim)
                t0 = time.monotonic()
                err: BaseException | None = None
                try:
                    mgr.wait()
                except Exception as e:
                    err = e
                took = time.monotonic() - t0
                assert took < 60, (victim, k, took)
                said = ""
                if rank == victim:
                    assert isinstance(err, WriterDiedError), (k, repr(err))
                    said = str(err)
                    assert "killed by SIGKILL" in said, said
                    killed.add(killer.killed(token))
                msgs: list[str] = ["" for _ in range(dist.get_world_size())]
                dist.all_gather_object(msgs, said)
                said = msgs[victim]
                steps = mgr.all_steps()
                seen: list[list[int]] = [[] for _ in range(dist.get_world_size())]
                dist.all_gather_object(seen, steps)
                assert all(s == steps for s in seen), (victim, k, seen)
                if step in steps:
                    assert COMMITTED in said, (victim, k, said)
                    check_step(run, step, states[step])
                    report["committed"] += 1
                else:
                    assert NOT_COMMITTED in said, (victim, k, said)
                    assert steps[-1] == previous and mgr.latest_step() == previous, (victim, k, steps)
                    check_step(run, previous, states[previous])
                    report["not"] += 1
                killer.set(0, f"r{victim}-{k}")
                step += 1
                states[step] = bump()
                mgr.save(step, model, optim)
                mgr.wait()
                assert mgr.latest_step() == step, (victim, k)
                check_step(run, step, states[step])
                report["cases"] += 1
        mgr.close()
        kinds: list[set[str]] = [set() for _ in range(dist.get_world_size())]
        dist.all_gather_object(kinds, killed)
        report["killed_kinds"] = sorted(set().union(*kinds))
        dist.barrier()
        return report
    finally:
        sys.path.remove(HOOK_DIR)
        for k in ("UNICKPT_TEST_WRITER_CONTROL", "UNICKPT_TEST_WRITER_OPLOG", "UNICKPT_TEST_WRITER_ROOT"):
            os.environ.pop(k, None)


def search_cases(root: str, full: bool) -> dict[str, object]:
    return run_cases([("writer_kill_search", lambda: _search(os.path.join(root, "search"), full))])
