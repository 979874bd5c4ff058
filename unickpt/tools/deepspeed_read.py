"""Read DeepSpeed's pickled checkpoint files without running code from them.

DeepSpeed's ``*_model_states.pt`` holds only tensors and plain containers, but its ZeRO
``*_optim_states.pt`` also pickles a few of DeepSpeed's own objects: the loss scaler
(``LossScaler``, or ``DynamicLossScaler`` with fp16 dynamic scaling), the stage
(``ZeroStageEnum``) and each parameter's place in the flat partition (``fragment_address``).
Unpickling those with ``weights_only=False`` would import DeepSpeed and run whatever a crafted
file names. Here every file goes through torch's restricted unpickler
(``torch.load(weights_only=True)``: tensors, storages and their rebuild functions, plain
containers, numbers and strings) with exactly these classes added, mapped to the inert
stand-ins below: they only hold the values they are given, import nothing and run nothing.
Any other global (``os.system``, another DeepSpeed class, ...) is refused with
:class:`UnsupportedError` before anything is called; a damaged file gives
:class:`CheckpointFormatError`. DeepSpeed need not be installed. Imported lazily (needs torch).

What the restricted unpickler builds is still bounded before anything walks it
(:func:`load_restricted`, also used for Colossal-AI's files): only torch's zip format is read
(its reader checks every storage's claimed size against the bytes of its record before
allocating; the legacy pre-1.6 format allocates what the pickle claims, and is refused), and
an object that contains itself or is nested deeper than ``spec.untrusted.MAX_DEPTH`` is refused
with :class:`CheckpointFormatError` naming the file.
"""

from __future__ import annotations

import dataclasses
import enum
import pickle
import re
import zipfile
from typing import Any

import torch

from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, UnsupportedError
from unickpt.spec.untrusted import check_graph
from unickpt.store.storage import open_file_location

__all__ = [
    "load_deepspeed_file",
    "load_deepspeed_tensor",
    "load_restricted",
    "ZeroStage",
    "LossScalerState",
    "FragmentAddress",
]


class ZeroStage(enum.IntEnum):
    """Stand-in for ``deepspeed.runtime.zero.config.ZeroStageEnum`` (same values)."""

    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3
    max_stage = 4


class LossScalerState:
    """Stand-in for DeepSpeed's loss scalers: a bag of the attributes the file sets."""

    def __repr__(self) -> str:
        return f"LossScalerState({vars(self)})"


@dataclasses.dataclass
class FragmentAddress:
    """Stand-in for ``deepspeed.utils.tensor_fragment.fragment_address``."""

    numel: int = 0
    start: int = 0


# The only globals a DeepSpeed checkpoint may name beyond what weights_only allows.
_STAND_INS: list[Any] = [
    (ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (LossScalerState, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_deepspeed_file(path: str) -> dict[str, Any]:
    """The dict pickled in the DeepSpeed file ``path``, on CPU, read as the module docstring says."""
    obj = load_restricted(path, "DeepSpeed checkpoint", _STAND_INS)
    if not isinstance(obj, dict):
        raise CheckpointFormatError(
            f"{path}: not a readable DeepSpeed state dict (holds a {type(obj).__name__})"
        )
    return obj


def load_deepspeed_tensor(path: str) -> torch.Tensor:
    """The tensor pickled alone in the DeepSpeed file ``path`` (a universal checkpoint's ``step.pt``)."""
    obj = load_restricted(path, "DeepSpeed checkpoint", _STAND_INS)
    if not isinstance(obj, torch.Tensor):
        raise CheckpointFormatError(f"{path}: expected a tensor, found a {type(obj).__name__}")
    return obj


def load_restricted(path: str, what: str, stand_ins: list[Any] | None = None) -> Any:
    """The object pickled in the torch zip file ``path`` (a ``what``), read with
    ``torch.load(weights_only=True)`` plus ``stand_ins``, bounded as the module docstring says:
    :class:`UnsupportedError` for a global it refuses or the legacy format,
    :class:`CheckpointFormatError` for a damaged, self-containing or too deeply nested object."""
    try:
        f = open_file_location(path)
    except IncompleteCheckpointError:
        raise IncompleteCheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise CheckpointFormatError(f"{path}: cannot be read ({e.strerror})") from None
    with f:
        try:
            magic = f.read(4)
        except OSError as e:
            raise CheckpointFormatError(f"{path}: cannot be read ({e.strerror})") from None
        if magic != b"PK\x03\x04":
            raise UnsupportedError(
                f"{path}: not a torch zip file (torch.save's format since torch 1.6); the legacy format "
                f"is not read (re-save it with a current torch) or the file is no {what} file"
            )
        f.seek(0)
        return _load_zip(f, path, what, stand_ins)


def _load_zip(f: Any, path: str, what: str, stand_ins: list[Any] | None) -> Any:
    """``torch.load(weights_only=True)`` of the open torch zip file ``f`` (at ``path``)."""
    try:
        with torch.serialization.safe_globals(stand_ins or []):
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        m = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(e))
        which = f"{m.group(1)}, which" if m else "objects"
        raise UnsupportedError(
            f"{path}: torch.load(weights_only=True) refused it: it refers to {which} a {what} never needs; "
            "refusing to unpickle it "
            "(unickpt never runs code from a checkpoint)"
        ) from None
    except (RuntimeError, ValueError, EOFError, TypeError, KeyError, zipfile.BadZipFile, OverflowError) as e:
        raise CheckpointFormatError(f"{path}: not a readable {what} file ({type(e).__name__}: {e})") from None
    check_graph(obj, path, f"{what} file's object", CheckpointFormatError)
    return obj
