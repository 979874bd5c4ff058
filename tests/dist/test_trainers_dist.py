"""The trainer integrations on 2 processes (gloo). Hugging Face Trainer: a checkpoint written by one process
resumes under DDP on 2 (gloo), and the 2-process run saves its own checkpoints from rank 0 alone
(unickpt's calls there run over a one-process group, never waiting for rank 1). Lightning's DDP
strategy: rank 0 saves through UnickptCheckpointIO, both ranks resume, losses bit-exact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed (make peers)")
pytest.importorskip("accelerate", reason="accelerate is not installed (make peers)")

from _trainer_worker import args, same_rows, tiny_gpt2
from harness import WorldPool

from unickpt import verify_checkpoint
from unickpt.integrations.hf_trainer import OPTIMIZER_DIR, UnickptTrainer

pytestmark = pytest.mark.timeout(400)


def test_one_process_checkpoint_resumes_on_two(tmp_path: Path, world_pool: WorldPool) -> None:
    full = UnickptTrainer(model=tiny_gpt2(), args=args(str(tmp_path / "a"), 4), train_dataset=same_rows())
    full.train()
    results = world_pool.run(2, "_trainer_worker:resume_worker", str(tmp_path), timeout=300)
    for r in (0, 1):
        assert results[r]["step"] == 6
    final = full.model.state_dict()
    diffs = {}
    for name, t in final.items():
        # Both ranks hold the same weights, and the one-process run's up to DDP's rounding.
        assert torch.equal(results[0]["weights"][name], results[1]["weights"][name]), name
        diffs[name] = (results[0]["weights"][name] - t).abs().max().item()
    # Measured: 2e-6 at most (attention key biases, whose gradient is rounding noise that Adam
    # scales up), against steps of about lr = 1e-2 that a wrong resume would show.
    assert max(diffs.values()) < 1e-5, sorted(diffs.items(), key=lambda kv: -kv[1])[:5]
    assert abs(results[0]["exp_avg_sum"] - results[1]["exp_avg_sum"]) == 0
    # Rank 0 wrote checkpoint-6 at world size 2: complete and verified.
    ck = tmp_path / "b" / "checkpoint-6"
    for part in (ck, ck / OPTIMIZER_DIR):
        report = verify_checkpoint(str(part))
        assert list(report) == [] and report.hashed == report.slices > 0, report
    assert not any(p.endswith(".pt") and "optimizer" in p for p in os.listdir(ck))


def test_lightning_ddp_saves_from_rank_zero_and_resumes_exactly(
    tmp_path: Path, world_pool: WorldPool
) -> None:
    pytest.importorskip("lightning", reason="lightning is not installed (make peers)")
    results = world_pool.run(2, "_trainer_worker:lightning_worker", str(tmp_path), timeout=300)
    for r in (0, 1):
        res = results[r]
        assert len(res["full"]) == 16 and res["resumed"] == res["full"], res  # 4 epochs of 4 steps, bit-exact
        assert res["same_weights"] and res["ckpt"] == ["lightning.json", "model", "state"]
    ck = tmp_path / "ck" / "epoch=1-step=8.ckpt"
    report = verify_checkpoint(str(ck / "model"))
    assert list(report) == [] and report.hashed == report.slices > 0, report
