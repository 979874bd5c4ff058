"""Process-group and device-mesh helpers shared by the plugins.

Every plugin calls :func:`ensure_process_group` before it builds its mesh, so a script
launched with ``torchrun`` needs no ``init_process_group`` of its own. A script started
with plain ``python`` (no torchrun environment) gets a one-process world, which lets the
same training script run on a laptop.

All ranks call these functions, in the same order.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from unickpt._logging import get_logger
from unickpt.errors import DistributedError

__all__ = ["build_mesh", "default_backend", "device_type", "ensure_process_group", "local_device"]

logger = get_logger(__name__)

# The variables torchrun (and tests/dist/harness.py) set for every rank.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def default_backend() -> str:
    """``nccl`` when CUDA is usable, otherwise ``gloo`` (CPU)."""
    return "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"


def device_type() -> str:
    """The device type meshes and models live on: ``cuda`` under nccl, else ``cpu``."""
    if dist.is_initialized():
        return "cuda" if dist.get_backend() == "nccl" else "cpu"
    return "cuda" if default_backend() == "nccl" else "cpu"


def local_device() -> torch.device:
    """This rank's device (``cuda:LOCAL_RANK`` under nccl, ``cpu`` otherwise)."""
    if device_type() == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


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
    elif len(present) != len(_TORCHRUN_VARS):
        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        raise DistributedError(
            f"incomplete torchrun environment: {', '.join(missing)} not set (found {', '.join(present)}); "
            "launch with `torchrun --nproc_per_node N script.py` or call "
            "torch.distributed.init_process_group yourself before creating the plugin"
        )
    else:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
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
