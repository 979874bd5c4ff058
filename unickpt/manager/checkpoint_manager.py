"""``CheckpointManager``: the collective save and load of a step (see the package docstring).

The policy (``policy.py``), the training state (``train_state.py``), the capture of a step
(``snapshot.py``) and where steps live (``storage.py``) are separate modules; this one runs
the collective protocol over them, with one code path for local directories and fsspec URLs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt._rng import keeps_python_random
from unickpt.ckpt import run_layout
from unickpt.ckpt.run_layout import HF_DIR
from unickpt.errors import ConfigError, UnickptError
from unickpt.io.async_save import AsyncSaves, shared_payload
from unickpt.io.pinned import POOL, StagingSet
from unickpt.io.save import WriteSpec
from unickpt.manager import policy, snapshot, train_state
from unickpt.manager.storage import RemoteStorage, Storage, open_storage
from unickpt.store.publish import copy_files, fsync_dir, write_small_file
from unickpt.store.storage import compared_location, process_reachable

__all__ = ["CheckpointManager", "RetentionWarning"]

logger = get_logger("unickpt.manager")

# Shard size of the sliced model/optimizer files (MB): the same for sync and async saves.
_SHARD_MB = 1024


class RetentionWarning(UserWarning):
    """A step was committed, but deleting the older steps ``keep_last`` retires failed."""


class CheckpointManager:
    """Save every ``save_steps`` steps, keep the last ``keep_last``, resume exactly.

    Args:
        checkpoint_dir: a local directory (created if needed; ``file://`` URLs too), or an fsspec
            URL (``s3://``, ``gs://``, ``memory://``...): see "Remote storage" in the package docstring.
        booster: the ``Booster`` whose plugin's CheckpointIO saves the model and optimizer;
            ``None`` means one process with a ``GeneralCheckpointIO``.
        save_steps: ``save(step)`` saves when ``step % save_steps == 0`` (or ``force=True``).
        keep_last: committed steps to keep (oldest deleted after a new commit); ``None`` or 0 keeps all.
        async_save: write in the background, in a writer process (see the package docstring).
        save_hf: also write a merged Hugging Face copy of the model into ``step-<N>/hf``.
        local_cache_dir: fsspec URLs only: where each rank downloads a step to load (saves write
            straight to the store) (``<local_cache_dir>/rank-<r>/``); default a temporary directory per process,
            removed when the manager is garbage collected.
        storage_options: fsspec URLs only: passed to the fsspec filesystem (credentials, endpoint);
            also given to the CheckpointIO when it has none of its own.

    Built by every rank, with the same arguments (collective: one exchange checks them, and
    ``async_save`` creates a process group).
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
        # The gloo twin of a group without a CPU backend (pure NCCL), made here on the main thread,
        # before any save: the saves' object exchanges and their background thread use it.
        _dist.setup_cpu_group(self.io.group)
        # Every rank must build the same manager: a save_steps or async_save of its own would
        # make the ranks' later calls take different collectives.
        _dist.agree(
            None,
            "creating the CheckpointManager",
            self.io.group,
            _dist.Args(
                "CheckpointManager",
                {
                    "checkpoint_dir": compared_location(checkpoint_dir),
                    "save_steps": save_steps,
                    "keep_last": keep_last,
                    "async_save": async_save,
                    "save_hf": save_hf,
                },
            ),
        )
        self.storage: Storage = open_storage(
            checkpoint_dir, local_cache_dir, storage_options, _dist.rank(self.io.group)
        )
        self.checkpoint_dir = self.storage.location
        # A store's options reach the CheckpointIO's saves (which write the step's files there).
        self._storage_options: dict[str, Any] | None = getattr(self.storage, "storage_options", None)
        if self._storage_options is not None and getattr(self.io, "storage_options", None) is None:
            self.io.storage_options = self._storage_options
        policy.check_settings(save_steps, keep_last)
        self.save_steps = save_steps
        self.keep_last = keep_last or None
        self.async_save = async_save
        # The host buffers of the async snapshot in flight (or the last one), by kind: leased from
        # the process's pool (io/pinned.py, shared with the IOs), handed back once it is over.
        self._staging: dict[str, StagingSet] = {}
        self._leased: list[StagingSet] = []  # those not yet handed back
        self.save_hf = save_hf
        self.group = self.io.group
        self._async = AsyncSaves()
        # An async save is written by this rank's writer process (started now: its startup is
        # off the save path), or, for a store only this process reaches (memory://), by a
        # thread over a second gloo group.
        self._in_writer = async_save and process_reachable(self.checkpoint_dir)
        self._bg_group: Any = None
        if self._in_writer:
            self._async.writer.ensure(self.group)
        elif async_save:
            self._bg_group = self._async.background_group(self.group)
        self._lock = contextlib.ExitStack()

    # ------------------------------------------------------------------ queries
    def all_steps(self) -> list[int]:
        """Committed steps in ascending order (files only; any rank may call)."""
        return sorted(self.storage.committed_step_dirs())

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None`` (files only; any rank may call).

        The ``latest`` record wins when it names a committed step (after a resume from an older
        step, it is the most recent save); otherwise the highest committed step.
        """
        steps = self.all_steps()
        if not steps:
            return None
        return policy.latest_of(steps, self.storage.read_latest())

    def step_dir(self, step: int) -> str:
        """The path (local) or URL (fsspec) of ``step-<step>``."""
        return self.storage.step_dir(step)

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

        def check() -> None:
            if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint != "latest":
                raise ConfigError(
                    f"resume_from_checkpoint must be None, an int step or 'latest', got {resume_from_checkpoint!r}"
                )

        def pick() -> tuple[int, str]:
            if _dist.rank(self.group) != 0 or resume_from_checkpoint is None:
                return (0, "")
            maybe_fail("manager.load.pick")
            return self._pick_step(resume_from_checkpoint)

        # Rank 0 reads the directory; a failure there reaches every rank (not a wait in broadcast).
        # The same exchange checks that every rank asked for the same step and objects.
        args = _dist.Args(
            "CheckpointManager.load",
            _call_args(
                optimizer,
                lr_scheduler,
                dataloader,
                extra_states,
                resume_from_checkpoint=resume_from_checkpoint,
            ),
            check,
        )
        # Listing the store leaves Python's random stream alone (a run with nothing to resume
        # trains as if no manager were there); a resumed step restores the streams it saved.
        picked = _dist.agreed(
            keeps_python_random(pick),
            f"picking the step to resume in {self.checkpoint_dir}",
            self.group,
            args,
        )
        if resume_from_checkpoint is None:
            return 0
        step, path = _dist.broadcast_object(picked, 0, self.group)
        step = int(step)
        if step == 0:
            return 0
        logger.info("resuming from %s", path)
        with self.storage.open_step(step, path, self.group) as d:
            self._load_picked(d, path, step, model, optimizer, lr_scheduler, dataloader, extra_states)
        return step

    def _load_picked(
        self,
        d: str,
        where: str,
        step: int,
        model: torch.nn.Module,
        optimizer: Any,
        lr_scheduler: Any,
        dataloader: Any,
        extra_states: dict[str, Any],
    ) -> None:
        """Collective: load the local copy ``d`` of the committed step at ``where``.

        A damaged step is reported with the committed steps to resume from instead.

        No silent fallback to an older step: that would throw away training progress unnoticed,
        and the objects may already hold part of the damaged step. The error names the step and
        the other committed steps; ``resume_from_checkpoint=<step>`` picks one.
        """
        try:
            self.io.load_model(model, os.path.join(d, "model"))
            if optimizer is not None:
                self.io.load_optimizer(optimizer, os.path.join(d, "optimizer"))
            if lr_scheduler is not None:
                self.io.load_lr_scheduler(lr_scheduler, os.path.join(d, run_layout.SCHEDULER_NAME))
            err: BaseException | None = None
            try:
                maybe_fail("manager.load.train_state")
                rank, world = _dist.rank(self.group), _dist.world_size(self.group)
                train_state.restore(d, step, rank, world, dataloader, extra_states, self._storage_options)
            except BaseException as e:
                err = e
            _dist.agree(err, f"loading the training state of {d}", self.group)
        except UnickptError as e:
            others = [s for s in self.all_steps() if s != step]
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
        """Rank 0: (step, directory to load it from); (0, "") when there is nothing to resume from."""
        dirs = self.storage.committed_step_dirs()
        return policy.pick_step(dirs, self.storage.read_latest(), wanted, self.checkpoint_dir)

    # ------------------------------------------------------------------ save
    @keeps_python_random
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
        if not policy.should_save(step, self.save_steps, force):
            return False
        self.wait()
        rank = _dist.rank(self.group)
        stage_name = run_layout.work_name(step, "staging") if rank == 0 else ""
        # One exchange hands rank 0's staging name to every rank and checks that every rank
        # saves the same step with the same objects.
        args = _dist.Args(
            "CheckpointManager.save",
            _call_args(optimizer, lr_scheduler, dataloader, extra_states, step=step, force=force),
        )
        stage_name = _dist.agree_gather(None, stage_name, f"saving step {step}", self.group, args)[0]
        stage = os.path.join(self.storage.root, stage_name)
        err: BaseException | None = None
        target = ""
        try:
            target = self.storage.begin_save(step, stage, rank, self._lock)
        except BaseException as e:
            err = e
        try:
            _dist.agree(err, f"starting the save of step {step} in {self.checkpoint_dir}", self.group)
            staging: dict[str, Any] | None = None
            if self.async_save:
                staging = self._staging = {
                    kind: POOL.lease(kind, shared=self._in_writer) for kind in ("model", "optimizer")
                }
                self._leased = list(self._staging.values())
            payload = snapshot.capture(
                self.io,
                step,
                stage,
                model,
                optimizer,
                lr_scheduler,
                dataloader,
                extra_states,
                staging,
                rows=self.save_hf and self._shared_stage(),
            )
            payload.target = self.storage.share_target(target, self.group)
            payload.stage = self.storage.write_root(payload.stage, payload.target)
        except BaseException:
            self._release()
            raise
        writer = self._step_writer()
        if not self.async_save:
            writer.write(payload, self.group, self._release)
            return True
        name = f"step-{step}"
        if not self._in_writer:
            self._async.start(name, lambda: writer.write(payload, self._bg_group, self._release))
            return True
        try:
            payload.model = shared_payload(payload.model, self._staging["model"])
            if payload.optimizer is not None:
                payload.optimizer = shared_payload(payload.optimizer, self._staging["optimizer"])
            # The save lock and the staging directory's claim live in this process: released
            # once the writer answered.
            buffers = [t for kind in ("model", "optimizer") for t in self._staging.get(kind, {}).values()]
            self._async.start_in_writer(
                self.group,
                name,
                functools.partial(writer.write, payload),
                buffers,
                lambda: step in self.storage.committed_step_dirs(),
                cleanup=self._release,
            )
        except BaseException:
            self._release()
            raise
        return True

    def wait(self) -> None:
        """Collective for async saves: block until the save in flight is committed; raise its error."""
        self._async.wait()

    def close(self) -> None:
        """Collective for async saves: wait for the save in flight (raising its error), then stop
        the writer process. Optional: it stops at exit too."""
        self._async.close()

    def _step_writer(self) -> StepWriter:
        hf_in_place = self.save_hf and self._shared_stage()
        optim = self.io.write_spec("optimizer", True, False, _SHARD_MB)
        return StepWriter(
            storage=self.storage,
            model_spec=self.io.write_spec("model", True, hf_in_place, _SHARD_MB),
            optim_spec=optim,
            save_hf=self.save_hf,
            hf_in_place=hf_in_place,
            keep_last=self.keep_last,
            storage_options=self._storage_options,
            plugin_name=self.io.plugin_name,
            fsync=bool(getattr(self.io, "fsync", True)),
            location=self.checkpoint_dir,
        )

    def _shared_stage(self) -> bool:
        """Whether the step is written into a local directory the ranks share (not on a store)."""
        return not isinstance(self.storage, RemoteStorage)

    def _release(self) -> None:
        leased, self._leased = self._leased, []
        for staging in leased:
            POOL.give_back(staging)
        self._lock.close()
        self._lock = contextlib.ExitStack()

    def release_staging(self) -> int:
        """Free the process's snapshot buffers (exact-size, pinned on CUDA: ``io/pinned.py``) that
        no save in flight uses, the manager's and every IO's: the next async save allocates (and
        pins) again. Returns the bytes freed now; they are freed at exit too."""
        return POOL.release()


@dataclasses.dataclass
class StepWriter:
    """What writing and committing a step needs of the manager, as a picklable value: the
    synchronous save runs it in the training process, an async one in its writer process."""

    storage: Storage
    model_spec: WriteSpec
    optim_spec: WriteSpec
    save_hf: bool
    hf_in_place: bool
    keep_last: int | None
    storage_options: dict[str, Any] | None
    plugin_name: str
    fsync: bool
    location: str

    def write(self, p: snapshot.Payload, group: Any, release: Callable[[], None] | None = None) -> None:
        """Collective over ``group``: write the staged step, then rank 0 commits it.

        ``release`` (the manager's save lock and staging claim) runs once the step is committed
        or failed, before the last barrier; an async save's writer process has none (the
        training process releases once the writer answered).
        """
        rank = _dist.rank(group)
        committed = False
        try:
            # save_hf: the model is written once, as Hugging Face files (every rank writes its
            # own bytes); it loads under any layout like a sliced one.
            for kind, plan, spec in (
                ("model", p.model, self.model_spec),
                ("optimizer", p.optimizer, self.optim_spec),
            ):
                if plan is None:
                    continue
                spec.write(plan, os.path.join(p.stage, kind), group)
            err: BaseException | None = None
            try:
                maybe_fail("manager.train_state")
                opts = self.storage_options
                if rank == 0 and p.scheduler is not None:
                    write_small_file(os.path.join(p.stage, run_layout.SCHEDULER_NAME), p.scheduler, opts)
                if rank == 0:
                    # config.json beside the sliced model: `unickpt merge` carries it to the HF copy.
                    for fname, text in p.hf_config.items():
                        write_small_file(os.path.join(p.stage, "model", fname), text.encode("utf-8"), opts)
                train_state.write_rank_state(
                    p.stage, rank, p.train_state, p.state_tensors, p.scheduler if rank == 0 else None, opts
                )
            except BaseException as e:
                err = e
            _dist.agree(err, f"writing the training state of step {p.step}", group)
            if self.save_hf:
                self._write_hf(p, group)
            err = None
            if rank == 0:
                try:
                    maybe_fail("manager.commit")
                    self._commit(p)
                except BaseException as e:
                    err = e
            _dist.agree(err, f"committing step {p.step} in {self.location}", group)
            committed = True
        finally:
            self.storage.end_save(p.stage)
            if not committed and release is not None:
                release()  # the save lock (rank 0) and this rank's claim on its staging directory
        try:
            _dist.barrier(group)
        finally:
            if rank == 0:
                self._retire(p.step)  # after the barrier: the other ranks are on their way already
            if release is not None:
                release()

    def _commit(self, p: snapshot.Payload) -> None:
        """Rank 0, after every rank wrote its files: commit and ``latest`` (retention follows, see
        :meth:`_retire`)."""
        side = run_layout.side_files_of(p.hf_config, p.scheduler, self.save_hf)
        record = run_layout.commit_record(p.step, int(p.train_state["world_size"]), self.plugin_name, side)
        self.storage.commit(p.step, p.stage, p.target, record)
        logger.info("committed %s", self.storage.step_dir(p.step))

    def _retire(self, step: int) -> None:
        """Rank 0, under the save lock, once step ``step`` is committed and every rank has left the
        save's last collective: delete the steps ``keep_last`` retires.

        Deleting is slow file-system work (a store deletes object by object): no rank waits for
        it inside a collective, where a watchdog (NCCL's) would abort the job. A failure leaves
        the old step committed, is logged and warned about (``RetentionWarning``) on rank 0, and
        the next save's retention tries again; the save itself succeeded.
        """
        try:
            for s in policy.retired_steps(sorted(self.storage.committed_step_dirs()), step, self.keep_last):
                self.storage.remove_step(s)
        except Exception as e:
            msg = (
                f"step {step} is committed in {self.location}, but deleting the steps keep_last="
                f"{self.keep_last} retires failed ({type(e).__name__}: {e}); the next save tries again"
            )
            logger.error("%s", msg)
            warnings.warn(msg, RetentionWarning, stacklevel=2)

    def _write_hf(self, p: snapshot.Payload, group: Any) -> None:
        """Collective over ``group``: the Hugging Face copy of the model into ``<stage>/hf``.

        In a local directory the ranks share, ``_write`` saved the model itself as Hugging Face
        files (every rank writes its own bytes from the payload: the live tensors, or an async
        save's snapshot; no gather, no re-read, ``io/hf_save.py``), and ``hf/`` holds copies of
        them, made in the kernel: files of their own, so that editing the user's copy never
        changes the training checkpoint. An object store has neither ``pwrite`` nor links:
        the model is saved sliced, and rank 0 merges the ranks' written copy
        (``merge_checkpoint``, streamed in bounded memory) and uploads the files to ``hf/``.
        """
        hf = os.path.join(p.stage, HF_DIR)
        rank, world = _dist.rank(group), _dist.world_size(group)
        err: BaseException | None = None
        if self.hf_in_place:  # model/ holds the Hugging Face files: hf/ is a copy of them
            # Every rank copies its share of the files (a shared directory: no rank-0 funnel),
            # then rank 0 adds config.json and makes hf/'s entries durable.
            try:
                maybe_fail("manager.hf_copy")
                copy_files(os.path.join(p.stage, "model"), hf, fsync=self.fsync, part=(rank, world))
            except BaseException as e:
                err = e
            _dist.agree(err, f"copying the Hugging Face files of step {p.step}", group)
        if rank == 0:
            try:
                if self.hf_in_place:
                    for fname, text in p.hf_config.items():
                        write_small_file(os.path.join(hf, fname), text.encode("utf-8"), self.storage_options)
                    if self.fsync:
                        fsync_dir(hf)
                else:
                    self._merge_hf(p, hf)
            except BaseException as e:
                err = e
        _dist.agree(err, f"writing the Hugging Face copy of step {p.step}", group)

    def _merge_hf(self, p: snapshot.Payload, hf: str) -> None:
        """Rank 0, on a store: merge the step's sliced model into Hugging Face files at ``hf``,
        read from the store and streamed back to it (``merge_checkpoint`` to a URL: the index or
        single file last); nothing is staged on local disk but a single-file output."""
        from unickpt.tools.merge import merge_checkpoint

        # config.json sits beside the sliced model: the merge carries it over.
        merge_checkpoint(
            f"{p.stage}/model",
            hf,
            max_shard_size=int(_SHARD_MB * 1024 * 1024),
            storage_options=self.storage_options,
        )


def _call_args(
    optimizer: Any, lr_scheduler: Any, dataloader: Any, extra_states: dict[str, Any], **values: Any
) -> dict[str, Any]:
    """A manager call's arguments as the ranks compare them: the values, and which objects were given."""
    return {
        **values,
        "optimizer": None if optimizer is None else "given",
        "lr_scheduler": None if lr_scheduler is None else "given",
        "dataloader": None if dataloader is None else "given",
        "extra_states": sorted(extra_states),
    }
