"""The hooks through which a plugin tells ``CheckpointIO`` what differs for its parallelism.

``CheckpointHooks`` is ``CheckpointIO``'s base class: the hook methods with their defaults, and
no IO of their own (no options, no files, no collectives). ``CheckpointIO``'s public methods
are final (``FINAL_METHODS``); each builds one ``HookContext`` for the call and hands it to the
hooks below, whose defaults already describe plain tensors, DTensors of any placement and tied
parameters. A plugin overrides a hook only for state that is not a DTensor or a plain
replicated tensor (ZeRO's flat shards) or that is named differently (tied copies across
pipeline stages).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from unickpt.errors import UnsupportedError
from unickpt.io.optim_state import init_state
from unickpt.io.tensors import LocalSlice, is_dtensor, local_slices, normalize_name, unwrap_model

__all__ = ["DETACHED_NOTE", "FINAL_METHODS", "CheckpointHooks", "HookContext"]

# HookContext.notes key of a model load's state dict when some entries are not the module's own.
DETACHED_NOTE = -1


def _storage_ptr(t: torch.Tensor) -> int:
    local = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
    return int(local.untyped_storage().data_ptr())


def _storages(module: torch.nn.Module) -> set[int]:
    """The storages of ``module``'s parameters and buffers."""
    return {_storage_ptr(t) for t in [*module.parameters(), *module.buffers()] if t.numel()}


# The public API: plugins customise the hooks, never these.
FINAL_METHODS = (
    "save_model",
    "load_model",
    "save_adapter",
    "load_adapter",
    "save_optimizer",
    "load_optimizer",
    "save_lr_scheduler",
    "load_lr_scheduler",
    "plan_model",
    "plan_optimizer",
    "write",
    "write_spec",
    "wait",
    "close",
    "synchronize",
)


@dataclasses.dataclass(frozen=True)
class HookContext:
    """What one public call is doing, handed to every hook it calls.

    ``kind`` is ``"model"`` or ``"optimizer"``; ``saving`` tells a save from a load; ``gather``
    and ``shard`` are the layout a save writes (``gather`` is False on loads); ``model`` and
    ``optimizer`` are the unwrapped objects of the call (``optimizer`` is None for models).
    ``notes`` belongs to the call: what a hook learns while listing tensors that a later hook
    of the same call needs (ZeRO's flat ranges, keyed by ``id`` of the listed tensor), so
    nothing of one call is left on the IO.
    """

    kind: str
    saving: bool
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    gather: bool = False
    shard: bool = True
    notes: dict[int, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The optimizer of an optimizer call."""
        if self.optimizer is None:
            raise UnsupportedError(f"a hook of a {self.kind} call asked for the optimizer")
        return self.optimizer


class CheckpointHooks:
    """The default hooks of ``CheckpointIO``, its base (every call passes its ``HookContext``)."""

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return unwrap_model(model)

    def _model_tensors(self, ctx: HookContext) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers by checkpoint name (tied ones share a tensor).

        A module's ``state_dict`` hooks may return fresh tensors instead of its own (a fused
        weight saved split); for a load the state dict is then noted in ``ctx`` so that
        ``CheckpointIO`` gives what was loaded into them to ``load_state_dict``.
        """
        module = self.unwrap_model(ctx.model)
        out: dict[str, torch.Tensor] = {}
        sd = module.state_dict(keep_vars=True)
        own = None if ctx.saving else _storages(module)
        detached = False
        for name, t in sd.items():
            if not isinstance(t, torch.Tensor):
                raise UnsupportedError(f"state_dict entry {name!r} is a {type(t).__name__}, not a tensor")
            out[normalize_name(name)] = t
            if own is not None and t.numel() and _storage_ptr(t) not in own:
                detached = True
        if detached:
            ctx.notes[DETACHED_NOTE] = sd
        return out

    def _local_slices(self, name: str, tensor: torch.Tensor, ctx: HookContext) -> list[LocalSlice]:
        """The local slices of the global tensor ``name`` that ``tensor`` holds on this rank."""
        del ctx
        return local_slices(name, tensor)

    def _after_load(self, ctx: HookContext) -> None:
        """Called on every rank once a load has copied everything in (ZeRO refreshes its shards)."""

    def _optimizer_state(self, ctx: HookContext) -> dict[str, Any]:
        """FQN-keyed optimizer state: ``{"state": {fqn: {key: value}}, "param_groups": [...]}``.

        While loading, every parameter gets its state slots first (to be filled from the
        checkpoint). While saving, an optimizer without state (never stepped, or stateless such
        as SGD without momentum) is described without asking torch, which would invent state
        with a zero-gradient step on every save.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model, optim = ctx.model, ctx.optim
        if not ctx.saving:
            init_state(optim)
        elif not optim.state:
            fqn_of = {id(prm): fqn for fqn, prm in self._state_parameters(model)}
            groups = []
            for g in optim.param_groups:
                missing = [tuple(prm.shape) for prm in g["params"] if id(prm) not in fqn_of]
                if missing:
                    raise UnsupportedError(
                        f"the optimizer updates {len(missing)} tensor(s) that are not parameters of the model "
                        f"(shapes {missing[:3]}); build it on model.parameters()"
                    )
                groups.append(dict(g, params=[fqn_of[id(prm)] for prm in g["params"]]))
            return {"state": {}, "param_groups": groups}
        osd: dict[str, Any] = dict(get_optimizer_state_dict(self.unwrap_model(model), optim))
        state = {normalize_name(k): v for k, v in osd["state"].items()}
        groups = [dict(g, params=[normalize_name(p) for p in g["params"]]) for g in osd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def _set_optimizer_state(self, ctx: HookContext, osd: dict[str, Any]) -> None:
        """Put the loaded state ``osd`` (as :meth:`_optimizer_state` listed it) into the optimizer."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # strict=False: parameters that never stepped have no saved state and get none (torch's
        # strict mode refuses them with "Missing optimizer state for parameter").
        set_optimizer_state_dict(
            self.unwrap_model(ctx.model),
            ctx.optim,
            osd,  # type: ignore[arg-type]
            options=StateDictOptions(strict=False),
        )

    def _state_parameters(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """``(fqn, tensor)`` for every parameter, where ``tensor`` is the key of its ``optimizer.state``.

        The default is the model's parameters. A plugin whose optimizer keeps state on other
        tensors (ZeRO's flat shards) or under other names (tied copies across pipeline stages)
        overrides it.
        """
        return [(normalize_name(n), prm) for n, prm in self.unwrap_model(model).named_parameters()]
