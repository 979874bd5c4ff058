"""Train the tiny Llama with hybrid parallelism: FSDP2 over tensor parallelism on one 2-D mesh.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/train_hybrid.py \\
        --steps 4 --save-dir /tmp/unickpt-demo/hybrid

``HybridParallelPlugin(tp_size=2, dp="fsdp2")``: the mesh is ``dp x tp`` (2 x 2 on 4 ranks, 1 x 2
on 2). Attention and MLP projections are split over ``tp`` (:func:`_common.tp_plan`), then
``fully_shard`` splits every parameter's rows over ``dp``. Over the same dimension this gives
``_StridedShard`` placements; each rank still writes its own block (sliced checkpoint), and
``--resume-from`` takes a checkpoint saved under any plugin and world size.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from _common import (
    build_model,
    evaluate,
    lm_loss,
    log,
    make_dataloader,
    make_optimizer,
    parse_args,
    resolve_resume,
    tp_plan,
)


def main() -> None:
    from unickpt import Booster, CheckpointManager
    from unickpt.data import wrap_dataloader
    from unickpt.plugins import HybridParallelPlugin

    args = parse_args("Train a tiny Llama with FSDP2 x TP and save/resume with unickpt.", 4)
    t0 = time.perf_counter()
    plugin = HybridParallelPlugin(tp_size=2, dp="fsdp2", tp_plan=tp_plan())
    booster = Booster(plugin=plugin)
    plain = build_model(args.seed)
    model, optimizer, *_ = booster.boost(plain, make_optimizer(plain))
    dataloader = wrap_dataloader(make_dataloader(plugin.dp_size), plugin)
    mesh = plugin.device_mesh
    assert mesh is not None
    log(f"[hybrid x{dist.get_world_size()}] mesh {dict(plugin.layout()['mesh'])}, dp={plugin.dp_size}")

    start = 0
    if args.resume_from:
        ckpt_dir, step = resolve_resume(args.resume_from)
        resume = CheckpointManager(ckpt_dir, booster=booster, keep_last=None)
        start = resume.load(model, optimizer, dataloader=dataloader, resume_from_checkpoint=step or "latest")
        if start == 0:
            raise SystemExit(f"--resume-from {args.resume_from}: no committed checkpoint there")
        log(f"resumed step {start} from {resume.step_dir(start)}; eval loss {evaluate(model):.6f}")

    data = iter(dataloader)
    for step in range(start + 1, start + args.steps + 1):
        try:
            (tokens,) = next(data)
        except StopIteration:
            data = iter(dataloader)
            (tokens,) = next(data)
        loss = lm_loss(model(input_ids=tokens).logits, tokens)
        booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        # Mean over the dp replicas only (the tp ranks of a replica hold the same loss).
        mean = loss.detach().reshape(1).clone()
        dist.all_reduce(mean, group=mesh["dp"].get_group())
        if not args.quiet:
            log(f"  step {step:3d}  loss {float(mean) / plugin.dp_size:.4f}")

    end = start + args.steps
    if args.save_dir:
        manager = CheckpointManager(args.save_dir, booster=booster, save_steps=1, keep_last=3)
        manager.save(end, model, optimizer, dataloader=dataloader, force=True)
        log(f"saved step {end} to {manager.step_dir(end)}; eval loss {evaluate(model):.6f}")
        if dist.get_rank() == 0:
            model.unwrap().config.to_json_file(os.path.join(args.save_dir, "config.json"))
    log(f"done: steps {start + 1}..{end} in {time.perf_counter() - t0:.1f} s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
