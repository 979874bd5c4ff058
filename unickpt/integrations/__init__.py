"""unickpt inside other trainers: torchtitan, Lightning, Hugging Face ``Trainer`` and accelerate.

Each integration lives in its own module and imports its trainer only when used, so
``import unickpt`` never imports torchtitan, lightning, transformers or accelerate:

- ``unickpt.integrations.torchtitan.CheckpointManager``: torchtitan's checkpointer, replaced by
  naming its config in the trainer's config (``CheckpointManager.Config``).
- ``unickpt.integrations.lightning.UnickptCheckpointIO``: Lightning's ``CheckpointIO`` plugin
  (single-device and DDP strategies); ``UnickptModelParallelStrategy`` and ``UnickptFSDPStrategy``:
  Lightning's FSDP2/TP and FSDP1 strategies saving through unickpt instead of DCP.
- ``unickpt.integrations.hf_trainer.UnickptTrainer``: a ``transformers.Trainer`` whose checkpoints
  (model, optimizer, scheduler) are unickpt checkpoints, sliced per rank under accelerate's FSDP2.
- ``unickpt.integrations.accelerate.register_unickpt_hooks``: ``accelerator.save_state`` /
  ``load_state`` write and read the models as unickpt checkpoints.

They use unickpt's public API only (``GeneralCheckpointIO`` and its documented hooks,
``OptimizerWrapper``, ``inspect_checkpoint``, the JSON state encoding of ``unickpt.io.jsonstate``).
"""

from __future__ import annotations

__all__: list[str] = []
