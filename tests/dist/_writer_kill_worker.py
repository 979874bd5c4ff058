"""Worker side of test_writer_kill: 2 ranks, async CheckpointManager saves through their writer processes.

``kill_case``: step 1 commits; rank 1's writer is SIGKILLed while step 2 is in flight (rank 0's
writer has started it and waits in its first collective for rank 1's); every rank's ``wait()``
raises (rank 1: ``WriterDiedError`` naming SIGKILL; rank 0: its writer's collective with the
dead peer), step 1 stays the committed latest step and loads bit-exact on every rank, and the
next save starts a new world of writers and commits, bit-exact.
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from harness import run_cases

from unickpt import Booster, CheckpointManager
from unickpt.io.writer_process import WriterDiedError
from unickpt.plugins.ddp import DDPPlugin


def build_model(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    return net, torch.optim.SGD(net.parameters(), lr=0.1)


def state_of(m: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in m.state_dict().items()}


def check_step(root: str, step: int, expected: dict[str, torch.Tensor]) -> None:
    net, opt = build_model(99)
    b = Booster(DDPPlugin())
    model, *_ = b.boost(net, opt)
    assert CheckpointManager(root, b).load(model, None, resume_from_checkpoint=step) == step
    got = model.unwrap().state_dict() if hasattr(model, "unwrap") else model.state_dict()
    for k, v in expected.items():
        assert torch.equal(got[k], v), (step, k)


def _kill_case(root: str) -> dict[str, str]:
    rank = dist.get_rank()
    net, opt = build_model(0)
    booster = Booster(DDPPlugin())
    model, optim, *_ = booster.boost(net, opt)
    mgr = CheckpointManager(root, booster, save_steps=1, keep_last=None, async_save=True)
    mgr.save(1, model, optim)
    mgr.wait()
    step1 = state_of(net)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
    pid = mgr._async.writer.pid
    assert pid is not None
    if rank == 1:
        os.kill(pid, signal.SIGSTOP)  # step 2 waits in its job queue until the kill
    mgr.save(2, model, optim)
    dist.barrier()  # every rank's step 2 is in flight
    if rank == 1:
        time.sleep(0.5)  # rank 0's writer is in its first collective with this one
        os.kill(pid, signal.SIGKILL)
        os.kill(pid, signal.SIGCONT)
    t0 = time.monotonic()
    try:
        mgr.wait()
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
        if rank == 1:
            assert isinstance(e, WriterDiedError), err
            assert f"the writer process (pid {pid}) killed by SIGKILL" in err, err
    else:
        raise AssertionError(f"rank {rank}: wait() returned after the writer of rank 1 was killed")
    took = time.monotonic() - t0
    assert took < 60, took
    assert mgr.all_steps() == [1] and mgr.latest_step() == 1
    check_step(root, 1, step1)
    step3 = state_of(net)
    mgr.save(3, model, optim)
    mgr.wait()
    assert mgr._async.writer.pid not in (None, pid)
    assert mgr.all_steps() == [1, 3]
    check_step(root, 3, step3)
    mgr.close()
    dist.barrier()
    return {"error": err, "seconds": f"{took:.1f}"}


def kill_cases(root: str) -> dict[str, object]:
    return run_cases([("writer_killed_mid_save", lambda: _kill_case(os.path.join(root, "kill")))])
