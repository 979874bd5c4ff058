"""Resume real DeepSpeed from a universal checkpoint and write down what its engine then holds.

    DS_ACCELERATOR=cpu python tests/data/load_deepspeed_universal.py CKPT OUT WORLD STAGE [sched]

``WORLD`` processes (gloo, CPU) build the tiny model of tests/data/make_deepspeed.py (Linear(4, 6),
LayerNorm(6), Linear(6, 3), a buffer) with two param groups whose hyperparameters differ from any
checkpoint's, wrap it in a ZeRO stage ``STAGE`` engine (torch's Adam: no op is compiled) configured
with ``"checkpoint": {"load_universal": true}`` and call ``engine.load_checkpoint(CKPT)``; with
``sched``, the engine also gets a torch ``StepLR`` whose state the checkpoint must restore.
Rank 0 then writes ``OUT.safetensors``: per parameter its fp32 master weight (``fp32.<fqn>``) and
Adam moments (``<key>.<fqn>``), each gathered from every rank's flat partition through the live
optimizer's own fragment addresses, and the module's weight (``module.<fqn>``); and ``OUT.json``:
each flat group's ``step`` and hyperparameters, the engine's counters and the scheduler's state.
Used by tests/unit/tools/test_export_deepspeed.py.
"""

from __future__ import annotations

import json
import os
import socket
import sys


def _run(rank: int, world: int, port: int, ckpt: str, out: str, stage: int, sched: bool) -> None:
    for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("MASTER_PORT", port)):
        os.environ[k] = os.environ["LOCAL_" + k] = str(v)
    os.environ.update(MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    from safetensors.torch import save_file
    from torch import nn

    # DeepSpeed's CPU backend compiles its shared-memory all-reduce kernel (a C++ build, about a
    # minute) the first time a process group starts; a checkpoint load never runs it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(123)  # other weights than any checkpoint's
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    model.register_buffer("scale", torch.zeros(3))
    groups = [
        {"params": [model[0].weight, model[0].bias, model[2].weight], "weight_decay": 0.5},
        {"params": [model[1].weight, model[1].bias, model[2].bias], "weight_decay": 0.25, "lr": 0.125},
    ]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 0.0625, "betas": [0.5, 0.75], "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "checkpoint": {"load_universal": True},
        "steps_per_print": 1000,
    }
    kw = {}
    if sched:
        kw["lr_scheduler"] = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.125)
    engine, opt, _, lr_sched = deepspeed.initialize(model=model, model_parameters=groups, config=config, **kw)
    path, _ = engine.load_checkpoint(ckpt)
    assert path is not None, "load_checkpoint found nothing"
    flat_groups = opt.single_partition_of_fp32_groups
    got = {}
    for n, p in engine.module.named_parameters():
        m = p._hp_mapping
        for key in ("fp32", "exp_avg", "exp_avg_sq"):
            buf = torch.zeros(p.numel(), dtype=torch.float32)
            if m is not None:
                flat = flat_groups[m.param_group_index]
                src = flat if key == "fp32" else opt.optimizer.state[flat][key]
                hp, lp = m.hp_fragment_address, m.lp_fragment_address
                buf.narrow(0, lp.start, lp.numel).copy_(src.narrow(0, hp.start, hp.numel))
            torch.distributed.all_reduce(buf)
            got[f"{key}.{n}"] = buf.reshape(p.shape)
        got[f"module.{n}"] = p.detach().clone()
    info = {
        "groups": [
            {
                "step": float(opt.optimizer.state[flat]["step"]),
                **{k: v for k, v in g.items() if k not in ("params", "param_names")},
            }
            for flat, g in zip(flat_groups, opt.optimizer.param_groups, strict=True)
        ],
        "global_steps": engine.global_steps,
        "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps,
        "lr_scheduler": lr_sched.state_dict() if sched else None,
    }
    if rank == 0:
        save_file(got, out + ".safetensors")
        with open(out + ".json", "w") as f:
            json.dump(info, f, default=str)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def main() -> None:
    import torch.multiprocessing as mp

    ckpt, out, world, stage = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    sched = sys.argv[5:] == ["sched"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    mp.spawn(_run, args=(world, port, ckpt, out, stage, sched), nprocs=world)


if __name__ == "__main__":
    main()
