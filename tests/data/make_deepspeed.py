"""Regenerate tests/data/deepspeed/ with real DeepSpeed (0.19.8 was used), on CPU with gloo.

    .venv/bin/pip install --no-deps deepspeed hjson einops msgpack py-cpuinfo   # beside torch
    DS_ACCELERATOR=cpu .venv/bin/python tests/data/make_deepspeed.py

For a tiny model (Linear(4, 6), LayerNorm(6), Linear(6, 3), and a non-trainable buffer)
trained 3 Adam steps (torch's Adam, ``torch_adam: true``, so no op is compiled) in fp32,
with two param groups (different lr and weight decay), writes ``zero<S>_ws<W>/`` for ZeRO
stage S in (1, 2, 3) and world size W in (1, 2) (W=2: two processes on gloo), each holding
(``make_deepspeed.py 3`` remakes stage 3 only), and ``bf16_zero1_ws<W>/``: the same model
trained in bf16 with ZeRO stage 1, which DeepSpeed runs with its ``BF16_Optimizer``
(``bf16_zero_pp_rank_*`` files; ``make_deepspeed.py bf16`` remakes those only), and
``ucp_zero2_ws2/``: ZeRO stage 2 on two ranks saved with ``universal_checkpoint_info`` and
converted by DeepSpeed's ``ds_to_universal`` (``ckpt/global_step3_universal/`` beside
``ckpt/global_step3/``; ``make_deepspeed.py ucp``):

- ``ckpt/``: what ``engine.save_checkpoint(dir)`` writes (``latest``, ``global_step3/``);
- ``expected.safetensors``: DeepSpeed's own ``get_fp32_state_dict_from_zero_checkpoint`` of
  it (``model.<fqn>``), the live optimizer's Adam moments per parameter (``state.<fqn>.<key>``,
  gathered from every rank's flat partition through the live optimizer's fragment addresses)
  and the module's own ``state_dict()`` (``module.<name>``, the dtype DeepSpeed trains in);
- ``expected.json``: the param groups' hyperparameters (``params`` as FQNs) and the step.

The helper scripts DeepSpeed copies beside the checkpoint (``zero_to_fp32.py``) are deleted.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed")
STEPS = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(
    rank: int, world: int, stage: int, port: int, out: str, bf16: bool = False, ucp: bool = False
) -> None:
    for k, v in (("RANK", rank), ("WORLD_SIZE", world), ("MASTER_PORT", port)):
        os.environ[k] = os.environ["LOCAL_" + k] = str(v)
    os.environ.update(MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
    import deepspeed
    import torch
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import save_file
    from torch import nn

    # DeepSpeed's CPU backend compiles its shared-memory all-reduce kernel (a C++ build, about a
    # minute) the first time a process group starts; saving a checkpoint never runs it.
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 3))
    model.register_buffer("scale", torch.tensor([1.5, 2.0, 0.5]))
    groups = [
        {"params": [model[0].weight, model[0].bias, model[2].weight], "weight_decay": 0.01},
        {"params": [model[1].weight, model[1].bias, model[2].bias], "weight_decay": 0.0, "lr": 5e-4},
    ]
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 1,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "betas": [0.85, 0.95], "torch_adam": True}},
        "zero_optimization": {"stage": stage},
        "steps_per_print": 1000,
    }
    if bf16:  # bf16 weights, fp32 master weights and gradient accumulation: BF16_Optimizer
        config.update(bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"})
    pre = {id(p): n for n, p in model.named_parameters()}
    group_names = [[pre[id(p)] for p in grp["params"]] for grp in groups]
    engine, opt, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    g = torch.Generator().manual_seed(1 + rank)
    for _ in range(STEPS):
        x = torch.randn(2, 4, generator=g)
        if bf16:
            x = x.bfloat16()
        loss = (engine(x) * engine.module.scale).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
    ckpt = os.path.join(out, "ckpt")
    if ucp:  # what ds_to_universal needs from the client (Megatron-DeepSpeed fills it in)
        from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

        engine.save_checkpoint(ckpt, client_state={UNIVERSAL_CHECKPOINT_INFO: {}})
    else:
        engine.save_checkpoint(ckpt)
    expected = {}
    for n, p in engine.module.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            if stage == 3:
                full = safe_get_full_optimizer_state(p, key)
                expected[f"state.{n}.{key}"] = full.detach().clone()
            else:
                expected[f"state.{n}.{key}"] = _full_state(opt, p, key)
        gi = next(i for i, gn in enumerate(group_names) if n in gn)
        flat = _fp32_partitions(opt, stage)[gi]
        expected[f"state.{n}.step"] = opt.optimizer.state[flat]["step"].detach().clone()
        if bf16:  # zero_to_fp32 refuses BF16_Optimizer files: the live fp32 master weights instead
            expected[f"model.{n}"] = safe_get_full_fp32_param(p).detach().clone().contiguous()
    if bf16:
        for n, b in engine.module.named_buffers():  # floating buffers as fp32, as zero_to_fp32 gives them
            expected[f"model.{n}"] = (b.float() if b.is_floating_point() else b).detach().clone()
    torch.distributed.barrier()
    if rank == 0:
        for f in os.listdir(ckpt):
            if f.endswith(".py"):
                os.remove(os.path.join(ckpt, f))
        fp32 = {} if bf16 else get_fp32_state_dict_from_zero_checkpoint(ckpt)
        for k, v in fp32.items():
            expected[f"model.{k}"] = v.contiguous()
        if stage != 3:  # under ZeRO-3 the module holds empty placeholders
            for k, v in engine.module.state_dict().items():
                expected[f"module.{k}"] = v.detach().clone()
        save_file(expected, os.path.join(out, "expected.safetensors"))
        pgs = []
        for grp in opt.optimizer.param_groups if hasattr(opt, "optimizer") else opt.param_groups:
            pgs.append({k: v for k, v in grp.items() if k not in ("params", "param_names")})
        for pg, gn in zip(pgs, group_names, strict=True):
            pg["params"] = gn
        with open(os.path.join(out, "expected.json"), "w") as f:
            json.dump({"param_groups": pgs, "step": STEPS}, f, indent=1, sort_keys=True, default=str)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _fp32_partitions(opt, stage):  # type: ignore[no-untyped-def]
    """This rank's flat fp32 master partition of every group, whatever the optimizer calls it."""
    if stage == 3:
        return opt.fp32_partitioned_groups_flat
    return (
        getattr(opt, "single_partition_of_fp32_groups", None) or opt.fp32_groups_flat_partition
    )  # BF16_Optimizer


def _full_state(opt, p, key):  # type: ignore[no-untyped-def]
    """The ``key`` moment of ``p`` gathered from every rank's flat partition, through the live
    optimizer's own fragment addresses (``deepspeed.utils.safe_get_full_optimizer_state`` does
    this too, but refuses a group whose flat partition carries alignment padding)."""
    import torch

    buf = torch.zeros(p.numel(), dtype=torch.float32)
    m = p._hp_mapping
    if m is not None:
        flat = opt.optimizer.state[_fp32_partitions(opt, 1)[m.param_group_index]][key]
        hp, lp = m.hp_fragment_address, m.lp_fragment_address
        buf.narrow(0, lp.start, lp.numel).copy_(flat.narrow(0, hp.start, hp.numel))
    torch.distributed.all_reduce(buf)
    return buf.reshape(p.shape)


def main() -> None:
    import torch.multiprocessing as mp

    arg = sys.argv[1] if len(sys.argv) > 1 else "1,2,3,bf16,ucp"
    named = {"bf16": [(1, (1, 2), "bf16_")], "ucp": [(2, (2,), "ucp_")]}
    variants = [v for x in arg.split(",") for v in named.get(x, [(int(x) if x.isdigit() else 0, (1, 2), "")])]
    for stage, worlds, prefix in variants:
        for world in worlds:
            out = os.path.join(HERE, f"{prefix}zero{stage}_ws{world}")
            shutil.rmtree(out, ignore_errors=True)
            os.makedirs(out)
            port = _free_port()
            mp.spawn(_run, args=(world, stage, port, out, prefix == "bf16_", prefix == "ucp_"), nprocs=world)
            if prefix == "ucp_":
                import subprocess

                step = os.path.join(out, "ckpt", f"global_step{STEPS}")
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "deepspeed.checkpoint.ds_to_universal",
                        "--input_folder",
                        step,
                        "--output_folder",
                        step + "_universal",
                        "--num_extract_workers",
                        "1",
                        "--num_merge_workers",
                        "1",
                    ],
                    check=True,
                    env=dict(os.environ, DS_ACCELERATOR="cpu"),
                )
                for f in os.listdir(os.path.join(out, "ckpt")):
                    if f.endswith(".py"):
                        os.remove(os.path.join(out, "ckpt", f))
            print("wrote", out, file=sys.stderr)


if __name__ == "__main__":
    main()
