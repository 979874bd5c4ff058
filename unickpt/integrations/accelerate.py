"""``accelerator.save_state`` / ``load_state`` writing and reading the models through unickpt.

``register_unickpt_hooks(accelerator)`` registers accelerate's own hooks
(``register_save_state_pre_hook`` / ``register_load_state_pre_hook``): each prepared model is
written as ``<dir>/unickpt_model`` (``unickpt_model_<i>`` for the i-th after the first), a Hugging
Face sharded safetensors checkpoint with unickpt's index, hashes and fingerprints (plus
``config.json`` for a transformers model), and read back from there, every slice rehashed,
instead of accelerate's ``model.safetensors`` (a directory saved without the hooks still loads,
through accelerate's own code). Optimizers, schedulers, dataloader positions and
RNG states stay accelerate's (``optimizer.bin``, ``random_states_<r>.pkl``...): its hooks are
given the models only. Under FSDP, DeepSpeed and Megatron-LM accelerate saves models through those
libraries, and registering is refused.
"""

from __future__ import annotations

import os
from typing import Any

from unickpt.errors import UnsupportedError
from unickpt.integrations._state import general_io

__all__ = ["register_unickpt_hooks", "model_dir"]


def model_dir(i: int) -> str:
    """The directory name of the ``i``-th prepared model inside a ``save_state`` directory."""
    return "unickpt_model" if i == 0 else f"unickpt_model_{i}"


def register_unickpt_hooks(
    accelerator: Any, *, verify: bool = True, size_per_shard: int = 1024
) -> tuple[Any, Any]:
    """Make ``accelerator.save_state``/``load_state`` save and load its models through unickpt.

    Returns accelerate's two removable handles (save hook, load hook).
    """
    kind = str(getattr(accelerator, "distributed_type", ""))
    if any(k in kind for k in ("FSDP", "DEEPSPEED", "MEGATRON")):
        raise UnsupportedError(
            f"register_unickpt_hooks: accelerate saves {kind} models itself; use unickpt's Booster "
            "plugins (FSDP2Plugin, ZeroPlugin) for sharded checkpoints"
        )

    def save_hook(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if accelerator.is_main_process:
            io = general_io()
            for i, model in enumerate(models):
                io.save_model(
                    accelerator.unwrap_model(model),
                    os.path.join(output_dir, model_dir(i)),
                    shard=True,
                    gather_dtensor=True,
                    size_per_shard=size_per_shard,
                )
        weights.clear()  # accelerate then writes no model file of its own

    def load_hook(models: list[Any], input_dir: str) -> None:
        io = general_io()
        if not any(os.path.isdir(os.path.join(input_dir, model_dir(i))) for i in range(len(models))):
            return  # a directory accelerate saved without these hooks: its own loading reads it
        for i, model in enumerate(models):
            io.load_model(
                accelerator.unwrap_model(model), os.path.join(input_dir, model_dir(i)), verify=verify
            )
        models.clear()  # loaded: accelerate's own model loading skips them

    return accelerator.register_save_state_pre_hook(save_hook), accelerator.register_load_state_pre_hook(
        load_hook
    )
