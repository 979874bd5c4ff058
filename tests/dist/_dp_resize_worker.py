"""One rank of a DDP run whose data-parallel size changes at a resume (issue: resume under another DP size).

    python _dp_resize_worker.py CKPT_DIR STOP_STEP LOG

Trains on 40 indexed samples (batch 2 per rank, shuffled) with DDPPlugin and the Booster's
resumable dataloader, through CheckpointManager: resumes from the latest checkpoint if any,
logs the sample ids each rank sees as ``"<step> <id> <id>"`` to ``LOG.rank<r>``, and saves at
STOP_STEP (or at the end of the epoch), then exits.
"""

from __future__ import annotations

import datetime
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

from unickpt import Booster, CheckpointManager
from unickpt.plugins.ddp import DDPPlugin

N = 40


def main(ckpt: str, stop: int, log: str) -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = TensorDataset(torch.arange(N, dtype=torch.float32).unsqueeze(1))
    booster = Booster(DDPPlugin())
    model, opt, _, dl, _ = booster.boost(model, opt, None, DataLoader(data, batch_size=2, shuffle=True))
    mgr = CheckpointManager(ckpt, booster, save_steps=10_000)
    step = mgr.load(model, opt, dataloader=dl)
    with open(f"{log}.rank{rank}", "a") as out:
        for (x,) in dl:
            loss = model(x).square().mean()
            booster.backward(loss, opt)
            opt.step()
            opt.zero_grad()
            step += 1
            out.write(f"{step} " + " ".join(str(int(v)) for v in x.reshape(-1).tolist()) + "\n")
            if step == stop:
                break
        mgr.save(step, model, opt, dataloader=dl, force=True)
    mgr.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
