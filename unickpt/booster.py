"""Booster: sets training objects up for a plugin and saves/loads them (Colossal-AI style API).

Typical use, the same on every rank::

    booster = Booster(plugin=FSDP2Plugin())
    model, optimizer, criterion, dataloader, lr_scheduler = booster.boost(
        model, optimizer, criterion, dataloader, lr_scheduler)
    loss = criterion(model(x), y)
    booster.backward(loss, optimizer)
    optimizer.step()
    booster.save_model(model, "ckpt/model", shard=True)

Every method is called by every rank (the save/load methods are collective).
"""

from __future__ import annotations

import importlib
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unickpt.errors import UnsupportedError
from unickpt.io.optimizer import check_param_names
from unickpt.io.tensors import normalize_name
from unickpt.wrappers import ModelWrapper, OptimizerWrapper, unwrap_optimizer

if TYPE_CHECKING:
    from unickpt.io import CheckpointIO
    from unickpt.plugins.base import Plugin

__all__ = ["Booster"]


def _wrap_dataloader(dataloader: Any, plugin: Plugin | None) -> Any:
    """Hand the dataloader to ``unickpt.data.wrap_dataloader`` when that module exists."""
    if plugin is not None:
        dataloader = plugin.prepare_dataloader(dataloader)
    try:
        data = importlib.import_module("unickpt.data")
    except ModuleNotFoundError as e:
        if e.name != "unickpt.data":
            raise
        return dataloader
    wrap = getattr(data, "wrap_dataloader", None)
    return dataloader if wrap is None else wrap(dataloader, plugin)


def _inputs_signature(model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    fqn = {id(p): n for n, p in model.named_parameters()}
    sig: dict[str, Any] = {
        "parameters": [
            (n, tuple(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()
        ]
    }
    if optim is not None:
        sig["optimizer class"] = f"{type(optim).__module__}.{type(optim).__qualname__}"
        sig["optimizer groups"] = [
            (sorted(k for k in g if k != "params"), [fqn.get(id(p), "?") for p in g["params"]])
            for g in optim.param_groups
        ]
        sig["optimizer has state"] = any(len(st) for st in optim.state.values())
    return sig


def _same_inputs_on_every_rank(model: torch.nn.Module, optim: torch.optim.Optimizer | None) -> None:
    """Collective: refuse, on every rank, a model or optimizer that differs between ranks.

    A plugin's set-up communicates (DDP broadcasts, ZeRO partitions); a rank whose objects differ
    would raise there alone and leave the others waiting in a collective. Parameter names,
    shapes, dtypes and ``requires_grad``, the optimizer's class, groups and whether it has state
    are compared first.
    """
    from unickpt import _dist
    from unickpt.errors import DistributedError

    sigs = _dist.all_gather_object(_inputs_signature(model, optim))
    if all(s == sigs[0] for s in sigs[1:]):
        return
    lines = []
    for key in sigs[0].keys() | {k for s in sigs for k in s}:
        values = [repr(s.get(key))[:300] for s in sigs]
        if len(set(values)) > 1:
            lines.append(f"{key}: " + "; ".join(f"rank {r}: {v}" for r, v in enumerate(values)))
    raise DistributedError(
        "Booster.boost: the ranks passed different models or optimizers:\n  " + "\n  ".join(sorted(lines))
    )


class Booster:
    """Entry point of training with unickpt. ``plugin=None`` means one process, no parallelism.

    ``storage_options``: fsspec options (credentials, endpoint) for checkpoint URLs, given to
    the CheckpointIO (a plugin's own ``storage_options`` is used when this is ``None``).
    """

    def __init__(self, plugin: Plugin | None = None, storage_options: dict[str, Any] | None = None) -> None:
        self.plugin = plugin
        self.storage_options = storage_options
        self._general_io: CheckpointIO | None = None
        # torch optimizer -> the model boost() returned with it: booster.save_optimizer(opt) on
        # the user's own optimizer object then saves as with the wrapper boost() returned.
        # (The model does not refer to the optimizer, so the entry goes when the optimizer does.)
        self._boosted: weakref.WeakKeyDictionary[Any, ModelWrapper] = weakref.WeakKeyDictionary()

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The plugin's CheckpointIO, or a ``GeneralCheckpointIO`` without a plugin."""
        if self.plugin is not None:
            io = self.plugin.get_checkpoint_io()
        else:
            if self._general_io is None:
                from unickpt.io import GeneralCheckpointIO

                self._general_io = GeneralCheckpointIO()
            io = self._general_io
        options = self.storage_options
        if options is None and self.plugin is not None:
            options = getattr(self.plugin, "storage_options", None)
        if options is not None:
            io.storage_options = options
        return io

    def boost(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | OptimizerWrapper | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> tuple[ModelWrapper, OptimizerWrapper | None, Callable[..., Any] | None, Any, Any]:
        """Set the objects up for the plugin; returns ``(model, optimizer, criterion, dataloader, lr_scheduler)``.

        Called once by every rank. The model comes back as a :class:`ModelWrapper`
        (``.unwrap()`` gives the user's module), the optimizer as an :class:`OptimizerWrapper`
        around the same torch optimizer, so a scheduler built on it keeps working. Build the
        optimizer on the plain model; the plugin points it at the parallelised parameters.
        """
        if isinstance(model, ModelWrapper):
            raise UnsupportedError(
                "the model is already boosted (a ModelWrapper); boost the plain model once"
            )
        optim = None
        if optimizer is not None:
            optim, _ = unwrap_optimizer(optimizer)
            # An optimizer built from named_parameters() must name this model's parameters.
            check_param_names(optim, [(normalize_name(n), p) for n, p in model.named_parameters()])
        if self.plugin is not None:
            from unickpt.plugins._shared import mesh as _mesh

            _mesh.ensure_process_group()
            _same_inputs_on_every_rank(model, optim)
            wrapped, optim, criterion, dataloader, lr_scheduler = self.plugin.configure(
                model, optim, criterion, dataloader, lr_scheduler
            )
            boosted = wrapped if isinstance(wrapped, ModelWrapper) else ModelWrapper(wrapped)
        else:
            boosted = ModelWrapper(model)
        if dataloader is not None:
            dataloader = _wrap_dataloader(dataloader, self.plugin)
        opt_wrapper = OptimizerWrapper(optim, boosted) if optim is not None else None
        if optim is not None:
            self._boosted[optim] = boosted
        return boosted, opt_wrapper, criterion, dataloader, lr_scheduler

    def _optimizer(self, optimizer: Any) -> Any:
        """The wrapper for a torch optimizer this booster boosted (its model names the state)."""
        if isinstance(optimizer, OptimizerWrapper):
            return optimizer
        try:
            model = self._boosted.get(optimizer)
        except TypeError:  # not weak-referenceable: not one of ours
            return optimizer
        return optimizer if model is None else OptimizerWrapper(optimizer, model)

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        """Back-propagate ``loss`` the way the plugin needs (every rank)."""
        if self.plugin is not None:
            self.plugin.backward(loss, optimizer)
        else:
            loss.backward()

    def execute_pipeline(self, data_iter: Any, model: Any, criterion: Any, optimizer: Any) -> Any:
        """Run one pipelined forward/backward pass (every rank); see the plugin's ``execute_pipeline``."""
        run = getattr(self.plugin, "execute_pipeline", None)
        if run is None:
            raise UnsupportedError(f"{type(self.plugin).__name__} has no pipeline; use it with PPPlugin")
        return run(data_iter, model, criterion, optimizer)

    # -- checkpoints (collective: every rank calls each of these) --------------------------

    def save_model(
        self,
        model: torch.nn.Module,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool | None = None,
        use_async: bool = False,
    ) -> None:
        """Save the model's weights and buffers; see ``CheckpointIO.save_model``.

        ``use_async=True`` returns once the data is copied; ``booster.checkpoint_io.wait()``
        (Colossal-AI: ``_sync_io()``) waits for the write, and so does every later save or load.
        """
        self.checkpoint_io.save_model(
            model,
            checkpoint,
            shard=shard,
            gather_dtensor=gather_dtensor,
            prefix=prefix,
            size_per_shard=size_per_shard,
            use_safetensors=use_safetensors,
            use_async=use_async,
        )

    def load_model(
        self,
        model: torch.nn.Module,
        checkpoint: str,
        strict: bool = True,
        verify: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Load weights into ``model`` under any layout; returns the IO's report (missing/unexpected keys)."""
        return self.checkpoint_io.load_model(model, checkpoint, strict=strict, verify=verify, **kwargs)

    def save_adapter(
        self,
        model: torch.nn.Module,
        checkpoint: str,
        adapter_name: str = "default",
        save_embedding_layers: bool | str = "auto",
    ) -> str:
        """Save a ``PeftModel``'s adapter alone (``adapter_model.safetensors`` + ``adapter_config.json``,
        loadable by ``peft.PeftModel.from_pretrained``); see ``CheckpointIO.save_adapter``."""
        return self.checkpoint_io.save_adapter(
            model, checkpoint, adapter_name=adapter_name, save_embedding_layers=save_embedding_layers
        )

    def load_adapter(
        self,
        model: torch.nn.Module,
        checkpoint: str,
        adapter_name: str = "default",
        strict: bool = True,
        verify: bool = False,
        **kwargs: Any,
    ) -> Any:
        """Load an adapter (unickpt's or peft's ``save_pretrained`` output) under any layout;
        see ``CheckpointIO.load_adapter``."""
        return self.checkpoint_io.load_adapter(
            model, checkpoint, adapter_name=adapter_name, strict=strict, verify=verify, **kwargs
        )

    def save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str,
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> None:
        """Save optimizer state keyed by parameter FQN; see ``CheckpointIO.save_optimizer``.

        ``optimizer``: the one ``boost`` returned, or the torch optimizer given to ``boost``
        (either way the boosted model names the state), or one built from ``named_parameters()``.
        """
        self.checkpoint_io.save_optimizer(
            self._optimizer(optimizer),
            checkpoint,
            shard=shard,
            gather_dtensor=gather_dtensor,
            prefix=prefix,
            size_per_shard=size_per_shard,
            use_async=use_async,
        )

    def load_optimizer(self, optimizer: Any, checkpoint: str, verify: bool = False, **kwargs: Any) -> Any:
        """Load optimizer state, resharded to this layout; see ``CheckpointIO.load_optimizer``."""
        return self.checkpoint_io.load_optimizer(
            self._optimizer(optimizer), checkpoint, verify=verify, **kwargs
        )

    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Save the scheduler's state (every rank calls; one rank writes)."""
        self.checkpoint_io.save_lr_scheduler(lr_scheduler, checkpoint)

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str) -> None:
        """Load the scheduler's state (every rank)."""
        self.checkpoint_io.load_lr_scheduler(lr_scheduler, checkpoint)
