"""Process-group and device-mesh helpers shared by the plugins.

Every plugin calls :func:`ensure_process_group` before it builds its mesh, so a script
launched with ``torchrun`` needs no ``init_process_group`` of its own. A script started
with plain ``python`` (no torchrun environment) gets a one-process world, which lets the
same training script run on a laptop.

All ranks call these functions, in the same order.
"""

from __future__ import annotations

import atexit
import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from unickpt._logging import get_logger
from unickpt.errors import DistributedError

__all__ = [
    "build_mesh",
    "default_backend",
    "device_type",
    "device_type_for",
    "ensure_process_group",
    "local_device",
    "local_index_for",
]

logger = get_logger(__name__)

# The variables torchrun (and tests/dist/harness.py) set for every rank.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# Where launchers other than torchrun put a rank's index on its node (torchrun, Slurm's srun,
# Open MPI's and MPICH's mpirun), in that order of precedence.
_LOCAL_RANK_VARS = ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")


def _accelerator_type() -> str | None:
    """The type of the accelerator torch would use (``cuda``, ``xpu``...), or ``None``."""
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        dev = acc.current_accelerator()
        return None if dev is None else dev.type
    return "cuda" if torch.cuda.is_available() else None


def device_type_for(backend_config: str, accelerator: str | None) -> str:
    """The device a process group's tensors live on, from its backend map (a pure rule).

    ``backend_config`` is what ``dist.get_backend_config()`` says (``"cpu:gloo,cuda:nccl"``,
    ``"cuda:nccl"``, ``"cpu:gloo"``), or a bare backend name as passed to
    ``init_process_group`` (``"nccl"``, ``"gloo"``). The accelerator is used when the group
    maps it to a backend of its own (NCCL, XCCL...): a group whose only backend for it is gloo
    (``init_process_group("gloo")`` maps every device to gloo) trains on CPU.
    """
    if accelerator is None:
        return "cpu"
    mapping: dict[str, str] = {}
    for part in backend_config.replace(" ", "").lower().split(","):
        if not part:
            continue
        dev, sep, name = part.partition(":")
        if sep:
            mapping[dev] = name
        elif part not in ("undefined", "gloo"):
            mapping[accelerator] = part  # a bare accelerator backend: "nccl"
    backend = mapping.get(accelerator)
    return accelerator if backend is not None and backend != "gloo" else "cpu"


def local_index_for(env: dict[str, str], rank: int, device_count: int) -> int:
    """This rank's device index on its node when nobody chose one (a pure rule).

    The launcher's local rank (torchrun, srun, mpirun) wins; without one, ranks are taken to
    fill nodes in order, as torch's ``DeviceMesh`` does (``rank % device_count``).
    """
    for var in _LOCAL_RANK_VARS:
        raw = env.get(var, "")
        if raw.strip().isdigit():
            return int(raw)
    return rank % max(device_count, 1)


def default_backend() -> str | None:
    """The backend a new world is created with: torch's own default (``None``: gloo for CPU
    tensors and the accelerator's backend for its tensors, in one group) when an accelerator
    with a distributed backend is present, plain ``gloo`` otherwise."""
    acc = _accelerator_type()
    if acc == "cuda" and dist.is_nccl_available():
        return None
    return "gloo" if acc is None or acc == "cuda" else None


def device_type() -> str:
    """The device type meshes and models live on: the accelerator when the default process
    group has a backend for it (NCCL or the like), else ``cpu``."""
    if dist.is_initialized():
        return device_type_for(str(dist.get_backend_config()), _accelerator_type())
    return _planned_type(default_backend())


def _planned_type(backend: str | None) -> str:
    """The device type of a world about to be created with ``backend`` (``None``: torch's
    default, which gives the accelerator its own backend)."""
    acc = _accelerator_type()
    if backend is None:
        return acc or "cpu"
    return device_type_for(backend, acc)


def _select_device(kind: str, rank: int) -> torch.device:
    """The current device of ``kind``, chosen by :func:`local_index_for` if nobody chose one."""
    module = torch.get_device_module(kind)
    if not module.is_initialized():
        module.set_device(local_index_for(dict(os.environ), rank, module.device_count()))
    return torch.device(kind, module.current_device())


def local_device() -> torch.device:
    """This rank's device: the accelerator's current device once one was chosen (by the user's
    ``torch.cuda.set_device``, or by :func:`ensure_process_group`), else the launcher's local
    rank (``LOCAL_RANK``, ``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``), else
    ``rank % device_count``, which is then made current; ``cpu`` without an accelerator."""
    kind = device_type()
    if kind == "cpu":
        return torch.device("cpu")
    return _select_device(kind, dist.get_rank() if dist.is_initialized() else 0)


def _destroy_own_world(world: object) -> None:
    """At exit: destroy the one-process world :func:`ensure_process_group` made, if it still stands."""
    if dist.is_initialized() and dist.group.WORLD is world:
        dist.destroy_process_group()


def ensure_process_group(backend: str | None = None, timeout_s: float | None = None) -> None:
    """Initialise the default process group from the torchrun environment if nobody has yet.

    Called by every rank. Without a torchrun environment (no ``RANK``/``WORLD_SIZE``...), a
    one-process world is created on an in-memory store. A partial environment is an error,
    because guessing would make ranks wait for each other forever.
    """
    if dist.is_initialized():
        return
    if not dist.is_available():
        raise DistributedError("torch.distributed is not available in this torch build")
    backend = backend or default_backend()
    kwargs: dict[str, object] = {}
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if not present:
        logger.info("no torchrun environment found: starting a one-process %s world", backend)
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(backend, store=store, rank=0, world_size=1, **kwargs)  # type: ignore[arg-type]
        # The world is this library's: it is destroyed at exit (after async saves finish, whose
        # hook runs first), so that gloo's threads never meet the interpreter's teardown
        # ("terminate called without an active exception").
        atexit.register(_destroy_own_world, dist.group.WORLD)
    elif len(present) != len(_TORCHRUN_VARS):
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise DistributedError(
            f"incomplete torchrun environment: {', '.join(missing)} not set (found {', '.join(present)}); "
            "launch with `torchrun --nproc_per_node N script.py` or call "
            "torch.distributed.init_process_group yourself before creating the plugin"
        )
    else:
        kind = _planned_type(backend)
        if kind != "cpu":
            # Chosen before the group exists, so that NCCL's communicators bind to this device.
            _select_device(kind, int(os.environ["RANK"]))
        dist.init_process_group(backend, init_method="env://", **kwargs)  # type: ignore[arg-type]
    logger.debug("process group up: rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), backend)


def build_mesh(shape: Sequence[int], dim_names: Sequence[str]) -> DeviceMesh:
    """A DeviceMesh over the whole world with the given shape and dimension names.

    Called by every rank. The product of ``shape`` must equal the world size.
    """
    ensure_process_group()
    world = dist.get_world_size()
    total = 1
    for n in shape:
        total *= n
    if total != world:
        raise DistributedError(
            f"mesh shape {tuple(shape)} ({' x '.join(dim_names)}) needs {total} ranks, "
            f"but the world has {world}"
        )
    return init_device_mesh(device_type(), tuple(shape), mesh_dim_names=tuple(dim_names))
