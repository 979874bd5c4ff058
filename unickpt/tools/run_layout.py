"""Write one committed ``step-<N>/`` of a ``CheckpointManager`` run directory from converted files.

The layout is the manager's (``unickpt/ckpt/run_layout.py``): ``step-<N>/model/``,
``optimizer/``, ``lr_scheduler.json``, ``train_state/rank-00000.{json,safetensors}``, then the
manager's own step commit (``store.publish.commit_step``: the ``COMMIT`` marker written last, the
staged directory put in place as ``step-<N>``, then ``latest``). ``CheckpointManager.load``
resumes from the result (tests/unit/tools/test_convert_training.py).

An imported step holds no RNG states (the source did not save them, or saved them in a form
unickpt does not read); the manager then leaves the RNGs as they are and says so.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from unickpt.ckpt.run_layout import (
    COMMIT_NAME,
    COMMIT_VERSION,
    LATEST_NAME,
    TRAIN_STATE_DIR,
    commit_record,
    work_name,
)
from unickpt.store.publish import atomic_write_bytes, commit_step, fsync_dir

__all__ = ["write_step", "COMMIT_NAME", "LATEST_NAME", "TRAIN_STATE_DIR", "STATE_VERSION"]

STATE_VERSION = COMMIT_VERSION  # the train-state files' version (the manager's STATE_VERSION)


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

    stage = os.path.join(run_dir, work_name(step, "staging"))
    os.makedirs(os.path.join(stage, TRAIN_STATE_DIR))
    fill(stage)
    # What fill created or renamed into the stage's directories is durable before COMMIT names it.
    for d, _, _ in os.walk(stage):
        fsync_dir(d)
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
    return commit_step(run_dir, stage, step, commit_record(step, world_size, plugin))
