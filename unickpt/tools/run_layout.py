"""Write one committed ``step-<N>/`` of a ``CheckpointManager`` run directory from converted files.

The layout is the manager's (``unickpt/manager.py``): ``step-<N>/model/``, ``optimizer/``,
``lr_scheduler.json``, ``train_state/rank-00000.{json,safetensors}``, the ``COMMIT`` marker
written last, then one atomic rename of the staged directory to ``step-<N>``, then
``latest``. The tools layer may not import the manager (docs/architecture.md), so the file
names are repeated here; ``tests/unit/test_convert_run.py`` checks they agree with the
manager's constants and that ``CheckpointManager.load`` resumes from the result.

An imported step holds no RNG states (the source did not save them, or saved them in a form
unickpt does not read); the manager then leaves the RNGs as they are and says so.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable
from typing import Any

from unickpt.format.commit import atomic_write_bytes, fsync_dir

__all__ = ["write_step"]

COMMIT_NAME = "COMMIT"
LATEST_NAME = "latest"
TRAIN_STATE_DIR = "train_state"
STATE_VERSION = 1


def write_step(
    run_dir: str,
    step: int,
    fill: Callable[[str], None],
    *,
    extra: dict[str, Any],
    world_size: int,
    plugin: str,
) -> str:
    """Stage ``step-<step>`` in ``run_dir``; ``fill(stage)`` writes ``model/``, ``optimizer/`` and
    ``lr_scheduler.json`` into it; then the train state (``step``, ``extra`` as the manager's
    extra states, no RNG) and the commit. Returns the step directory."""
    from safetensors.numpy import save

    final = os.path.join(run_dir, f"step-{step}")
    stage = os.path.join(run_dir, f".step-{step}.staging-{uuid.uuid4().hex[:12]}")
    os.makedirs(os.path.join(stage, TRAIN_STATE_DIR))
    fill(stage)
    base = os.path.join(stage, TRAIN_STATE_DIR, "rank-00000")
    js = {
        "unickpt_train_state": STATE_VERSION,
        "step": step,
        "rank": 0,
        "world_size": world_size,
        "rng": None,
        "extra": extra,
    }
    atomic_write_bytes(base + ".safetensors", save({}, metadata={"format": "unickpt-train-state"}))
    atomic_write_bytes(base + ".json", json.dumps(js, sort_keys=True).encode())
    fsync_dir(os.path.join(stage, TRAIN_STATE_DIR))
    commit = {"unickpt_commit": STATE_VERSION, "step": step, "world_size": world_size, "plugin": plugin}
    atomic_write_bytes(os.path.join(stage, COMMIT_NAME), json.dumps(commit).encode())
    fsync_dir(stage)
    os.rename(stage, final)
    fsync_dir(run_dir)
    atomic_write_bytes(os.path.join(run_dir, LATEST_NAME), json.dumps({"step": step}).encode())
    return final
