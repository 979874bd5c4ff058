"""Write one committed ``step-<N>/`` of a ``CheckpointManager`` run directory from converted files.

The layout is the manager's (``unickpt/ckpt/run_layout.py``): ``step-<N>/model/``,
``optimizer/``, ``lr_scheduler.json``, ``train_state/rank-00000.{json,safetensors}``, then the
manager's own step commit: the step's ``COMMIT`` record written last, then ``latest`` (as
``store.publish.commit_step`` and ``RemoteStore.commit`` publish a step). Everything is written
into a tool's output (``store.publish.output_sink``): a staged local directory renamed into place
once ``latest`` is written, or an object-store prefix where the two records are the output's last
commit points (exclusive PUTs, after every other object). ``CheckpointManager.load`` resumes from
the result (tests/unit/tools/test_convert_training.py).

An imported step holds no RNG states (the source did not save them, or saved them in a form
unickpt does not read); the manager then leaves the RNGs as they are and says so.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from unickpt.ckpt.run_layout import (
    COMMIT_NAME,
    COMMIT_VERSION,
    LATEST_NAME,
    TRAIN_STATE_DIR,
    commit_record,
    latest_record,
    step_name,
)
from unickpt.store.publish import Sink

__all__ = ["write_step", "COMMIT_NAME", "LATEST_NAME", "TRAIN_STATE_DIR", "STATE_VERSION"]

STATE_VERSION = COMMIT_VERSION  # the train-state files' version (the manager's STATE_VERSION)


def write_step(
    run: Sink,
    step: int,
    fill: Callable[[Sink], None],
    *,
    extra: dict[str, Any],
    world_size: int,
    plugin: str,
) -> str:
    """Write ``step-<step>`` into the run output ``run``; ``fill(step_sink)`` writes ``model/``,
    ``optimizer/`` and ``lr_scheduler.json`` into it; then the train state (``step``, ``extra``
    as the manager's extra states, no RNG), the step's ``COMMIT`` and ``latest``, in that order,
    as commit points of ``run``. Returns the step directory's location."""
    from safetensors.numpy import save

    name = step_name(step)
    stage = run.within(name)
    fill(stage)
    state = stage.within(TRAIN_STATE_DIR)
    js = {
        "unickpt_train_state": STATE_VERSION,
        "step": step,
        "rank": 0,
        "world_size": world_size,
        "rng": None,
        "extra": extra,
    }
    state.put("rank-00000.safetensors", save({}, metadata={"format": "unickpt-train-state"}))
    state.put("rank-00000.json", json.dumps(js, sort_keys=True).encode())
    run.commit_later(f"{name}/{COMMIT_NAME}", commit_record(step, world_size, plugin))
    run.commit_later(LATEST_NAME, latest_record(step))
    return stage.url
