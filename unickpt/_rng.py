"""Capture and restore a process's random number generators, without pickle.

Each rank captures its own streams: Python ``random``, numpy's legacy global generator,
torch's CPU generator and, when CUDA is available, every CUDA device's generator. The JSON
part holds the Python and numpy states; torch's states are byte tensors, returned apart so
that the caller stores them in a safetensors file.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["capture_rng", "restore_rng"]


def capture_rng() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This rank's RNG states: ``(json_part, {name: uint8 tensor})``. Called by every rank."""
    version, internal, gauss = random.getstate()
    key, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    js: dict[str, Any] = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "key": str(key),
            "keys": [int(k) for k in keys],
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "cuda_devices": 0,
    }
    tensors = {"rng.torch_cpu": torch.get_rng_state().clone()}
    if torch.cuda.is_available():
        states = torch.cuda.get_rng_state_all()
        js["cuda_devices"] = len(states)
        for i, s in enumerate(states):
            tensors[f"rng.cuda.{i}"] = s.cpu().clone()
    return js, tensors


def restore_rng(js: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Restore states produced by :func:`capture_rng` (on the rank that captured them)."""
    py = js["python"]
    random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
    n = js["numpy"]
    np.random.set_state(
        (
            n["key"],
            np.asarray(n["keys"], dtype=np.uint32),
            int(n["pos"]),
            int(n["has_gauss"]),
            float(n["cached_gaussian"]),
        )
    )
    torch.set_rng_state(tensors["rng.torch_cpu"].to(torch.uint8))
    saved_cuda = int(js.get("cuda_devices", 0))
    if saved_cuda and torch.cuda.is_available():
        count = min(saved_cuda, torch.cuda.device_count())
        torch.cuda.set_rng_state_all([tensors[f"rng.cuda.{i}"] for i in range(count)])
