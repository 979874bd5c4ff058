"""Capture and restore a process's random number generators, without pickle.

Each rank captures its own streams: Python ``random``, numpy's legacy global generator,
torch's CPU generator and, when CUDA is available, every CUDA device's generator. The JSON
part holds the Python and numpy states; torch's states are byte tensors, returned apart so
that the caller stores them in a safetensors file.
"""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = ["capture_rng", "keeps_python_random", "restore_rng", "RngStateError"]

F = TypeVar("F", bound=Callable[..., Any])


def keeps_python_random(fn: F) -> F:
    """``fn`` leaves Python's global ``random`` stream as it found it, when called on the main thread.

    Clients of object stores draw from it: botocore's retry backoff takes its jitter from
    ``random.random()``, so a save that met one slow response would shift a training's data
    order or dropout from the next step on. The main thread is blocked in ``fn`` meanwhile, so
    every draw in between is the library's own; in another thread the training may be drawing,
    and the stream is left alone.
    """

    @functools.wraps(fn)
    def kept(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is not threading.main_thread():
            return fn(*args, **kwargs)
        state = random.getstate()
        try:
            return fn(*args, **kwargs)
        finally:
            random.setstate(state)

    return kept  # type: ignore[return-value]


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


class RngStateError(ValueError):
    """A recorded RNG state that is not one this module captures (the caller names the file)."""


# What capture_rng records: CPython's Mersenne Twister (624 words and a position), numpy's
# legacy MT19937 (624 words). Checked before anything is converted or restored.
_PY_STATE_LEN = 625
_NP_KEYS_LEN = 624


def _words(v: Any, n: int, what: str) -> list[int]:
    if type(v) is not list or len(v) != n:
        found = f"{len(v)} values" if type(v) is list else type(v).__name__
        raise RngStateError(f"{what} must be a list of {n} integers, found {found}")
    if not all(type(x) is int and 0 <= x < 1 << 32 for x in v):
        raise RngStateError(f"{what} must hold integers in [0, 2^32)")
    return v


def restore_rng(js: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Restore states produced by :func:`capture_rng` (on the rank that captured them).

    ``RngStateError`` when ``js`` or ``tensors`` is not such a state; nothing is restored then."""
    try:
        py, n = js["python"], js["numpy"]
        state = tuple(_words(py["state"], _PY_STATE_LEN, "python.state"))
        keys = np.asarray(_words(n["keys"], _NP_KEYS_LEN, "numpy.keys"), dtype=np.uint32)
        version, gauss = py["version"], py["gauss_next"]
        pos, has_gauss, cached = n["pos"], n["has_gauss"], n["cached_gaussian"]
        if type(version) is not int or not (gauss is None or type(gauss) is float):
            raise RngStateError("python.version must be an integer and gauss_next a number or null")
        if type(pos) is not int or type(has_gauss) is not int or type(cached) not in (int, float):
            raise RngStateError("numpy.pos and numpy.has_gauss must be integers, cached_gaussian a number")
        cpu = tensors["rng.torch_cpu"]
        saved_cuda = js.get("cuda_devices", 0)
        if type(saved_cuda) is not int or saved_cuda < 0:
            raise RngStateError(
                f"cuda_devices must be a non-negative integer, found {str(saved_cuda)[:40]!r}"
            )
        count = min(saved_cuda, torch.cuda.device_count()) if saved_cuda and torch.cuda.is_available() else 0
        cuda = [tensors[f"rng.cuda.{i}"] for i in range(count)]
    except (KeyError, TypeError) as e:
        raise RngStateError(f"missing or malformed entry {e}") from None
    try:
        random.setstate((version, state, gauss))
        np.random.set_state((n["key"], keys, pos, has_gauss, float(cached)))
        torch.set_rng_state(cpu.to(torch.uint8))
        if cuda:
            torch.cuda.set_rng_state_all(cuda)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise RngStateError(str(e)) from None
