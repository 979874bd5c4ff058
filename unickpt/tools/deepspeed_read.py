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

__all__ = ["load_deepspeed_file", "load_deepspeed_tensor", "ZeroStage", "LossScalerState", "FragmentAddress"]


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
    obj = _load(path)
    if not isinstance(obj, dict):
        raise CheckpointFormatError(
            f"{path}: not a readable DeepSpeed state dict (holds a {type(obj).__name__})"
        )
    return obj


def load_deepspeed_tensor(path: str) -> torch.Tensor:
    """The tensor pickled alone in the DeepSpeed file ``path`` (a universal checkpoint's ``step.pt``)."""
    obj = _load(path)
    if not isinstance(obj, torch.Tensor):
        raise CheckpointFormatError(f"{path}: expected a tensor, found a {type(obj).__name__}")
    return obj


def _load(path: str) -> Any:
    try:
        with torch.serialization.safe_globals(_STAND_INS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path} is missing") from None
    except pickle.UnpicklingError as e:
        m = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(e))
        what = f"{m.group(1)}, which" if m else "objects"
        raise UnsupportedError(
            f"{path}: refers to {what} a DeepSpeed checkpoint never needs; refusing to unpickle it "
            "(unickpt never runs code from a checkpoint)"
        ) from None
    except (RuntimeError, ValueError, EOFError, TypeError, KeyError, zipfile.BadZipFile) as e:
        obj = e  # damaged: reported below with what torch said
    if isinstance(obj, Exception):
        raise CheckpointFormatError(f"{path}: not a readable DeepSpeed file ({type(obj).__name__}: {obj})")
    return obj
