"""Per-rank side of test_trainers_dist: a Hugging Face Trainer under DDP (2 processes) resuming
a checkpoint written by one process, and saving its own from rank 0 alone."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist


def tiny_gpt2() -> Any:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_head=2,
        n_embd=16,
        vocab_size=64,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def same_rows() -> list[dict[str, torch.Tensor]]:
    # Every sample alike: the batches of any world size and sampler hold the same data, so the
    # averaged DDP gradient equals the one-process gradient up to rounding.
    row = torch.randint(0, 64, (12,), generator=torch.Generator().manual_seed(3))
    return [{"input_ids": row.clone(), "labels": row.clone()} for _ in range(16)]


def args(out: str, batch: int) -> Any:
    import transformers

    return transformers.TrainingArguments(
        output_dir=out,
        max_steps=6,
        save_steps=3,
        per_device_train_batch_size=batch,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )


def resume_worker(root: str) -> dict[str, Any]:
    from unickpt.integrations.hf_trainer import UnickptTrainer

    world = dist.get_world_size()
    trainer = UnickptTrainer(
        model=tiny_gpt2(), args=args(os.path.join(root, "b"), 4 // world), train_dataset=same_rows()
    )
    assert trainer.args.world_size == world, (trainer.args.world_size, world)
    trainer.train(resume_from_checkpoint=os.path.join(root, "a", "checkpoint-3"))
    dist.barrier()
    return {
        "step": trainer.state.global_step,
        "weights": {k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
        "exp_avg_sum": float(sum(s["exp_avg"].double().sum() for s in trainer.optimizer.state.values())),
    }


def lightning_worker(root: str) -> dict[str, Any]:
    """Lightning's DDP strategy on this world: 4 epochs straight, and 2 + 2 resumed from rank 0's save."""
    import warnings

    os.environ.setdefault("TORCHELASTIC_RUN_ID", "unickpt-tests")  # Lightning joins this world
    import lightning.pytorch as pl

    from unickpt.integrations.lightning import UnickptCheckpointIO

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
            self.losses: list[float] = []

        def training_step(self, batch: Any, idx: int) -> torch.Tensor:
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    g = torch.Generator().manual_seed(1)
    x = torch.randn(24, 6, generator=g)
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=3
    )

    def trainer(epochs: int, name: str, **kw: Any) -> Any:
        return pl.Trainer(
            default_root_dir=os.path.join(root, name),
            max_epochs=epochs,
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            plugins=[UnickptCheckpointIO()],
            **kw,
        )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = Tiny()
        trainer(4, "full", enable_checkpointing=False).fit(full, data)
        first = Tiny()
        cb = pl.callbacks.ModelCheckpoint(dirpath=os.path.join(root, "ck"), save_top_k=-1)
        trainer(2, "a", callbacks=[cb]).fit(first, data)
        ckpt = os.path.join(root, "ck", "epoch=1-step=8.ckpt")
        second = Tiny()
        trainer(4, "b", enable_checkpointing=False).fit(second, data, ckpt_path=ckpt)
    assert second.trainer.world_size == 2 and second.trainer.strategy.global_rank == dist.get_rank()
    return {
        "full": full.losses,
        "resumed": first.losses + second.losses,
        "same_weights": all(
            torch.equal(a, b)
            for a, b in zip(full.state_dict().values(), second.state_dict().values(), strict=True)
        ),
        "ckpt": sorted(os.listdir(ckpt)),
    }
