"""``CheckpointIO``: the one save/load machinery behind every plugin.

Public methods own validation, rank coordination and the commit; they are collective:
every rank of the job calls each of them, in the same order, with its own view of the
model. They are final (``CheckpointIO.__init_subclass__`` refuses a subclass that overrides
one). A plugin's subclass describes only what differs for its parallelism, through the
private hooks ``_model_tensors``, ``_local_boxes``, ``_optimizer_state``,
``_set_optimizer_state``, ``_state_parameters`` and ``_after_load``; each public call passes
them one ``HookContext`` (what is being done: kind, save or load, gathered or sliced, the
model and optimizer; both live in ``unickpt.io.hooks``), so no hook depends on state left
on the IO by the call. The defaults
already handle plain tensors (replicated: one rank writes each), DTensors of any placement
(each rank writes the block it holds), tied parameters and wrapper-free names, so DDP,
FSDP2, TP and their combinations need no checkpoint code of their own.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import torch

from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt.errors import ConfigError, IndexFileError, UnsupportedError
from unickpt.format._json import strict_loads
from unickpt.format.commit import atomic_write_bytes
from unickpt.format.index import LayoutInfo
from unickpt.format.reader import CheckpointReader
from unickpt.format.storage import is_url
from unickpt.io import _dist
from unickpt.io.async_save import AsyncSaveMixin, check_use_safetensors, write_config_files
from unickpt.io.hooks import FINAL_METHODS, CheckpointHooks, HookContext
from unickpt.io.jsonstate import from_json_value, to_json_value
from unickpt.io.load import LoadReport, load_tensors
from unickpt.io.names import apply_prefix
from unickpt.io.optim_state import (
    apply_groups,
    merge_groups,
    optimizer_tensor_name,
    param_of,
    same_optimizer_class,
    state_targets,
)
from unickpt.io.param_groups import validate_param_groups
from unickpt.io.param_names import check_param_names, model_from_param_names
from unickpt.io.replicas import REPLICA_MODES, check_replicas
from unickpt.io.save import SaveOptions, save_tensors
from unickpt.io.tensors import LocalSlice
from unickpt.io.url_load import open_for_load, read_file_bytes
from unickpt.wrappers import unwrap_optimizer

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
SCHEDULER_FILE = "lr_scheduler.json"


@dataclasses.dataclass
class SavePayload:
    """What one rank saves in one checkpoint: its tensors, the blocks it holds, and the extras.

    ``CheckpointIO.plan_model``/``plan_optimizer`` build it from live objects; ``snapshot``
    copies the blocks to CPU memory (an async save writes the copy while training goes on);
    ``CheckpointIO.write`` saves it.
    """

    kind: str
    tensors: dict[str, torch.Tensor]
    boxes: dict[str, list[LocalSlice]]
    aliases: dict[str, str] = dataclasses.field(default_factory=dict)
    entry_extras: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    block_extras: dict[str, Any] = dataclasses.field(default_factory=dict)

    def snapshot(self, staging: dict[tuple[str, int], torch.Tensor] | None = None) -> SavePayload:
        """A copy whose blocks live in CPU memory (pinned when they come from CUDA).

        ``staging`` keeps the CPU buffers between calls: a caller that snapshots repeatedly
        (the async checkpoint manager, which has one save in flight at most) reuses them, and
        a snapshot is then a plain copy into memory that is already mapped, several times
        faster than allocating fresh buffers each time.
        """
        boxes: dict[str, list[LocalSlice]] = {}
        for name, sls in self.boxes.items():
            out = []
            for i, sl in enumerate(sls):
                src = sl.tensor.detach()
                buf = None if staging is None else staging.get((name, i))
                if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                    buf = _cpu_buffer(src)
                    if staging is not None:
                        staging[(name, i)] = buf
                buf.copy_(src, non_blocking=src.device.type == "cuda")
                out.append(dataclasses.replace(sl, tensor=buf))
            boxes[name] = out
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return dataclasses.replace(self, boxes=boxes)


def _cpu_buffer(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=t.device.type == "cuda")


def hf_config_files(module: torch.nn.Module) -> dict[str, str]:
    """``config.json`` / ``generation_config.json`` contents of a Hugging Face model, if it has them."""
    out: dict[str, str] = {}
    for attr, fname in (("config", "config.json"), ("generation_config", "generation_config.json")):
        to_json = getattr(getattr(module, attr, None), "to_json_string", None)
        if to_json is not None:
            out[fname] = str(to_json())
    return out


def lr_scheduler_json(state: dict[str, Any]) -> bytes:
    """The bytes of ``lr_scheduler.json`` for a scheduler's ``state_dict()``."""
    return json.dumps(
        {"unickpt_lr_scheduler": 1, "state": to_json_value(state, "lr_scheduler")}, indent=2
    ).encode()


class CheckpointIO(CheckpointHooks, AsyncSaveMixin):
    """Save and load models, optimizers and LR schedulers in the unickpt format.

    Args:
        mesh: the plugin's ``DeviceMesh`` (recorded in the index; the IO itself needs none).
        group: process group for coordination (default: the whole world).
        hashes: write an xxh3-64 hash of every stored slice (default on).
        fingerprints: write every tensor's layout-invariant fingerprint (default on).
        fsync: make every data file durable before the index commits it (default on).
        atomic_load: read a rank's whole share into CPU memory before copying any of it, so that
            an I/O error while reading leaves every model untouched, at the price of one extra
            CPU copy of the share (default off: blocks are read in place, one at a time; every
            mismatch and, with ``verify=True``, every hash failure is still found before anything
            is copied).
        check_replicas: what a save does when ranks holding the same block of a tensor (DDP
            replicas, replicated DTensor placements) hold different bytes, of which only one copy
            would be written: ``"warn"`` (default: a ``ReplicaMismatchWarning`` naming the tensors
            and ranks), ``"raise"`` (a ``DistributedError`` on every rank, nothing written) or
            ``"off"`` (no check: saves skip one xxh3 pass over the replicated tensors and one
            all-gather of their digests). Also settable as an attribute.
    """

    plugin_name = "general"
    # Every rank holds every tensor whole (DDP): a tensor some ranks lack is a divergence.
    replicated_everywhere = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        overridden = sorted(name for name in FINAL_METHODS if name in vars(cls))
        if overridden:
            raise TypeError(
                f"{cls.__qualname__} overrides {overridden}: the public CheckpointIO methods are final; "
                "implement the private hooks (_model_tensors, _local_boxes, _optimizer_state, "
                "_set_optimizer_state, _state_parameters, _after_load) instead"
            )

    def __init__(
        self,
        mesh: Any = None,
        group: Any = None,
        *,
        hashes: bool = True,
        fingerprints: bool = True,
        fsync: bool = True,
        atomic_load: bool = False,
        check_replicas: str = "warn",
    ) -> None:
        if check_replicas not in REPLICA_MODES:
            raise ConfigError(f"check_replicas must be one of {REPLICA_MODES}, got {check_replicas!r}")
        self.check_replicas = check_replicas
        self.mesh = mesh
        self.group = group
        self.hashes = hashes
        self.fingerprints = fingerprints
        self.fsync = fsync
        self.atomic_load = atomic_load

    # ------------------------------------------------------------------ hooks
    def layout(self) -> LayoutInfo:
        """The parallel layout recorded in the index."""
        mesh: dict[str, int] = {}
        if self.mesh is not None:
            names = self.mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(self.mesh.ndim))
            mesh = {str(n): int(s) for n, s in zip(names, self.mesh.shape, strict=True)}
        return LayoutInfo(plugin=self.plugin_name, world_size=_dist.world_size(self.group), mesh=mesh)

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
        background thread (see :meth:`wait`); ``use_safetensors`` is accepted, and ``False``
        warns that unickpt writes safetensors regardless.
        """
        self.wait()
        check_use_safetensors(use_safetensors, "save_model")
        payload = self.plan_model(model, prefix=prefix, shard=shard, gather_dtensor=gather_dtensor)
        if use_async:
            config = hf_config_files(self.unwrap_model(model))
            return self._write_async(
                payload,
                checkpoint,
                shard,
                gather_dtensor,
                size_per_shard,
                after=lambda path: write_config_files(config, path),
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

        Each rank reads only the bytes of the blocks it holds. Every problem (missing or
        unexpected names under ``strict``, shape or dtype mismatches always) is reported in
        one ``StateMismatchError`` raised on every rank before anything is copied.
        ``verify=True`` rehashes the slices read first. Returns a ``LoadReport``. An async save
        in flight is waited for first. ``low_cpu_mem_mode``/``num_threads`` (Colossal-AI's
        tuning knobs) are accepted and change nothing: each rank reads its blocks directly.
        """
        del low_cpu_mem_mode, num_threads
        self.wait()
        reader = self._open(checkpoint, "model")
        ctx = HookContext("model", saving=False, model=model)
        try:
            targets = _dist.agreed(
                lambda: self._model_tensors(ctx), "listing the model's tensors to load", self.group
            )
            report = load_tensors(
                reader,
                targets,
                self._boxes_fn(ctx),
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
        payload = self.plan_optimizer(optimizer, prefix=prefix, shard=shard, gather_dtensor=gather_dtensor)
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
    ) -> SavePayload:
        """What this rank saves of ``model``: tied tensors once (the others become aliases).

        ``shard``/``gather_dtensor`` name the layout the payload will be written in (the
        arguments of :meth:`write`); the default is the sliced save of ``CheckpointManager``.
        """
        ctx = HookContext("model", saving=True, model=model, gather=gather_dtensor, shard=shard)
        return _dist.agreed(lambda: self._plan_model(ctx, prefix), "planning the model save", self.group)

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
        return SavePayload("model", stored, self._boxes(stored, ctx), aliases=aliases)

    def plan_optimizer(
        self,
        optimizer: Any,
        prefix: str | None = None,
        *,
        shard: bool = True,
        gather_dtensor: bool = False,
    ) -> SavePayload:
        """Collective: what this rank saves of ``optimizer`` (param groups merged over ranks).

        ``shard``/``gather_dtensor`` as for :meth:`plan_model`. Each local phase is agreed before the next collective: an optimizer that fails on one
        rank (another class, a value JSON cannot hold) raises on every rank, none waits.
        """
        optim, model = _dist.agreed(
            lambda: self._optim_and_model(optimizer), "checking the optimizer to save", self.group
        )
        same_optimizer_class(optim, self.group)
        ctx = HookContext(
            "optimizer", saving=True, model=model, optimizer=optim, gather=gather_dtensor, shard=shard
        )
        had_state = {id(param) for param, st in optim.state.items() if st}
        try:
            osd = _dist.agreed(
                lambda: self._optimizer_state(ctx), "collecting the optimizer's state", self.group
            )
            payload = _dist.agreed(
                lambda: self._plan_optimizer(ctx, osd, had_state, prefix),
                "planning the optimizer save",
                self.group,
            )
        except BaseException:
            # A failed save leaves behind no state torch invented for parameters that never stepped.
            for _, param in self._state_parameters(model):
                if id(param) not in had_state:
                    optim.state.pop(param, None)
            raise
        # Pipeline stages each know part of every group: merge the ranks' views.
        all_groups = _dist.all_gather_object(payload.block_extras["param_groups"], self.group)
        all_scalars = _dist.all_gather_object(payload.block_extras["param_state"], self.group)
        merged_scalars: dict[str, dict[str, Any]] = {}
        for ps in all_scalars:
            merged_scalars.update(ps)
        payload.block_extras = {"param_groups": merge_groups(all_groups), "param_state": merged_scalars}
        return payload

    def _plan_optimizer(
        self, ctx: HookContext, osd: dict[str, Any], had_state: set[int], prefix: str | None
    ) -> SavePayload:
        model, optim = ctx.model, ctx.optim
        p = apply_prefix(prefix)
        # torch fills in state for parameters that never stepped (a zero-gradient step);
        # that state is not the user's and is neither saved nor left behind.
        for fqn, param in self._state_parameters(model):
            if id(param) not in had_state:
                optim.state.pop(param, None)
                osd["state"].pop(fqn, None)
        maybe_fail("optimizer.plan")
        tensors: dict[str, torch.Tensor] = {}
        extras: dict[str, dict[str, Any]] = {}
        param_state: dict[str, dict[str, Any]] = {}
        for fqn, st in osd["state"].items():
            for k, v in st.items():
                if isinstance(v, torch.Tensor):
                    name = optimizer_tensor_name(p + fqn, k)
                    tensors[name] = v
                    extras[name] = {"param": p + fqn, "state": k}
                else:
                    param_state.setdefault(p + fqn, {})[k] = to_json_value(v, f"state[{fqn!r}][{k!r}]")
        groups = [
            {
                **{
                    k: to_json_value(v, f"param_groups[{i}][{k!r}]")
                    for k, v in g.items()
                    if k not in ("params", "param_names")  # the FQNs are "params" already
                },
                "params": [p + f for f in g["params"]],
            }
            for i, g in enumerate(osd["param_groups"])
        ]
        boxes = self._boxes(tensors, ctx)
        return SavePayload(
            "optimizer",
            tensors,
            boxes,
            entry_extras=extras,
            block_extras={"param_groups": groups, "param_state": param_state},
        )

    def write(
        self,
        payload: SavePayload,
        checkpoint: str | os.PathLike[str],
        *,
        shard: bool = True,
        gather_dtensor: bool = True,
        size_per_shard: float = 1024,
        group: Any = None,
    ) -> str:
        """Collective over ``group`` (default: this IO's group): save a payload; returns the committed path.

        With ``gather_dtensor=True`` the live tensors are gathered (collectives on their
        meshes), so a snapshot is written sliced (``gather_dtensor=False``) only.
        """
        boxes = payload.boxes
        check_replicas(
            boxes,
            self.check_replicas,
            f"saving the {payload.kind} to {os.fspath(checkpoint)}",
            self.group if group is None else group,
            everywhere=self.replicated_everywhere,
        )

        def boxes_fn(name: str, tensor: torch.Tensor) -> list[LocalSlice]:
            del tensor
            return boxes[name]

        return save_tensors(
            payload.tensors,
            os.fspath(checkpoint),
            self._options(payload.kind, shard, gather_dtensor, size_per_shard),
            boxes_fn,
            aliases=payload.aliases,
            entry_extras=payload.entry_extras,
            block_extras=payload.block_extras,
            group=self.group if group is None else group,
        )

    def _boxes(self, tensors: dict[str, torch.Tensor], ctx: HookContext) -> dict[str, list[LocalSlice]]:
        return {name: self._local_boxes(name, t, ctx) for name, t in tensors.items()}

    def _boxes_fn(self, ctx: HookContext) -> Callable[[str, torch.Tensor], list[LocalSlice]]:
        """:meth:`_local_boxes` of one call, as the loader asks for it."""
        return lambda name, tensor: self._local_boxes(name, tensor, ctx)

    def load_optimizer(
        self,
        optimizer: Any,
        checkpoint: str | os.PathLike[str],
        verify: bool = False,
        *,
        prefix: str | None = None,
        low_cpu_mem_mode: bool = True,
        num_threads: int = 1,
    ) -> LoadReport:
        """Collective: load optimizer state saved under any layout into this optimizer.

        State is matched by parameter FQN; hyperparameters of each group come from the saved
        group holding the same parameters. A parameter with no saved state (never stepped)
        gets none. ``checkpoint`` is a directory or the single file of an unsharded save.
        ``low_cpu_mem_mode``/``num_threads`` are accepted (Colossal-AI) and change nothing.
        """
        del low_cpu_mem_mode, num_threads
        self.wait()
        optim, model = _dist.agreed(
            lambda: self._optim_and_model(optimizer), "checking the optimizer to load", self.group
        )
        same_optimizer_class(optim, self.group)
        p = apply_prefix(prefix)
        where = os.fspath(checkpoint)
        reader = self._open(checkpoint, "optimizer")
        try:
            block = reader.block
            # Every FQN some rank's optimizer holds (pipeline stages each hold a part).
            mine = [p + f for f, _ in self._state_parameters(model)]
            known = {f for fs in _dist.all_gather_object(mine, self.group) for f in fs}

            def check_groups() -> None:
                maybe_fail("optimizer.load.prepare")
                validate_param_groups(
                    block.param_groups or [],
                    self._live_groups(model, optim),
                    prefix=p,
                    known=known,
                    where=where,
                )

            # Before anything changes: a refused checkpoint leaves the optimizer as it was.
            _dist.agreed(check_groups, f"checking the param_groups of {where}", self.group)
            had_state = {id(param) for param, st in optim.state.items() if st}
            ctx = HookContext("optimizer", saving=False, model=model, optimizer=optim)
            done = False
            saved_params: set[str] = set()
            try:
                report, template, saved_params = self._load_optimizer_state(reader, ctx, p, verify, where)

                def apply() -> None:
                    maybe_fail("optimizer.load.apply")
                    apply_groups(template["param_groups"], block.param_groups or [], p)
                    self._set_optimizer_state(ctx, template)

                _dist.agreed(apply, f"applying the optimizer state of {where}", self.group)
                done = True
                self._after_load(ctx)
            finally:
                # Building the template gave parameters without state fresh state (a zero-gradient
                # step); parameters the checkpoint holds no state for get none, and a failed load
                # leaves none invented behind.
                for fqn, param in self._state_parameters(model):
                    if (done and p + fqn not in saved_params) or (not done and id(param) not in had_state):
                        optim.state.pop(param, None)
            return report
        finally:
            reader.close()

    def _live_groups(self, model: torch.nn.Module, optim: torch.optim.Optimizer) -> list[dict[str, Any]]:
        """The optimizer's param groups with ``params`` as FQN lists, read without changing anything."""
        fqns: dict[int, list[str]] = {}
        for fqn, t in self._state_parameters(model):
            fqns.setdefault(id(t), []).append(fqn)
        return [
            dict(g, params=[f for prm in g["params"] for f in fqns.get(id(prm), [])])
            for g in optim.param_groups
        ]

    def _load_optimizer_state(
        self, reader: CheckpointReader, ctx: HookContext, p: str, verify: bool, where: str
    ) -> tuple[LoadReport, dict[str, Any], set[str]]:
        """Collective: build the state template, then read the saved tensors into it."""
        block = reader.block
        saved_params = {e.param for e in block.tensors.values() if e.param is not None} | set(
            block.param_state
        )

        def prepare() -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
            template = self._optimizer_state(ctx)
            fqns = [f for f, _ in self._state_parameters(ctx.model)]
            return template, state_targets(template, block, p, saved_params, fqns, where)

        template, targets = _dist.agreed(prepare, f"preparing the optimizer to load {where}", self.group)
        owned = {p + f for f in template["state"]}
        report = load_tensors(
            reader,
            targets,
            self._boxes_fn(ctx),
            strict=True,
            verify=verify,
            what="optimizer",
            group=self.group,
            ignore_unexpected=lambda n: param_of(reader, n) not in owned,
            atomic=self.atomic_load,
        )
        return report, template, saved_params

    # ------------------------------------------------------------------ lr scheduler
    def save_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> str:
        """Collective: rank 0 writes the scheduler's state as JSON (``checkpoint`` is a file or a directory)."""
        self.wait()
        path = os.fspath(checkpoint)
        if os.path.isdir(path) or not path.endswith(".json"):
            path = os.path.join(path, SCHEDULER_FILE)
        err: BaseException | None = None
        if _dist.rank(self.group) == 0:
            try:
                maybe_fail("scheduler.save")
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                atomic_write_bytes(path, lr_scheduler_json(lr_scheduler.state_dict()))
            except BaseException as e:
                err = e
        _dist.agree(err, f"saving the LR scheduler to {path}", self.group)
        return path

    def load_lr_scheduler(self, lr_scheduler: Any, checkpoint: str | os.PathLike[str]) -> None:
        """Collective: every rank reads the scheduler JSON and loads it; an error on any rank raises on all."""
        self.wait()
        path = os.fspath(checkpoint)
        if is_url(path) and not path.endswith(".json"):
            path = f"{path.rstrip('/')}/{SCHEDULER_FILE}"
        elif os.path.isdir(path):
            path = os.path.join(path, SCHEDULER_FILE)
        _dist.agreed(lambda: self._load_lr_scheduler(lr_scheduler, path), f"loading {path}", self.group)

    def _load_lr_scheduler(self, lr_scheduler: Any, path: str) -> None:
        maybe_fail("scheduler.load")
        try:
            raw = read_file_bytes(path, getattr(self, "storage_options", None))
            obj = strict_loads(raw.decode("utf-8"), IndexFileError, f"{path}: LR scheduler state")
        except FileNotFoundError as e:
            from unickpt.errors import IncompleteCheckpointError

            raise IncompleteCheckpointError(f"no LR scheduler state at {path}") from e
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise IndexFileError(
                f"{path}: LR scheduler state is not valid JSON ({type(e).__name__}: {e})"
            ) from None
        if not isinstance(obj, dict) or "state" not in obj:
            raise IndexFileError(f"{path}: not a unickpt LR scheduler file (no 'state' key)")
        try:
            state = from_json_value(obj["state"], f"{path}: state")
        except IndexFileError:
            raise
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            raise IndexFileError(f"{path}: malformed LR scheduler state ({type(e).__name__}: {e})") from None
        if not isinstance(state, dict):
            raise IndexFileError(f"{path}: LR scheduler state must be a JSON object")
        lr_scheduler.load_state_dict(state)

    # ------------------------------------------------------------------ helpers
    def _options(self, kind: str, shard: bool, gather: bool, size_mb: float) -> SaveOptions:
        if size_mb <= 0:
            raise ConfigError(f"size_per_shard must be a positive number of MB, got {size_mb}")
        layout = self.layout()
        return SaveOptions(
            kind=kind,
            shard=shard,
            gather=gather,
            size_per_shard_mb=size_mb,
            layout=layout,
            hashes=self.hashes,
            fingerprints=self.fingerprints,
            fsync=self.fsync,
        )

    def _open(self, checkpoint: str | os.PathLike[str], kind: str) -> CheckpointReader:
        # A URL's storage options come from the IO (given at construction) or the environment.
        return open_for_load(checkpoint, kind, self.group, getattr(self, "storage_options", None))

    def _optim_and_model(self, optimizer: Any) -> tuple[torch.optim.Optimizer, torch.nn.Module]:
        optim, model = unwrap_optimizer(optimizer)
        if model is None:
            # torch keeps the names of an optimizer built from model.named_parameters().
            model = model_from_param_names(optim)
            if model is None:
                raise UnsupportedError(
                    "optimizer state is saved keyed by parameter FQN, which needs the model: pass the optimizer "
                    "returned by Booster.boost(), unickpt.OptimizerWrapper(optimizer, model), or an optimizer "
                    "built from model.named_parameters()"
                )
        else:
            check_param_names(optim, self._state_parameters(model))
        return optim, model

    def _save_hf_config(self, model: torch.nn.Module, path: str) -> None:
        """Write config.json / generation_config.json beside the weights when the model has them."""
        if _dist.rank(self.group) != 0:
            return
        maybe_fail("model.hf_config")
        directory = path if os.path.isdir(path) else os.path.dirname(os.path.abspath(path))
        for fname, text in hf_config_files(self.unwrap_model(model)).items():
            atomic_write_bytes(os.path.join(directory, fname), text.encode("utf-8"))
