"""A ``PeftModel``'s adapter alone, in the directory layout ``peft.PeftModel.from_pretrained`` reads.

``adapter_model.safetensors`` holds the adapter's tensors under peft's own names (those of
``peft.utils.get_peft_model_state_dict``: ``...q_proj.lora_A.weight``, no adapter name), and
``adapter_config.json`` the adapter's ``PeftConfig`` as ``PeftConfig.save_pretrained`` writes it.
The tensors are written by the ordinary unickpt save (``CheckpointIO.write``, one gathered
file): DTensors are gathered by the writer, replicated tensors written by one rank, the file
committed atomically, and its header metadata carries unickpt's index block (every tensor's
xxh3 and fingerprint) beside peft's ``{"format": "pt"}``; peft's loader
(``safetensors.torch.load_file``) reads the tensors and ignores the metadata.

The names are peft's: this module asks ``get_peft_model_state_dict`` which of the model's
state-dict entries make up the adapter (it hands back the very tensor objects it was given, so
each peft name is tied to the model's own tensor, sharded or not) and keeps its names.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Any

import torch

from unickpt.errors import ConfigError, IncompleteCheckpointError, IndexFileError, UnsupportedError
from unickpt.spec.naming import shown
from unickpt.spec.untrusted import strict_loads
from unickpt.store.publish import read_small_file
from unickpt.store.storage import join_location

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "adapter_config_json",
    "adapter_paths",
    "adapter_tensors",
    "check_adapter_config",
    "peft_model_of",
    "read_adapter_config",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# LoraConfig fields that change the adapter's function: a file whose value differs from the
# model's is refused, for loading it would give a model that computes something else.
_COMPARED = (
    "peft_type",
    "r",
    "lora_alpha",
    "use_rslora",
    "use_dora",
    "fan_in_fan_out",
    "lora_bias",
    "rank_pattern",
    "alpha_pattern",
    "target_modules",
)


def peft_model_of(module: torch.nn.Module, what: str) -> Any:
    """``module`` when it is a peft model (it has ``peft_config``), else an ``UnsupportedError``."""
    if not isinstance(getattr(module, "peft_config", None), dict):
        raise UnsupportedError(
            f"{what}: the model is a {type(module).__name__}, not a peft model (no peft_config); "
            "wrap it with peft.get_peft_model first, or use save_model/load_model"
        )
    return module


def _peft_config(module: Any, adapter_name: str, what: str) -> Any:
    if adapter_name not in module.peft_config:
        raise ConfigError(
            f"{what}: the model has no adapter {shown(adapter_name)} (it has {sorted(module.peft_config)})"
        )
    return module.peft_config[adapter_name]


def adapter_tensors(
    module: Any,
    tensors: dict[str, torch.Tensor],
    adapter_name: str,
    save_embedding_layers: bool | str,
    what: str,
) -> dict[str, str]:
    """peft name -> checkpoint name (a key of ``tensors``) of every tensor of the adapter.

    ``tensors`` is the model's state dict by checkpoint name; peft's
    ``get_peft_model_state_dict`` picks the adapter's entries from it and names them.
    """
    from peft.utils import get_peft_model_state_dict

    _peft_config(module, adapter_name, what)
    name_of: dict[int, str] = {}
    for name, t in tensors.items():
        name_of.setdefault(id(t), name)
    picked = get_peft_model_state_dict(
        module,
        state_dict=dict(tensors),
        adapter_name=adapter_name,
        save_embedding_layers=save_embedding_layers,  # type: ignore[arg-type]
    )
    out: dict[str, str] = {}
    for peft_name, t in picked.items():
        src = name_of.get(id(t))
        if src is None:
            raise UnsupportedError(
                f"{what}: peft's state dict of adapter {shown(adapter_name)} holds {shown(peft_name)}, which is not one of "
                "the model's state-dict tensors (a value peft computed); unickpt saves only the model's own tensors"
            )
        out[peft_name] = src
    if not out:
        raise UnsupportedError(f"{what}: adapter {shown(adapter_name)} of the model has no tensors to save")
    return out


def adapter_config_json(module: Any, adapter_name: str, what: str) -> bytes:
    """``adapter_config.json`` as ``PeftModel.save_pretrained`` writes it (inference mode on, the
    base model's name filled in, ``auto_mapping`` for configs without a task type)."""
    # A shallow copy: its fields are the config's own objects, dumped by to_dict as peft's own
    # save dumps them (target_modules, a set, then lists in the same order as peft writes it).
    config = copy.copy(_peft_config(module, adapter_name, what))
    get_base = getattr(module, "get_base_model", None)
    base = get_base() if callable(get_base) else None
    if config.base_model_name_or_path is None and base is not None:
        config.base_model_name_or_path = base.__dict__.get("name_or_path", None) or None
    config.inference_mode = True
    out = config.to_dict()
    for key, value in out.items():
        if isinstance(value, set):
            out[key] = list(value)
    if config.task_type is None and base is not None:
        out["auto_mapping"] = {
            "base_model_class": type(base).__name__,
            "parent_library": type(base).__module__,
        }
    return json.dumps(out, indent=2, sort_keys=True).encode()


def adapter_paths(checkpoint: str | os.PathLike[str]) -> tuple[str, str]:
    """(directory, weights file) of an adapter checkpoint given as its directory or its weights file."""
    path = os.fspath(checkpoint).rstrip("/")
    if path.endswith(".safetensors"):
        return os.path.dirname(path) or ".", path
    return path, join_location(path, ADAPTER_WEIGHTS)


def read_adapter_config(directory: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``directory`` as a dict (an ``IncompleteCheckpointError`` when
    there is none, an ``IndexFileError`` naming the file when it is not a JSON object)."""
    path = join_location(directory, ADAPTER_CONFIG)
    try:
        raw = read_small_file(path, storage_options)
    except FileNotFoundError as e:
        raise IncompleteCheckpointError(f"no adapter config at {path} (peft writes {ADAPTER_CONFIG})") from e
    try:
        obj = strict_loads(raw.decode("utf-8"), IndexFileError, f"{path}: adapter config")
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise IndexFileError(f"{path}: adapter config is not valid JSON ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise IndexFileError(f"{path}: adapter config must be a JSON object, found {type(obj).__name__}")
    return obj


def _comparable(key: str, value: Any) -> Any:
    if key == "target_modules" and isinstance(value, (list, tuple, set)):
        return sorted(value)
    if key in ("rank_pattern", "alpha_pattern") and value is None:
        return {}
    if hasattr(value, "value"):  # an enum (PeftType)
        return value.value
    return value


def check_adapter_config(module: Any, adapter_name: str, found: dict[str, Any], path: str, what: str) -> None:
    """Refuse an adapter config ``found`` (read from ``path``) whose function-defining fields differ
    from those of the model's adapter ``adapter_name``, naming each field with both values."""
    live = _peft_config(module, adapter_name, what).to_dict()
    diffs = []
    for key in _COMPARED:
        if key not in live and key not in found:
            continue
        want, got = _comparable(key, live.get(key)), _comparable(key, found.get(key))
        if want != got:
            diffs.append(f"{key}: the model's adapter has {shown(want)}, the file {shown(got)}")
    if diffs:
        raise ConfigError(
            f"{what}: {path} was written for a different adapter than the model's {shown(adapter_name)}: "
            + "; ".join(diffs)
        )
