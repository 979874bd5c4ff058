"""Per-rank side of test_hf_fsdp2: ``UnickptTrainer`` under accelerate's FSDP2 (``fsdp_version=2``)
on a 2-process gloo world, and the same checkpoint resumed by one process.

accelerate 1.15 turns FSDP on only for accelerator worlds: ``AcceleratorState.__init__`` sets
``distributed_type = DistributedType.FSDP`` and keeps the ``fsdp_plugin`` only when the
distributed type is MULTI_GPU/MLU/SDAA/MUSA/NPU/XPU/HPU/NEURON; on a CPU world (MULTI_CPU, gloo)
the plugin is dropped without a word and the Trainer trains plain DDP (``is_fsdp_enabled`` False).
``fsdp2_on_cpu`` makes the same two assignments for MULTI_CPU, in the test process only (again
after each later ``AcceleratorState()``, which copies PartialState's MULTI_CPU back); the rest
(``fully_shard`` of the model, the Trainer's FSDP code paths) is accelerate's and transformers' own.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

STEPS, SAVE = 6, 3


def fsdp2_on_cpu() -> None:
    import accelerate.state as st
    from accelerate.utils import DistributedType

    if getattr(st.AcceleratorState.__init__, "_unickpt_test", False):
        return
    orig = st.AcceleratorState.__init__

    def init(self: Any, *a: Any, fsdp_plugin: Any = None, **kw: Any) -> None:
        orig(self, *a, fsdp_plugin=fsdp_plugin, **kw)
        # Every later AcceleratorState() copies PartialState's distributed_type (MULTI_CPU) back
        # over the shared state: the plugin it keeps makes it FSDP again.
        plugin = fsdp_plugin if fsdp_plugin is not None else self.__dict__.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = plugin

    init._unickpt_test = True  # type: ignore[attr-defined]
    st.AcceleratorState.__init__ = init


def _args(out: str, fsdp: bool) -> Any:
    import transformers

    world = dist.get_world_size() if dist.is_initialized() else 1
    kw: dict[str, Any] = {}
    if fsdp:
        kw = {
            "fsdp": True,
            "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]},
        }
    return transformers.TrainingArguments(
        output_dir=out,
        max_steps=STEPS,
        save_steps=SAVE,
        per_device_train_batch_size=4 // world,
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


def _full_state(trainer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    model = trainer.model
    optim = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    full = StateDictOptions(full_state_dict=True)
    msd = get_model_state_dict(model, options=full)
    osd = get_optimizer_state_dict(model, optim, options=full)
    return {
        "weights": {k: v.detach().clone() for k, v in msd.items()},
        "optim": {
            f"{fqn}/{k}": v.detach().clone() if isinstance(v, torch.Tensor) else v
            for fqn, st in osd["state"].items()
            for k, v in st.items()
        },
    }


def train(root: str, name: str, resume: str | None) -> dict[str, Any]:
    """Train to STEPS under FSDP2 when the world has 2 ranks (plain on 1), saving every SAVE steps."""
    from _trainer_worker import same_rows, tiny_gpt2

    from unickpt.integrations.hf_trainer import UnickptTrainer

    fsdp2_on_cpu()
    world = dist.get_world_size() if dist.is_initialized() else 1
    trainer = UnickptTrainer(
        model=tiny_gpt2(), args=_args(os.path.join(root, name), world > 1), train_dataset=same_rows()
    )
    trainer.train(resume_from_checkpoint=os.path.join(root, resume) if resume else None)
    out = {
        "fsdp2": bool(trainer.is_fsdp_enabled and trainer.accelerator.is_fsdp2),
        "dtensor": any(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
        "step": trainer.state.global_step,
        "losses": {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h},
        "lr": trainer.lr_scheduler.get_last_lr(),
        **_full_state(trainer),
    }
    if resume is None:
        trainer.save_model(os.path.join(root, f"{name}-final"))
    if dist.is_initialized():
        dist.barrier()
    return out
