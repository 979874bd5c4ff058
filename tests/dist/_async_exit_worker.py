"""A training script whose last statement is an async save, for tests/dist/test_async_exit.py.

Run as a script (one process, or each rank of a gloo world with torchrun-style environment
variables)::

    python _async_exit_worker.py MODE ROOT EXPECTED

``MODE``: ``manager`` (``CheckpointManager(async_save=True).save(1, ...)``), ``io``
(``CheckpointIO.save_model(..., use_async=True)`` of the model into ROOT/model) or
``manager-destroy`` (the manager's save, then ``dist.destroy_process_group()``). Rank 0 first
writes the tensors it saves to ``EXPECTED`` (safetensors) for the test to compare with; then
the script saves and ends without waiting for the save.
"""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from unickpt import Booster, CheckpointManager
from unickpt.io import GeneralCheckpointIO
from unickpt.plugins.ddp import DDPPlugin


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    # Large enough that its write is still running when the script reaches its end.
    net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(list(net.named_parameters()), lr=1e-2)
    net(torch.randn(4, 256)).square().sum().backward()
    opt.step()
    return net, opt


def expected(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {f"model.{k}": v.detach().clone().contiguous() for k, v in net.state_dict().items()}
    names = {id(p): n for n, p in net.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            out[f"optim.{names[id(p)]}.{k}"] = torch.as_tensor(v).clone().contiguous()
    return out


def main(mode: str, root: str, exp: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    net, opt = build()
    if dist.is_available() and world > 1:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if int(os.environ.get("RANK", "0")) == 0:
        save_file(expected(net, opt), exp)
    booster = None
    model, optim = net, opt
    if world > 1:
        booster = Booster(DDPPlugin())
        model, optim, *_ = booster.boost(net, opt)
    if mode.startswith("manager"):
        mgr = CheckpointManager(root, booster, save_steps=1, async_save=True)
        mgr.save(1, model, optim)
        if mode == "manager-destroy":
            dist.destroy_process_group()
    elif mode == "io":
        io = booster.checkpoint_io if booster is not None else GeneralCheckpointIO()
        io.save_model(model, os.path.join(root, "model"), shard=True, use_async=True)
    else:
        raise ValueError(mode)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
