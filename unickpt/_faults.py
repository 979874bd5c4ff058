"""Named fault-injection points in the collective code paths, for distributed tests.

Each local phase of a collective method (the work a rank does between two collectives) calls
``maybe_fail("<stage>")``. When nothing is armed, that is one test of an empty set. A test
arms stages with ``UNICKPT_FAULTS="stage@rank,stage@rank"`` in the environment (read at
import), or with :func:`injected` / :func:`arm` in a running process; the named rank then raises
``InjectedFault`` there, as if that phase had failed on that rank only. A test checks that
every rank raises within seconds (no peer left waiting in a collective) and that no committed
checkpoint is damaged. ``rank`` may be ``*`` (every rank).

``STAGES`` lists every stage the library defines, so a test can prove it injected all of them
(``hits`` counts how often each armed stage was reached). :func:`tracing` records the stages an
operation reaches on this rank without failing, so a test injects exactly those.
"""

from __future__ import annotations

import collections
import contextlib
import os
from collections.abc import Iterable, Iterator

from unickpt.errors import ConfigError

__all__ = [
    "RANK0_ONLY",
    "STAGES",
    "InjectedFault",
    "arm",
    "armed",
    "armed_as",
    "count",
    "take_trace",
    "hits",
    "injected",
    "maybe_fail",
    "tracing",
]

STAGES: tuple[str, ...] = (
    # io/save.py: save_tensors
    "save.list",  # listing this rank's blocks
    "save.plan",  # planning files (every rank computes the same plan)
    "save.prepare",  # rank 0: lock + directory (rank 0 only)
    "save.write",  # writing this rank's files
    "save.hf_create",  # gathered saves (io/hf_save.py): rank 0 creates the staged files (rank 0 only)
    "save.hf_write",  # gathered saves: writing this rank's bytes into the staged files
    "save.commit",  # rank 0: the index (rank 0 only)
    # io/load.py: load_tensors
    "load.match",  # matching names/shapes, coverage, headers, verify
    "load.read",  # reading and copying
    # io/checkpoint_io.py
    "open",  # opening the checkpoint
    "model.plan",  # what this rank saves of the model
    "model.hf_config",  # rank 0: config.json beside the weights (rank 0 only)
    "optimizer.plan",  # this rank's optimizer state and param groups
    "optimizer.load.prepare",  # state slots and targets, param_groups validation
    "optimizer.load.apply",  # handing the loaded state to the optimizer
    "scheduler.save",  # rank 0: lr_scheduler.json (rank 0 only)
    "scheduler.load",  # every rank: reading and applying the scheduler state
    "replicas.digest",  # digests of replicated tensors, for the replica check
    # manager/ (checkpoint_manager.py, storage.py, snapshot.py)
    "manager.start",  # rank 0: lock and staging directory (rank 0 only)
    "manager.capture",  # state_dicts, RNG, dataloader, extra states
    "manager.train_state",  # this rank's training state file
    "manager.hf_copy",  # this rank's share of the Hugging Face copy (save_hf)
    "manager.commit",  # rank 0: COMMIT, rename, latest (rank 0 only)
    "manager.load.pick",  # rank 0: which step to resume (rank 0 only)
    "manager.load.train_state",  # this rank's RNG, dataloader and extra states
)

# Stages reached by rank 0 only: a test injects them there.
RANK0_ONLY: frozenset[str] = frozenset(
    {
        "save.prepare",
        "save.hf_create",
        "save.commit",
        "model.hf_config",
        "scheduler.save",
        "manager.start",
        "manager.commit",
        "manager.load.pick",
    }
)


class InjectedFault(RuntimeError):
    """The failure a test asked for at ``stage`` on this rank (deliberately not a UnickptError)."""

    def __init__(self, stage: str, rank: int) -> None:
        super().__init__(f"injected fault at stage {stage!r} on rank {rank}")
        self.stage = stage
        self.rank = rank

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.stage, self.rank))


def _parse(spec: str) -> frozenset[tuple[str, str]]:
    out = set()
    for item in spec.split(","):
        item = item.strip()
        if not item:
            continue
        stage, _, rank = item.partition("@")
        if stage not in STAGES:
            raise ConfigError(f"UNICKPT_FAULTS: unknown stage {stage!r}; stages: {', '.join(STAGES)}")
        out.add((stage, rank.strip() or "*"))
    return frozenset(out)


_armed: frozenset[tuple[str, str]] = _parse(os.environ.get("UNICKPT_FAULTS", ""))
hits: collections.Counter[str] = collections.Counter()
_TRACE = ("", "trace")  # armed marker of tracing(): never matches a stage
_trace: list[str] = []


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return int(dist.get_rank())
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    return int(os.environ.get("RANK", "0"))


def maybe_fail(stage: str) -> None:
    """Raise ``InjectedFault`` if ``stage`` is armed for this rank; otherwise do nothing."""
    if not _armed:
        return
    if _TRACE in _armed:
        _trace.append(stage)
        return
    r = _rank()
    if (stage, str(r)) in _armed or (stage, "*") in _armed:
        hits[stage] += 1
        raise InjectedFault(stage, r)


def arm(spec: str | Iterable[tuple[str, int | str]]) -> None:
    """Replace the armed stages: a ``"stage@rank,..."`` string or ``(stage, rank)`` pairs."""
    global _armed
    if isinstance(spec, str):
        _armed = _parse(spec)
    else:
        _armed = _parse(",".join(f"{s}@{r}" for s, r in spec))


@contextlib.contextmanager
def injected(stage: str, rank: int | str) -> Iterator[None]:
    """Arm ``stage@rank`` for the duration of the block."""
    global _armed
    old = _armed
    arm([(stage, rank)])
    try:
        yield
    finally:
        _armed = old


def armed() -> frozenset[tuple[str, str]]:
    """The armed stages, as :func:`armed_as` takes them (an async save's writer process runs under them)."""
    return _armed


@contextlib.contextmanager
def armed_as(state: frozenset[tuple[str, str]]) -> Iterator[None]:
    """Run the block with ``state`` (from :func:`armed` of another process) armed."""
    global _armed
    old = _armed
    _armed = state
    try:
        yield
    finally:
        _armed = old


def count(more: dict[str, int], trace: list[str]) -> None:
    """Add another process's hits and traced stages (an async save's writer) to this one's."""
    hits.update(more)
    _trace.extend(trace)


def take_trace() -> list[str]:
    """The stages traced so far in this process, cleared (a writer process sends them back)."""
    out = list(_trace)
    _trace.clear()
    return out


@contextlib.contextmanager
def tracing() -> Iterator[list[str]]:
    """Record, in order, every stage reached on this rank during the block (nothing fails)."""
    global _armed
    old = _armed
    _trace.clear()
    _armed = frozenset({_TRACE})
    out: list[str] = []
    try:
        yield out
    finally:
        out.extend(_trace)
        _trace.clear()
        _armed = old
