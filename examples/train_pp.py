"""Train a small transformer with pipeline parallelism (PPPlugin, 1F1B schedule); save and resume.

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 examples/train_pp.py \\
        --steps 4 --save-dir /tmp/unickpt-demo/pp
    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 4 examples/train_pp.py \\
        --steps 2 --resume-from /tmp/unickpt-demo/pp

One stage per rank (2 or 4 stages). The model is a small GPT-style transformer of its own
(``LlamaForCausalLM``'s forward does not skip the modules of other stages): an embedding, four
blocks, a final norm and an output head tied to the embedding. Each rank keeps only its stage,
in place, so every parameter keeps its full-model name and the checkpoint is the same whatever
the number of stages: ``--resume-from`` takes one saved with 2 stages, 4 stages, or by
``python examples/train_pp.py`` (one process, no pipeline).
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _common import GLOBAL_BATCH, SEQ, VOCAB, log, make_dataloader, parse_args, resolve_resume
from torch import nn

DIM, HEADS, FF, LAYERS = 24, 4, 46, 4


class Block(nn.Module):
    """Pre-norm causal self-attention and MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, FF), nn.Linear(FF, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, DIM))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyLM(nn.Module):
    """A forward that skips the modules PPPlugin removed (set to None) on other stages."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight
        nn.init.normal_(self.emb.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) if self.emb is not None else x
        for block in self.blocks:
            if block is not None:
                h = block(h)
        if self.norm is not None:
            h = self.norm(h)
        return self.head(h) if self.head is not None else h


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def split_points(stages: int) -> list[str]:
    """Where stages 1.. begin: the blocks spread evenly (2 stages: blocks.2; 4: blocks.1-3)."""
    if stages not in (1, 2, 4):
        raise SystemExit(f"run with 1, 2 or 4 processes, not {stages}")
    return [f"blocks.{i * LAYERS // stages}" for i in range(1, stages)]


def main() -> None:
    from unickpt import Booster, CheckpointManager
    from unickpt.data import wrap_dataloader
    from unickpt.plugins import PPPlugin

    args = parse_args("Train a small transformer with pipeline parallelism and save/resume with unickpt.", 4)
    t0 = time.perf_counter()
    from unickpt.plugins._shared import mesh as _mesh

    _mesh.ensure_process_group()
    stages = dist.get_world_size()
    plugin = PPPlugin(stages, split_points(stages)) if stages > 1 else None  # a microbatch per stage
    booster = Booster(plugin=plugin)
    torch.manual_seed(args.seed)
    model = TinyLM()
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-2,
        foreach=False,
    )
    model, optimizer, *_ = booster.boost(model, optimizer, criterion=loss_fn)
    dataloader = wrap_dataloader(make_dataloader(1), plugin)  # every stage draws the same batches
    log(f"[pp x{stages}] split points {split_points(stages)}; global batch {GLOBAL_BATCH}, seq {SEQ}")

    start = 0
    if args.resume_from:
        ckpt_dir, step = resolve_resume(args.resume_from)
        resume = CheckpointManager(ckpt_dir, booster=booster, keep_last=None)
        start = resume.load(model, optimizer, dataloader=dataloader, resume_from_checkpoint=step or "latest")
        if start == 0:
            raise SystemExit(f"--resume-from {args.resume_from}: no committed checkpoint there")
        log(f"resumed step {start} from {resume.step_dir(start)}")

    data = iter(dataloader)
    for step in range(start + 1, start + args.steps + 1):
        try:
            (tokens,) = next(data)
        except StopIteration:
            data = iter(dataloader)
            (tokens,) = next(data)
        batch = (tokens[:, :-1], tokens[:, 1:])
        if plugin is not None:
            loss = booster.execute_pipeline(iter([batch]), model, loss_fn, optimizer)
        else:
            loss = loss_fn(model(batch[0]), batch[1])
            booster.backward(loss, optimizer)
        optimizer.step()
        optimizer.zero_grad()
        # The loss lives on the last stage: send it to every rank for the log line.
        value = torch.zeros(1) if loss is None else loss.detach().reshape(1).clone()
        if dist.get_world_size() > 1:
            dist.all_reduce(value)
        if not args.quiet:
            log(f"  step {step:3d}  loss {float(value):.4f}")

    end = start + args.steps
    if args.save_dir:
        manager = CheckpointManager(args.save_dir, booster=booster, save_steps=1, keep_last=3)
        manager.save(end, model, optimizer, dataloader=dataloader, force=True)
        log(f"saved step {end} to {manager.step_dir(end)} (every stage wrote its own tensors)")
    log(f"done: steps {start + 1}..{end} in {time.perf_counter() - t0:.1f} s")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
