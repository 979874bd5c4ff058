"""``IOCore``: the configuration of a ``CheckpointIO`` and the steps every public method shares.

``CheckpointIO`` is built in layers, each a class adding one side to the one below:
``CheckpointHooks`` (hooks.py, the defaults plugins override) -> ``IOCore`` (this module: the
options, the layout recorded in the index, opening a checkpoint on every rank, writing a
``SavePayload``) -> ``AsyncSaveIO`` (async_save.py) -> ``OptimizerIO`` (optimizer_io.py) ->
``CheckpointIO`` (checkpoint_io.py: the model and scheduler methods, and the final public API).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from unickpt import _dist
from unickpt._rng import keeps_python_random
from unickpt.errors import ConfigError
from unickpt.format.index import LayoutInfo
from unickpt.format.reader import CheckpointReader
from unickpt.format.storage import is_url
from unickpt.io.hooks import CheckpointHooks, HookContext
from unickpt.io.payload import SavePayload
from unickpt.io.pinned import wait_staged
from unickpt.io.replicas import REPLICA_MODES, ReplicaCheck, check_replicas
from unickpt.io.save import SaveOptions, save_tensors
from unickpt.io.tensors import LocalSlice, mesh_dims
from unickpt.io.url_load import open_for_load

__all__ = ["IOCore", "WriteSpec"]


class IOCore(CheckpointHooks):
    """The options of a ``CheckpointIO`` (documented there) and the steps its methods share."""

    plugin_name = "general"
    # Every rank holds every tensor whole (DDP): a tensor some ranks lack is a divergence.
    replicated_everywhere = False

    def __init__(
        self,
        mesh: Any = None,
        group: Any = None,
        *,
        hashes: bool = True,
        fingerprints: bool = True,
        fsync: bool = True,
        atomic_load: bool = False,
        check_replicas: str = "warn",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        # fsspec options (credentials, endpoint) of checkpoint URLs; None: the environment's.
        self.storage_options = storage_options
        if check_replicas not in REPLICA_MODES:
            raise ConfigError(f"check_replicas must be one of {REPLICA_MODES}, got {check_replicas!r}")
        self.check_replicas = check_replicas
        self.mesh = mesh
        self.group = group
        self.hashes = hashes
        self.fingerprints = fingerprints
        self.fsync = fsync
        self.atomic_load = atomic_load

    def layout(self) -> LayoutInfo:
        """The parallel layout recorded in the index."""
        return LayoutInfo(
            plugin=self.plugin_name, world_size=_dist.world_size(self.group), mesh=mesh_dims(self.mesh)
        )

    def write(
        self,
        payload: SavePayload,
        checkpoint: str | os.PathLike[str],
        *,
        shard: bool = True,
        gather_dtensor: bool = True,
        size_per_shard: float = 1024,
        group: Any = None,
    ) -> str:
        """Collective over ``group`` (default: this IO's group): save a payload; returns the committed path.

        With ``gather_dtensor=True`` the live tensors are gathered (collectives on their
        meshes), so a snapshot is written sliced (``gather_dtensor=False``) only.
        """
        spec = self.write_spec(payload.kind, shard, gather_dtensor, size_per_shard)
        return spec.write(payload, checkpoint, self.group if group is None else group)

    def write_spec(self, kind: str, shard: bool, gather_dtensor: bool, size_per_shard: float) -> WriteSpec:
        """What :meth:`write` needs of this IO, as a picklable value (an async save's writer process runs it)."""
        return WriteSpec(
            self._options(kind, shard, gather_dtensor, size_per_shard),
            self.check_replicas,
            self.replicated_everywhere,
        )

    def _local_slices_of(
        self, tensors: dict[str, torch.Tensor], ctx: HookContext
    ) -> dict[str, list[LocalSlice]]:
        return {name: self._local_slices(name, t, ctx) for name, t in tensors.items()}

    def _local_slices_fn(self, ctx: HookContext) -> Callable[[str, torch.Tensor], list[LocalSlice]]:
        """:meth:`_local_slices` of one call, as the loader asks for it."""
        return lambda name, tensor: self._local_slices(name, tensor, ctx)

    def _options(self, kind: str, shard: bool, gather: bool, size_mb: float) -> SaveOptions:
        size_mb = check_size_per_shard(size_mb)
        layout = self.layout()
        return SaveOptions(
            kind=kind,
            shard=shard,
            gather=gather,
            size_per_shard_mb=size_mb,
            layout=layout,
            hashes=self.hashes,
            fingerprints=self.fingerprints,
            fsync=self.fsync,
            storage_options=self.storage_options,
        )

    @keeps_python_random
    def _open(
        self, checkpoint: str | os.PathLike[str], kind: str, args: _dist.Args | None = None
    ) -> CheckpointReader:
        # A URL's storage options come from the IO (given at construction) or the environment;
        # a local path ignores them.
        options = self.storage_options if is_url(os.fspath(checkpoint)) else None
        return open_for_load(checkpoint, kind, self.group, options, args)


@dataclasses.dataclass(frozen=True)
class WriteSpec:
    """The options of one ``IOCore.write``, without the IO (picklable: no process group, no mesh)."""

    options: SaveOptions
    check_replicas: str
    everywhere: bool

    @keeps_python_random
    def write(self, payload: SavePayload, checkpoint: str | os.PathLike[str], group: Any) -> str:
        """Collective over ``group``: save ``payload``; returns the committed path."""
        slices = payload.slices
        what = f"saving the {payload.kind} to {os.fspath(checkpoint)}"
        check = ReplicaCheck(self.check_replicas, what, self.everywhere)
        if payload.staged is not None:  # a copy: its replica digests were planned when it was staged
            wait_staged()  # its copies (a side CUDA stream, io/stage.py) are done before it is read
            check_replicas(
                slices, self.check_replicas, what, group, everywhere=self.everywhere, staged=payload.staged
            )

        def slices_fn(name: str, tensor: torch.Tensor) -> list[LocalSlice]:
            del tensor
            return slices[name]

        return save_tensors(
            payload.tensors,
            os.fspath(checkpoint),
            self.options,
            slices_fn,
            aliases=payload.aliases,
            entry_extras=payload.entry_extras,
            block_extras=payload.block_extras,
            group=group,
            live=payload.staged is None,
            replicas=check if payload.staged is None else None,
        )


# The largest shard size a save plans with (1 EiB): ``size_per_shard=float("inf")`` means no
# limit, as in Colossal-AI (every tensor in one file), and stays an integer byte count.
_MAX_SHARD_MB = float(1 << 40)


def check_size_per_shard(size_mb: object) -> float:
    """``size_per_shard`` (MB) as a float; ``ConfigError`` naming it for anything but a positive number.

    ``inf`` is no limit (one file, as Colossal-AI writes). ``None``, strings, NaN, zero and
    negative sizes are refused before anything is planned.
    """
    import math
    import numbers

    if not isinstance(size_mb, numbers.Real) or math.isnan(float(size_mb)) or float(size_mb) <= 0:
        raise ConfigError(
            f"size_per_shard must be a positive number of MB (int or float; inf for no limit), got {size_mb!r}"
        )
    return min(float(size_mb), _MAX_SHARD_MB)
