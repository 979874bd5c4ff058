"""Shared pieces of the example training scripts: a tiny Llama, synthetic data, the training loop.

Every example (``train_fsdp2.py``, ``train_tp.py`` ...) does the same thing under a different
plugin: build the same tiny ``LlamaForCausalLM`` from a config (no download), train it a few
steps on synthetic token sequences, save with :class:`unickpt.CheckpointManager` (a sliced
checkpoint: every rank writes its own blocks, hashed), and resume from any checkpoint saved
under any plugin and world size.

The model has odd sizes so every split is uneven (vocab 37 rows over 4 ranks: 10, 10, 10, 7;
MLP width 46 over 4 ranks: 12, 12, 12, 10) and its output head is tied to the embedding.

Run these scripts under ``torchrun`` (``OMP_NUM_THREADS=1`` on CPU; gloo is picked
automatically without CUDA); see ``examples/README.md``.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from collections.abc import Callable
from typing import Any

# No network: the model is built from a config, never downloaded.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

# Model sizes. Odd on purpose: splits over 2 and 4 ranks are uneven.
VOCAB = 37
HIDDEN = 24
HEADS = 4
KV_HEADS = 2
FFN = 46
LAYERS = 2
SEQ = 12
# The global batch stays the same under every layout, so the loss curve continues smoothly
# when a run resumes with another parallelism: each data-parallel rank gets GLOBAL_BATCH / dp.
GLOBAL_BATCH = 8
DATASET_SAMPLES = 512
LR = 1e-2


def log(msg: str) -> None:
    """Print on rank 0 only (every rank calls it)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(msg, flush=True)


def headline(msg: str) -> None:
    log(f"\n=== {msg}")


def parse_args(description: str, default_steps: int = 6) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--steps", type=int, default=default_steps, help="training steps to run in this launch")
    p.add_argument(
        "--save-dir",
        default=None,
        help="CheckpointManager directory: a step-<N>/ checkpoint is saved there at the end (sliced, hashed)",
    )
    p.add_argument(
        "--resume-from",
        default=None,
        help="resume from a CheckpointManager directory (its latest step) or one step-<N> directory, "
        "saved under any plugin and world size",
    )
    p.add_argument("--seed", type=int, default=0, help="model initialisation seed (same on every rank)")
    p.add_argument("--quiet", action="store_true", help="only the summary lines")
    return p.parse_args()


def build_model(seed: int = 0) -> torch.nn.Module:
    """A tiny ``LlamaForCausalLM`` built from a config (same weights on every rank for a seed)."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError as e:  # pragma: no cover - transformers is in the dev extras
        raise SystemExit(
            "the examples need transformers: pip install 'unickpt[dev]' (or transformers)"
        ) from e
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    return model


def tp_plan() -> dict[str, Any]:
    """Megatron-style plan: q/k/v and gate/up column-parallel, o and down row-parallel.

    Each rank holds its own attention heads (4 query and 2 key/value heads over 2 ranks) and
    its own slice of the MLP width (46 -> 23 + 23; torch's RowwiseParallel needs even splits of its input dim). The tied embedding/head stays replicated.
    """
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "model.layers.*.self_attn.q_proj": ColwiseParallel(),
        "model.layers.*.self_attn.k_proj": ColwiseParallel(),
        "model.layers.*.self_attn.v_proj": ColwiseParallel(),
        "model.layers.*.self_attn.o_proj": RowwiseParallel(),
        "model.layers.*.mlp.gate_proj": ColwiseParallel(),
        "model.layers.*.mlp.up_proj": ColwiseParallel(),
        "model.layers.*.mlp.down_proj": RowwiseParallel(),
    }


def decoder_layer_class() -> type[torch.nn.Module]:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    return LlamaDecoderLayer


def make_dataset() -> TensorDataset:
    """Synthetic sequences with a learnable rule: each next token is (7 * token + 3) mod VOCAB."""
    g = torch.Generator().manual_seed(1234)
    first = torch.randint(0, VOCAB, (DATASET_SAMPLES, 1), generator=g)
    seqs = [first]
    for _ in range(SEQ - 1):
        seqs.append((seqs[-1] * 7 + 3) % VOCAB)
    tokens = torch.cat(seqs, dim=1)
    # A little noise so the task is not trivially perfect.
    noise = torch.rand(tokens.shape, generator=g) < 0.05
    tokens = torch.where(noise, torch.randint(0, VOCAB, tokens.shape, generator=g), tokens)
    return TensorDataset(tokens)


def make_dataloader(dp_size: int) -> DataLoader[Any]:
    """Per-rank batches of GLOBAL_BATCH / dp_size; ``Booster.boost`` makes it resumable and sharded."""
    if GLOBAL_BATCH % dp_size:
        raise SystemExit(
            f"the global batch {GLOBAL_BATCH} does not divide over {dp_size} data-parallel ranks"
        )
    return DataLoader(make_dataset(), batch_size=GLOBAL_BATCH // dp_size, shuffle=True, drop_last=True)


def eval_batch() -> torch.Tensor:
    """A fixed batch (the first 8 samples) on which every layout reports the same loss."""
    return make_dataset().tensors[0][:8]


def lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), tokens[:, 1:].reshape(-1))


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    """AdamW with two param groups (no weight decay on norms), built on the plain model."""
    decay = [p for _, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for _, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
        lr=LR,
        betas=(0.9, 0.95),
        foreach=False,
    )


def global_mean(value: torch.Tensor, plugin: Any) -> float:
    """Mean of a per-rank scalar over the data-parallel ranks (every rank calls it)."""
    v = value.detach().float().reshape(1).clone()
    if plugin is not None and plugin.dp_size > 1:
        dist.all_reduce(v)
        v /= plugin.dp_size
    return float(v)


def evaluate(model: torch.nn.Module) -> float:
    """Loss on :func:`eval_batch` (every rank runs the whole batch; collective under FSDP/TP)."""
    tokens = eval_batch()
    with torch.no_grad():
        return float(lm_loss(model(input_ids=tokens).logits, tokens))


def resolve_resume(path: str) -> tuple[str, int | None]:
    """(manager directory, step) for ``--resume-from`` given a manager directory or a step directory."""
    path = os.path.abspath(path)
    base = os.path.basename(path.rstrip(os.sep))
    if base.startswith("step-") and os.path.isdir(os.path.join(path, "model")):
        return os.path.dirname(path), int(base.split("-", 1)[1])
    return path, None


def run(plugin_factory: Callable[[], Any], description: str, default_steps: int = 6) -> None:
    """The whole example: boost, optionally resume, train ``--steps`` steps, save. Every rank runs it."""
    from unickpt import Booster, CheckpointManager
    from unickpt.data import wrap_dataloader

    args = parse_args(description, default_steps)
    # Rank 0 shows warnings (e.g. "RNG states are not restored" after a world-size change); the
    # other ranks only errors, so each message appears once.
    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(
        level=logging.WARNING if rank == 0 else logging.ERROR,
        format=f"[rank{rank}] %(levelname)s %(name)s: %(message)s",
    )
    t0 = time.perf_counter()
    plugin = plugin_factory()
    booster = Booster(plugin=plugin)
    model = build_model(args.seed)
    optimizer = make_optimizer(model)
    model, optimizer, _, _, _ = booster.boost(model, optimizer)
    # The data-parallel size is known once the plugin has joined the process group (in boost);
    # wrap_dataloader (what boost(dataloader=...) does) shards the data over the dp ranks and
    # makes its position resumable under any other dp size.
    dp_size = plugin.dp_size if plugin is not None else 1
    dataloader = wrap_dataloader(make_dataloader(dp_size), plugin)
    world = dist.get_world_size() if dist.is_initialized() else 1
    log(
        f"[{plugin.name if plugin else 'single'} x{world}] tiny Llama: "
        f"{sum(p.numel() for p in model.unwrap().parameters())} parameters, "
        f"global batch {GLOBAL_BATCH} ({GLOBAL_BATCH // dp_size} per data-parallel rank, dp={dp_size})"
    )

    start = 0
    if args.resume_from:
        ckpt_dir, step = resolve_resume(args.resume_from)
        resume = CheckpointManager(ckpt_dir, booster=booster, keep_last=None)
        start = resume.load(
            model, optimizer, dataloader=dataloader, resume_from_checkpoint=step if step else "latest"
        )
        if start == 0:
            raise SystemExit(f"--resume-from {args.resume_from}: no committed checkpoint there")
        log(
            f"resumed step {start} from {resume.step_dir(start)} "
            f"(model + AdamW state resharded to this layout, data position restored); "
            f"eval loss {evaluate(model):.6f}"
        )

    data = iter(dataloader)
    losses = []
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
        losses.append(global_mean(loss, plugin))
        if not args.quiet:
            log(f"  step {step:3d}  loss {losses[-1]:.4f}")

    end = start + args.steps
    if args.save_dir:
        manager = CheckpointManager(args.save_dir, booster=booster, save_steps=1, keep_last=3)
        manager.save(end, model, optimizer, dataloader=dataloader, force=True)
        log(
            f"saved step {end} to {manager.step_dir(end)} "
            f"(every rank wrote its own slices, xxh3 hashes + fingerprints); eval loss {evaluate(model):.6f}"
        )
        if dist.get_rank() == 0:
            # The tiny Llama's config, so the merged Hugging Face checkpoint loads with from_pretrained.
            model.unwrap().config.to_json_file(os.path.join(args.save_dir, "config.json"))
    log(f"done: steps {start + 1}..{end} in {time.perf_counter() - t0:.1f} s")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
