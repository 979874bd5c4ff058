"""``CheckpointManager``: periodic saves, exact resume, async save, atomic commit, retention.

Layout of ``checkpoint_dir``::

    step-<N>/                      one committed checkpoint (COMMIT marker inside)
        model/                     sliced model checkpoint (every rank writes its own blocks)
        optimizer/                 sliced optimizer checkpoint
        lr_scheduler.json          rank 0
        train_state/rank-<r>.json  per rank: step, RNG (Python, numpy), dataloader position, extra states
        train_state/rank-<r>.safetensors   per rank: torch RNG byte tensors, tensors of extra states
        train_state/rank-<r>.hashes.json   per rank: xxh3-64 of the two files above (rank 0: and
                                           lr_scheduler.json), checked by `unickpt verify`
        hf/                        merged Hugging Face copy (save_hf=True)
        COMMIT                     written last, before the directory is renamed into place
    latest                         {"step": N}: moved only after step-<N> is committed
    .step-<N>.staging-<id>/        a save in progress (or killed): never loaded, removed by a later save
    .step-<N>.old-<id>/            a replaced step N kept until its replacement is committed

A save is staged under ``.step-<N>.staging-<id>``; every rank fsyncs what it wrote; rank 0
writes ``COMMIT``, fsyncs, puts the directory in place as ``step-<N>``, fsyncs
``checkpoint_dir``, then replaces ``latest`` atomically and only then applies ``keep_last``.
Putting in place is one atomic rename for a new step. A step already committed (a resumed run
saving it again) is swapped with the stage atomically (Linux ``renameat2(RENAME_EXCHANGE)``);
where the filesystem cannot swap, it is first renamed to ``.step-<N>.old-<id>``, which stays
committed (readers take it for step N while ``step-<N>`` is not committed, the next save moves
it back) and is deleted only once the new ``step-<N>`` is committed. A process killed at any
moment therefore leaves a committed copy of every committed step (``_stepdirs.py``).

Saves into one directory are serialised by the kernel lock of ``.unickpt.lock`` (``flock``;
``CheckpointBusyError`` for a second manager, released by the kernel when a holder dies). A
cleanup removes only work directories whose owner is dead (each owner holds a ``flock`` on
its directory). ``load`` never silently starts from 0 when ``latest`` records a save and no
committed step is left (``IncompleteCheckpointError``), and does not fall back to an older
step when the chosen one is damaged: it raises, naming the other committed steps.

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
prefixes without ``COMMIT``. Once every rank has uploaded everything, rank 0 uploads ``COMMIT``
last, then ``latest``, then applies ``keep_last`` (deleting ``COMMIT`` first). A step is
committed iff its ``COMMIT`` object exists; readers ignore the others. A committed step saved
again is uploaded to ``.step-<N>.replacing-<id>/``, committed there, then copied over
``step-<N>`` (see ``_remote_store.py``): step N stays committed throughout. Guarantees rest on
whole-object PUTs and consistent listings (S3, GCS); limits: no lock between writers, and each
rank downloads the whole step (but ``hf/`` and other ranks' states) to load it. See
docs/guide.md, "Storage".
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import tempfile
import threading
import uuid
import weakref
from typing import Any

import torch

from unickpt import _rng
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt._remote_store import RemoteStore
from unickpt._stepdirs import (
    COMMIT_NAME,
    LATEST_NAME,
    clean_work_dirs,
    committed_step_dirs,
    committed_steps,
    discard,
    install_step,
    make_work_dir,
    read_latest,
    remove_step,
)
from unickpt.errors import (
    ConfigError,
    IncompleteCheckpointError,
    IndexFileError,
    StateMismatchError,
    UnickptError,
    UnsupportedError,
)
from unickpt.format import run_layout
from unickpt.format.commit import atomic_write_bytes, directory_lock, fsync_dir
from unickpt.io import _dist
from unickpt.io.checkpoint_io import SavePayload, hf_config_files, lr_scheduler_json
from unickpt.io.jsonstate import from_json_value, to_json_value

__all__ = ["CheckpointManager"]

logger = get_logger(__name__)

TRAIN_STATE_DIR = "train_state"
HF_DIR = "hf"
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
    target: str = ""  # fsspec URLs: the prefix uploaded into (``step-<N>`` or a replacement copy)


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
        self._remote: RemoteStore | None = None
        if _is_remote(checkpoint_dir):
            self._remote = RemoteStore(os.fspath(checkpoint_dir), storage_options)
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
                raise ConfigError(
                    "local_cache_dir and storage_options are for fsspec URLs; "
                    f"{os.fspath(checkpoint_dir)!r} is a local directory"
                )
            self.checkpoint_dir = _local_dir(checkpoint_dir)
            self._root = self.checkpoint_dir
        if save_steps < 1:
            raise ConfigError(f"save_steps must be a positive number of steps, got {save_steps}")
        if keep_last is not None and keep_last < 0:
            raise ConfigError(f"keep_last must be >= 0 (0 or None keeps all), got {keep_last}")
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
        return committed_steps(self.checkpoint_dir)

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` (files only; any rank may call).

        The ``latest`` record wins when it names a committed step (after a resume from an older
        step, it is the most recent save); otherwise the highest committed step.
        """
        steps = self.all_steps()
        if not steps:
            return None
        rec = self._remote.read_latest() if self._remote is not None else read_latest(self.checkpoint_dir)
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
            raise ConfigError(
                f"resume_from_checkpoint must be None, an int step or 'latest', got {resume_from_checkpoint!r}"
            )

        def pick() -> tuple[int, str]:
            if _dist.rank(self.group) != 0:
                return (0, "")
            maybe_fail("manager.load.pick")
            return self._pick_step(resume_from_checkpoint)

        # Rank 0 reads the directory; a failure there reaches every rank (not a wait in broadcast).
        picked = _dist.agreed(pick, f"picking the step to resume in {self.checkpoint_dir}", self.group)
        step, path = _dist.broadcast_object(picked, 0, self.group)
        step = int(step)
        if step == 0:
            return 0
        logger.info("resuming from %s", path)
        if self._remote is None:
            self._load_picked(path, step, model, optimizer, lr_scheduler, dataloader, extra_states)
            return step
        d = os.path.join(self._root, f".step-{step}.download-{uuid.uuid4().hex[:12]}")
        err = None
        owned: int | None = None
        try:
            os.makedirs(self._root, exist_ok=True)
            clean_work_dirs(self._root)
            owned = make_work_dir(d)
            self._remote.download_step(step, d, _dist.rank(self.group))
        except BaseException as e:
            err = e
        try:
            _dist.agree(err, f"downloading {self.step_dir(step)}", self.group)
            self._load_picked(d, step, model, optimizer, lr_scheduler, dataloader, extra_states)
        finally:
            shutil.rmtree(d, ignore_errors=True)
            if owned is not None:
                os.close(owned)
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

    def _load_picked(
        self,
        d: str,
        step: int,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any,
        dataloader: Any,
        extra_states: dict[str, Any],
    ) -> None:
        """``_load_step``; a damaged step is reported with the committed steps to resume from instead.

        No silent fallback to an older step: that would throw away training progress unnoticed,
        and the objects may already hold part of the damaged step. The error names the step and
        the other committed steps; ``resume_from_checkpoint=<step>`` picks one.
        """
        try:
            self._load_step(d, step, model, optimizer, lr_scheduler, dataloader, extra_states)
        except UnickptError as e:
            others = [s for s in self.all_steps() if s != step]
            where = d if self._remote is None else self.step_dir(step)
            hint = (
                f"step {step} ({where}) could not be loaded; the model, optimizer and other objects may hold "
                f"part of it. Other committed steps: {others or 'none'}"
                + (f"; resume from one with resume_from_checkpoint={others[-1]}" if others else "")
                + " (or fix or delete the damaged step)"
            )
            logger.error("%s: %s", hint, e)
            e.add_note(hint)
            raise

    def _pick_step(self, wanted: int | str) -> tuple[int, str]:
        """Rank 0: (step, directory to load it from); (0, "") when there is nothing to resume from.

        Raises ``IncompleteCheckpointError`` when ``latest`` records a save but no committed step
        is left: resuming from scratch would silently throw the run away.
        """
        if self._remote is not None:
            dirs = {s: self.step_dir(s) for s in self._remote.committed_steps()}
            rec = self._remote.read_latest()
        else:
            dirs = committed_step_dirs(self.checkpoint_dir)
            rec = read_latest(self.checkpoint_dir)
        if not dirs:
            if rec is not None:
                raise IncompleteCheckpointError(
                    f"{self.checkpoint_dir}: 'latest' records a save of step {rec}, but no committed step "
                    "is left (step-<N> directories without COMMIT, or deleted); pass "
                    "resume_from_checkpoint=None to start afresh"
                )
            return 0, ""
        newest = max(dirs)
        if rec is not None and rec not in dirs:
            logger.warning(
                "%s: 'latest' records step %s, which is not committed (deleted or damaged); "
                "the highest committed step is %s",
                self.checkpoint_dir,
                rec,
                newest,
            )
        latest = rec if rec in dirs else newest
        if wanted == "latest":
            return latest, dirs[latest]
        if int(wanted) in dirs:
            return int(wanted), dirs[int(wanted)]
        logger.warning(
            "step %s is not a committed checkpoint in %s; resuming from the latest committed step %s",
            wanted,
            self.checkpoint_dir,
            latest,
        )
        return latest, dirs[latest]

    def _load_train_state(self, d: str, step: int, dataloader: Any, extra_states: dict[str, Any]) -> None:
        rank, world = _dist.rank(self.group), _dist.world_size(self.group)
        err: BaseException | None = None
        try:
            maybe_fail("manager.load.train_state")
            js, tensors = _read_rank_state(d, rank)
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
        target = ""
        if self._remote is not None:
            try:
                target = self._start_remote_save(step, stage, rank)
            except BaseException as e:
                err = e
        elif rank == 0:
            try:
                maybe_fail("manager.start")
                os.makedirs(self.checkpoint_dir, exist_ok=True)
                self._lock.enter_context(directory_lock(self.checkpoint_dir))
                clean_work_dirs(self.checkpoint_dir)
                self._lock.callback(os.close, make_work_dir(stage))
                os.makedirs(os.path.join(stage, TRAIN_STATE_DIR))
            except BaseException as e:
                err = e
        try:
            _dist.agree(err, f"starting the save of step {step} in {self.checkpoint_dir}", self.group)
            payload = self._capture(step, stage, model, optimizer, lr_scheduler, dataloader, extra_states)
            if self._remote is not None:
                payload.target = _dist.broadcast_object(target, 0, self.group)
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

    def _start_remote_save(self, step: int, stage: str, rank: int) -> str:
        """Every rank: its local staging directory; rank 0 tidies the store and returns the upload prefix."""
        os.makedirs(self._root, exist_ok=True)
        clean_work_dirs(self._root)
        self._lock.callback(os.close, make_work_dir(stage))
        # Every rank writes into its own local copy of the stage, so every rank creates the
        # directories the writers expect (on a shared directory rank 0 alone creates them).
        for sub in (TRAIN_STATE_DIR, "model", "optimizer", HF_DIR):
            os.makedirs(os.path.join(stage, sub))
        if rank == 0 and self._remote is not None:
            return self._remote.prepare(step)
        return ""

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
        # Collective, and agreed inside: not part of the local phase below.
        model_plan = self.io.plan_model(model)
        try:
            maybe_fail("manager.capture")
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
                maybe_fail("manager.train_state")
                if rank == 0 and p.scheduler is not None:
                    atomic_write_bytes(os.path.join(p.stage, "lr_scheduler.json"), p.scheduler)
                if rank == 0:
                    # config.json beside the sliced model: `unickpt merge` carries it to the HF copy.
                    for fname, text in p.hf_config.items():
                        atomic_write_bytes(os.path.join(p.stage, "model", fname), text.encode("utf-8"))
                _write_rank_state(
                    p.stage, rank, p.train_state, p.state_tensors, p.scheduler if rank == 0 else None
                )
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
                    maybe_fail("manager.commit")
                    if self._remote is None:
                        self._commit(p)
                    else:
                        self._commit_remote(p)
                except BaseException as e:
                    err = e
            _dist.agree(err, f"committing step {p.step} in {self.checkpoint_dir}", group)
        finally:
            if self._remote is not None:  # uploaded or failed: the local copy is not needed
                shutil.rmtree(p.stage, ignore_errors=True)
            self._release()  # the save lock (rank 0) and this rank's claim on its staging directory
        _dist.barrier(group)

    def _upload(self, p: _Payload, group: Any, uploaded: set[str]) -> None:
        """Collective over ``group``: every rank uploads the files of its stage not uploaded yet."""
        err: BaseException | None = None
        try:
            if self._remote is not None:
                self._remote.upload_step(p.stage, p.target, uploaded)
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
        remote.commit(p.step, p.target, json.dumps(commit).encode())  # COMMIT last, then promoted
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
                    self._remote.fetch_missing(p.target, "model", p.stage, uploaded)
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
        replaced = install_step(self.checkpoint_dir, p.stage, final, p.step)
        atomic_write_bytes(
            os.path.join(self.checkpoint_dir, LATEST_NAME), json.dumps({"step": p.step}).encode()
        )
        if replaced is not None:  # the new step-<N> is committed: the replaced copy may go
            discard(replaced)
        logger.info("committed %s", final)
        if self.keep_last is not None:
            steps = [s for s in committed_steps(self.checkpoint_dir) if s != p.step]
            doomed = steps[: max(0, len(steps) - (self.keep_last - 1))]
            for s in doomed:
                remove_step(self.checkpoint_dir, s)


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


def _write_rank_state(
    stage: str,
    rank: int,
    js: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    scheduler: bytes | None = None,
) -> None:
    """Every rank: its JSON state and tensors, each written and fsynced atomically, then their
    xxh3-64 hashes (and those of ``lr_scheduler.json``, written by rank 0) for ``unickpt verify``."""
    from safetensors.torch import save

    jpath, tpath = _rank_paths(stage, rank)
    tbytes = save(tensors, metadata={"format": "unickpt-train-state"})
    jbytes = json.dumps(js, sort_keys=True).encode()
    atomic_write_bytes(tpath, tbytes)
    atomic_write_bytes(jpath, jbytes)
    written = {os.path.relpath(tpath, stage): tbytes, os.path.relpath(jpath, stage): jbytes}
    if scheduler is not None:
        written["lr_scheduler.json"] = scheduler
    run_layout.write_hashes(stage, rank, written)


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


_RemoteStore = RemoteStore  # (its former name here)
