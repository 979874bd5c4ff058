"""FSDP2Plugin: torch ``fully_shard`` (FSDP2) over a one-dimensional ``dp`` mesh.

Parameters become ``Shard(0)`` DTensors (uneven splits allowed); the CheckpointIO base
saves and reshards them generically.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from unickpt.errors import UnsupportedError
from unickpt.io import CheckpointIO
from unickpt.plugins import _mesh
from unickpt.plugins.base import (
    ConfigureResult,
    Plugin,
    check_optimizer,
    parameter_fqns,
    remap_optimizer_params,
)
from unickpt.wrappers import ModelWrapper

__all__ = ["FSDP2CheckpointIO", "FSDP2Plugin", "default_shard_units"]

ShardSpec = Iterable[str | type[nn.Module]]


class FSDP2CheckpointIO(CheckpointIO):
    """CheckpointIO for models set up by :class:`FSDP2Plugin` (the base class does all the work)."""

    plugin_name = "fsdp2"


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _within(fqn: str, unit: str) -> bool:
    return unit == "" or fqn == unit or fqn.startswith(unit + ".")


def _param_owners(root: nn.Module) -> dict[int, set[str]]:
    """``id(parameter)`` -> FQNs of every module that holds it directly (tied params have several)."""
    owners: dict[int, set[str]] = {}
    for mfqn, mod in root.named_modules(remove_duplicate=False):
        for p in mod._parameters.values():
            if p is not None:
                owners.setdefault(id(p), set()).add(mfqn)
    return owners


def _shared_outside(unit: str, mod: nn.Module, owners: dict[int, set[str]]) -> list[str]:
    """FQNs of modules outside ``unit`` holding one of its parameters (tied weights)."""
    out: set[str] = set()
    for p in mod.parameters():
        out.update(o for o in owners.get(id(p), ()) if not _within(o, unit))
    return sorted(out)


def _group_dtypes(root: nn.Module, unit: str, units: Iterable[str]) -> dict[torch.dtype, list[str]]:
    """Dtypes of the trainable parameters ``fully_shard(unit)`` would manage, with their FQNs."""
    inner = [u for u in units if u != unit and _within(u, unit)]
    found: dict[torch.dtype, list[str]] = {}
    mod = root.get_submodule(unit)
    for name, p in mod.named_parameters():
        fqn = _join(unit, name)
        if p.requires_grad and not any(_within(fqn, u) for u in inner):
            found.setdefault(p.dtype, []).append(fqn)
    return found


def default_shard_units(root: nn.Module) -> list[str]:
    """The FQNs ``fully_shard`` is applied to before the root, when ``shard_modules`` is None.

    Each item of a ``ModuleList``/``ModuleDict`` child and each other direct child that holds
    parameters becomes a unit, except that a child whose parameters are tied to a module
    outside it is left to the root (sharding it alone would untie the weights), and a child
    whose trainable parameters mix dtypes is split into its own children (FSDP2 needs one
    dtype per group).
    """
    owners = _param_owners(root)
    units: list[str] = []

    def mixed(mod: nn.Module) -> bool:
        return len({p.dtype for p in mod.parameters() if p.requires_grad}) > 1

    def consider(fqn: str, mod: nn.Module) -> None:
        if next(mod.parameters(), None) is None or _shared_outside(fqn, mod, owners):
            return
        if mixed(mod):
            for cname, child in mod.named_children():
                consider(_join(fqn, cname), child)
            return
        units.append(fqn)

    for name, child in root.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for cname, item in child.named_children():
                consider(_join(name, cname), item)
        else:
            consider(name, child)
    return units


def _resolve_units(root: nn.Module, shard_modules: ShardSpec | None) -> list[str]:
    if shard_modules is None:
        return default_shard_units(root)
    names = {s for s in shard_modules if isinstance(s, str)}
    types = tuple(s for s in shard_modules if isinstance(s, type))
    all_fqns = {fqn for fqn, _ in root.named_modules()}
    unknown = sorted(names - all_fqns)
    if unknown:
        raise UnsupportedError(
            f"FSDP2Plugin(shard_modules=...) names modules the model does not have: {unknown}"
        )
    units = {fqn for fqn, mod in root.named_modules() if fqn and (fqn in names or isinstance(mod, types))}
    owners = _param_owners(root)
    for unit in sorted(units):
        shared = _shared_outside(unit, root.get_submodule(unit), owners)
        if shared:
            raise UnsupportedError(
                f"cannot fully_shard {unit!r} on its own: its parameters are tied to {shared}, "
                "which lie outside it; shard a module that contains both, or leave them to the root"
            )
    return sorted(units)


class FSDP2Plugin(Plugin):
    """Fully sharded data parallelism with torch's ``fully_shard``.

    Args:
        reshard_after_forward: passed to every ``fully_shard`` call.
        shard_modules: FQNs and/or module classes that get their own ``fully_shard`` (their own
            all-gather group) before the root does. ``None`` picks each block as described in
            :func:`default_shard_units`.
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (default: none).
    """

    name = "fsdp2"

    def __init__(
        self,
        reshard_after_forward: bool = True,
        shard_modules: ShardSpec | None = None,
        mp_policy: MixedPrecisionPolicy | None = None,
    ) -> None:
        super().__init__()
        self.reshard_after_forward = reshard_after_forward
        self.shard_modules = None if shard_modules is None else list(shard_modules)
        self.mp_policy = mp_policy
        self.units: list[str] = []

    def configure(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> ConfigureResult:
        """Apply ``fully_shard`` to each unit, deepest first, then to the root (every rank)."""
        if isinstance(model, FSDPModule):
            raise UnsupportedError("the model is already sharded with fully_shard; pass the plain model")
        _mesh.ensure_process_group()
        self._mesh = _mesh.build_mesh((self.world_size,), ("dp",))
        self._io = None
        model = model.to(self.device)
        check_optimizer(optimizer, model)
        units = _resolve_units(model, self.shard_modules)
        for unit in [*units, ""]:
            groups = _group_dtypes(model, unit, units)
            if len(groups) > 1:
                detail = "; ".join(f"{dt}: {fqns[:3]}" for dt, fqns in groups.items())
                raise UnsupportedError(
                    f"fully_shard({unit or '<root>'!r}) would manage trainable parameters of several dtypes "
                    f"({detail}); FSDP2 needs one dtype per group: give those parameters their own "
                    "module and list it in shard_modules"
                )
        old_fqns = parameter_fqns(model)
        kwargs: dict[str, Any] = {"mesh": self._mesh, "reshard_after_forward": self.reshard_after_forward}
        if self.mp_policy is not None:
            kwargs["mp_policy"] = self.mp_policy
        for unit in sorted(units, key=lambda u: u.count("."), reverse=True):
            fully_shard(model.get_submodule(unit), **kwargs)
        fully_shard(model, **kwargs)
        self.units = units
        remap_optimizer_params(optimizer, old_fqns, model)
        return ModelWrapper(model), optimizer, criterion, dataloader, lr_scheduler

    def get_checkpoint_io(self) -> CheckpointIO:
        if self._io is None:
            self._io = FSDP2CheckpointIO(mesh=self._mesh)
        return self._io
