"""unickpt's torchtitan checkpointer (``unickpt.integrations.torchtitan``) driven as torchtitan's
``Trainer`` drives it, with torchtitan's own llama3 debug model, ``OptimizersContainer``,
``LRSchedulersContainer`` and ``ParallelAwareDataloader`` (tests/dist/_titan_worker.py), in one
process. The resharded resume (2-rank FSDP2 -> 1 rank) is tests/dist/test_torchtitan_dist.py.

torchtitan 0.3.0 and the runtime modules it imports install with ``--no-deps`` (``make peers``);
without them these tests skip with the reason."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "torchtitan.trainer", reason="torchtitan and its runtime modules (make peers) not installed"
)
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "dist"))

import _titan_worker as titan

from unickpt.errors import StateMismatchError

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def test_trainer_config_takes_it_and_builds_it() -> None:
    from torchtitan.trainer import Trainer

    from unickpt.integrations.torchtitan import CheckpointManager

    cfg = Trainer.Config(checkpoint=CheckpointManager.Config(enable=True, interval=7, async_mode="ASYNC"))
    assert type(cfg.checkpoint) is CheckpointManager.Config and cfg.checkpoint.async_mode == "async"
    assert cfg.checkpoint._owner is CheckpointManager
    # the trainer's own validation of the shared keys still runs
    with pytest.raises(ValueError, match="at least 2 checkpoint replicas"):
        CheckpointManager.Config(keep_latest_k=1)
    with pytest.raises(ValueError, match="Invalid async_mode: sometimes"):
        CheckpointManager.Config(async_mode="sometimes")  # type: ignore[arg-type]
    off = CheckpointManager.Config(enable=False).build(
        dataloader=None, model_parts=[], optimizers=None, lr_schedulers=None, states={}, sd_adapter=None
    )
    assert off.save(10) is False and off.load() is False
    off.maybe_wait_for_staging()
    off.close()


def test_stop_and_resume_is_bit_exact(tmp_path: Path) -> None:
    """Uninterrupted 4 steps against: 3 steps saving every 2 (async), stopped, then resumed from
    step 2 with the dataloader position, optimizer, scheduler and train state restored."""
    full = titan.train(str(tmp_path / "a"), 4, interval=2, keep_latest_k=0, last_save_model_only=False)
    part = titan.train(
        str(tmp_path / "b"),
        4,
        stop_after=3,
        interval=2,
        keep_latest_k=0,
        async_mode="async",
        last_save_model_only=False,
    )
    assert part["loaded"] is False and sorted(part["losses"]) == [1, 2, 3]
    run = tmp_path / "b" / "checkpoint"
    assert sorted(os.listdir(run)) == ["latest", "step-2"]
    res = titan.train(str(tmp_path / "b"), 4, interval=2, keep_latest_k=0, last_save_model_only=False)
    assert res["loaded"] is True
    assert res["losses"] == {3: full["losses"][3], 4: full["losses"][4]}  # bit-exact
    assert res["ntokens_seen"] == full["ntokens_seen"] == 4 * titan.GLOBAL_BATCH * titan.SEQ
    for (n, a), b in zip(
        full["parts"]["model"].named_parameters(), res["parts"]["model"].parameters(), strict=True
    ):
        assert torch.equal(a, b), n
    assert sorted(os.listdir(run)) == ["latest", "step-2", "step-4"]
    # the step holds torchtitan's canonical names (the fused wqkv as wq/wk/wv, as its DCP saves)
    index = json.loads((run / "step-4" / "model" / "model.safetensors.index.json").read_text())
    assert "layers.0.attention.qkv_linear.wq.weight" in index["weight_map"]
    assert not any("wqkv" in k for k in index["weight_map"])


def test_retention_and_last_save_in_hf(tmp_path: Path) -> None:
    """keep_latest_k=2 over saves at steps 1..3; the last step saves the model only, in bfloat16,
    as Hugging Face files named by torchtitan's state dict adapter, which a fresh run loads with
    initial_load_in_hf."""
    out = titan.train(
        str(tmp_path),
        4,
        interval=1,
        keep_latest_k=2,
        last_save_model_only=True,
        last_save_in_hf=True,
        export_dtype="bfloat16",
    )
    run = tmp_path / "checkpoint"
    assert sorted(os.listdir(run)) == ["latest", "model-step-4", "step-2", "step-3"]
    from safetensors.torch import load_file

    hf = run / "model-step-4"
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(hf.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    assert "model.layers.0.self_attn.q_proj.weight" in tensors
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    model = out["parts"]["model"]
    assert torch.equal(tensors["lm_head.weight"], model.lm_head.weight.detach().to(torch.bfloat16))
    fresh = titan.build(
        str(tmp_path / "fresh"),
        4,
        initial_load_path=str(hf),
        initial_load_in_hf=True,
        initial_load_model_only=True,
    )
    assert fresh["checkpointer"].load() is True
    for (n, a), b in zip(model.named_parameters(), fresh["model"].parameters(), strict=True):
        assert torch.equal(a.detach().to(torch.bfloat16).float(), b.detach().float()), n


def test_resumes_a_torchtitan_dcp_folder(tmp_path: Path) -> None:
    """A folder written by torchtitan's own DCP CheckpointManager (step-2/.metadata) resumes
    under unickpt's checkpointer: the same losses as torchtitan resuming it itself, bit-exact;
    later saves are unickpt steps beside it."""
    common = dict(interval=2, keep_latest_k=0, last_save_model_only=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        titan.train(str(tmp_path / "a"), 4, stop_after=2, torchtitan_dcp=True, **common)
    assert (tmp_path / "a" / "checkpoint" / "step-2" / ".metadata").is_file()
    import shutil

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    theirs = titan.train(str(tmp_path / "a"), 4, torchtitan_dcp=True, **common)
    ours = titan.train(str(tmp_path / "b"), 4, **common)
    assert ours["loaded"] is True and theirs["loaded"] is True
    assert ours["losses"] == theirs["losses"] and sorted(ours["losses"]) == [3, 4]
    from unickpt import CheckpointManager as Run

    assert Run(str(tmp_path / "b" / "checkpoint")).all_steps() == [4]  # committed unickpt steps


def test_exclude_from_loading_and_a_dataloader_at_another_degree(tmp_path: Path) -> None:
    titan.train(str(tmp_path), 2, interval=2, keep_latest_k=0, last_save_model_only=False)
    parts = titan.build(str(tmp_path), 4, exclude_from_loading=["dataloader", "lr_scheduler", "train_state"])
    assert parts["checkpointer"].load() is True
    assert parts["train_state"].step == 0  # excluded: left as built
    assert parts["lr_schedulers"].schedulers[0].last_epoch == 0
    assert parts["dataloader"].dataset.sample_idx == 0
    # load_step names a step that is not there: refused, as torchtitan does, not another step
    with pytest.raises(
        StateMismatchError, match=r"load_step=5: .* holds no committed step 5 \(committed: \[2\]\)"
    ):
        titan.build(str(tmp_path), 4)["checkpointer"].load(step=5)
    # the dataloader's position was saved at data-parallel degree 1: degree 2 is refused by name
    parts = titan.build(str(tmp_path), 4)
    parts["dataloader"].dp_world_size = 2
    with pytest.raises(StateMismatchError, match="saved at data-parallel degree 1, this run has 2"):
        parts["checkpointer"].load()


def test_seed_checkpoint_is_the_model_only_and_loads_first(tmp_path: Path) -> None:
    """create_seed_checkpoint: the trainer's save(curr_step=0, last_step=True) writes the model
    only; a run whose folder holds nothing newer starts from it (optimizer untouched)."""
    seeded = titan.build(str(tmp_path), 4)
    with torch.no_grad():
        for p in seeded["model"].parameters():
            p.add_(0.5)
    assert seeded["checkpointer"].save(curr_step=0, last_step=True) is True
    run = tmp_path / "checkpoint"
    assert sorted(os.listdir(run)) == ["model-step-0"]
    fresh = titan.build(str(tmp_path), 4)
    assert fresh["checkpointer"].load() is True
    for (n, a), b in zip(seeded["model"].named_parameters(), fresh["model"].parameters(), strict=True):
        assert torch.equal(a, b), n
    assert not fresh["optimizers"].optimizers[0].state
