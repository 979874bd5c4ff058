"""The small JSON files saved beside the tensors: a Hugging Face model's config and the LR scheduler state."""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from unickpt.errors import IncompleteCheckpointError, IndexFileError
from unickpt.io.jsonstate import from_json_value, to_json_value
from unickpt.spec.untrusted import strict_loads
from unickpt.store.publish import checkpoint_directory, write_small_file

__all__ = [
    "SCHEDULER_FILE",
    "hf_config_files",
    "lr_scheduler_json",
    "read_lr_scheduler_state",
    "write_config_files",
]

SCHEDULER_FILE = "lr_scheduler.json"


def hf_config_files(module: torch.nn.Module) -> dict[str, str]:
    """``config.json`` / ``generation_config.json`` contents of a Hugging Face model, if it has them.

    ``config.json`` names the model's architecture (``architectures``) as ``save_pretrained``
    writes it: the class of the model, or of the base model a wrapper (a ``PeftModel``) holds,
    never the class FSDP2 makes of it (``FSDPMixtralForCausalLM``), which transformers does not have.
    A ``PeftModel`` also gets ``adapter_config.json``, its active adapter's config as peft writes it.
    """
    out: dict[str, str] = {}
    for attr, fname in (("config", "config.json"), ("generation_config", "generation_config.json")):
        to_json = getattr(getattr(module, attr, None), "to_json_string", None)
        if to_json is not None:
            out[fname] = str(to_json())
    if "config.json" in out:
        try:
            cfg = json.loads(out["config.json"])
        except ValueError:
            return out
        if not cfg.get("architectures"):
            base = module
            get_base = getattr(module, "get_base_model", None)  # peft's PeftModel
            if callable(get_base):
                base = get_base()
            # A transformers config (PretrainedConfig has the field) of a transformers model; the
            # class FSDP2's fully_shard (or replicate) puts in front of it does not count.
            cls = next(
                (c for c in type(base).__mro__ if not c.__module__.startswith("torch.distributed.")),
                type(base),
            )
            if hasattr(getattr(base, "config", None), "architectures") and cls.__module__.startswith(
                "transformers."
            ):
                cfg["architectures"] = [cls.__name__]
                out["config.json"] = json.dumps(cfg, indent=2, sort_keys=True) + "\n"
    peft_config = getattr(module, "peft_config", None)
    if isinstance(peft_config, dict) and peft_config:
        # A PeftModel's run: its adapter's config, which ``unickpt merge --merge-adapters`` reads.
        from unickpt.io.adapters import ADAPTER_CONFIG, adapter_config_json

        active = getattr(module, "active_adapter", None)
        name = active if isinstance(active, str) and active in peft_config else next(iter(peft_config))
        out[ADAPTER_CONFIG] = adapter_config_json(module, name, "save_model").decode()
    return out


def write_config_files(
    config: dict[str, str], path: str, storage_options: dict[str, Any] | None = None
) -> None:
    """Write ``config.json``-like files beside the committed checkpoint ``path`` (a URL too)."""
    directory = checkpoint_directory(path)
    for fname, text in config.items():
        write_small_file(os.path.join(directory, fname), text.encode("utf-8"), storage_options)


def lr_scheduler_json(state: dict[str, Any]) -> bytes:
    """The bytes of ``lr_scheduler.json`` for a scheduler's ``state_dict()``.

    Every float as it is (``ReduceLROnPlateau``'s ``best`` and ``mode_worse`` are ``inf`` until it
    steps): inf, -inf and nan as ``Infinity``, ``-Infinity``, ``NaN``, which ``strict_loads`` and
    ``json.load`` read back. What cannot be kept is refused, naming the file and the field.
    """
    state_json = to_json_value(state, f"{SCHEDULER_FILE}: state")
    return json.dumps({"unickpt_lr_scheduler": 1, "state": state_json}, indent=2, allow_nan=True).encode()


def read_lr_scheduler_state(
    path: str, storage_options: dict[str, Any] | None = None, given: str | None = None
) -> dict[str, Any]:
    """The scheduler ``state_dict()`` stored in the ``lr_scheduler.json`` at ``path``.

    A missing file is an ``IncompleteCheckpointError`` naming ``path`` and, when the caller gave
    another location (``given``: a directory ``path`` is inside), that one too; anything else that
    is not a scheduler state written by :func:`lr_scheduler_json` is an ``IndexFileError`` naming
    ``path``.
    """
    try:
        from unickpt.store.publish import read_small_file  # a local path or a URL

        raw = read_small_file(path, storage_options)
        obj = strict_loads(raw.decode("utf-8"), IndexFileError, f"{path}: LR scheduler state")
    except FileNotFoundError as e:
        if given is not None and given != path:
            raise IncompleteCheckpointError(
                f"no LR scheduler state at {given}: it is not a file and {path} does not exist "
                f"(a directory's scheduler state is its {SCHEDULER_FILE})"
            ) from e
        raise IncompleteCheckpointError(f"no LR scheduler state at {path}") from e
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise IndexFileError(
            f"{path}: LR scheduler state is not valid JSON ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(obj, dict) or "state" not in obj:
        raise IndexFileError(f"{path}: not a unickpt LR scheduler file (no 'state' key)")
    try:
        state = from_json_value(obj["state"], f"{path}: state")
    except IndexFileError:
        raise
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise IndexFileError(f"{path}: malformed LR scheduler state ({type(e).__name__}: {e})") from None
    if not isinstance(state, dict):
        raise IndexFileError(f"{path}: LR scheduler state must be a JSON object")
    return state
