"""One rank of a small DDP training run that saves through CheckpointManager (kill-and-resume test).

Run as a script by tests/dist/test_manager_dist.py with torchrun-style environment variables::

    python _manager_worker.py CKPT_DIR TOTAL_STEPS ASYNC(0|1) LOSS_LOG

Every rank appends ``"<step> <loss.hex()>"`` lines to ``LOSS_LOG.rank<r>`` (flushed at once),
and ``"resume <step>"`` after loading.
"""

from __future__ import annotations

import datetime
import os
import random
import sys

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from unickpt import Booster, CheckpointManager
from unickpt.plugins.ddp import DDPPlugin

DATA = [(torch.randn(6, generator=torch.Generator().manual_seed(i)), i % 4) for i in range(44)]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 9)
        self.b = torch.nn.Linear(9, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.dropout(torch.tanh(self.a(x)), 0.25, self.training))


def main(ckpt: str, total: int, async_save: bool, log: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    random.seed(rank)
    np.random.seed(rank)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 5, gamma=0.7)
    booster = Booster(DDPPlugin())
    model, optim, _, dl, sched = booster.boost(
        net, opt, None, DataLoader(DATA, batch_size=3, shuffle=True), sched
    )
    mgr = CheckpointManager(ckpt, booster, save_steps=2, keep_last=2, async_save=async_save)
    step = mgr.load(model, optim, sched, dl)
    with open(f"{log}.rank{rank}", "a") as out:
        out.write(f"resume {step}\n")
        out.flush()
        while step < total:
            for x, y in dl:
                noise = torch.randn(()) * 1e-3 + random.random() * 1e-3 + float(np.random.rand()) * 1e-3
                loss = torch.nn.functional.cross_entropy(model(x), y) + noise
                optim.zero_grad()
                booster.backward(loss, optim)
                optim.step()
                sched.step()
                step += 1
                out.write(f"{step} {loss.item().hex()}\n")
                out.flush()
                mgr.save(step, model, optim, sched, dl)
                if step >= total:
                    break
    mgr.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", sys.argv[4])
    os._exit(0)
