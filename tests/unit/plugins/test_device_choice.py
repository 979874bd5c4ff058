"""Which device a rank trains and saves on: the rules of plugins/_shared/mesh.py as plain values.

A GPU job whose group was made by ``init_process_group()`` (torch's default, ``cpu:gloo,cuda:nccl``)
or by srun/mpirun (no ``LOCAL_RANK``) must train on its own GPU, never silently on CPU or on
``cuda:0`` for every rank.
"""

from __future__ import annotations

import pytest
import torch

from unickpt.plugins._shared import mesh


@pytest.mark.parametrize(
    ("config", "accelerator", "expected"),
    [
        ("nccl", "cuda", "cuda"),
        ("cuda:nccl", "cuda", "cuda"),
        ("cpu:gloo,cuda:nccl", "cuda", "cuda"),
        ("CUDA:NCCL, CPU:GLOO", "cuda", "cuda"),
        ("cpu:gloo,cuda:gloo", "cuda", "cpu"),  # init_process_group("gloo") on a GPU machine
        ("gloo", "cuda", "cpu"),
        ("cpu:gloo", "cuda", "cpu"),
        ("undefined", "cuda", "cpu"),
        ("cpu:gloo,xpu:xccl", "xpu", "xpu"),
        ("cpu:gloo,cuda:nccl", None, "cpu"),
        ("nccl", None, "cpu"),
    ],
)
def test_device_type_follows_the_groups_backend_map(
    config: str, accelerator: str | None, expected: str
) -> None:
    assert mesh.device_type_for(config, accelerator) == expected


@pytest.mark.parametrize(
    ("env", "rank", "count", "expected"),
    [
        ({"LOCAL_RANK": "3"}, 11, 8, 3),
        ({"SLURM_LOCALID": "5"}, 13, 8, 5),  # srun
        ({"OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 10, 8, 2),  # Open MPI's mpirun
        ({"MPI_LOCALRANKID": "6"}, 14, 8, 6),  # MPICH
        ({"LOCAL_RANK": "1", "SLURM_LOCALID": "7"}, 9, 8, 1),  # torchrun's wins
        ({"LOCAL_RANK": ""}, 9, 8, 1),  # unset in effect: rank % devices
        ({}, 13, 8, 5),
        ({}, 3, 0, 0),
    ],
)
def test_local_device_index_without_a_chosen_device(
    env: dict[str, str], rank: int, count: int, expected: int
) -> None:
    assert mesh.local_index_for(env, rank, count) == expected


def test_cpu_world_trains_on_cpu() -> None:
    # This machine has no accelerator: a new world is gloo, and its device the CPU.
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    assert mesh.default_backend() == "gloo"
    assert mesh.device_type() == "cpu"
    assert str(mesh.local_device()) == "cpu"
