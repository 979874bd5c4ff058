"""``CheckpointIO``: the one save/load machinery behind every plugin.

Public methods own validation, rank coordination and the commit; they are collective:
every rank of the job calls each of them, in the same order, with its own view of the
model. They are final (``CheckpointIO.__init_subclass__`` refuses a subclass that overrides
one). A plugin's subclass describes only what differs for its parallelism, through the
private hooks ``_model_tensors``, ``_local_slices``, ``_optimizer_state``,
``_set_optimizer_state``, ``_state_parameters`` and ``_after_load``; each public call passes
them one ``HookContext`` (what is being done: kind, save or load, gathered or sliced, the
model and optimizer; both live in ``unickpt.io.hooks``), so no hook depends on state left
on the IO by the call. The defaults
already handle plain tensors (replicated: one rank writes each), DTensors of any placement
(each rank writes the slice it holds), tied parameters and wrapper-free names, so DDP,
FSDP2, TP and their combinations need no checkpoint code of their own.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt.format.commit_store import write_small_file
from unickpt.format.storage import is_url
from unickpt.io.async_save import check_use_safetensors
from unickpt.io.core import check_size_per_shard
from unickpt.io.hooks import FINAL_METHODS, HookContext
from unickpt.io.load import LoadReport, load_tensors
from unickpt.io.names import apply_prefix
from unickpt.io.optim_state import optimizer_tensor_name
from unickpt.io.optimizer_io import OptimizerIO
from unickpt.io.payload import SavePayload
from unickpt.io.side_files import (
    SCHEDULER_FILE,
    hf_config_files,
    lr_scheduler_json,
    read_lr_scheduler_state,
    write_config_files,
)

# CheckpointIO is this module's own; the other names are re-exported from the modules that
# define them, for code written when they lived here.
__all__ = [
    "FINAL_METHODS",
    "CheckpointIO",
    "HookContext",
    "LoadReport",
    "SavePayload",
    "hf_config_files",
    "lr_scheduler_json",
    "optimizer_tensor_name",
]

logger = get_logger(__name__)


class CheckpointIO(OptimizerIO):
    """Save and load models, optimizers and LR schedulers in the unickpt format.

    Args:
        mesh: the plugin's ``DeviceMesh`` (recorded in the index; the IO itself needs none).
        group: process group for coordination (default: the whole world).
        hashes: write an xxh3-64 hash of every stored slice (default on).
        fingerprints: write every tensor's layout-invariant fingerprint (default on).
        fsync: make every data file durable before the index commits it (default on).
        atomic_load: read a rank's whole share into CPU memory before copying any of it, so that
            an I/O error while reading leaves every model untouched, at the price of one extra
            CPU copy of the share (default off: slices are read in place, one at a time; every
            mismatch and, with ``verify=True``, every hash failure is still found before anything
            is copied).
        check_replicas: what a save does when ranks holding the same slice of a tensor (DDP
            replicas, replicated DTensor placements) hold different bytes, of which only one copy
            would be written: ``"warn"`` (default: a ``ReplicaMismatchWarning`` naming the tensors
            and ranks), ``"raise"`` (a ``DistributedError`` on every rank, nothing written) or
            ``"off"`` (no check: saves skip one xxh3 pass over the replicated tensors and one
            all-gather of their digests). Also settable as an attribute.
        storage_options: fsspec options (credentials, endpoint...) for checkpoint URLs
            (``s3://``, ``gs://``...); ``None`` uses the store's standard environment and config
            (``AWS_ENDPOINT_URL``, profiles). Also settable as an attribute.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = sorted(name for name in FINAL_METHODS if name in vars(cls))
        if overridden:
            raise TypeError(
                f"{cls.__qualname__} overrides {overridden}: the public CheckpointIO methods are final; "
                "implement the private hooks (_model_tensors, _local_slices, _optimizer_state, "
                "_set_optimizer_state, _state_parameters, _after_load) instead"
            )

    # ------------------------------------------------------------------ model
    def save_model(
        self,
        model: torch.nn.Module,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_safetensors: bool | None = None,
        use_async: bool = False,
    ) -> str:
        """Collective: save the model's parameters and persistent buffers.

        ``shard=False, gather_dtensor=True``: one ``model.safetensors`` file (``checkpoint`` is a
        ``.safetensors`` path, or a directory to put it in). Otherwise ``checkpoint`` is a
        directory with ``model.safetensors.index.json``. ``gather_dtensor=False`` keeps each
        rank's slices (every rank writes its own, no gather). ``size_per_shard`` is in MB.
        Tied parameters are stored once. ``checkpoint`` may be an existing file (e.g. a
        ``tempfile.NamedTemporaryFile``): an unsharded save then replaces it atomically.
        Returns the committed path.

        Colossal-AI's flags: ``use_async=True`` copies the data to CPU memory and writes it in a
        writer process (see :meth:`wait`); ``use_safetensors`` is accepted, and ``False``
        warns that unickpt writes safetensors regardless.
        """
        self.wait()
        check_use_safetensors(use_safetensors, "save_model")
        args = self._save_args(
            "save_model",
            checkpoint,
            shard,
            gather_dtensor,
            prefix,
            size_per_shard,
            use_async,
            use_safetensors,
        )
        payload = self.plan_model(model, prefix=prefix, shard=shard, gather_dtensor=gather_dtensor, args=args)
        if use_async:
            config = hf_config_files(self.unwrap_model(model))
            return self._write_async(
                payload,
                checkpoint,
                shard,
                gather_dtensor,
                size_per_shard,
                after=lambda path: write_config_files(config, path, self.storage_options),
            )
        path = self.write(
            payload, checkpoint, shard=shard, gather_dtensor=gather_dtensor, size_per_shard=size_per_shard
        )
        _dist.agreed(
            lambda: self._save_hf_config(model, path), f"writing the model config beside {path}", self.group
        )
        return path

    def load_model(
        self,
        model: torch.nn.Module,
        checkpoint: str | os.PathLike[str],
        strict: bool = True,
        verify: bool = False,
        *,
        prefix: str | None = None,
        allow_dtype_cast: bool = False,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> LoadReport:
        """Collective: load a checkpoint of any layout and world size into this model, in place.

        Each rank reads only the bytes of the slices it holds. Every problem (missing or
        unexpected names under ``strict``, shape or dtype mismatches always) is reported in
        one ``StateMismatchError`` raised on every rank before anything is copied.
        ``verify=True`` rehashes the slices read first. Returns a ``LoadReport``. An async save
        in flight is waited for first. ``low_cpu_mem_mode``/``num_threads`` (Colossal-AI's
        tuning knobs) are accepted and change nothing: each rank reads its slices directly.
        """
        del low_cpu_mem_mode, num_threads
        self.wait()
        args = _dist.Args(
            "load_model",
            {
                "checkpoint": _dist.path_arg(checkpoint),
                "strict": strict,
                "verify": verify,
                "prefix": prefix,
                "allow_dtype_cast": allow_dtype_cast,
            },
            check=lambda: apply_prefix(prefix),
        )
        reader = self._open(checkpoint, "model", args)
        ctx = HookContext("model", saving=False, model=model)
        try:
            targets = _dist.agreed(
                lambda: self._model_tensors(ctx), "listing the model's tensors to load", self.group
            )
            report = load_tensors(
                reader,
                targets,
                self._local_slices_fn(ctx),
                strict=strict,
                verify=verify,
                allow_dtype_cast=allow_dtype_cast,
                prefix=apply_prefix(prefix),
                what="model",
                group=self.group,
                atomic=self.atomic_load,
            )
        finally:
            reader.close()
        self._hand_back(ctx)
        self._after_load(ctx)
        return report

    # ------------------------------------------------------------------ optimizer
    def save_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        shard: bool = False,
        gather_dtensor: bool = True,
        prefix: str | None = None,
        size_per_shard: int = 1024,
        use_async: bool = False,
    ) -> str:
        """Collective: save optimizer state keyed by parameter FQN, ``param_groups`` as JSON.

        ``optimizer`` is the one ``Booster.boost`` returned (or an ``OptimizerWrapper``): it knows
        the model, whose FQNs name the state), or a torch optimizer built from
        ``model.named_parameters()`` (torch keeps the names in its ``param_groups``). Layout rules
        are those of ``save_model``: ``shard=False`` writes one ``optimizer.safetensors`` file (or
        replaces the existing file ``checkpoint``), whose header metadata holds ``param_groups``
        and the scalar state. ``use_async=True`` writes in the background (see :meth:`wait`).
        """
        self.wait()
        args = self._save_args(
            "save_optimizer", checkpoint, shard, gather_dtensor, prefix, size_per_shard, use_async
        )
        payload = self.plan_optimizer(
            optimizer, prefix=prefix, shard=shard, gather_dtensor=gather_dtensor, args=args
        )
        if use_async:
            return self._write_async(payload, checkpoint, shard, gather_dtensor, size_per_shard)
        return self.write(
            payload, checkpoint, shard=shard, gather_dtensor=gather_dtensor, size_per_shard=size_per_shard
        )

    # ------------------------------------------------------------------ plan + write
    def plan_model(
        self,
        model: torch.nn.Module,
        prefix: str | None = None,
        *,
        shard: bool = True,
        gather_dtensor: bool = False,
        args: _dist.Args | None = None,
    ) -> SavePayload:
        """What this rank saves of ``model``: tied tensors once (the others become aliases).

        ``shard``/``gather_dtensor`` name the layout the payload will be written in (the
        arguments of :meth:`write`); the default is the sliced save of ``CheckpointManager``.
        ``args``: the calling save's arguments, checked equal on every rank by this agreement.
        """
        ctx = HookContext("model", saving=True, model=model, gather=gather_dtensor, shard=shard)
        return _dist.agreed(
            lambda: self._plan_model(ctx, prefix), "planning the model save", self.group, args
        )

    def _save_args(
        self,
        method: str,
        checkpoint: str | os.PathLike[str],
        shard: bool,
        gather_dtensor: bool,
        prefix: str | None,
        size_per_shard: float,
        use_async: bool,
        use_safetensors: bool | None = None,
    ) -> _dist.Args:
        """A save's arguments, for its first agreement (checked there: a bad value raises on every rank)."""
        values: dict[str, Any] = {
            "checkpoint": _dist.path_arg(checkpoint),
            "shard": shard,
            "gather_dtensor": gather_dtensor,
            "prefix": prefix,
            "size_per_shard": size_per_shard,
            "use_async": use_async,
        }
        if method == "save_model":
            values["use_safetensors"] = use_safetensors

        def check() -> None:
            check_size_per_shard(size_per_shard)
            apply_prefix(prefix)

        return _dist.Args(method, values, check)

    def _plan_model(self, ctx: HookContext, prefix: str | None) -> SavePayload:
        maybe_fail("model.plan")
        p = apply_prefix(prefix)
        stored: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        first: dict[int, str] = {}
        for name, t in self._model_tensors(ctx).items():
            # state_dict(keep_vars=True) returns the same Parameter object under every tied name.
            if id(t) in first:
                aliases[p + name] = p + first[id(t)]
                continue
            first[id(t)] = name
            stored[p + name] = t
        return SavePayload("model", stored, self._local_slices_of(stored, ctx), aliases=aliases)

    # ------------------------------------------------------------------ lr scheduler
    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> str:
        """Collective: rank 0 writes the scheduler's state as JSON; returns the path written.

        ``checkpoint``: a directory (``lr_scheduler.json`` inside it), a ``.json`` path, or an
        existing file of any name (e.g. a ``tempfile.NamedTemporaryFile``, as Colossal-AI's tests
        use), which is replaced atomically, as Colossal-AI's ``save_lr_scheduler`` overwrites it.
        Any other path is a directory to create.
        """
        self.wait()
        # Before rank 0 writes: ranks that name different files must not write one of them.
        _dist.agree(
            None,
            "saving the LR scheduler",
            self.group,
            _dist.Args("save_lr_scheduler", {"checkpoint": _dist.path_arg(checkpoint)}),
        )
        path = os.fspath(checkpoint)
        if os.path.isdir(path) or not (path.endswith(".json") or (not is_url(path) and os.path.isfile(path))):
            path = os.path.join(path, SCHEDULER_FILE)
        err: BaseException | None = None
        if _dist.rank(self.group) == 0:
            try:
                maybe_fail("scheduler.save")
                write_small_file(path, lr_scheduler_json(lr_scheduler.state_dict()), self.storage_options)
            except BaseException as e:
                err = e
        _dist.agree(err, f"saving the LR scheduler to {path}", self.group)
        return path

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """Collective: every rank reads the scheduler JSON and loads it; an error on any rank raises on all."""
        self.wait()
        # Before any rank changes its scheduler.
        _dist.agree(
            None,
            "loading the LR scheduler",
            self.group,
            _dist.Args("load_lr_scheduler", {"checkpoint": _dist.path_arg(checkpoint)}),
        )
        path = os.fspath(checkpoint)
        if is_url(path) and not path.endswith(".json"):
            path = f"{path.rstrip('/')}/{SCHEDULER_FILE}"
        elif os.path.isdir(path):
            path = os.path.join(path, SCHEDULER_FILE)
        _dist.agreed(lambda: self._load_lr_scheduler(lr_scheduler, path), f"loading {path}", self.group)

    def _load_lr_scheduler(self, lr_scheduler: Any, path: str) -> None:
        maybe_fail("scheduler.load")
        lr_scheduler.load_state_dict(read_lr_scheduler_state(path, self.storage_options))

    # ------------------------------------------------------------------ helpers
    def _save_hf_config(self, model: torch.nn.Module, path: str) -> None:
        """Write config.json / generation_config.json beside the weights when the model has them."""
        if _dist.rank(self.group) != 0:
            return
        maybe_fail("model.hf_config")
        write_config_files(hf_config_files(self.unwrap_model(model)), path, self.storage_options)
