"""The directory layout ``CheckpointManager`` writes, read from files alone (no torch).

A run directory holds ``step-<N>/`` directories; a step is committed iff its ``COMMIT`` marker
exists (see unickpt/manager/ and docs/guide.md). Inside a step::

    model/  optimizer/  lr_scheduler.json  train_state/rank-<r>.{json,safetensors}  hf/  COMMIT

Train-state files and ``lr_scheduler.json`` are not safetensors checkpoints with slice hashes,
so each rank also writes ``train_state/rank-<r>.hashes.json``: the xxh3-64 of every such file
it wrote (path relative to the step directory). Steps saved before these files existed have
none; their train state is checked for structure only.

This is the one definition of the layout's names and records: the manager (``_stepdirs.py``,
``unickpt/manager/``), ``convert --to run`` (``tools/run_layout.py``) and
the command line (``unickpt inspect``/``verify`` on a run or a step) use the functions here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import uuid
from typing import Any

from unickpt.errors import CheckpointFormatError, ConfigError
from unickpt.format.commit_store import write_small_file
from unickpt.format.hashing import slice_hash

__all__ = [
    "COMMIT_NAME",
    "LATEST_NAME",
    "TRAIN_STATE_DIR",
    "HASHES_SUFFIX",
    "HF_DIR",
    "SCHEDULER_NAME",
    "STEP_RE",
    "COMMIT_VERSION",
    "step_name",
    "work_name",
    "WORK_RE",
    "REPLACING_RE",
    "commit_record",
    "latest_record",
    "read_latest",
    "StepLayout",
    "step_of",
    "committed_steps",
    "latest_step",
    "read_commit",
    "looks_like_run",
    "step_layout",
    "write_hashes",
    "read_hashes",
]

COMMIT_NAME = "COMMIT"
LATEST_NAME = "latest"
TRAIN_STATE_DIR = "train_state"
SCHEDULER_NAME = "lr_scheduler.json"
HF_DIR = "hf"
HASHES_SUFFIX = ".hashes.json"
COMMIT_VERSION = 1
_HASHES_VERSION = 1
STEP_RE = re.compile(r"^step-(\d+)$")
# Hidden work directories of a local run: a save in progress, a step being replaced, a step being
# deleted, a remote step downloaded for loading (in the local cache of an fsspec URL).
WORK_RE = re.compile(r"^\.step-(\d+)\.(staging|old|deleting|download)-[0-9a-f]+$")
# Under an fsspec URL: a committed step saved again, uploaded beside it.
REPLACING_RE = re.compile(r"^\.step-(\d+)\.replacing-[0-9a-f]+$")
_STEP_RE = STEP_RE
_RANK_RE = re.compile(r"^rank-(\d+)\.(json|safetensors)$")


@dataclasses.dataclass
class StepLayout:
    """What one committed step directory holds (paths absolute; ``None`` where absent)."""

    path: str
    step: int
    commit: dict[str, Any]
    model: str | None
    optimizer: str | None
    scheduler: str | None
    hf: str | None
    train_state: dict[int, list[str]]  # rank -> its files (json, safetensors)
    hash_files: dict[int, str]  # rank -> its train_state/rank-<r>.hashes.json


def step_name(step: int) -> str:
    """The directory name of committed step ``step``."""
    return f"step-{step}"


def work_name(step: int, kind: str) -> str:
    """A fresh name ``.step-<N>.<kind>-<id>`` for a work directory (or prefix) of step ``step``."""
    return f".{step_name(step)}.{kind}-{uuid.uuid4().hex[:12]}"


def commit_record(step: int, world_size: int, plugin: str) -> bytes:
    """The contents of a step's ``COMMIT`` marker."""
    commit = {"unickpt_commit": COMMIT_VERSION, "step": step, "world_size": world_size, "plugin": plugin}
    return json.dumps(commit).encode()


def latest_record(step: int) -> bytes:
    """The contents of ``latest`` naming ``step``."""
    return json.dumps({"step": step}).encode()


def read_latest(run_dir: str | os.PathLike[str]) -> int | None:
    """The step recorded in ``latest``, or ``None``."""
    try:
        with open(os.path.join(os.fspath(run_dir), LATEST_NAME), "rb") as f:
            obj = json.loads(f.read())
        return int(obj["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def step_of(path: str | os.PathLike[str]) -> int | None:
    """``N`` when ``path`` is a directory named ``step-<N>``, else ``None``."""
    m = _STEP_RE.match(os.path.basename(os.path.normpath(os.fspath(path))))
    return int(m.group(1)) if m and os.path.isdir(path) else None


def committed_steps(run_dir: str | os.PathLike[str]) -> list[int]:
    """Committed steps of a run directory, ascending (a ``step-<N>`` with a ``COMMIT`` file)."""
    d = os.fspath(run_dir)
    try:
        names = os.listdir(d)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for n in names:
        m = _STEP_RE.match(n)
        if m and os.path.isfile(os.path.join(d, n, COMMIT_NAME)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_step(run_dir: str | os.PathLike[str]) -> int | None:
    """The step ``CheckpointManager.load`` resumes from: ``latest`` if it names a committed step, else the highest."""
    steps = committed_steps(run_dir)
    if not steps:
        return None
    rec = read_latest(run_dir)
    return rec if rec in steps else steps[-1]


def read_commit(step_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``COMMIT`` record of a step (``{}`` if unreadable), ``None`` if there is no marker."""
    path = os.path.join(os.fspath(step_dir), COMMIT_NAME)
    if not os.path.isfile(path):
        return None
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read())
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


def looks_like_run(path: str | os.PathLike[str]) -> bool:
    """A directory the manager wrote: a ``step-<N>`` directory, or one holding ``step-<N>``/``latest``."""
    p = os.fspath(path)
    if not os.path.isdir(p):
        return False
    try:
        names = os.listdir(p)
    except OSError:
        return False
    if any(
        n.endswith(".safetensors.index.json") or n in ("model.safetensors", "optimizer.safetensors")
        for n in names
    ):
        return False  # a checkpoint directory (which may be named step-<N> by its user)
    if step_of(p) is not None:
        return True
    return LATEST_NAME in names or any(_STEP_RE.match(n) for n in names)


def step_layout(step_dir: str | os.PathLike[str]) -> StepLayout:
    """The parts of a step directory (raises ``ConfigError``, a ``ValueError``, if it is not a committed step)."""
    d = os.path.abspath(os.fspath(step_dir))
    step = step_of(d)
    commit = read_commit(d)
    if step is None or commit is None:
        raise ConfigError(f"{d} is not a committed step directory (step-<N> with a {COMMIT_NAME} file)")

    def opt(name: str, isdir: bool) -> str | None:
        p = os.path.join(d, name)
        return p if (os.path.isdir(p) if isdir else os.path.isfile(p)) else None

    train: dict[int, list[str]] = {}
    hashes: dict[int, str] = {}
    ts = os.path.join(d, TRAIN_STATE_DIR)
    if os.path.isdir(ts):
        for n in sorted(os.listdir(ts)):
            if n.endswith(HASHES_SUFFIX) and n.startswith("rank-"):
                r = n[len("rank-") : -len(HASHES_SUFFIX)]
                if r.isdigit():
                    hashes[int(r)] = os.path.join(ts, n)
                continue
            m = _RANK_RE.match(n)
            if m:
                train.setdefault(int(m.group(1)), []).append(os.path.join(ts, n))
    return StepLayout(
        path=d,
        step=step,
        commit=commit,
        model=opt("model", True),
        optimizer=opt("optimizer", True),
        scheduler=opt(SCHEDULER_NAME, False),
        hf=opt(HF_DIR, True),
        train_state=train,
        hash_files=hashes,
    )


def hashes_path(step_dir: str, rank: int) -> str:
    return os.path.join(step_dir, TRAIN_STATE_DIR, f"rank-{rank:05d}{HASHES_SUFFIX}")


def write_hashes(
    step_dir: str, rank: int, files: dict[str, bytes], storage_options: dict[str, Any] | None = None
) -> None:
    """Record the xxh3-64 of the bytes written to ``files`` (paths relative to ``step_dir``, a
    local directory or a URL) for ``rank``."""
    record = {
        "unickpt_hashes": _HASHES_VERSION,
        "xxh3": {rel: slice_hash(data) for rel, data in sorted(files.items())},
    }
    write_small_file(
        hashes_path(step_dir, rank), json.dumps(record, sort_keys=True).encode(), storage_options
    )


def read_hashes(path: str) -> dict[str, str]:
    """``{relative path: xxh3-64}`` from a hashes file; ``ValueError`` (``CheckpointFormatError``) if it is malformed."""
    with open(path, "rb") as f:
        obj = json.loads(f.read())
    if not isinstance(obj, dict) or obj.get("unickpt_hashes") != _HASHES_VERSION:
        raise CheckpointFormatError("not a unickpt hashes file")
    table = obj.get("xxh3")
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in table.items()
    ):
        raise CheckpointFormatError("'xxh3' must map relative paths to hex digests")
    return table
