"""The directory layout ``CheckpointManager`` writes: read from files alone, and a step written from converted files (no torch).

A run directory holds ``step-<N>/`` directories; a step is committed iff its ``COMMIT`` marker
exists (see unickpt/manager/ and docs/guide.md). Inside a step::

    model/  optimizer/  lr_scheduler.json  train_state/rank-<r>.{json,safetensors}  hf/  COMMIT

Train-state files and ``lr_scheduler.json`` are not safetensors checkpoints with slice hashes,
so each rank also writes ``train_state/rank-<r>.hashes.json``: the xxh3-64 of every such file
it wrote (path relative to the step directory). Steps saved before these files existed have
none; their train state is checked for structure only. The ``COMMIT`` record itself carries the
xxh3-64 of the step's side files (``config.json``/``generation_config.json`` beside ``model/`` and
in ``hf/``, ``lr_scheduler.json``; :func:`commit_record`); records written before have none.

A run or step may live at a URL (``s3://...``): the readers below take an optional
:class:`~unickpt.ckpt.run_files.RunFiles` (one listing of the location, shared by the calls of
one command) and work the same there; without one, a local path is read with ``os`` calls.

This is the one definition of the layout's names and records: the manager (``store/publish.py``,
``unickpt/manager/``), ``convert --to run`` (:func:`write_step`) and
the command line (``unickpt inspect``/``verify`` on a run or a step) use the functions here.

**A step written from converted files** (:func:`write_step`, for ``convert --to run``): one committed
``step-<N>/``: ``model/``, ``optimizer/``, ``lr_scheduler.json``, ``train_state/rank-00000.{json,safetensors}``, then the
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

import dataclasses
import json
import os
import re
from collections.abc import Callable
from typing import Any

from unickpt.ckpt.run_files import RunFiles
from unickpt.errors import CheckpointFormatError, ConfigError
from unickpt.spec.hashing import slice_hash
from unickpt.spec.index import KINDS
from unickpt.spec.naming import INDEX_SUFFIX, index_name, single_name
from unickpt.spec.run_names import (
    COMMIT_NAME,
    COMMIT_VERSION,
    HASHES_SUFFIX,
    HF_DIR,
    LATEST_NAME,
    MAX_STEP,
    REPLACING_RE,
    SCHEDULER_NAME,
    SIDE_FILE_NAMES,
    STEP_RE,
    TRAIN_STATE_DIR,
    WORK_RE,
    commit_hashes,
    commit_record,
    latest_record,
    side_files_of,
    step_name,
    work_name,
)
from unickpt.spec.untrusted import strict_loads
from unickpt.store.publish import Sink
from unickpt.store.storage import shown_location

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
    "side_files_of",
    "commit_hashes",
    "SIDE_FILE_NAMES",
    "latest_record",
    "read_latest",
    "read_record",
    "MAX_STEP",
    "StepLayout",
    "step_of",
    "committed_steps",
    "latest_step",
    "read_commit",
    "looks_like_run",
    "step_layout",
    "hashes_record",
    "read_hashes",
    "write_step",
    "STATE_VERSION",
]


_HASHES_VERSION = 1
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


def _view(path: str, files: RunFiles | None) -> RunFiles:
    return files if files is not None else RunFiles(path)


def read_latest(run_dir: str | os.PathLike[str], files: RunFiles | None = None) -> int | None:
    """The step recorded in ``latest``, or ``None``."""
    d = shown_location(run_dir)
    view = _view(d, files)
    try:
        obj = read_record(view, view.join(d, LATEST_NAME), 1 << 20)
    except (OSError, ValueError):
        return None
    step = obj.get("step") if isinstance(obj, dict) else None
    # A step number as save writes it: a JSON integer (not true, 2.0, "2" or Infinity) that names
    # a directory step-<N> (so below 2^63); anything else is no record.
    return step if type(step) is int and 0 <= step < MAX_STEP else None


def read_record(view: RunFiles, path: str, limit: int) -> Any:
    """A small JSON record of a run (``latest``, ``COMMIT``, a hashes file, a train state):
    at most ``limit`` bytes (``OSError`` past it), UTF-8, no duplicate key, nested at most as
    deep as the parser allows (``CheckpointFormatError``, a ``ValueError``, naming ``path``)."""
    raw = view.read_bytes(path, limit=limit)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{path}: not valid UTF-8 ({e})") from None
    return strict_loads(text, CheckpointFormatError, path)


def step_of(path: str | os.PathLike[str], files: RunFiles | None = None) -> int | None:
    """``N`` when ``path`` is a directory named ``step-<N>``, else ``None``."""
    p = shown_location(path)
    view = _view(p, files)
    m = _STEP_RE.match(view.basename(p))
    if not m:
        return None
    return int(m.group(1)) if view.is_dir(p) else None


def committed_steps(run_dir: str | os.PathLike[str], files: RunFiles | None = None) -> list[int]:
    """Committed steps of a run directory, ascending (a ``step-<N>`` with a ``COMMIT`` file)."""
    d = shown_location(run_dir)
    view = _view(d, files)
    out = []
    for n in view.listdir(d):
        m = _STEP_RE.match(n)
        if m and view.is_file(view.join(d, n, COMMIT_NAME)):
            out.append(int(m.group(1)))
    return sorted(out)


def latest_step(run_dir: str | os.PathLike[str], files: RunFiles | None = None) -> int | None:
    """The step ``CheckpointManager.load`` resumes from: ``latest`` if it names a committed step, else the highest."""
    d = shown_location(run_dir)
    view = _view(d, files)
    steps = committed_steps(d, view)
    if not steps:
        return None
    rec = read_latest(d, view)
    return rec if rec in steps else steps[-1]


def read_commit(step_dir: str | os.PathLike[str], files: RunFiles | None = None) -> dict[str, Any] | None:
    """The ``COMMIT`` record of a step (``{}`` if unreadable), ``None`` if there is no marker."""
    d = shown_location(step_dir)
    view = _view(d, files)
    path = view.join(d, COMMIT_NAME)
    if not view.is_file(path):
        return None
    try:
        obj = read_record(view, path, 1 << 20)
    except (OSError, ValueError):
        return {}
    return obj if isinstance(obj, dict) else {}


#: Indexes whose presence makes a URL a checkpoint, never a run (checked before any listing).
_CHECKPOINT_INDEXES = tuple(index_name(kind) for kind in KINDS)
_CHECKPOINT_SINGLES = tuple(single_name(kind) for kind in KINDS)


def looks_like_run(path: str | os.PathLike[str]) -> bool:
    """A directory the manager wrote: a ``step-<N>`` directory, or one holding ``step-<N>``/``latest``.

    At a URL, a location holding a checkpoint's index is recognised by a metadata request for it,
    before anything is listed (``inspect`` on a checkpoint URL reads only its index).
    """
    view = RunFiles(path)  # (on a store: drops listings cached by earlier calls)
    p, storage = view.root, view.storage
    if any(storage.exists(storage.join(p, n)) for n in _CHECKPOINT_INDEXES):
        return False
    names = storage.listdir(p)  # one level (on a store a delimited listing), never the whole run
    if not names and storage.what(p) != "directory":
        return False  # nothing there, or a file (an object store has no empty directories)
    if any(n.endswith(INDEX_SUFFIX) or n in _CHECKPOINT_SINGLES for n in names):
        return False  # a checkpoint directory (which may be named step-<N> by its user)
    if _STEP_RE.match(view.basename(p)):
        return True
    return LATEST_NAME in names or any(_STEP_RE.match(n) for n in names)


def step_layout(step_dir: str | os.PathLike[str], files: RunFiles | None = None) -> StepLayout:
    """The parts of a step directory (raises ``ConfigError``, a ``ValueError``, if it is not a committed step)."""
    d = shown_location(step_dir)
    view = _view(d, files)
    step = step_of(d, view)
    commit = read_commit(d, view)
    if step is None or commit is None:
        raise ConfigError(f"{d} is not a committed step directory (step-<N> with a {COMMIT_NAME} file)")

    def opt(name: str, isdir: bool) -> str | None:
        p = view.join(d, name)
        return p if (view.is_dir(p) if isdir else view.is_file(p)) else None

    train: dict[int, list[str]] = {}
    hashes: dict[int, str] = {}
    ts = view.join(d, TRAIN_STATE_DIR)
    if view.is_dir(ts):
        for n in view.listdir(ts):
            if n.endswith(HASHES_SUFFIX) and n.startswith("rank-"):
                r = n[len("rank-") : -len(HASHES_SUFFIX)]
                if r.isdigit():
                    hashes[int(r)] = view.join(ts, n)
                continue
            m = _RANK_RE.match(n)
            if m:
                train.setdefault(int(m.group(1)), []).append(view.join(ts, n))
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


def hashes_record(files: dict[str, bytes]) -> bytes:
    """The hashes file of a rank (written at :func:`hashes_path`): the xxh3-64 of the bytes
    written to ``files`` (paths relative to the step directory)."""
    record = {
        "unickpt_hashes": _HASHES_VERSION,
        "xxh3": {rel: slice_hash(data) for rel, data in sorted(files.items())},
    }
    return json.dumps(record, sort_keys=True).encode()


def read_hashes(path: str, files: RunFiles | None = None) -> dict[str, str]:
    """``{relative path: xxh3-64}`` from a hashes file; ``ValueError`` (``CheckpointFormatError``) if it is malformed."""
    obj = read_record(_view(path, files), path, 64 << 20)
    if not isinstance(obj, dict) or obj.get("unickpt_hashes") != _HASHES_VERSION:
        raise CheckpointFormatError("not a unickpt hashes file")
    table = obj.get("xxh3")
    if not isinstance(table, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in table.items()
    ):
        raise CheckpointFormatError("'xxh3' must map relative paths to hex digests")
    return table


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
