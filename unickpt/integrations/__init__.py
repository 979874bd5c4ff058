"""unickpt inside other trainers: Lightning, Hugging Face ``Trainer`` and accelerate.

Each integration lives in its own module and imports its trainer only when used, so
``import unickpt`` never imports lightning, transformers or accelerate:

- ``unickpt.integrations.lightning.UnickptCheckpointIO``: Lightning's ``CheckpointIO`` plugin.
- ``unickpt.integrations.hf_trainer.UnickptTrainer``: a ``transformers.Trainer`` whose checkpoints
  (model, optimizer, scheduler) are unickpt checkpoints.
- ``unickpt.integrations.accelerate.register_unickpt_hooks``: ``accelerator.save_state`` /
  ``load_state`` write and read the models as unickpt checkpoints.

They use unickpt's public API only (``GeneralCheckpointIO`` and its documented hooks,
``OptimizerWrapper``, ``inspect_checkpoint``, the JSON state encoding of ``unickpt.io.jsonstate``).
"""

from __future__ import annotations

__all__: list[str] = []
