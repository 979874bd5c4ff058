"""Per-rank side of test_torchtitan_trainer: torchtitan's own ``Trainer(config).train()`` on CPU
(gloo) with unickpt's checkpointer named by its config. What is changed in the test process to
run it on CPU is said where it is done (``cpu_device``, ``config``) and in the test's docstring."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

import torch


class _CpuModule(types.ModuleType):
    """``torch.cpu`` plus the few ``torch.cuda`` calls torchtitan's metrics make (device name,
    properties, memory statistics: none on CPU)."""

    def __init__(self) -> None:
        super().__init__("unickpt_tests_cpu_device")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device: Any = None) -> Any:
        return types.SimpleNamespace(total_memory=1 << 40, name="cpu")

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, int]:
        return {}

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        return None

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def current_device() -> int:
        return 0  # an index, as torch.cuda's (torch.cpu's is the string "cpu")


def cpu_device() -> None:
    """torchtitan picks its device once, at import (``tools.utils.device_type``: "cuda" when no
    accelerator is present); point it, and the modules that imported it by name, at the CPU."""
    import torchtitan.tools.utils as tu
    import torchtitan.trainer  # noqa: F401  (imports every module that reads the device)

    cpu = _CpuModule()
    for name, mod in list(sys.modules.items()):
        if (name == "torchtitan" or name.startswith("torchtitan.")) and mod is not None:
            if getattr(mod, "device_type", None) == "cuda":
                mod.device_type = "cpu"
            if getattr(mod, "device_module", None) is torch.cuda:
                mod.device_module = cpu
    assert tu.device_type == "cpu"
    # After its first step the trainer shortens every process group's timeout with
    # torch.distributed.set_timeout, which torch 2.13 does not have ("module 'torch.distributed'
    # has no attribute 'set_timeout'"): the groups keep the timeout they were made with.
    import torchtitan.distributed.utils as du

    if not hasattr(torch.distributed, "set_timeout"):
        du.set_pg_timeouts = lambda timeout, parallel_dims: None
    # torchtitan turns off FSDP's gradient division (divide factor 1.0: it scales the loss by
    # the global token count itself), which FSDP2 reduces with ReduceOp.PREMUL_SUM(1.0), an op
    # gloo has not ("Cannot use ReduceOp.PREMUL_SUM with Gloo"); FSDP's own switch to plain SUM
    # reductions (then a division by 1.0, skipped) gives the same sums.
    import torchtitan.distributed.fsdp as tf
    from torch.distributed.fsdp import FSDPModule

    if not getattr(tf.disable_fsdp_gradient_division, "_unickpt_test", False):
        orig = tf.disable_fsdp_gradient_division

        def disable_division(model: Any) -> None:
            orig(model)
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)

        disable_division._unickpt_test = True  # type: ignore[attr-defined]
        tf.disable_fsdp_gradient_division = disable_division


def _components() -> tuple[Any, Any]:
    """A tokenizer (torchtitan's needs tokenizer files) and a dataloader of the synthetic token
    stream, as torchtitan Configurables: the trainer builds them from its config."""
    from _titan_worker import VOCAB, TokenStream
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.tokenizer import BaseTokenizer

    class TinyTokenizer(BaseTokenizer):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config: Any, tokenizer_path: str | None = None) -> None:
            super().__init__()
            self.eos_id = 0

        def encode(self, *args: Any, **kwargs: Any) -> list[int]:
            raise NotImplementedError

        def decode(self, *args: Any, **kwargs: Any) -> str:
            raise NotImplementedError

        def get_vocab_size(self) -> int:
            return VOCAB

    class StreamLoader(ParallelAwareDataloader):
        @dataclass(kw_only=True, slots=True)
        class Config(ParallelAwareDataloader.Config):
            skip_samples: int = 0
            """global samples already consumed (a resume at another degree restarts the stream there)"""

        def __init__(
            self, config: Any, *, dp_world_size: int, dp_rank: int, local_batch_size: int, **_: Any
        ) -> None:
            stream = TokenStream(dp_rank, dp_world_size)
            stream.sample_idx = config.skip_samples // dp_world_size
            super().__init__(
                stream, dp_rank=dp_rank, dp_world_size=dp_world_size, batch_size=local_batch_size
            )

    return TinyTokenizer, StreamLoader


def config(folder: str, steps: int, world: int, skip_samples: int = 0, **ckpt: Any) -> Any:
    from _titan_worker import GLOBAL_BATCH, SEQ
    from torchtitan.components.loss import ChunkedLossWrapper, CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.common.config_utils import decoder_vocab_size
    from torchtitan.models.llama3 import model_registry
    from torchtitan.trainer import Trainer

    from unickpt.integrations.torchtitan import CheckpointManager

    spec = model_registry("debugmodel", attn_backend="flex")
    for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
        if isinstance(parent, list):
            parent[attr] = ScaledDotProductAttention.Config()
        else:
            setattr(parent, attr, ScaledDotProductAttention.Config())
    spec.model.layers = spec.model.layers[:2]
    tokenizer, loader = _components()
    return Trainer.Config(
        model_spec=spec,
        dump_folder=folder,
        optimizer=default_adamw(lr=8e-4),
        lr_scheduler=LRSchedulersContainer.Config(
            warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0
        ),
        # float32 compute (torchtitan's FSDP default all-gathers bfloat16 parameters): the runs at
        # 2 ranks and 1 then differ by float32 rounding of the reduced gradients only
        training=TrainingConfig(
            local_batch_size=GLOBAL_BATCH // world, seq_len=SEQ, steps=steps, mixed_precision_param="float32"
        ),
        loss=ChunkedLossWrapper.Config(
            loss_fn=CrossEntropyLoss.Config(global_vocab_size=decoder_vocab_size(spec))
        ),
        tokenizer=tokenizer.Config(),
        dataloader=loader.Config(skip_samples=skip_samples),
        checkpoint=CheckpointManager.Config(enable=True, **ckpt),
        metrics=MetricsProcessor.Config(log_freq=1),
        # torchtitan's classic FSDP2 over plain parameters; its default "spmd_types" backend
        # expects them distributed onto the whole mesh first ("When dp_mesh_dims is provided,
        # all parameters must be DTensors on the full SPMD mesh") and fails at 2 ranks here
        parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
    )


def train(folder: str, steps: int, skip_samples: int, ckpt: dict[str, Any]) -> dict[str, Any]:
    """torchtitan's ``Trainer(config).train()`` on this world (FSDP2 over every rank, torchtitan's
    default ``data_parallel_shard_degree=-1``), unickpt's checkpointer named by the config.
    Returns the global loss torchtitan logs at each step, the train state and what was loaded."""
    import torch.distributed as dist

    cpu_device()
    from torchtitan.trainer import Trainer

    world = dist.get_world_size() if dist.is_initialized() else 1
    trainer = Trainer(config(folder, steps, world, skip_samples, **ckpt))
    losses: dict[int, float] = {}
    log = trainer.metrics_processor.log

    def record(step: int, loss: float, *args: Any, **kwargs: Any) -> Any:
        losses[step] = float(loss)
        return log(step, loss, *args, **kwargs)

    trainer.metrics_processor.log = record
    try:
        trainer.train()
    finally:
        trainer.close()
    return {
        "checkpointer": type(trainer.checkpointer).__module__,
        "world": world,
        "fsdp": trainer.parallel_dims.fsdp_enabled,
        "dtensor": any(type(p).__name__ == "DTensor" for p in trainer.model_parts[0].parameters()),
        "losses": losses,
        "step": trainer.step,
        "ntokens_seen": trainer.ntokens_seen,
    }
