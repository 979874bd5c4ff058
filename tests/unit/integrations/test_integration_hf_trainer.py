"""``UnickptTrainer`` (transformers.Trainer) and accelerate's save_state through unickpt: exact resume,
Hugging Face-loadable output, unickpt's hashes, no pickled optimizer or scheduler."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make peers)")
accelerate = pytest.importorskip("accelerate", reason="accelerate is not installed (make peers)")

from unickpt import verify_checkpoint  # noqa: E402
from unickpt.errors import IncompleteCheckpointError, IntegrityError  # noqa: E402
from unickpt.integrations.accelerate import model_dir, register_unickpt_hooks  # noqa: E402
from unickpt.integrations.hf_trainer import ARGS_FILE, OPTIMIZER_DIR, SCHEDULER_FILE, UnickptTrainer  # noqa: E402


def _model() -> Any:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_head=2, n_embd=16, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    return transformers.GPT2LMHeadModel(cfg)


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (16, 12), generator=g)
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(out: Path, **kw: Any) -> Any:
    kw.setdefault("max_steps", 6)
    return transformers.TrainingArguments(
        output_dir=str(out),
        save_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        logging_steps=1,
        use_cpu=True,
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **kw,
    )


def _assert_verified(path: Path) -> None:
    report = verify_checkpoint(str(path))
    assert list(report) == [] and report.unickpt_block, report
    assert report.hashed == report.slices > 0 and report.fingerprints == report.tensors > 0


def _losses(trainer: Any) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_trainer_resumes_exactly_and_writes_hf_files(tmp_path: Path) -> None:
    full = UnickptTrainer(model=_model(), args=_args(tmp_path / "a"), train_dataset=_data())
    full.train()
    ck = tmp_path / "a" / "checkpoint-3"
    names = set(os.listdir(ck))
    assert {"model.safetensors.index.json", "config.json", OPTIMIZER_DIR, SCHEDULER_FILE, ARGS_FILE} <= names
    assert not names & {"optimizer.pt", "scheduler.pt", "training_args.bin", "model.safetensors"}, names
    _assert_verified(ck)
    _assert_verified(ck / OPTIMIZER_DIR)

    resumed = UnickptTrainer(model=_model(), args=_args(tmp_path / "b"), train_dataset=_data())
    resumed.train(resume_from_checkpoint=str(ck))
    a, b = _losses(full), _losses(resumed)
    assert sorted(a) == list(range(1, 7)) and a == b, (
        a,
        b,
    )  # steps 1-3 from trainer_state.json, 4-6 run again
    for (n, x), (_, y) in zip(
        full.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        assert torch.equal(x, y), n
    fo, ro = full.optimizer.state_dict(), resumed.optimizer.state_dict()
    for k, st in fo["state"].items():
        for key, v in st.items():
            assert torch.equal(ro["state"][k][key], v), (k, key)
    assert full.lr_scheduler.state_dict() == resumed.lr_scheduler.state_dict()

    # The final model: from_pretrained loads it, bit for bit, and it carries unickpt's hashes.
    out = tmp_path / "final"
    resumed.save_model(str(out))
    _assert_verified(out)
    back = transformers.GPT2LMHeadModel.from_pretrained(str(out))
    for n, t in resumed.model.state_dict().items():
        assert torch.equal(back.state_dict()[n], t), n


def test_a_corrupt_checkpoint_refuses_to_resume(tmp_path: Path) -> None:
    t = UnickptTrainer(model=_model(), args=_args(tmp_path / "a", max_steps=3), train_dataset=_data())
    t.train()
    ck = tmp_path / "a" / "checkpoint-3"
    data = next((ck / OPTIMIZER_DIR).glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0x10
    data.write_bytes(bytes(raw))
    again = UnickptTrainer(model=_model(), args=_args(tmp_path / "b"), train_dataset=_data())
    with pytest.raises(IntegrityError, match="optimizer"):
        again.train(resume_from_checkpoint=str(ck))
    # A save cut off after the model: no optimizer/, refused rather than resumed with a fresh optimizer.
    shutil.rmtree(ck / OPTIMIZER_DIR)
    again = UnickptTrainer(model=_model(), args=_args(tmp_path / "c"), train_dataset=_data())
    with pytest.raises(IncompleteCheckpointError, match="no optimizer/ beside the model"):
        again.train(resume_from_checkpoint=str(ck))


def test_accelerate_save_state_goes_through_unickpt(tmp_path: Path) -> None:
    acc = accelerate.Accelerator(cpu=True)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = acc.prepare(model, opt)
    register_unickpt_hooks(acc)
    batch = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        loss = model(input_ids=batch, labels=batch).loss
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    acc.save_state(str(tmp_path / "state"))
    files = set(os.listdir(tmp_path / "state"))
    assert model_dir(0) in files and "model.safetensors" not in files, files
    _assert_verified(tmp_path / "state" / model_dir(0))
    saved = {k: v.clone() for k, v in acc.unwrap_model(model).state_dict().items()}

    acc2 = accelerate.Accelerator(cpu=True)
    fresh = _model()
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    fresh, opt2 = acc2.prepare(fresh, opt2)
    register_unickpt_hooks(acc2)
    acc2.load_state(str(tmp_path / "state"))
    for n, t in acc2.unwrap_model(fresh).state_dict().items():
        assert torch.equal(t, saved[n]), n
    # accelerate's own loading of the model files was skipped, and the optimizer came back.
    assert opt2.state_dict()["state"][0]["exp_avg"].abs().sum() > 0


def test_accelerate_hooks_still_load_a_stock_save_state(tmp_path: Path) -> None:
    acc = accelerate.Accelerator(cpu=True)
    model = acc.prepare(_model())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    acc.save_state(str(tmp_path / "stock"))  # no hooks: accelerate's model.safetensors
    assert "model.safetensors" in os.listdir(tmp_path / "stock")
    acc2 = accelerate.Accelerator(cpu=True)
    fresh = acc2.prepare(_model())
    register_unickpt_hooks(acc2)
    acc2.load_state(str(tmp_path / "stock"))
    for (n, a), (_, b) in zip(model.state_dict().items(), fresh.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    # A unickpt part that is damaged is refused, not silently replaced by the stock files.
    register_unickpt_hooks(acc)
    acc.save_state(str(tmp_path / "ours"))
    data = next((tmp_path / "ours" / model_dir(0)).glob("*.safetensors"))
    raw = bytearray(data.read_bytes())
    raw[-7] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(IntegrityError):
        acc2.load_state(str(tmp_path / "ours"))
