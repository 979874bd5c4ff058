"""The names and records of the directory layout ``CheckpointManager`` writes (no I/O, no torch).

A run directory holds ``step-<N>/`` directories; a step is committed iff its ``COMMIT`` marker
exists. The names here are the layout's one definition: the manager's publishing
(``store/publish.py``) writes them, ``ckpt/run_layout.py`` reads a run from files with them.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from unickpt.errors import CheckpointFormatError
from unickpt.spec.hashing import slice_hash

__all__ = [
    "COMMIT_NAME",
    "LATEST_NAME",
    "TRAIN_STATE_DIR",
    "SCHEDULER_NAME",
    "MAX_STEP",
    "HF_DIR",
    "HASHES_SUFFIX",
    "SIDE_FILE_NAMES",
    "COMMIT_VERSION",
    "STEP_RE",
    "WORK_RE",
    "REPLACING_RE",
    "step_name",
    "work_name",
    "commit_record",
    "side_files_of",
    "commit_hashes",
    "latest_record",
]

COMMIT_NAME = "COMMIT"
LATEST_NAME = "latest"
TRAIN_STATE_DIR = "train_state"
SCHEDULER_NAME = "lr_scheduler.json"
#: Step numbers are below this (``latest`` naming another is no record).
MAX_STEP = 1 << 63
HF_DIR = "hf"
HASHES_SUFFIX = ".hashes.json"
#: A Hugging Face model's config files, saved beside ``model/`` and in ``hf/``.
SIDE_FILE_NAMES = ("config.json", "generation_config.json")
COMMIT_VERSION = 1
STEP_RE = re.compile(r"^step-(\d+)$")
# Hidden work directories of a local run: a save in progress, a step being replaced, a step being
# deleted, a remote step downloaded for loading (in the local cache of an fsspec URL).
WORK_RE = re.compile(r"^\.step-(\d+)\.(staging|old|deleting|download)-[0-9a-f]+$")
# Under an fsspec URL: a committed step saved again, uploaded beside it.
REPLACING_RE = re.compile(r"^\.step-(\d+)\.replacing-[0-9a-f]+$")


def step_name(step: int) -> str:
    """The directory name of committed step ``step``."""
    return f"step-{step}"


def work_name(step: int, kind: str) -> str:
    """A fresh name ``.step-<N>.<kind>-<id>`` for a work directory (or prefix) of step ``step``."""
    return f".{step_name(step)}.{kind}-{uuid.uuid4().hex[:12]}"


def commit_record(
    step: int, world_size: int, plugin: str, side_files: dict[str, bytes] | None = None
) -> bytes:
    """The contents of a step's ``COMMIT`` marker.

    ``side_files`` (path relative to the step -> the bytes written there) are the step's small
    files that carry no other hash: ``config.json``/``generation_config.json`` beside the model
    and in ``hf/``, ``lr_scheduler.json``. Their xxh3-64 goes in the record's ``"xxh3"`` table
    (records written before it have none: those files are checked for structure only).
    """
    commit: dict[str, Any] = {
        "unickpt_commit": COMMIT_VERSION,
        "step": step,
        "world_size": world_size,
        "plugin": plugin,
    }
    if side_files:
        commit["xxh3"] = {rel: slice_hash(data) for rel, data in sorted(side_files.items())}
    return json.dumps(commit).encode()


def side_files_of(config: dict[str, str], scheduler: bytes | None, with_hf: bool) -> dict[str, bytes]:
    """The side files a manager step holds (for :func:`commit_record`): the model's config files
    beside ``model/`` (and in ``hf/`` when ``with_hf``), and ``lr_scheduler.json``."""
    out: dict[str, bytes] = {}
    for fname, text in config.items():
        for d in ("model",) + ((HF_DIR,) if with_hf else ()):
            out[f"{d}/{fname}"] = text.encode("utf-8")
    if scheduler is not None:
        out[SCHEDULER_NAME] = scheduler
    return out


def commit_hashes(commit: dict[str, Any]) -> dict[str, str] | None:
    """The ``"xxh3"`` table of a ``COMMIT`` record, ``None`` for a record written before it
    existed; ``CheckpointFormatError`` (a ``ValueError``) when it is malformed."""
    table = commit.get("xxh3")
    if table is None:
        return None
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in table.items()
    ):
        raise CheckpointFormatError("'xxh3' must map relative paths to hex digests")
    return table


def latest_record(step: int) -> bytes:
    """The contents of ``latest`` naming ``step``."""
    return json.dumps({"step": step}).encode()
