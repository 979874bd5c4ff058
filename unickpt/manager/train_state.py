"""The per-rank training state of a step: RNG states, dataloader position, extra states.

``train_state/rank-<r>.json`` holds the JSON (``io/jsonstate`` encoding: tensors referenced into
``rank-<r>.safetensors``, tuples kept), ``rank-<r>.hashes.json`` the xxh3-64 of both files (rank 0:
and of ``lr_scheduler.json``) for ``unickpt verify``.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from unickpt import _rng
from unickpt._logging import get_logger
from unickpt.ckpt import run_layout
from unickpt.ckpt.run_layout import TRAIN_STATE_DIR
from unickpt.errors import (
    IncompleteCheckpointError,
    IndexFileError,
    StateMismatchError,
    UnickptError,
    UnsupportedError,
)
from unickpt.io.jsonstate import from_json_value, to_json_value
from unickpt.spec.naming import shown
from unickpt.spec.untrusted import strict_loads
from unickpt.store.publish import write_small_file
from unickpt.store.storage import open_storage, url_options

__all__ = ["STATE_VERSION", "capture", "restore", "write_rank_state", "read_rank_state"]

logger = get_logger("unickpt.manager")

STATE_VERSION = 1

NOT_RESUMABLE = (
    "the dataloader ({}) has no state_dict(): pass the dataloader returned by Booster.boost, or wrap it "
    "with unickpt.data.wrap_dataloader (or use torchdata's StatefulDataLoader)"
)


def capture(
    step: int, rank: int, world: int, dataloader: Any, extra_states: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """This rank's state as (JSON, tensors); the tensors are copies."""
    rng_js, tensors = _rng.capture_rng()
    state: dict[str, Any] = {
        "unickpt_train_state": STATE_VERSION,
        "step": step,
        "rank": rank,
        "world_size": world,
        "rng": rng_js,
        "extra": {},
    }
    if dataloader is not None:
        if not hasattr(dataloader, "state_dict"):
            raise UnsupportedError(NOT_RESUMABLE.format(type(dataloader).__name__))
        state["dataloader"] = to_json_value(dataloader.state_dict(), "dataloader", tensors)
    for name, obj in extra_states.items():
        if not hasattr(obj, "state_dict") or not hasattr(obj, "load_state_dict"):
            raise UnsupportedError(
                f"extra state {shown(name)} ({type(obj).__name__}) has no state_dict()/load_state_dict()"
            )
        state["extra"][name] = to_json_value(obj.state_dict(), f"extra.{name}", tensors)
    return state, tensors


def restore(
    d: str,
    step: int,
    rank: int,
    world: int,
    dataloader: Any,
    extra_states: dict[str, Any],
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Load this rank's state of the step directory ``d`` (a local path or a URL) into the RNGs,
    ``dataloader`` and ``extra_states``."""
    js, tensors = read_rank_state(d, rank, storage_options)
    if js is None:
        # The saving world's size, from the step's COMMIT record (for the message only).
        storage, root = open_storage(d, url_options(d, storage_options))
        try:
            raw = storage.read_bytes(storage.join(root, run_layout.COMMIT_NAME), limit=1 << 20)
            commit = strict_loads(raw.decode("utf-8"), IndexFileError, d)
        except (OSError, ValueError, UnickptError):
            commit = None
        saved_world = commit.get("world_size", "?") if isinstance(commit, dict) else "?"
        logger.warning(
            "step %s was saved by %s rank(s), this is rank %s of %s: RNG states are not restored "
            "and per-rank states come from rank 0",
            step,
            saved_world,
            rank,
            world,
        )
        js, tensors = read_rank_state(d, 0, storage_options)
        if js is None:
            raise IncompleteCheckpointError(f"{d}: no train state for rank 0")
    elif js.get("rng") is None:
        # a step imported by `unickpt convert --to run`: the source saved no RNG states
        logger.warning("step %s holds no RNG states (imported): RNG states are not restored", step)
    elif js["world_size"] == world:
        try:
            _rng.restore_rng(js["rng"], tensors)
        except _rng.RngStateError as e:
            raise IndexFileError(f"{_rank_paths(d, rank)[0]}: training state field 'rng': {e}") from None
    else:
        logger.warning(
            "step %s was saved by %s rank(s), resumed on %s: RNG states are not restored",
            step,
            js["world_size"],
            world,
        )
    if dataloader is not None:
        _load_dataloader(dataloader, js, tensors, world)
    saved_extra = js.get("extra", {})
    for name, obj in extra_states.items():
        if name not in saved_extra:
            raise StateMismatchError(
                f"extra state {shown(name)} is not in {d} (saved: {sorted(saved_extra)})",
                missing=[name],
            )
        loaded = from_json_value(saved_extra[name], f"extra.{name}", tensors)
        obj.load_state_dict(onto_live(loaded, obj.state_dict()))


def onto_live(saved: Any, live: Any) -> Any:
    """``saved`` (tensors read into CPU memory) put where the live state keeps its tensors.

    A saved tensor whose live counterpart (same path in ``live``, the object's current
    ``state_dict()``) has its shape and dtype is copied into it, and the live tensor is handed
    back: state that lived on a GPU comes back there, in place, for objects whose
    ``load_state_dict`` keeps what it is given as well as for those that copy. Another saved
    tensor goes to its live counterpart's device; one with no counterpart stays on the CPU.
    """
    if isinstance(saved, torch.Tensor):
        if isinstance(live, torch.Tensor):
            if (
                live.shape == saved.shape
                and live.dtype == saved.dtype
                and live.device.type != "meta"
                and not live.is_inference()
            ):
                with torch.no_grad():
                    live.copy_(saved)
                return live
            return saved.to(live.device)
        return saved
    if isinstance(saved, dict) and isinstance(live, dict):
        return {k: onto_live(v, live.get(k)) for k, v in saved.items()}
    if isinstance(saved, (list, tuple)) and isinstance(live, (list, tuple)) and len(saved) == len(live):
        out = [onto_live(v, lv) for v, lv in zip(saved, live, strict=True)]
        return type(saved)(out) if isinstance(saved, tuple) else out
    return saved


def _load_dataloader(dataloader: Any, js: dict[str, Any], tensors: dict[str, Any], world: int) -> None:
    if not hasattr(dataloader, "load_state_dict"):
        raise UnsupportedError(NOT_RESUMABLE.format(type(dataloader).__name__))
    state = js.get("dataloader")
    if state is None:
        raise StateMismatchError("the checkpoint holds no dataloader position", missing=["dataloader"])
    value = from_json_value(state, "dataloader", tensors)
    from unickpt.data import ResumableDataLoader

    if js["world_size"] != world and not isinstance(dataloader, ResumableDataLoader):
        raise StateMismatchError(
            f"the dataloader ({type(dataloader).__name__}) keeps per-rank state saved by "
            f"{js['world_size']} rank(s); it cannot be resumed on {world}. Wrap a torch DataLoader with "
            "unickpt.data.wrap_dataloader (global sample position), or do not pass the dataloader "
            "to load() to start it afresh"
        )
    dataloader.load_state_dict(value)


def _rank_paths(step_dir: str, rank: int) -> tuple[str, str]:
    base = os.path.join(step_dir, TRAIN_STATE_DIR, f"rank-{rank:05d}")
    return base + ".json", base + ".safetensors"


def write_rank_state(
    stage: str,
    rank: int,
    js: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    scheduler: bytes | None = None,
    storage_options: dict[str, Any] | None = None,
) -> None:
    """Every rank: its JSON state and tensors, each written and fsynced atomically (one PUT
    each when ``stage`` is a URL), then their xxh3-64 hashes (and those of
    ``lr_scheduler.json``, written by rank 0) for ``unickpt verify``."""
    from safetensors.torch import save

    jpath, tpath = _rank_paths(stage, rank)
    tbytes = save(tensors, metadata={"format": "unickpt-train-state"})
    jbytes = json.dumps(js, sort_keys=True).encode()
    write_small_file(tpath, tbytes, storage_options)
    write_small_file(jpath, jbytes, storage_options)
    written = {os.path.relpath(tpath, stage): tbytes, os.path.relpath(jpath, stage): jbytes}
    if scheduler is not None:
        written[run_layout.SCHEDULER_NAME] = scheduler
    write_small_file(run_layout.hashes_path(stage, rank), run_layout.hashes_record(written), storage_options)


def read_rank_state(
    step_dir: str, rank: int, storage_options: dict[str, Any] | None = None
) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    """A rank's JSON state and tensors from a step directory or URL; (None, {}) when absent."""
    from safetensors.torch import load

    from unickpt.store.publish import read_small_file

    jpath, tpath = _rank_paths(step_dir, rank)
    try:
        raw = read_small_file(jpath, storage_options)
        js = strict_loads(raw.decode("utf-8"), IndexFileError, f"{jpath}: training state")
        tensors = load(read_small_file(tpath, storage_options, limit=1 << 30))
    except FileNotFoundError:
        return None, {}
    except IndexFileError:
        raise
    except (OSError, ValueError) as e:  # too large, not UTF-8, a malformed safetensors file
        raise IndexFileError(f"{jpath}: unreadable training state ({e})") from None
    if not isinstance(js, dict) or js.get("unickpt_train_state") != STATE_VERSION:
        raise IndexFileError(f"{jpath}: not a unickpt training state")
    for field in ("step", "rank", "world_size"):
        v = js.get(field)
        lo = 1 if field == "world_size" else 0
        if type(v) is not int or not lo <= v < 1 << 63:
            raise IndexFileError(
                f"{jpath}: training state field {shown(field)} must be an integer >= {lo} below 2^63, "
                f"found {shown(str(v)[:40])}"
            )
    return js, tensors
