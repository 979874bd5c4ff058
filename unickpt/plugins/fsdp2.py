"""FSDP2Plugin: torch ``fully_shard`` (FSDP2) over a one-dimensional ``dp`` mesh.

Parameters become ``Shard(0)`` DTensors (uneven splits allowed); the CheckpointIO base
saves and reshards them generically.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from unickpt._logging import get_logger
from unickpt.errors import UnsupportedError
from unickpt.io import CheckpointIO
from unickpt.plugins._shared import mesh as _mesh
from unickpt.plugins._shared.fsdp_units import default_shard_units, group_dtypes, resolve_units
from unickpt.plugins.base import (
    Plugin,
    check_optimizer,
    parameter_fqns,
    remap_optimizer_params,
)
from unickpt.wrappers import ModelWrapper

__all__ = ["FSDP2CheckpointIO", "FSDP2Plugin", "default_shard_units"]

ShardSpec = Iterable[str | type[nn.Module]]
logger = get_logger(__name__)


def _summary(units: list[str]) -> str:
    """Units for a log line: ``model.layers.0`` .. ``model.layers.31`` as ``model.layers.{0..31}``."""
    runs: dict[str, list[int]] = {}
    order: list[str] = []
    for unit in units:
        head, _, tail = unit.rpartition(".")
        key = f"{head}." if tail.isdigit() else unit
        if key not in runs:
            runs[key] = []
            order.append(key)
        if tail.isdigit():
            runs[key].append(int(tail))
    parts = []
    for key in order:
        nums = runs[key]
        if not nums:
            parts.append(key)
        elif len(nums) == 1:
            parts.append(f"{key}{nums[0]}")
        else:
            parts.append(f"{key}{{{min(nums)}..{max(nums)}}} ({len(nums)})")
    return ", ".join(parts) or "none"


class FSDP2CheckpointIO(CheckpointIO):
    """CheckpointIO for models set up by :class:`FSDP2Plugin` (the base class does all the work)."""

    plugin_name = "fsdp2"


class FSDP2Plugin(Plugin):
    """Fully sharded data parallelism with torch's ``fully_shard``.

    Args:
        reshard_after_forward: passed to every ``fully_shard`` call.
        shard_modules: FQNs and/or module classes that get their own ``fully_shard`` (their own
            all-gather group) before the root does. ``None`` picks the units described in
            :func:`default_shard_units`.
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (default: none).
    """

    name = "fsdp2"
    checkpoint_io_class = FSDP2CheckpointIO

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

    def _parallelize(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> torch.nn.Module:
        """Apply ``fully_shard`` to each unit, deepest first, then to the root (every rank)."""
        if isinstance(model, FSDPModule):
            raise UnsupportedError("the model is already sharded with fully_shard; pass the plain model")
        self._mesh = _mesh.build_mesh((self.world_size,), ("dp",))
        model = model.to(self.device)
        check_optimizer(optimizer, model)
        units = resolve_units(model, self.shard_modules)
        for unit in [*units, ""]:
            groups = group_dtypes(model, unit, units)
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
        logger.info(
            "fully_shard units (%s): %s, then the root",
            "shard_modules" if self.shard_modules is not None else "chosen by default",
            _summary(units),
        )
        remap_optimizer_params(optimizer, old_fqns, model)
        return ModelWrapper(model)
