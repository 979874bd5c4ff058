"""A torchtitan checkpointer that saves and loads unickpt checkpoints.

torchtitan (0.3.0) builds its checkpointer from the trainer config: ``Trainer.Config.checkpoint``
is typed ``BaseCheckpointManager.Config`` and the trainer calls ``config.checkpoint.build(...)``.
So this manager swaps in by config alone, no trainer edit and no monkeypatch::

    from unickpt.integrations.torchtitan import CheckpointManager
    config = Trainer.Config(..., checkpoint=CheckpointManager.Config(enable=True, interval=500))

It takes torchtitan's constructor (``dataloader``, ``model_parts``, ``optimizers``,
``lr_schedulers``, ``states``, ``sd_adapter``, ``base_folder``) and its config keys, and answers
the trainer's calls (``save(curr_step, last_step)``, ``load(step)``, ``maybe_wait_for_staging()``,
``close()``). ``<dump_folder>/<folder>`` becomes a :class:`unickpt.CheckpointManager` run
(``step-<N>/`` with the model and optimizer sliced, each rank writing its own slices), which
resumes under any other parallelism. It also loads torchtitan's own DCP checkpoints (a
``step-<N>/.metadata`` in the folder, or ``initial_load_path``) and Hugging Face checkpoints
(``initial_load_in_hf``, through the model's state dict adapter), as torchtitan does.

Tested with torchtitan's own ``Trainer(config).train()`` (tests/dist/test_torchtitan_trainer.py: a
2-rank FSDP2 run stopped after a save and resumed on 1 rank, on CPU) and with its components driven
as the trainer drives them (tests/dist/test_torchtitan_dist.py, tests/unit/integrations/test_torchtitan_integration.py).

Importing this module imports torchtitan; ``import unickpt`` does not import this module.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Literal

import torch
from torchtitan.components.checkpointer import BaseCheckpointManager

from unickpt.errors import ConfigError, StateMismatchError, UnsupportedError
from unickpt.io import CheckpointIO, HookContext
from unickpt.io.pinned import wait_staged
from unickpt.manager import CheckpointManager as RunManager
from unickpt.wrappers import OptimizerWrapper

__all__ = ["CheckpointManager", "TorchtitanCheckpointIO"]

MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER = "model", "optimizer", "lr_scheduler", "dataloader"
_STANDARD = (MODEL, OPTIMIZER, LR_SCHEDULER, DATALOADER)
_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
_DCP_STEP = re.compile(r"^step-(\d+)$")


class TorchtitanCheckpointIO(CheckpointIO):
    """``CheckpointIO`` for torchtitan's model parts (DTensor or plain parameters).

    Tensors are saved and loaded by torchtitan's canonical state dict names, the names of its
    DCP checkpoints (the fused ``wqkv`` as ``wq``/``wk``/``wv``, made by its ``state_dict``
    hooks; a load gives them back through ``load_state_dict``, as for any ``CheckpointIO``).

    ``export_dtype`` casts floating tensors as they are saved (the last, model-only save);
    ``rename`` maps the model's state dict to the names saved (the state dict adapter's
    ``to_hf``, for a Hugging Face export). Neither changes the live model.
    """

    plugin_name = "torchtitan"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.export_dtype: torch.dtype | None = None
        self.rename: Any = None

    def _model_tensors(self, ctx: HookContext) -> dict[str, torch.Tensor]:
        out = super()._model_tensors(ctx)
        if not ctx.saving:
            return out
        if self.rename is not None:
            out = dict(self.rename(out))
        if self.export_dtype is not None:
            dt = self.export_dtype
            out = {
                k: v.detach().to(dt) if v.is_floating_point() and v.dtype != dt else v for k, v in out.items()
            }
        return out


class _DataloaderState:
    """torchtitan's ``ParallelAwareDataloader`` state without its pickle: the inner
    ``StatefulDataLoader`` state (plain values) plus the data-parallel world size it needs."""

    def __init__(self, dataloader: Any) -> None:
        self.dataloader = dataloader

    def _inner(self) -> Any:
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader if isinstance(self.dataloader, StatefulDataLoader) else None

    def state_dict(self) -> dict[str, Any]:
        inner = self._inner()
        if inner is None:
            return {"state": self.dataloader.state_dict()}
        return {
            "dp_world_size": int(self.dataloader.dp_world_size),
            "state": inner.state_dict(self.dataloader),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        inner = self._inner()
        if inner is None:
            self.dataloader.load_state_dict(state["state"])
            return
        saved, now = state.get("dp_world_size"), int(self.dataloader.dp_world_size)
        if saved != now:
            raise StateMismatchError(
                f"the dataloader position was saved at data-parallel degree {saved}, this run has {now}: "
                "torchtitan's dataloader cannot be resharded; add 'dataloader' to "
                "checkpoint.exclude_from_loading to restart it"
            )
        inner.load_state_dict(self.dataloader, state["state"])


class CheckpointManager(BaseCheckpointManager):  # type: ignore[misc]  # torchtitan is untyped
    """torchtitan's checkpointer contract, written as unickpt checkpoints (see the module docstring).

    Config keys as torchtitan's ``CheckpointManager.Config``; ``async_mode`` "async" and
    "async_with_pinned_mem" both give unickpt's async save (``save`` returns once the
    copies to the process's reused pinned buffers are issued on a side stream;
    ``maybe_wait_for_staging`` and every optimizer step wait for them).
    Model-only last saves (``last_save_model_only``) go to ``<folder>/model-step-<N>/`` (Hugging
    Face files named by the state dict adapter with ``last_save_in_hf``), outside the run, so that
    resuming never picks a step without an optimizer. A save at step 0 (torchtitan's seed
    checkpoint) is the model only, in ``model-step-0/``, loaded when the folder has no step.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(BaseCheckpointManager.Config):  # type: ignore[misc]
        async_mode: Literal["disabled", "async", "async_with_pinned_mem"] = "disabled"
        """Synchronous, or unickpt's async save ("async" and "async_with_pinned_mem" alike)."""

        def __post_init__(self) -> None:
            BaseCheckpointManager.Config.__post_init__(self)
            mode = self.async_mode.lower()
            if mode not in ("disabled", "async", "async_with_pinned_mem"):
                raise ValueError(f"Invalid async_mode: {mode}")
            self.async_mode = mode  # type: ignore[assignment]

    def __init__(
        self,
        config: Config,
        *,
        dataloader: Any,
        model_parts: list[torch.nn.Module],
        optimizers: Any,
        lr_schedulers: Any,
        states: dict[str, Any],
        sd_adapter: Any,
        base_folder: str = "",
    ) -> None:
        self.enable = config.enable
        self.save_future = None
        if not self.enable:
            return
        if len(model_parts) != 1:
            raise UnsupportedError(
                f"unickpt's torchtitan checkpointer takes one model part, got {len(model_parts)} "
                "(pipeline parallelism with several stages per rank is not supported)"
            )
        self.model = model_parts[0]
        optims = list(getattr(optimizers, "optimizers", [optimizers]))
        if len(optims) != 1:
            raise UnsupportedError(
                f"unickpt's torchtitan checkpointer takes one optimizer, got {len(optims)}"
            )
        self.optimizer = OptimizerWrapper(optims[0], self.model)
        self.optimizers, self.lr_schedulers, self.dataloader = optimizers, lr_schedulers, dataloader
        self.extra = {k: v for k, v in states.items() if k not in _STANDARD}
        self.states = states
        states.update(
            {MODEL: self.model, OPTIMIZER: optimizers, DATALOADER: dataloader, LR_SCHEDULER: lr_schedulers}
        )
        self.folder = os.path.join(base_folder, config.folder)
        self.interval = config.interval
        self.load_only = config.load_only
        self.enable_first_step_checkpoint = config.enable_first_step_checkpoint
        self.exclude_from_loading = list(config.exclude_from_loading)
        for key in self.exclude_from_loading:
            if key not in states:
                raise ConfigError(
                    f"checkpoint.exclude_from_loading names {key!r}, not a state (have {sorted(states)})"
                )
        self.initial_load_path = config.initial_load_path
        self.initial_load_model_only = config.initial_load_model_only
        self.initial_load_in_hf = config.initial_load_in_hf
        self.last_save_model_only = config.last_save_model_only
        self.last_save_in_hf = config.last_save_in_hf
        self.export_dtype = _DTYPES[config.export_dtype]
        self.sd_adapter = sd_adapter
        if (self.last_save_in_hf or self.initial_load_in_hf) and sd_adapter is None:
            raise ConfigError(
                "checkpoint.last_save_in_hf / initial_load_in_hf need the model's state dict adapter"
            )
        self.io = TorchtitanCheckpointIO()
        self.run = RunManager(
            self.folder,
            booster=SimpleNamespace(checkpoint_io=self.io),
            save_steps=1,
            keep_last=config.keep_latest_k or None,
            async_save=config.async_mode != "disabled",
        )

    # ------------------------------------------------------------------ save
    def _should_save(self, curr_step: int, last_step: bool) -> bool:
        if self.load_only:
            return False
        if curr_step == 1 and self.enable_first_step_checkpoint:
            return True
        return last_step or curr_step % self.interval == 0

    @torch.no_grad()
    def _save(self, curr_step: int, last_step: bool = False) -> bool:
        if not self._should_save(curr_step, last_step):
            return False
        if curr_step == 0 or (last_step and self.last_save_model_only):
            # step 0 is torchtitan's seed checkpoint (create_seed_checkpoint): the model only,
            # under its own names, loaded by a run that finds nothing newer
            self.run.wait()
            self._save_model_only(curr_step, hf=self.last_save_in_hf and curr_step != 0)
            return True
        if last_step:
            self.run.wait()
        self.run.save(
            curr_step,
            self.model,
            self.optimizer,
            self.lr_schedulers,
            _DataloaderState(self.dataloader) if self.dataloader is not None else None,
            force=True,
            **self.extra,
        )
        if last_step:
            self.run.wait()
        return True

    def model_only_dir(self, step: int) -> str:
        """Where the model-only last save of ``step`` goes."""
        return os.path.join(self.folder, f"model-step-{step}")

    def _save_model_only(self, step: int, hf: bool) -> None:
        self.io.export_dtype = self.export_dtype
        self.io.rename = self.sd_adapter.to_hf if hf else None
        try:
            # Hugging Face: global tensors (every rank writes its own bytes); else sliced.
            self.io.save_model(self.model, self.model_only_dir(step), shard=True, gather_dtensor=hf)
        finally:
            self.io.export_dtype = None
            self.io.rename = None

    # ------------------------------------------------------------------ load
    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        excluded = set(self.exclude_from_loading)
        steps = self.run.all_steps()
        if steps and step != -1 and step not in steps:
            raise StateMismatchError(
                f"checkpoint.load_step={step}: {self.folder} holds no committed step {step} (committed: {steps})"
            )
        if steps:
            optim = None if OPTIMIZER in excluded else self.optimizer
            sched = None if LR_SCHEDULER in excluded else self.lr_schedulers
            dl = (
                None
                if DATALOADER in excluded or self.dataloader is None
                else _DataloaderState(self.dataloader)
            )
            extra = {k: v for k, v in self.extra.items() if k not in excluded}
            got = self.run.load(self.model, optim, sched, dl, "latest" if step == -1 else step, **extra)
            return got > 0
        dcp_step = _latest_dcp_step(self.folder) if step == -1 else step
        if dcp_step >= 0 and os.path.isfile(os.path.join(self.folder, f"step-{dcp_step}", ".metadata")):
            # torchtitan's own resume of its DCP folder (step 0, its seed checkpoint, is model-only).
            self._dcp_load(os.path.join(self.folder, f"step-{dcp_step}"), model_only=dcp_step == 0)
            return True
        seed = self.model_only_dir(0)
        if step in (-1, 0) and os.path.isdir(seed) and not self.initial_load_path:
            self.io.load_model(self.model, seed)  # the seed checkpoint: the model only
            return True
        if step != -1:
            raise StateMismatchError(f"checkpoint.load_step={step}: no step-{step} in {self.folder}")
        if not self.initial_load_path and not self.initial_load_in_hf:
            return False
        path = self.initial_load_path or getattr(self.sd_adapter, "hf_assets_path", None)
        if not path or not os.path.isdir(path):
            raise ConfigError(f"checkpoint.initial_load_path {path!r} is not a directory")
        if self.initial_load_in_hf:
            self._hf_load(path)
        elif os.path.isfile(os.path.join(path, ".metadata")):
            self._dcp_load(path, model_only=self.initial_load_model_only)
        elif self.initial_load_model_only:
            model_dir = os.path.join(path, "model") if os.path.isdir(os.path.join(path, "model")) else path
            self.io.load_model(self.model, model_dir)
        else:
            RunManager(path, booster=SimpleNamespace(checkpoint_io=self.io), keep_last=None).load(
                self.model,
                None if OPTIMIZER in excluded else self.optimizer,
                None if LR_SCHEDULER in excluded else self.lr_schedulers,
                None
                if DATALOADER in excluded or self.dataloader is None
                else _DataloaderState(self.dataloader),
                **{k: v for k, v in self.extra.items() if k not in excluded},
            )
        return True

    def _dcp_load(self, path: str, model_only: bool) -> None:
        """torchtitan's DCP layout: model tensors flattened at the top, other states by name."""
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        msd = self.model.state_dict()
        sd: dict[str, Any] = dict(msd)
        if not model_only:
            sd.update(
                {
                    k: v
                    for k, v in self.states.items()
                    if k != MODEL and k not in self.exclude_from_loading and v is not None
                }
            )
        dcp_load(sd, checkpoint_id=path)
        self.model.load_state_dict({k: sd[k] for k in msd}, strict=False)

    def _hf_load(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        hf_sd = self.sd_adapter.to_hf(self.model.state_dict())
        dcp_load(hf_sd, storage_reader=self.sd_adapter.get_hf_storage_reader(path, False))
        self.model.load_state_dict(self.sd_adapter.from_hf(hf_sd), strict=False)

    # ------------------------------------------------------------------ rest of the contract
    def _maybe_wait_for_staging(self) -> None:
        """Block until the async snapshot's copies are done (a side CUDA stream; on CPU they are
        done when ``save`` returns). An optimizer step waits for them by itself too."""
        wait_staged()

    def _wait_for_saving(self) -> None:
        self.run.wait()

    def _close(self) -> None:
        self.run.wait()


def _latest_dcp_step(folder: str) -> int:
    """The highest ``step-<N>`` of ``folder`` holding a DCP ``.metadata`` (-1: none)."""
    if not os.path.isdir(folder):
        return -1
    steps = [
        int(m.group(1))
        for name in os.listdir(folder)
        if (m := _DCP_STEP.match(name)) and os.path.isfile(os.path.join(folder, name, ".metadata"))
    ]
    return max(steps, default=-1)
