"""``CheckpointManager``: periodic saves, exact resume, async save, atomic commit, retention.

Layout of ``checkpoint_dir``::

    step-<N>/                      one committed checkpoint (COMMIT marker inside)
        model/                     sliced model checkpoint (every rank writes its own blocks)
        optimizer/                 sliced optimizer checkpoint
        lr_scheduler.json          rank 0
        train_state/rank-<r>.json  per rank: step, RNG (Python, numpy), dataloader position, extra states
        train_state/rank-<r>.safetensors   per rank: torch RNG byte tensors, tensors of extra states
        hf/                        merged Hugging Face copy (save_hf=True)
        COMMIT                     written last, before the directory is renamed into place
    latest                         {"step": N}: moved only after step-<N> is committed
    .step-<N>.staging-<id>/        a save in progress (or killed): never loaded, removed by a later save

A save is staged under ``.step-<N>.staging-<id>``; every rank fsyncs what it wrote; rank 0
writes ``COMMIT``, fsyncs, renames the directory to ``step-<N>`` (one atomic rename), fsyncs
``checkpoint_dir``, then replaces ``latest`` atomically and only then applies ``keep_last``.
A process killed at any moment therefore leaves every committed step intact. Saves into one
directory are serialised by a lock file (``CheckpointBusyError`` for a second manager).

Every public method is collective: every rank calls it, in the same order, with its own
objects. Rank 0 does the directory work; every rank writes its own tensor blocks and state.

Async saves (``async_save=True``): ``save`` runs the cross-rank planning and copies this
rank's tensor blocks to CPU memory in the foreground, then a background thread writes,
fsyncs and commits. The background thread talks to the other ranks only through a second
gloo process group created once when the manager is built (``dist.new_group``), never
through the training's group, so it cannot interleave with the training's collectives. One
save is in flight at most; its error is raised by the next ``save`` or ``wait``.

Remote storage (``checkpoint_dir`` an fsspec URL other than ``file://``): object stores have no
atomic rename, so nothing is ever renamed or moved there. Every rank stages its files in its
own local directory (``<local_cache_dir>/rank-<r>/``, default a temporary directory) exactly as
above, then uploads them to ``<url>/step-<N>/`` file by file; rank 0 first deletes ``step-*``
prefixes without ``COMMIT`` and an existing ``step-<N>`` (``COMMIT`` first). Once every rank has
uploaded everything, rank 0 uploads ``COMMIT`` last, then ``latest``, then applies ``keep_last``
(deleting ``COMMIT`` first). A step is committed iff its ``COMMIT`` object exists; readers ignore
the others. Guarantees rest on whole-object PUTs and consistent listings (S3, GCS); limits: no
lock between writers, re-saving an existing step is not atomic, and each rank downloads the
whole step (but ``hf/`` and other ranks' states) to load it. See docs/guide.md, "Storage".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import posixpath
import re
import shutil
import tempfile
import threading
import uuid
import weakref
from collections.abc import Callable
from typing import Any

import torch

from unickpt import _rng
from unickpt._logging import get_logger
from unickpt.errors import (
    IncompleteCheckpointError,
    IndexFileError,
    StateMismatchError,
    UnsupportedError,
)
from unickpt.format.commit import atomic_write_bytes, directory_lock, fsync_dir
from unickpt.io import _dist
from unickpt.io.checkpoint_io import SavePayload, hf_config_files, lr_scheduler_json
from unickpt.io.jsonstate import from_json_value, to_json_value

__all__ = ["CheckpointManager"]

logger = get_logger(__name__)

COMMIT_NAME = "COMMIT"
LATEST_NAME = "latest"
TRAIN_STATE_DIR = "train_state"
HF_DIR = "hf"
_STEP_RE = re.compile(r"^step-(\d+)$")
# Hidden work directories: a save in progress, a step being replaced, a step being deleted.
# (``download``: a remote step fetched for loading, in the local cache of an fsspec URL.)
_WORK_RE = re.compile(r"^\.step-(\d+)\.(staging|old|deleting|download)-[0-9a-f]+$")
_STATE_VERSION = 1
# Shard size of the sliced model/optimizer files (MB): the same for sync and async saves.
_SHARD_MB = 1024


@dataclasses.dataclass
class _Payload:
    """Everything one rank writes for one step (tensors already copied for an async save)."""

    step: int
    stage: str
    model: SavePayload
    optimizer: SavePayload | None
    scheduler: bytes | None  # lr_scheduler.json contents
    train_state: dict[str, Any]
    state_tensors: dict[str, torch.Tensor]
    hf_config: dict[str, str]


class CheckpointManager:
    """Save every ``save_steps`` steps, keep the last ``keep_last``, resume exactly.

    Args:
        checkpoint_dir: a local directory (created if needed; ``file://`` URLs too), or an fsspec
            URL (``s3://``, ``gs://``, ``memory://``...): see "Remote storage" in the module docstring.
        booster: the ``Booster`` whose plugin's CheckpointIO saves the model and optimizer;
            ``None`` means one process with a ``GeneralCheckpointIO``.
        save_steps: ``save(step)`` saves when ``step % save_steps == 0`` (or ``force=True``).
        keep_last: committed steps to keep (oldest deleted after a new commit); ``None`` or 0 keeps all.
        async_save: write in a background thread (see the module docstring).
        save_hf: also write a merged Hugging Face copy of the model into ``step-<N>/hf``.
        local_cache_dir: fsspec URLs only: where each rank stages a save and downloads a step
            to load (``<local_cache_dir>/rank-<r>/``); default a temporary directory per process,
            removed when the manager is garbage collected.
        storage_options: fsspec URLs only: passed to the fsspec filesystem (credentials, endpoint).

    Built by every rank (with ``async_save`` it creates a process group: collective).
    """

    def __init__(
        self,
        checkpoint_dir: str | os.PathLike[str],
        booster: Any = None,
        save_steps: int = 100,
        keep_last: int | None = 3,
        async_save: bool = False,
        save_hf: bool = False,
        local_cache_dir: str | os.PathLike[str] | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.booster = booster
        if booster is not None:
            self.io = booster.checkpoint_io
        else:
            from unickpt.io import GeneralCheckpointIO

            self.io = GeneralCheckpointIO()
        self._remote: _RemoteStore | None = None
        if _is_remote(checkpoint_dir):
            self._remote = _RemoteStore(os.fspath(checkpoint_dir), storage_options)
            self.checkpoint_dir = self._remote.url
            if local_cache_dir is None:
                base = tempfile.mkdtemp(prefix="unickpt-cache-")
                weakref.finalize(self, shutil.rmtree, base, True)
            else:
                base = os.path.abspath(os.fspath(local_cache_dir))
            # One directory per rank: ranks never share (or upload) each other's local files.
            self._root = os.path.join(base, f"rank-{_dist.rank(self.io.group):05d}")
        else:
            if local_cache_dir is not None or storage_options is not None:
                raise ValueError(
                    "local_cache_dir and storage_options are for fsspec URLs; "
                    f"{os.fspath(checkpoint_dir)!r} is a local directory"
                )
            self.checkpoint_dir = _local_dir(checkpoint_dir)
            self._root = self.checkpoint_dir
        if save_steps < 1:
            raise ValueError(f"save_steps must be a positive number of steps, got {save_steps}")
        if keep_last is not None and keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 or None keeps all), got {keep_last}")
        self.save_steps = save_steps
        self.keep_last = keep_last or None
        self.async_save = async_save
        # CPU buffers of the async snapshot, reused from one save to the next (one save in flight).
        self._staging: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
        self.save_hf = save_hf
        self.group = self.io.group
        self._bg_group: Any = None
        if async_save and _dist.is_distributed(self.group):
            import torch.distributed as dist

            ranks = None if self.group is None else dist.get_process_group_ranks(self.group)
            self._bg_group = dist.new_group(ranks=ranks, backend="gloo")
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = contextlib.ExitStack()

    # ------------------------------------------------------------------ queries
    def all_steps(self) -> list[int]:
        """Committed steps in ascending order (files only; any rank may call)."""
        if self._remote is not None:
            return self._remote.committed_steps()
        return _committed_steps(self.checkpoint_dir)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` (files only; any rank may call).

        The ``latest`` record wins when it names a committed step (after a resume from an older
        step, it is the most recent save); otherwise the highest committed step.
        """
        steps = self.all_steps()
        if not steps:
            return None
        rec = self._remote.read_latest() if self._remote is not None else _read_latest(self.checkpoint_dir)
        return rec if rec in steps else steps[-1]

    def step_dir(self, step: int) -> str:
        """The path (local) or URL (fsspec) of ``step-<step>``."""
        if self._remote is not None:
            return f"{self._remote.url}/step-{step}"
        return os.path.join(self.checkpoint_dir, f"step-{step}")

    # ------------------------------------------------------------------ load
    def load(
        self,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        resume_from_checkpoint: int | str | None = "latest",
        **extra_states: Any,
    ) -> int:
        """Collective: restore a committed step into the given objects; returns that step (0: none).

        ``resume_from_checkpoint``: ``None`` loads nothing; an int loads that step (the latest
        committed one, with a warning, if it is not there); ``"latest"`` the newest committed
        step. Rank 0 picks the step and tells the others. Model and optimizer load through the
        resharding path (any saved layout); RNG states, dataloader position and extra states
        come from this rank's own file when the world size is unchanged.
        """
        self.wait()
        if resume_from_checkpoint is None:
            return 0
        if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint != "latest":
            raise ValueError(
                f"resume_from_checkpoint must be None, an int step or 'latest', got {resume_from_checkpoint!r}"
            )
        step = 0
        if _dist.rank(self.group) == 0:
            step = self._pick_step(resume_from_checkpoint) or 0
        step = int(_dist.broadcast_object(step, 0, self.group))
        if step == 0:
            return 0
        logger.info("resuming from %s", self.step_dir(step))
        if self._remote is None:
            self._load_step(
                self.step_dir(step), step, model, optimizer, lr_scheduler, dataloader, extra_states
            )
            return step
        d = os.path.join(self._root, f".step-{step}.download-{uuid.uuid4().hex[:12]}")
        err: BaseException | None = None
        try:
            os.makedirs(self._root, exist_ok=True)
            _clean_work_dirs(self._root)
            self._remote.download_step(step, d, _dist.rank(self.group))
        except BaseException as e:
            err = e
        try:
            _dist.agree(err, f"downloading {self.step_dir(step)}", self.group)
            self._load_step(d, step, model, optimizer, lr_scheduler, dataloader, extra_states)
        finally:
            shutil.rmtree(d, ignore_errors=True)
        return step

    def _load_step(
        self,
        d: str,
        step: int,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any,
        dataloader: Any,
        extra_states: dict[str, Any],
    ) -> None:
        """Collective: load the local step directory ``d``."""
        self.io.load_model(model, os.path.join(d, "model"))
        if optimizer is not None:
            self.io.load_optimizer(optimizer, os.path.join(d, "optimizer"))
        if lr_scheduler is not None:
            self.io.load_lr_scheduler(lr_scheduler, os.path.join(d, "lr_scheduler.json"))
        self._load_train_state(d, step, dataloader, extra_states)

    def _pick_step(self, wanted: int | str) -> int | None:
        latest = self.latest_step()
        if wanted == "latest":
            return latest
        if int(wanted) in self.all_steps():
            return int(wanted)
        logger.warning(
            "step %s is not a committed checkpoint in %s; resuming from the latest committed step %s",
            wanted,
            self.checkpoint_dir,
            latest,
        )
        return latest

    def _load_train_state(self, d: str, step: int, dataloader: Any, extra_states: dict[str, Any]) -> None:
        rank, world = _dist.rank(self.group), _dist.world_size(self.group)
        js, tensors = _read_rank_state(d, rank)
        err: BaseException | None = None
        try:
            if js is None:
                saved_world = _read_commit(d).get("world_size", "?")
                logger.warning(
                    "step %s was saved by %s rank(s), this is rank %s of %s: RNG states are not restored "
                    "and per-rank states come from rank 0",
                    step,
                    saved_world,
                    rank,
                    world,
                )
                js, tensors = _read_rank_state(d, 0)
                if js is None:
                    raise IncompleteCheckpointError(f"{d}: no train state for rank 0")
            elif js.get("rng") is None:
                # a step imported by `unickpt convert --to run`: the source saved no RNG states
                logger.warning("step %s holds no RNG states (imported): RNG states are not restored", step)
            elif int(js["world_size"]) == world:
                _rng.restore_rng(js["rng"], tensors)
            else:
                logger.warning(
                    "step %s was saved by %s rank(s), resumed on %s: RNG states are not restored",
                    step,
                    js["world_size"],
                    world,
                )
            if dataloader is not None:
                self._load_dataloader(dataloader, js, tensors, world)
            saved_extra = js.get("extra", {})
            for name, obj in extra_states.items():
                if name not in saved_extra:
                    raise StateMismatchError(
                        f"extra state {name!r} is not in {d} (saved: {sorted(saved_extra)})",
                        missing=[name],
                    )
                obj.load_state_dict(_decode(saved_extra[name], tensors))
        except BaseException as e:
            err = e
        _dist.agree(err, f"loading the training state of {d}", self.group)

    def _load_dataloader(
        self, dataloader: Any, js: dict[str, Any], tensors: dict[str, Any], world: int
    ) -> None:
        if not hasattr(dataloader, "load_state_dict"):
            raise UnsupportedError(_NOT_RESUMABLE.format(type(dataloader).__name__))
        state = js.get("dataloader")
        if state is None:
            raise StateMismatchError("the checkpoint holds no dataloader position", missing=["dataloader"])
        value = _decode(state, tensors)
        from unickpt.data import ResumableDataLoader

        if int(js["world_size"]) != world and not isinstance(dataloader, ResumableDataLoader):
            raise StateMismatchError(
                f"the dataloader ({type(dataloader).__name__}) keeps per-rank state saved by "
                f"{js['world_size']} rank(s); it cannot be resumed on {world}. Wrap a torch DataLoader with "
                "unickpt.data.wrap_dataloader (global sample position), or do not pass the dataloader "
                "to load() to start it afresh"
            )
        dataloader.load_state_dict(value)

    # ------------------------------------------------------------------ save
    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any = None,
        dataloader: Any = None,
        force: bool = False,
        **extra_states: Any,
    ) -> bool:
        """Collective: save when ``step % save_steps == 0`` or ``force``; returns whether it saved.

        Synchronous: returns once ``step-<N>`` is committed on disk. Async: returns once this
        rank's tensors are copied; an earlier save still in flight is waited for first, and its
        error (if any) is raised here.
        """
        if not force and step % self.save_steps != 0:
            return False
        self.wait()
        rank = _dist.rank(self.group)
        stage_name = f".step-{step}.staging-{uuid.uuid4().hex[:12]}" if rank == 0 else ""
        stage_name = _dist.broadcast_object(stage_name, 0, self.group)
        stage = os.path.join(self._root, stage_name)
        err: BaseException | None = None
        if self._remote is not None:
            try:
                self._start_remote_save(step, stage, rank)
            except BaseException as e:
                err = e
        elif rank == 0:
            try:
                os.makedirs(self.checkpoint_dir, exist_ok=True)
                self._lock.enter_context(directory_lock(self.checkpoint_dir))
                _clean_work_dirs(self.checkpoint_dir)
                os.makedirs(os.path.join(stage, TRAIN_STATE_DIR))
            except BaseException as e:
                err = e
        try:
            _dist.agree(err, f"starting the save of step {step} in {self.checkpoint_dir}", self.group)
            payload = self._capture(step, stage, model, optimizer, lr_scheduler, dataloader, extra_states)
        except BaseException:
            self._release()
            raise
        if not self.async_save:
            self._write(payload, self.group, model)
            return True
        thread = threading.Thread(
            target=self._background, args=(payload,), name=f"unickpt-save-step-{step}", daemon=True
        )
        self._thread = thread
        thread.start()
        return True

    def _start_remote_save(self, step: int, stage: str, rank: int) -> None:
        """Every rank: its local staging directory; rank 0 clears ``step-<step>`` and dead uploads."""
        os.makedirs(self._root, exist_ok=True)
        _clean_work_dirs(self._root)
        # Every rank writes into its own local copy of the stage, so every rank creates the
        # directories the writers expect (on a shared directory rank 0 alone creates them).
        for sub in (TRAIN_STATE_DIR, "model", "optimizer", HF_DIR):
            os.makedirs(os.path.join(stage, sub))
        if rank == 0 and self._remote is not None:
            self._remote.prepare(step)

    def wait(self) -> None:
        """Collective for async saves: block until the save in flight is committed; raise its error."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join()
        err, self._error = self._error, None
        if err is not None:
            raise err

    def _background(self, payload: _Payload) -> None:
        try:
            self._write(payload, self._bg_group, None)
        except BaseException as e:  # surfaced by the next save()/wait()
            logger.error("async save of step %s failed: %s", payload.step, e)
            self._error = e

    def _release(self) -> None:
        self._lock.close()
        self._lock = contextlib.ExitStack()

    # ------------------------------------------------------------------ capture (foreground)
    def _capture(
        self,
        step: int,
        stage: str,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any,
        dataloader: Any,
        extra_states: dict[str, Any],
    ) -> _Payload:
        copy = self.async_save
        err: BaseException | None = None
        model_plan = optim_plan = None
        sched = None
        state: dict[str, Any] = {}
        state_tensors: dict[str, torch.Tensor] = {}
        hf_config: dict[str, str] = {}
        try:
            model_plan = self.io.plan_model(model)
            if copy:
                model_plan = model_plan.snapshot(self._staging.setdefault("model", {}))
            if lr_scheduler is not None:
                sched = lr_scheduler_json(lr_scheduler.state_dict())
            rng_js, state_tensors = _rng.capture_rng()
            state = {
                "unickpt_train_state": _STATE_VERSION,
                "step": step,
                "rank": _dist.rank(self.group),
                "world_size": _dist.world_size(self.group),
                "rng": rng_js,
                "extra": {},
            }
            if dataloader is not None:
                if not hasattr(dataloader, "state_dict"):
                    raise UnsupportedError(_NOT_RESUMABLE.format(type(dataloader).__name__))
                state["dataloader"] = _encode(dataloader.state_dict(), "dataloader", state_tensors)
            for name, obj in extra_states.items():
                if not hasattr(obj, "state_dict") or not hasattr(obj, "load_state_dict"):
                    raise UnsupportedError(
                        f"extra state {name!r} ({type(obj).__name__}) has no state_dict()/load_state_dict()"
                    )
                state["extra"][name] = _encode(obj.state_dict(), f"extra.{name}", state_tensors)
            hf_config = hf_config_files(self.io.unwrap_model(model))
        except BaseException as e:
            err = e
        _dist.agree(err, f"capturing the state of step {step}", self.group)
        # Optimizer planning gathers param groups from every rank: always in the foreground.
        if optimizer is not None:
            optim_plan = self.io.plan_optimizer(optimizer)
            if copy:
                optim_plan = optim_plan.snapshot(self._staging.setdefault("optimizer", {}))
        if model_plan is None:  # pragma: no cover - agree() raised already
            raise RuntimeError("internal: no model plan after a successful capture")
        return _Payload(step, stage, model_plan, optim_plan, sched, state, state_tensors, hf_config)

    # ------------------------------------------------------------------ write + commit
    def _write(self, p: _Payload, group: Any, model: torch.nn.Module | None) -> None:
        """Collective over ``group``: write the staged step, then rank 0 commits it."""
        rank = _dist.rank(group)
        try:
            for kind, plan in (("model", p.model), ("optimizer", p.optimizer)):
                if plan is None:
                    continue
                self.io.write(
                    plan,
                    os.path.join(p.stage, kind),
                    shard=True,
                    gather_dtensor=False,
                    size_per_shard=_SHARD_MB,
                    group=group,
                )
            err: BaseException | None = None
            try:
                if rank == 0 and p.scheduler is not None:
                    atomic_write_bytes(os.path.join(p.stage, "lr_scheduler.json"), p.scheduler)
                if rank == 0:
                    # config.json beside the sliced model: `unickpt merge` carries it to the HF copy.
                    for fname, text in p.hf_config.items():
                        atomic_write_bytes(os.path.join(p.stage, "model", fname), text.encode("utf-8"))
                _write_rank_state(p.stage, rank, p.train_state, p.state_tensors)
            except BaseException as e:
                err = e
            _dist.agree(err, f"writing the training state of step {p.step}", group)
            uploaded: set[str] = set()
            if self._remote is not None:
                self._upload(p, group, uploaded)
            if self.save_hf:
                self._write_hf(p, group, model, uploaded)
                if self._remote is not None:
                    self._upload(p, group, uploaded)
            err = None
            if rank == 0:
                try:
                    if self._remote is None:
                        self._commit(p)
                    else:
                        self._commit_remote(p)
                except BaseException as e:
                    err = e
            _dist.agree(err, f"committing step {p.step} in {self.checkpoint_dir}", group)
        finally:
            if rank == 0:
                self._release()
            if self._remote is not None:  # uploaded or failed: the local copy is not needed
                shutil.rmtree(p.stage, ignore_errors=True)
        _dist.barrier(group)

    def _upload(self, p: _Payload, group: Any, uploaded: set[str]) -> None:
        """Collective over ``group``: every rank uploads the files of its stage not uploaded yet."""
        err: BaseException | None = None
        try:
            if self._remote is not None:
                self._remote.upload_step(p.stage, p.step, uploaded)
        except BaseException as e:
            err = e
        _dist.agree(err, f"uploading step {p.step} to {self.checkpoint_dir}", group)

    def _commit_remote(self, p: _Payload) -> None:
        """Rank 0, after every rank uploaded its files: ``COMMIT`` object last, ``latest``, retention."""
        remote = self._remote
        if remote is None:  # pragma: no cover - only called for URLs
            raise RuntimeError("internal: remote commit without a remote store")
        commit = {
            "unickpt_commit": _STATE_VERSION,
            "step": p.step,
            "world_size": int(p.train_state["world_size"]),
            "plugin": self.io.plugin_name,
        }
        remote.put_bytes(f"step-{p.step}/{COMMIT_NAME}", json.dumps(commit).encode())
        remote.put_bytes(LATEST_NAME, json.dumps({"step": p.step}).encode())
        logger.info("committed %s", self.step_dir(p.step))
        if self.keep_last is not None:
            steps = [s for s in remote.committed_steps() if s != p.step]
            for s in steps[: max(0, len(steps) - (self.keep_last - 1))]:
                remote.remove_step(s)

    def _write_hf(self, p: _Payload, group: Any, model: torch.nn.Module | None, uploaded: set[str]) -> None:
        hf = os.path.join(p.stage, HF_DIR)
        if model is not None:  # synchronous: the gathered save of the live model
            self.io.save_model(model, hf, shard=True, gather_dtensor=True)
            return
        # Async: rank 0 assembles full tensors from the sliced copy just written; every rank
        # joins the gathered save on the background group (ranks other than 0 hold nothing).
        from unickpt.io.tensors import local_boxes

        full: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        err: BaseException | None = None
        if _dist.rank(group) == 0:
            try:
                if self._remote is not None:  # the other ranks' model files are in the store only
                    self._remote.fetch_missing(p.step, "model", p.stage, uploaded)
                full, aliases = _read_full(os.path.join(p.stage, "model"))
            except BaseException as e:
                err = e
        _dist.agree(err, f"assembling the Hugging Face copy of step {p.step}", group)
        payload = SavePayload("model", full, {n: local_boxes(n, t) for n, t in full.items()}, aliases=aliases)
        self.io.write(payload, hf, shard=True, gather_dtensor=True, size_per_shard=_SHARD_MB, group=group)
        if _dist.rank(group) == 0:
            for fname, text in p.hf_config.items():
                atomic_write_bytes(os.path.join(hf, fname), text.encode("utf-8"))

    def _commit(self, p: _Payload) -> None:
        """Rank 0: COMMIT marker, atomic rename to ``step-<N>``, ``latest``, retention."""
        commit = {
            "unickpt_commit": _STATE_VERSION,
            "step": p.step,
            "world_size": int(p.train_state["world_size"]),
            "plugin": self.io.plugin_name,
        }
        atomic_write_bytes(os.path.join(p.stage, COMMIT_NAME), json.dumps(commit).encode())
        fsync_dir(p.stage)
        final = self.step_dir(p.step)
        old = None
        if os.path.exists(final):  # the same step saved again (a resumed run): replace it
            old = os.path.join(self.checkpoint_dir, f".step-{p.step}.old-{uuid.uuid4().hex[:12]}")
            os.rename(final, old)
        os.rename(p.stage, final)
        fsync_dir(self.checkpoint_dir)
        atomic_write_bytes(
            os.path.join(self.checkpoint_dir, LATEST_NAME), json.dumps({"step": p.step}).encode()
        )
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("committed %s", final)
        if self.keep_last is not None:
            steps = [s for s in _committed_steps(self.checkpoint_dir) if s != p.step]
            doomed = steps[: max(0, len(steps) - (self.keep_last - 1))]
            for s in doomed:
                _remove_step(self.checkpoint_dir, s)


# ---------------------------------------------------------------------- tensor plans
def _read_full(model_dir: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Rank 0: every tensor of a sliced model checkpoint, assembled whole in CPU memory."""
    from unickpt.format.reader import open_checkpoint
    from unickpt.io.tensors import torch_dtype

    out: dict[str, torch.Tensor] = {}
    with open_checkpoint(model_dir, "model") as reader:
        for name, entry in reader.tensors.items():
            dt = torch_dtype(entry.dtype)
            full = torch.empty(tuple(entry.shape), dtype=dt)
            for s in entry.slices:
                data = torch.frombuffer(bytearray(reader.read_slice(s)), dtype=dt).reshape(tuple(s.shape))
                idx = tuple(slice(o, o + n) for o, n in zip(s.offsets, s.shape, strict=True))
                full[idx] = data
            out[name] = full
        aliases = dict(reader.block.aliases)
    return out, aliases


# ---------------------------------------------------------------------- train state files
def _encode(value: Any, where: str, tensors: dict[str, torch.Tensor]) -> Any:
    """JSON for ``value``; tensors go to ``tensors`` (for a safetensors file) as references."""
    if isinstance(value, torch.Tensor):
        key = f"{where}#{len(tensors)}"
        tensors[key] = value.detach().to("cpu", copy=True).contiguous()
        return {"__st__": key}
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise UnsupportedError(f"{where}: dict key {k!r} is neither str nor int")
            out[k if isinstance(k, str) else f"__int__{k}"] = _encode(v, f"{where}.{k}", tensors)
        return out
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    return to_json_value(value, where)


def _decode(value: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__st__"}:
            return tensors[value["__st__"]].clone()
        if set(value) == {"__tuple__"}:
            return tuple(_decode(v, tensors) for v in value["__tuple__"])
        if set(value) in ({"__tensor__"}, {"__str__"}):
            return from_json_value(value)
        out: dict[Any, Any] = {}
        for k, v in value.items():
            key: Any = int(k[7:]) if k.startswith("__int__") and k[7:].lstrip("-").isdigit() else k
            out[key] = _decode(v, tensors)
        return out
    if isinstance(value, list):
        return [_decode(v, tensors) for v in value]
    return value


def _rank_paths(step_dir: str, rank: int) -> tuple[str, str]:
    base = os.path.join(step_dir, TRAIN_STATE_DIR, f"rank-{rank:05d}")
    return base + ".json", base + ".safetensors"


def _write_rank_state(stage: str, rank: int, js: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Every rank: its JSON state and tensors, each written and fsynced atomically."""
    from safetensors.torch import save

    jpath, tpath = _rank_paths(stage, rank)
    atomic_write_bytes(tpath, save(tensors, metadata={"format": "unickpt-train-state"}))
    atomic_write_bytes(jpath, json.dumps(js, sort_keys=True).encode())


def _read_rank_state(step_dir: str, rank: int) -> tuple[dict[str, Any] | None, dict[str, torch.Tensor]]:
    from safetensors.torch import load

    jpath, tpath = _rank_paths(step_dir, rank)
    try:
        with open(jpath, "rb") as f:
            js = json.loads(f.read())
        with open(tpath, "rb") as f:
            tensors = load(f.read())
    except FileNotFoundError:
        return None, {}
    except ValueError as e:
        raise IndexFileError(f"{jpath}: unreadable training state ({e})") from None
    if not isinstance(js, dict) or js.get("unickpt_train_state") != _STATE_VERSION:
        raise IndexFileError(f"{jpath}: not a unickpt training state")
    return js, tensors


def _read_commit(step_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(step_dir, COMMIT_NAME), "rb") as f:
            obj = json.loads(f.read())
        return obj if isinstance(obj, dict) else {}
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------- directory helpers
_NOT_RESUMABLE = (
    "the dataloader ({}) has no state_dict(): pass the dataloader returned by Booster.boost, or wrap it "
    "with unickpt.data.wrap_dataloader (or use torchdata's StatefulDataLoader)"
)


def _is_remote(path: str | os.PathLike[str]) -> bool:
    """An fsspec URL other than ``file://`` (``file://`` paths keep the rename-based commit)."""
    s = os.fspath(path)
    return "://" in s and not s.startswith("file://")


def _local_dir(path: str | os.PathLike[str]) -> str:
    s = os.fspath(path)
    if s.startswith("file://"):
        s = s[len("file://") :]
    return os.path.abspath(s)


def _committed_steps(directory: str) -> list[int]:
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    steps = []
    for n in names:
        m = _STEP_RE.match(n)
        if m and os.path.isfile(os.path.join(directory, n, COMMIT_NAME)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def _read_latest(directory: str) -> int | None:
    try:
        with open(os.path.join(directory, LATEST_NAME), "rb") as f:
            obj = json.loads(f.read())
        return int(obj["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _clean_work_dirs(directory: str) -> None:
    """Rank 0, under the lock: remove staging/old/deleting directories left by killed saves."""
    for n in os.listdir(directory):
        if _WORK_RE.match(n):
            logger.info("removing %s left by an interrupted save", os.path.join(directory, n))
            shutil.rmtree(os.path.join(directory, n), ignore_errors=True)


def _remove_step(directory: str, step: int) -> None:
    """Rank 0: un-commit a step by renaming it (atomic), then delete it."""
    src = os.path.join(directory, f"step-{step}")
    dst = os.path.join(directory, f".step-{step}.deleting-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(src, dst)
    except FileNotFoundError:
        return
    shutil.rmtree(dst, ignore_errors=True)
    logger.info("removed %s (keep_last)", src)


# ---------------------------------------------------------------------- fsspec storage
class _RemoteStore:
    """``step-<N>/`` prefixes under an fsspec URL; a step is committed iff its ``COMMIT`` object exists.

    Never renames or moves anything (object stores cannot rename a prefix atomically): a step
    is uploaded file by file in place, ``COMMIT`` last, and deleted ``COMMIT`` first.
    """

    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        try:
            from fsspec.core import url_to_fs

            fs, root = url_to_fs(url, **(storage_options or {}))
        except (ImportError, ValueError) as e:
            raise UnsupportedError(
                f"checkpoint_dir {url!r}: fsspec cannot open it ({e}); install the filesystem's package "
                "(s3fs for s3://, gcsfs for gs://) or pass a local directory"
            ) from e
        self.url = url.rstrip("/")
        self.fs: Any = fs
        self.root: str = str(root).rstrip("/")

    def path(self, rel: str) -> str:
        return posixpath.join(self.root, rel) if self.root else rel

    def _step_names(self) -> dict[int, str]:
        """Every ``step-<N>`` prefix, committed or not: {N: path}."""
        self.fs.invalidate_cache()  # listings may be cached (s3fs, gcsfs); we need the current state
        try:
            names = self.fs.ls(self.root, detail=False)
        except FileNotFoundError:
            return {}
        out = {}
        for n in names:
            m = _STEP_RE.match(posixpath.basename(str(n).rstrip("/")))
            if m:
                out[int(m.group(1))] = self.path(f"step-{m.group(1)}")
        return out

    def _committed(self, path: str) -> bool:
        return bool(self.fs.exists(posixpath.join(path, COMMIT_NAME)))

    def committed_steps(self) -> list[int]:
        return sorted(s for s, p in self._step_names().items() if self._committed(p))

    def read_latest(self) -> int | None:
        try:
            obj = json.loads(self.fs.cat_file(self.path(LATEST_NAME)))
            return int(obj["step"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def put_bytes(self, rel: str, data: bytes) -> None:
        path = self.path(rel)
        self.fs.makedirs(posixpath.dirname(path), exist_ok=True)
        self.fs.pipe_file(path, data)

    def remove_step(self, step: int) -> None:
        """Un-commit (delete ``COMMIT``), then delete the rest: a half-deleted step is never committed."""
        path = self.path(f"step-{step}")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(posixpath.join(path, COMMIT_NAME))
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(path, recursive=True)
        logger.info("removed %s", f"{self.url}/step-{step}")

    def prepare(self, step: int) -> None:
        """Rank 0, before uploading ``step``: delete it if present, and every uncommitted step."""
        for s, path in self._step_names().items():
            if s == step or not self._committed(path):
                if s != step:
                    logger.info("removing %s/step-%s left by an interrupted save", self.url, s)
                self.remove_step(s)

    def upload_step(self, stage: str, step: int, done: set[str]) -> None:
        """Upload every file under the local ``stage`` not in ``done`` to ``step-<step>/`` (adds them)."""
        made: set[str] = set()
        for dirpath, _dirs, files in os.walk(stage):
            for f in sorted(files):
                local = os.path.join(dirpath, f)
                rel = os.path.relpath(local, stage).replace(os.sep, "/")
                if rel in done:
                    continue
                remote = self.path(f"step-{step}/{rel}")
                parent = posixpath.dirname(remote)
                if parent not in made:
                    self.fs.makedirs(parent, exist_ok=True)
                    made.add(parent)
                self.fs.put_file(local, remote)
                done.add(rel)

    def _download(self, step: int, dest: str, keep: Callable[[str], bool]) -> list[str]:
        base = self.path(f"step-{step}")
        got = []
        for remote in sorted(self.fs.find(base)):
            rel = posixpath.relpath(str(remote), base)
            if rel.startswith("..") or not keep(rel):
                continue
            local = os.path.join(dest, *rel.split("/"))
            os.makedirs(os.path.dirname(local), exist_ok=True)
            self.fs.get_file(remote, local)
            got.append(rel)
        return got

    def download_step(self, step: int, dest: str, rank: int) -> None:
        """Fetch what ``load`` reads on ``rank``: all but ``hf/`` and other ranks' train states."""
        own = {f"rank-{rank:05d}", "rank-00000"}

        def keep(rel: str) -> bool:
            if rel.startswith(HF_DIR + "/"):
                return False
            if rel.startswith(TRAIN_STATE_DIR + "/"):
                return posixpath.basename(rel).split(".")[0] in own
            return True

        got = self._download(step, dest, keep)
        if COMMIT_NAME not in got:  # deleted by retention or a replacing save since it was listed
            raise IncompleteCheckpointError(f"{self.url}/step-{step} is no longer committed")

    def fetch_missing(self, step: int, sub: str, stage: str, done: set[str]) -> None:
        """Download the files of ``step-<step>/<sub>/`` absent from the local ``stage``."""
        have = set(done)
        for dirpath, _dirs, files in os.walk(stage):
            for f in files:
                have.add(os.path.relpath(os.path.join(dirpath, f), stage).replace(os.sep, "/"))
        done.update(self._download(step, stage, lambda rel: rel.startswith(sub + "/") and rel not in have))
