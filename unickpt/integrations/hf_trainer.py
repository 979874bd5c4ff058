"""A Hugging Face ``Trainer`` whose checkpoints are unickpt checkpoints: ``UnickptTrainer``.

Use it where ``transformers.Trainer`` is used; nothing else changes. Each ``checkpoint-<N>/``
(and ``trainer.save_model()``'s output) then holds:

- the model as Hugging Face sharded safetensors with unickpt's index (slice hashes, fingerprints),
  ``config.json`` and ``generation_config.json``: ``from_pretrained`` loads it, ``unickpt verify``
  checks it, any unickpt plugin loads it under another layout and world size;
- ``optimizer/``: the optimizer state keyed by parameter name (unickpt's optimizer checkpoint:
  safetensors, ``param_groups`` as JSON) instead of ``optimizer.pt``;
- ``lr_scheduler.json`` instead of ``scheduler.pt``; ``training_args.json`` instead of
  ``training_args.bin``.

``trainer.train(resume_from_checkpoint=...)`` loads the model and the optimizer through unickpt,
every slice rehashed; a checkpoint of the stock ``Trainer`` (``optimizer.pt``) still resumes, through
the stock code. What stays the ``Trainer``'s own: ``trainer_state.json``, the RNG states
(``rng_state*.pth``, ``torch.load(weights_only=True)``) and a GradScaler's ``scaler.pt``.

Under accelerate's FSDP2 (``TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2, ...})``
or a ``FullyShardedDataParallelPlugin(fsdp_version=2)``) every rank takes part: a checkpoint's
model and ``optimizer/`` are written sliced (each rank the DTensor slices it holds, hashed; no
gather), and load back at any world size (a checkpoint of a 2-rank FSDP2 run resumes on one
process); ``trainer.save_model()`` gathers, writing Hugging Face files ``from_pretrained`` loads.
Under FSDP1, DeepSpeed or XLA the ``Trainer`` saves through those libraries and this class
defers to it; PEFT models keep their adapter files (``save_pretrained`` of the adapter).
"""

from __future__ import annotations

import os
from typing import Any

from transformers import Trainer

from unickpt.errors import IncompleteCheckpointError
from unickpt.integrations._state import general_io, read_json
from unickpt.io import CheckpointIO
from unickpt.store.publish import write_small_file
from unickpt.wrappers import OptimizerWrapper

__all__ = ["UnickptTrainer", "OPTIMIZER_DIR", "SCHEDULER_FILE", "ARGS_FILE"]

OPTIMIZER_DIR = "optimizer"
SCHEDULER_FILE = "lr_scheduler.json"
ARGS_FILE = "training_args.json"
_INDEX = "model.safetensors.index.json"  # Hugging Face's name for a sharded model's index


def _check_no_optimizer_expected(checkpoint: str) -> None:
    """A checkpoint this class wrote without ``save_only_model`` has ``optimizer/``: its absence (a
    save interrupted between the model and the optimizer) must not resume with a fresh optimizer."""
    args_file = os.path.join(checkpoint, ARGS_FILE)
    if not os.path.isfile(args_file) or os.path.isfile(os.path.join(checkpoint, "optimizer.pt")):
        return  # not written by UnickptTrainer: the stock Trainer's rules apply
    saved = read_json(args_file)
    if isinstance(saved, dict) and saved.get("save_only_model") is True:
        return
    raise IncompleteCheckpointError(
        f"{checkpoint}: no {OPTIMIZER_DIR}/ beside the model (training_args.json says the optimizer was "
        "saved): the save did not finish; resume from an earlier checkpoint"
    )


def _is_peft(model: Any) -> bool:
    return any(c.__name__ == "PeftModel" for c in type(model).__mro__)


class UnickptTrainer(Trainer):
    """``transformers.Trainer`` saving and resuming through unickpt (see the module's docstring).

    Class attributes: ``unickpt_verify`` (rehash every slice on resume, default True) and
    ``unickpt_size_per_shard`` (MB per safetensors file, default 1024).
    """

    unickpt_verify: bool = True
    unickpt_size_per_shard: int = 1024

    def _unickpt_applies(self) -> bool:
        return not (
            self.is_deepspeed_enabled
            or (self.is_fsdp_enabled and not self._unickpt_fsdp2())
            or getattr(self, "is_fsdp_xla_v1_enabled", False)
            or _is_peft(self._unickpt_model())
        )

    def _unickpt_fsdp2(self) -> bool:
        """accelerate's FSDP2 (``fsdp_version=2``): parameters are DTensors, every rank saves its slices."""
        return bool(self.is_fsdp_enabled and getattr(self.accelerator, "is_fsdp2", False))

    def _unickpt_io(self) -> CheckpointIO:
        """Over the whole world under FSDP2 (collective: every rank calls), else this process alone."""
        return CheckpointIO() if self._unickpt_fsdp2() else general_io()

    def _unickpt_model(self) -> Any:
        return self.accelerator.unwrap_model(self.model, keep_torch_compile=False)

    def _unickpt_optimizer(self) -> OptimizerWrapper:
        optim: Any = self.optimizer
        optim = getattr(optim, "optimizer", optim)  # accelerate's AcceleratedOptimizer
        return OptimizerWrapper(optim, self._unickpt_model())

    # ------------------------------------------------------------------ model
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Under FSDP2, every rank writes: the slices it holds into a checkpoint (``_internal_call``),
        the gathered tensors (Hugging Face files ``from_pretrained`` loads) otherwise."""
        if not (self._unickpt_fsdp2() and self._unickpt_applies()):
            super().save_model(output_dir, _internal_call)
            return
        out = str(output_dir if output_dir is not None else self.args.output_dir)
        model: Any = self.model
        CheckpointIO().save_model(
            model,
            out,
            shard=True,
            gather_dtensor=not _internal_call,
            size_per_shard=self.unickpt_size_per_shard,
        )
        if self.args.should_save:
            self._save_side_files(out)

    def _save_side_files(self, output_dir: str) -> None:
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        write_small_file(os.path.join(output_dir, ARGS_FILE), self.args.to_json_string().encode())

    def _save(self, output_dir: str | None = None, state_dict: dict[str, Any] | None = None) -> None:
        if state_dict is not None or not self._unickpt_applies():
            super()._save(output_dir, state_dict)
            return
        output_dir = str(output_dir if output_dir is not None else self.args.output_dir)
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        general_io().save_model(
            self._unickpt_model(),
            output_dir,
            shard=True,
            gather_dtensor=True,
            size_per_shard=self.unickpt_size_per_shard,
        )
        self._save_side_files(output_dir)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not (self._unickpt_applies() and os.path.isfile(os.path.join(resume_from_checkpoint, _INDEX))):
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        target = self.accelerator.unwrap_model(model, keep_torch_compile=False) if model is not None else None
        self._unickpt_io().load_model(
            target if target is not None else self._unickpt_model(),
            resume_from_checkpoint,
            strict=True,
            verify=self.unickpt_verify,
        )

    # ------------------------------------------------------------------ optimizer, scheduler
    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._unickpt_applies():
            super()._save_optimizer_and_scheduler(output_dir)
            return
        fsdp2 = self._unickpt_fsdp2()
        if not (self.args.should_save or fsdp2):
            return
        self._unickpt_io().save_optimizer(
            self._unickpt_optimizer(),
            os.path.join(output_dir, OPTIMIZER_DIR),
            shard=True,
            gather_dtensor=not fsdp2,  # FSDP2: each rank its own slices
            size_per_shard=self.unickpt_size_per_shard,
        )
        if self.lr_scheduler is not None and self.args.should_save:
            general_io().save_lr_scheduler(self.lr_scheduler, os.path.join(output_dir, SCHEDULER_FILE))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is not None and not os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR)):
            _check_no_optimizer_expected(checkpoint)
        if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, OPTIMIZER_DIR)):
            super()._load_optimizer_and_scheduler(checkpoint)
            return
        self._unickpt_io().load_optimizer(
            self._unickpt_optimizer(), os.path.join(checkpoint, OPTIMIZER_DIR), verify=self.unickpt_verify
        )
        sched = os.path.join(checkpoint, SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.isfile(sched):
            general_io().load_lr_scheduler(self.lr_scheduler, sched)
