"""The ``Plugin`` base class: how a parallelism sets a model up, and which CheckpointIO saves it.

A plugin is created once per process, before ``Booster.boost``. ``configure`` is called
once by every rank with the user's objects and returns them ready to train; the plugin's
``get_checkpoint_io()`` then saves and loads them. Plugins use torch's own parallelism
(DDP, ``fully_shard``, ``parallelize_module``); unickpt adds no runtime of its own.

Models must be initialised identically on every rank (same seed), as torch's parallel
wrappers expect: ``fully_shard`` and ``parallelize_module`` keep each rank's own values.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from unickpt import _dist
from unickpt.errors import UnsupportedError
from unickpt.io.tensors import mesh_dims
from unickpt.plugins._shared import mesh as _mesh

if TYPE_CHECKING:
    from unickpt.io import CheckpointIO

__all__ = ["ConfigureResult", "Plugin", "check_optimizer", "parameter_fqns", "remap_optimizer_params"]

ConfigureResult = tuple[torch.nn.Module, Any, Any, Any, Any]


class Plugin(abc.ABC):
    """Base class of every parallelism plugin.

    Subclasses set ``name``, implement :meth:`_parallelize`, and name their CheckpointIO: set
    ``checkpoint_io_class`` (built with the plugin's mesh), or override
    :meth:`_make_checkpoint_io` when it needs more than the mesh.
    """

    name: ClassVar[str] = "plugin"
    # False for a plugin whose ranks all consume the same batches (TP, PP): dp_size 1, dp_rank 0.
    data_parallel: ClassVar[bool] = True
    checkpoint_io_class: ClassVar[type[CheckpointIO] | None] = None

    def __init__(self, storage_options: dict[str, Any] | None = None) -> None:
        # fsspec options of checkpoint URLs, handed to the CheckpointIO by the Booster.
        self.storage_options = storage_options
        self._mesh: DeviceMesh | None = None
        # Built lazily by get_checkpoint_io and reset by configure (the mesh changes).
        self._io: CheckpointIO | None = None

    # -- set-up ---------------------------------------------------------------------------

    def configure(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        criterion: Callable[..., Any] | None = None,
        dataloader: Any = None,
        lr_scheduler: Any = None,
    ) -> ConfigureResult:
        """Parallelise ``model`` and return ``(model, optimizer, criterion, dataloader, lr_scheduler)``.

        Called once by every rank. The process group is initialised from the torchrun
        environment if needed, then :meth:`_parallelize` builds the mesh and sets the model up.
        The returned optimizer is the same torch optimizer object (so a scheduler built on it
        stays valid), with its parameters replaced by the parallelised ones. The returned model
        is a :class:`unickpt.wrappers.ModelWrapper`; ``criterion``, ``dataloader`` and
        ``lr_scheduler`` come back unchanged.
        """
        _mesh.ensure_process_group()
        _dist.setup_cpu_group()  # the gloo twin of a pure NCCL world, for CPU collectives
        self._io = None  # the mesh changes: the next get_checkpoint_io builds a new IO
        return self._parallelize(model, optimizer), optimizer, criterion, dataloader, lr_scheduler

    @abc.abstractmethod
    def _parallelize(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None
    ) -> torch.nn.Module:
        """Build ``self._mesh``, set ``model`` up with torch's parallelism, point ``optimizer`` at its
        new parameters, and return the model's :class:`unickpt.wrappers.ModelWrapper` (every rank)."""

    def get_checkpoint_io(self) -> CheckpointIO:
        """The CheckpointIO that saves and loads models set up by this plugin (all ranks)."""
        if self._io is None:
            self._io = self._make_checkpoint_io()
        return self._io

    def _make_checkpoint_io(self) -> CheckpointIO:
        """A new CheckpointIO for the current mesh: ``checkpoint_io_class(mesh=...)`` by default."""
        if self.checkpoint_io_class is None:
            raise NotImplementedError(f"{type(self).__name__} names no checkpoint_io_class")
        return self.checkpoint_io_class(mesh=self._mesh)

    def backward(self, loss: torch.Tensor, optimizer: Any) -> None:
        """Back-propagate ``loss`` (every rank). Gradient reduction is done by torch's wrappers."""
        del optimizer
        loss.backward()

    def prepare_dataloader(self, dataloader: Any) -> Any:
        """Hook for plugins that must change how data is fed (every rank). Default: unchanged.

        Data sharding and resumable positions are handled by ``unickpt.data``, which reads
        :attr:`dp_rank` and :attr:`dp_size`.
        """
        return dataloader

    # -- description ----------------------------------------------------------------------

    @property
    def device_mesh(self) -> DeviceMesh | None:
        """The mesh built by :meth:`configure` (``None`` before it, or for a one-process plugin)."""
        return self._mesh

    @property
    def device(self) -> torch.device:
        """The device this rank trains on."""
        return _mesh.local_device()

    @property
    def dp_size(self) -> int:
        """How many data-parallel replicas consume different batches."""
        return self.world_size if self.data_parallel else 1

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas."""
        return dist.get_rank() if self.data_parallel and dist.is_initialized() else 0

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else 1

    def layout(self) -> dict[str, Any]:
        """A JSON-able description: plugin name, world size, mesh dimensions, dp size."""
        return {
            "plugin": self.name,
            "world_size": self.world_size,
            "mesh": mesh_dims(self._mesh),
            "dp_size": self.dp_size,
        }

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.layout()})"


def parameter_fqns(model: torch.nn.Module) -> dict[int, str]:
    """Map ``id(parameter)`` to its FQN (the first one, for tied parameters)."""
    return {id(p): name for name, p in model.named_parameters()}


def _refuse_stepped(optimizer: torch.optim.Optimizer) -> None:
    if any(len(s) for s in optimizer.state.values()):
        raise UnsupportedError(
            "the optimizer already holds state (it has stepped): pass a fresh optimizer to "
            "Booster.boost and load its state afterwards with booster.load_optimizer"
        )


def check_optimizer(optimizer: torch.optim.Optimizer | None, model: torch.nn.Module) -> None:
    """Refuse, before anything is parallelised, an optimizer the plugin cannot rebind.

    It must hold no state yet (it has not stepped) and only parameters of ``model``, each
    once. Called by every rank; raises ``UnsupportedError`` on each of them alike.
    """
    if optimizer is None:
        return
    _refuse_stepped(optimizer)
    fqns = parameter_fqns(model)
    seen: set[int] = set()
    for gi, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in fqns:
                raise UnsupportedError(
                    f"optimizer param group {gi} holds a tensor (shape {tuple(p.shape)}) that is not a "
                    "parameter of the model given to Booster.boost"
                )
            if id(p) in seen:
                raise UnsupportedError(
                    f"parameter {fqns[id(p)]!r} appears twice in the optimizer's param groups"
                )
            seen.add(id(p))


def remap_optimizer_params(
    optimizer: torch.optim.Optimizer | None,
    old_fqns: dict[int, str],
    model: torch.nn.Module,
) -> None:
    """Point ``optimizer``'s param groups at ``model``'s current parameters, matched by FQN.

    torch's ``fully_shard`` and ``parallelize_module`` replace parameters by new DTensor
    parameters; an optimizer built on the old ones would silently update nothing. Called by
    every rank right after parallelising, with ``old_fqns = parameter_fqns(model)`` taken
    before. Call :func:`check_optimizer` before parallelising, so that a refusal leaves the
    model untouched; the same checks are repeated here.
    """
    if optimizer is None:
        return
    _refuse_stepped(optimizer)
    current = dict(model.named_parameters())
    seen: set[int] = set()
    for gi, group in enumerate(optimizer.param_groups):
        params: Iterable[torch.Tensor] = group["params"]
        new_params = []
        for p in params:
            fqn = old_fqns.get(id(p))
            if fqn is None:
                raise UnsupportedError(
                    f"optimizer param group {gi} holds a tensor (shape {tuple(p.shape)}) that is not a "
                    "parameter of the model given to Booster.boost"
                )
            new = current[fqn]
            if id(new) in seen:
                raise UnsupportedError(f"parameter {fqn!r} appears twice in the optimizer's param groups")
            seen.add(id(new))
            new_params.append(new)
        group["params"] = new_params
    optimizer.state.clear()
