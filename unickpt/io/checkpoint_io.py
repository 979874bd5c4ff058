"""``CheckpointIO``: the one save/load machinery behind every plugin, and its hooks.

One class holds the whole public API (models, peft adapters, optimizers, LR schedulers; plans,
``write``, async saves' ``wait``/``close``); the hooks a plugin overrides, and their defaults,
are its base ``CheckpointHooks``, defined here with the ``HookContext`` every hook receives and
the names of the final public methods (``FINAL_METHODS``). The hooks hold no IO of their own
(no options, no files, no collectives): their defaults already describe plain tensors, DTensors
of any placement and tied parameters, so a plugin overrides a hook only for state that is not a
DTensor or a plain replicated tensor (ZeRO's flat shards) or that is named differently (tied
copies across pipeline stages). ``GeneralCheckpointIO``, at the end, is the class with the
defaults alone: one process, no parallelism. What is a concept
of its own is a plain module the class calls: the save engine and ``WriteSpec`` (``io/save.py``),
the load engine (``io/load.py``), the background save in flight and its writer process
(``AsyncSaves``, ``io/async_save.py``), the optimizer state as a payload (``io/optimizer.py``),
the adapters' files (``io/adapters.py``), the side files (``io/side_files.py``).

Public methods own validation, rank coordination and the commit; they are collective:
every rank of the job calls each of them, in the same order, with its own view of the
model. They are final (``CheckpointIO.__init_subclass__`` refuses a subclass that overrides
one). A plugin's subclass describes only what differs for its parallelism, through the
private hooks ``_model_tensors``, ``_local_slices``, ``_optimizer_state``,
``_set_optimizer_state``, ``_state_parameters`` and ``_after_load``; each public call passes
them one ``HookContext`` (what is being done: kind, save or load, gathered or sliced, the
model and optimizer), so no hook depends on state left on the IO by the call. The defaults
already handle plain tensors (replicated: one rank writes each), DTensors of any placement
(each rank writes the slice it holds), tied parameters and wrapper-free names, so DDP,
FSDP2, TP and their combinations need no checkpoint code of their own.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt._rng import keeps_python_random
from unickpt.ckpt.reader import CheckpointReader
from unickpt.errors import ConfigError, IncompleteCheckpointError, UnsupportedError
from unickpt.io.async_save import AsyncSaves
from unickpt.io.load import LoadReport, load_tensors, open_for_load
from unickpt.io.mapping import map_payload, resolve_mapping
from unickpt.io.optimizer import (
    apply_groups,
    check_param_names,
    init_state,
    merge_optimizer_extras,
    model_from_param_names,
    optimizer_payload,
    param_of,
    same_optimizer_class,
    state_targets,
    validate_param_groups,
)
from unickpt.io.pinned import POOL, wait_staged
from unickpt.io.replicas import REPLICA_MODES
from unickpt.io.save import WriteSpec
from unickpt.io.side_files import (
    SCHEDULER_FILE,
    hf_config_files,
    lr_scheduler_json,
    read_lr_scheduler_state,
    write_config_files,
)
from unickpt.io.tensors import (
    LocalSlice,
    SavePayload,
    apply_prefix,
    is_dtensor,
    local_slices,
    mesh_dims,
    normalize_name,
    unwrap_model,
)
from unickpt.io.write_strategy import SaveOptions, check_size_per_shard, check_use_safetensors
from unickpt.spec.index import LayoutInfo
from unickpt.spec.naming import optimizer_tensor_name
from unickpt.store.publish import write_small_file
from unickpt.store.storage import compared_location, join_location, side_file, url_options
from unickpt.wrappers import OptimizerWrapper, unwrap_optimizer

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.distributed.device_mesh import DeviceMesh

# CheckpointIO and its hooks are this module's own; the other names are re-exported from the
# modules that define them, for code written when they lived here.
__all__ = [
    "DETACHED_NOTE",
    "GeneralCheckpointIO",
    "FINAL_METHODS",
    "CheckpointHooks",
    "CheckpointIO",
    "HookContext",
    "LoadReport",
    "SavePayload",
    "hf_config_files",
    "lr_scheduler_json",
    "optimizer_tensor_name",
]

logger = get_logger(__name__)

# What ``save_model``/``load_model`` take as ``mapping``: a list of transformers'
# ``WeightRenaming``/``WeightConverter``, ``None`` (transformers' own) or ``False`` (none).
WeightMapping = list[Any] | tuple[Any, ...] | bool | None


class SchedulerState(Protocol):
    """An LR scheduler as ``save_lr_scheduler``/``load_lr_scheduler`` use it (torch's ``LRScheduler``)."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


# HookContext.notes key of a model load's state dict when some entries are not the module's own.
DETACHED_NOTE = -1


def _storage_ptr(t: torch.Tensor) -> int:
    local = t.to_local() if is_dtensor(t) else t  # type: ignore[attr-defined]
    return int(local.untyped_storage().data_ptr())


def _storages(module: torch.nn.Module) -> set[int]:
    """The storages of ``module``'s parameters and buffers."""
    return {_storage_ptr(t) for t in [*module.parameters(), *module.buffers()] if t.numel()}


# The public API: plugins customise the hooks, never these.
FINAL_METHODS = (
    "save_model",
    "load_model",
    "save_adapter",
    "load_adapter",
    "save_optimizer",
    "load_optimizer",
    "save_lr_scheduler",
    "load_lr_scheduler",
    "plan_model",
    "plan_optimizer",
    "write",
    "write_spec",
    "wait",
    "close",
    "synchronize",
)


@dataclasses.dataclass(frozen=True)
class HookContext:
    """What one public call is doing, handed to every hook it calls.

    ``kind`` is ``"model"`` or ``"optimizer"``; ``saving`` tells a save from a load; ``gather``
    and ``shard`` are the layout a save writes (``gather`` is False on loads); ``model`` and
    ``optimizer`` are the unwrapped objects of the call (``optimizer`` is None for models).
    ``notes`` belongs to the call: what a hook learns while listing tensors that a later hook
    of the same call needs (ZeRO's flat ranges, keyed by ``id`` of the listed tensor), so
    nothing of one call is left on the IO.
    """

    kind: str
    saving: bool
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    gather: bool = False
    shard: bool = True
    notes: dict[int, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @property
    def optim(self) -> torch.optim.Optimizer:
        """The optimizer of an optimizer call."""
        if self.optimizer is None:
            raise UnsupportedError(f"a hook of a {self.kind} call asked for the optimizer")
        return self.optimizer


class CheckpointHooks:
    """The default hooks of ``CheckpointIO``, its base (every call passes its ``HookContext``)."""

    def unwrap_model(self, model: torch.nn.Module) -> torch.nn.Module:
        return unwrap_model(model)

    def _model_tensors(self, ctx: HookContext) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers by checkpoint name (tied ones share a tensor).

        A module's ``state_dict`` hooks may return fresh tensors instead of its own (a fused
        weight saved split); for a load the state dict is then noted in ``ctx`` so that
        ``CheckpointIO`` gives what was loaded into them to ``load_state_dict``.
        """
        module = self.unwrap_model(ctx.model)
        out: dict[str, torch.Tensor] = {}
        sd = module.state_dict(keep_vars=True)
        own = None if ctx.saving else _storages(module)
        detached = False
        for name, t in sd.items():
            if not isinstance(t, torch.Tensor):
                raise UnsupportedError(f"state_dict entry {name!r} is a {type(t).__name__}, not a tensor")
            out[normalize_name(name)] = t
            if own is not None and t.numel() and _storage_ptr(t) not in own:
                detached = True
        if detached:
            ctx.notes[DETACHED_NOTE] = sd
        return out

    def _local_slices(self, name: str, tensor: torch.Tensor, ctx: HookContext) -> list[LocalSlice]:
        """The local slices of the global tensor ``name`` that ``tensor`` holds on this rank."""
        del ctx
        return local_slices(name, tensor)

    def _after_load(self, ctx: HookContext) -> None:
        """Called on every rank once a load has copied everything in (ZeRO refreshes its shards)."""

    def _optimizer_state(self, ctx: HookContext) -> dict[str, Any]:
        """FQN-keyed optimizer state: ``{"state": {fqn: {key: value}}, "param_groups": [...]}``.

        While loading, every parameter gets its state slots first (to be filled from the
        checkpoint). While saving, an optimizer without state (never stepped, or stateless such
        as SGD without momentum) is described without asking torch, which would invent state
        with a zero-gradient step on every save.
        """
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        model, optim = ctx.model, ctx.optim
        if not ctx.saving:
            init_state(optim)
        elif not optim.state:
            fqn_of = {id(prm): fqn for fqn, prm in self._state_parameters(model)}
            groups = []
            for g in optim.param_groups:
                missing = [tuple(prm.shape) for prm in g["params"] if id(prm) not in fqn_of]
                if missing:
                    raise UnsupportedError(
                        f"the optimizer updates {len(missing)} tensor(s) that are not parameters of the model "
                        f"(shapes {missing[:3]}); build it on model.parameters()"
                    )
                groups.append(dict(g, params=[fqn_of[id(prm)] for prm in g["params"]]))
            return {"state": {}, "param_groups": groups}
        osd: dict[str, Any] = dict(get_optimizer_state_dict(self.unwrap_model(model), optim))
        state = {normalize_name(k): v for k, v in osd["state"].items()}
        groups = [dict(g, params=[normalize_name(p) for p in g["params"]]) for g in osd["param_groups"]]
        return {"state": state, "param_groups": groups}

    def _set_optimizer_state(self, ctx: HookContext, osd: dict[str, Any]) -> None:
        """Put the loaded state ``osd`` (as :meth:`_optimizer_state` listed it) into the optimizer."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        # strict=False: parameters that never stepped have no saved state and get none (torch's
        # strict mode refuses them with "Missing optimizer state for parameter").
        set_optimizer_state_dict(
            self.unwrap_model(ctx.model),
            ctx.optim,
            osd,  # type: ignore[arg-type]
            options=StateDictOptions(strict=False),
        )

    def _state_parameters(self, model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
        """``(fqn, tensor)`` for every parameter, where ``tensor`` is the key of its ``optimizer.state``.

        The default is the model's parameters. A plugin whose optimizer keeps state on other
        tensors (ZeRO's flat shards) or under other names (tied copies across pipeline stages)
        overrides it.
        """
        return [(normalize_name(n), prm) for n, prm in self.unwrap_model(model).named_parameters()]


class CheckpointIO(CheckpointHooks):
    """Save and load models, peft adapters, optimizers and LR schedulers in the unickpt format.

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

    plugin_name = "general"
    # Every rank holds every tensor whole (DDP): a tensor some ranks lack is a divergence.
    replicated_everywhere = False

    def __init__(
        self,
        mesh: DeviceMesh | None = None,
        group: ProcessGroup | None = None,
        *,
        hashes: bool = True,
        fingerprints: bool = True,
        fsync: bool = True,
        atomic_load: bool = False,
        check_replicas: str = "warn",
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        # fsspec options (credentials, endpoint) of checkpoint URLs; None: the environment's.
        self.storage_options = storage_options
        if check_replicas not in REPLICA_MODES:
            raise ConfigError(f"check_replicas must be one of {REPLICA_MODES}, got {check_replicas!r}")
        self.check_replicas = check_replicas
        self.mesh = mesh
        self.group = group
        self.hashes = hashes
        self.fingerprints = fingerprints
        self.fsync = fsync
        self.atomic_load = atomic_load

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
        mapping: WeightMapping = None,
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

        ``mapping`` (a gathered save, ``gather_dtensor=True``): the names and tensors written, as
        :meth:`load_model` takes it, reversed. By default a transformers model whose weights
        transformers maps on load (fused MoE experts) is written under the Hub's names, one
        tensor per expert, as ``save_pretrained`` writes it; each rank writes the experts it
        holds. ``False`` writes the names the model holds. A sliced save always keeps them.
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
        payload = self.plan_model(
            model,
            prefix=prefix,
            shard=shard,
            gather_dtensor=gather_dtensor,
            args=args,
            mapping=mapping if gather_dtensor else False,
        )
        if use_async:
            config = hf_config_files(self.unwrap_model(model))
            return self._write_async(
                payload,
                checkpoint,
                shard,
                gather_dtensor,
                size_per_shard,
                after=lambda path: write_config_files(config, path, self.storage_options),
                model=model,
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
        mapping: WeightMapping = None,
    ) -> LoadReport:
        """Collective: load a checkpoint of any layout and world size into this model, in place.

        Each rank reads only the bytes of the slices it holds. Every problem (missing or
        unexpected names under ``strict``, shape or dtype mismatches always) is reported in
        one ``StateMismatchError`` raised on every rank before anything is copied.
        ``verify=True`` rehashes the slices read first. Returns a ``LoadReport``. An async save
        in flight is waited for first. ``low_cpu_mem_mode``/``num_threads`` (Colossal-AI's
        tuning knobs) are accepted and change nothing: each rank reads its slices directly.

        ``mapping``: how stored tensors the model does not hold by name make up its tensors, as a
        list of transformers' ``WeightRenaming``/``WeightConverter`` (``transformers.core_model_loading``;
        ops ``MergeModulelist``, ``SplitModulelist``, ``Concatenate``, ``Chunk``, ``Split``,
        ``Transpose``, ``Interleave``). The default ``None`` uses transformers' own conversion
        mapping for a transformers model (``get_model_conversion_mapping``), so a Hub checkpoint
        with one tensor per expert (Mixtral's ``block_sparse_moe.experts.3.w1.weight``) loads into
        the fused experts transformers holds in memory (``mlp.experts.gate_up_proj``); ``False``
        maps nothing. Names the checkpoint holds as they are never go through the mapping. Each
        rank still reads only the bytes of its own slices: an FSDP shard of ``gate_up_proj`` reads
        its own experts' ``w1``/``w3`` tensors. A mapping that does not fit (an expert's tensor
        missing, a shape that differs) is a ``StateMismatchError`` naming the tensor.
        """
        del low_cpu_mem_mode, num_threads
        self.wait()
        args = _dist.Args(
            "load_model",
            {
                "checkpoint": compared_location(checkpoint),
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
            targets, transforms = _dist.agreed(
                lambda: (
                    self._model_tensors(ctx),
                    resolve_mapping(self.unwrap_model(model), mapping, saving=False),
                ),
                "listing the model's tensors to load",
                self.group,
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
                transforms=transforms,
            )
        finally:
            reader.close()
        self._hand_back(ctx)
        self._after_load(ctx)
        return report

    def _hand_back(self, ctx: HookContext) -> None:
        """After a model load: state dict entries that are not the module's own tensors reach it
        through ``load_state_dict`` (whose hooks put them back, e.g. fuse the split weight)."""
        sd = ctx.notes.get(DETACHED_NOTE)
        if sd is not None:
            with torch.no_grad():
                self.unwrap_model(ctx.model).load_state_dict(sd, strict=False)

    # ------------------------------------------------------------------ peft adapter
    def save_adapter(
        self,
        model: torch.nn.Module,
        checkpoint: str | os.PathLike[str],
        adapter_name: str = "default",
        save_embedding_layers: bool | str = "auto",
    ) -> str:
        """Collective: save a ``PeftModel``'s adapter alone, as ``peft.PeftModel.from_pretrained`` loads it.

        ``checkpoint`` is a directory: it gets ``adapter_model.safetensors`` (the adapter's
        tensors under peft's names, those of ``peft.utils.get_peft_model_state_dict``, gathered
        whole whatever the parallelism: DTensors are gathered, replicated tensors written by one
        rank; the file is committed atomically and its header metadata carries unickpt's hashes
        and fingerprints, which peft's loader ignores) and then ``adapter_config.json`` (the
        adapter's config, as ``PeftModel.save_pretrained`` writes it). ``save_embedding_layers``
        is peft's. Returns the path of the weights file. The weights file is the commit point:
        a save that dies before it leaves the previous adapter's file; one that dies between it
        and the config leaves the new weights beside the previous ``adapter_config.json``
        (``load_adapter`` refuses a config that does not match the model's adapter), so save
        each step to a directory of its own.
        """
        from unickpt.io.adapters import ADAPTER_CONFIG, adapter_paths

        self.wait()
        directory, weights = adapter_paths(checkpoint)
        args = _dist.Args(
            "save_adapter",
            {
                "checkpoint": compared_location(checkpoint),
                "adapter_name": adapter_name,
                "save_embedding_layers": save_embedding_layers,
            },
        )
        ctx = HookContext("model", saving=True, model=model, gather=True, shard=False)
        payload, config = _dist.agreed(
            lambda: self._plan_adapter(ctx, adapter_name, save_embedding_layers),
            "planning the adapter save",
            self.group,
            args,
        )
        path = self.write(payload, weights, shard=False, gather_dtensor=True)

        def write_config() -> None:
            if _dist.rank(self.group) == 0:
                write_small_file(join_location(directory, ADAPTER_CONFIG), config, self.storage_options)

        _dist.agreed(write_config, f"writing {ADAPTER_CONFIG} beside {path}", self.group)
        return path

    def _plan_adapter(
        self, ctx: HookContext, adapter_name: str, save_embedding_layers: bool | str
    ) -> tuple[SavePayload, bytes]:
        from unickpt.io.adapters import adapter_config_json, adapter_tensors, peft_model_of

        module = peft_model_of(self.unwrap_model(ctx.model), "save_adapter")
        tensors = self._model_tensors(ctx)
        names = adapter_tensors(module, tensors, adapter_name, save_embedding_layers, "save_adapter")
        stored = {peft: tensors[src] for peft, src in names.items()}
        slices = {
            peft: [dataclasses.replace(sl, name=peft) for sl in self._local_slices(src, tensors[src], ctx)]
            for peft, src in names.items()
        }
        return SavePayload("model", stored, slices), adapter_config_json(module, adapter_name, "save_adapter")

    def load_adapter(
        self,
        model: torch.nn.Module,
        checkpoint: str | os.PathLike[str],
        adapter_name: str = "default",
        strict: bool = True,
        verify: bool = False,
        *,
        allow_dtype_cast: bool = False,
    ) -> LoadReport:
        """Collective: load an adapter saved by :meth:`save_adapter` or by peft's ``save_pretrained``
        into the adapter ``adapter_name`` of this ``PeftModel``, whatever its layout, in place.

        ``checkpoint``: the adapter's directory (or its ``adapter_model.safetensors``). Its
        ``adapter_config.json``, when present, must describe the model's adapter (``r``,
        ``lora_alpha``, ``target_modules``...: a ``ConfigError`` names each field that differs).
        Each rank reads the bytes of the slices it holds, as :meth:`load_model`; every missing,
        unexpected or mismatched tensor is reported in one ``StateMismatchError`` before anything
        is copied. ``verify=True`` checks unickpt's hashes (a file peft wrote has none).
        Embedding layers a file holds (peft's ``save_embedding_layers``) are loaded too.
        """
        from unickpt.io.adapters import adapter_paths

        self.wait()
        directory, weights = adapter_paths(checkpoint)
        args = _dist.Args(
            "load_adapter",
            {
                "checkpoint": compared_location(checkpoint),
                "adapter_name": adapter_name,
                "strict": strict,
                "verify": verify,
                "allow_dtype_cast": allow_dtype_cast,
            },
        )
        ctx = HookContext("model", saving=False, model=model)
        _dist.agreed(
            lambda: self._check_adapter_config(ctx, directory, adapter_name),
            f"reading the adapter config in {directory}",
            self.group,
            args,
        )
        reader = self._open(weights, "model")
        try:
            targets, src_of = _dist.agreed(
                lambda: self._adapter_targets(ctx, adapter_name, set(reader.tensors)),
                "listing the adapter's tensors to load",
                self.group,
            )

            def slices_fn(name: str, tensor: torch.Tensor) -> list[LocalSlice]:
                return [
                    dataclasses.replace(sl, name=name) for sl in self._local_slices(src_of[name], tensor, ctx)
                ]

            report = load_tensors(
                reader,
                targets,
                slices_fn,
                strict=strict,
                verify=verify,
                allow_dtype_cast=allow_dtype_cast,
                what="adapter",
                group=self.group,
                atomic=self.atomic_load,
            )
        finally:
            reader.close()
        self._hand_back(ctx)
        self._after_load(ctx)
        return report

    def _check_adapter_config(self, ctx: HookContext, directory: str, adapter_name: str) -> None:
        from unickpt.io.adapters import (
            ADAPTER_CONFIG,
            check_adapter_config,
            peft_model_of,
            read_adapter_config,
        )

        module = peft_model_of(self.unwrap_model(ctx.model), "load_adapter")
        options = url_options(directory, self.storage_options)
        try:
            found = read_adapter_config(directory, options)
        except IncompleteCheckpointError:
            return  # a bare weights file: its tensors' shapes are still checked
        check_adapter_config(
            module, adapter_name, found, join_location(directory, ADAPTER_CONFIG), "load_adapter"
        )

    def _adapter_targets(
        self, ctx: HookContext, adapter_name: str, stored: set[str]
    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """peft name -> the model's tensor to load it into, and peft name -> checkpoint name: the
        adapter's tensors (``save_embedding_layers=False``) and any other model tensor the file
        holds under its own name (embedding layers peft saved beside the adapter)."""
        from unickpt.io.adapters import adapter_tensors, peft_model_of

        module = peft_model_of(self.unwrap_model(ctx.model), "load_adapter")
        tensors = self._model_tensors(ctx)
        src_of = adapter_tensors(module, tensors, adapter_name, False, "load_adapter")
        taken = set(src_of.values())
        for name in sorted(stored - set(src_of)):
            if name in tensors and name not in taken:
                src_of[name] = name
        return {peft: tensors[src] for peft, src in src_of.items()}, src_of

    # ------------------------------------------------------------------ optimizer
    def save_optimizer(
        self,
        optimizer: torch.optim.Optimizer | OptimizerWrapper,
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

    def plan_optimizer(
        self,
        optimizer: torch.optim.Optimizer | OptimizerWrapper,
        prefix: str | None = None,
        *,
        shard: bool = True,
        gather_dtensor: bool = False,
        args: _dist.Args | None = None,
    ) -> SavePayload:
        """Collective: what this rank saves of ``optimizer`` (param groups merged over ranks).

        ``shard``/``gather_dtensor`` as for :meth:`plan_model`; ``args``: the calling save's
        arguments, checked equal on every rank by the first agreement. Each local phase is agreed before the next collective: an optimizer that fails on one
        rank (another class, a value JSON cannot hold) raises on every rank, none waits.
        """
        optim, model = _dist.agreed(
            lambda: self._optim_and_model(optimizer), "checking the optimizer to save", self.group, args
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
        payload.block_extras = merge_optimizer_extras(all_groups, all_scalars)
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
        return optimizer_payload(osd, p, lambda tensors: self._local_slices_of(tensors, ctx))

    def load_optimizer(
        self,
        optimizer: torch.optim.Optimizer | OptimizerWrapper,
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
        ``low_cpu_mem_mode``/``num_threads`` are accepted (Colossal-AI) and change nothing; a
        string in the third place is Colossal-AI's positional ``prefix``.
        """
        del low_cpu_mem_mode, num_threads
        if isinstance(verify, str) and prefix is None:  # Colossal-AI's third positional is prefix
            prefix, verify = verify, False
        self.wait()
        args = _dist.Args(
            "load_optimizer",
            {"checkpoint": compared_location(checkpoint), "verify": verify, "prefix": prefix},
            check=lambda: apply_prefix(prefix),
        )
        optim, model = _dist.agreed(
            lambda: self._optim_and_model(optimizer), "checking the optimizer to load", self.group, args
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
            self._local_slices_fn(ctx),
            strict=True,
            verify=verify,
            what="optimizer",
            group=self.group,
            ignore_unexpected=lambda n: param_of(reader, n) not in owned,
            atomic=self.atomic_load,
        )
        return report, template, saved_params

    def _optim_and_model(
        self, optimizer: torch.optim.Optimizer | OptimizerWrapper
    ) -> tuple[torch.optim.Optimizer, torch.nn.Module]:
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

    # ------------------------------------------------------------------ plan + write
    def plan_model(
        self,
        model: torch.nn.Module,
        prefix: str | None = None,
        *,
        shard: bool = True,
        gather_dtensor: bool = False,
        args: _dist.Args | None = None,
        mapping: WeightMapping = False,
    ) -> SavePayload:
        """What this rank saves of ``model``: tied tensors once (the others become aliases).

        ``shard``/``gather_dtensor`` name the layout the payload will be written in (the
        arguments of :meth:`write`); the default is the sliced save of ``CheckpointManager``.
        ``args``: the calling save's arguments, checked equal on every rank by this agreement.
        ``mapping``: as :meth:`save_model` takes it (default: none, the names the model holds).
        """
        ctx = HookContext("model", saving=True, model=model, gather=gather_dtensor, shard=shard)

        def plan() -> SavePayload:
            payload = self._plan_model(ctx, prefix)
            if mapping is False:  # the names the model holds: nothing to resolve
                return payload
            transforms = resolve_mapping(self.unwrap_model(model), mapping, saving=True)
            return map_payload(payload, transforms) if transforms else payload

        return _dist.agreed(plan, "planning the model save", self.group, args)

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
            "checkpoint": compared_location(checkpoint),
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

    def layout(self) -> LayoutInfo:
        """The parallel layout recorded in the index."""
        return LayoutInfo(
            plugin=self.plugin_name, world_size=_dist.world_size(self.group), mesh=mesh_dims(self.mesh)
        )

    def write(
        self,
        payload: SavePayload,
        checkpoint: str | os.PathLike[str],
        *,
        shard: bool = True,
        gather_dtensor: bool = True,
        size_per_shard: float = 1024,
        group: ProcessGroup | None = None,
    ) -> str:
        """Collective over ``group`` (default: this IO's group): save a payload; returns the committed path.

        With ``gather_dtensor=True`` the live tensors are gathered (collectives on their
        meshes), so a snapshot is written sliced (``gather_dtensor=False``) only.
        """
        spec = self.write_spec(payload.kind, shard, gather_dtensor, size_per_shard)
        return spec.write(payload, checkpoint, self.group if group is None else group)

    def write_spec(self, kind: str, shard: bool, gather_dtensor: bool, size_per_shard: float) -> WriteSpec:
        """What :meth:`write` needs of this IO, as a picklable value (an async save's writer process runs it)."""
        return WriteSpec(
            self._options(kind, shard, gather_dtensor, size_per_shard),
            self.check_replicas,
            self.replicated_everywhere,
        )

    def _options(self, kind: str, shard: bool, gather: bool, size_mb: float) -> SaveOptions:
        size_mb = check_size_per_shard(size_mb)
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
            storage_options=self.storage_options,
        )

    # ------------------------------------------------------------------ async saves
    @property
    def _async(self) -> AsyncSaves:
        saves: AsyncSaves | None = self.__dict__.get("_async_saves")
        if saves is None:
            saves = self.__dict__["_async_saves"] = AsyncSaves()
        return saves

    def _write_async(
        self,
        payload: SavePayload,
        checkpoint: str | os.PathLike[str],
        shard: bool,
        gather_dtensor: bool,
        size_per_shard: float,
        after: Callable[[str], None] | None = None,
        model: torch.nn.Module | None = None,
    ) -> str:
        """Collective: copy ``payload`` to CPU memory now, write and commit the copy in the background
        (``AsyncSaves.save``). Returns the path the save will commit; ``after(path)`` runs on rank 0
        once committed. ``model``'s forwards wait for the copies of its buffers still running.
        """
        # Bad arguments raise now, not in the background.
        spec = self.write_spec(payload.kind, shard, gather_dtensor, size_per_shard)
        return self._async.save(spec, payload, checkpoint, self.group, after, model)

    def wait(self) -> None:
        """Block until this IO's async save in flight is committed; raise its error, if it failed.

        Every rank calls it. Every save and load through this IO waits first, so a load never
        reads a checkpoint still being written. Colossal-AI's name, ``_sync_io()``, works too.
        """
        saves: AsyncSaves | None = self.__dict__.get("_async_saves")
        if saves is not None:  # none yet: this IO never saved in the background, nothing is in flight
            saves.wait()

    def _sync_io(self) -> None:
        """Colossal-AI's name for :meth:`wait`."""
        self.wait()

    def synchronize(self) -> None:
        """Colossal-AI: call before the weights change. Blocks until the copies of the async
        snapshot are done (they run on a side CUDA stream; an optimizer step and the forward of
        a module whose buffers are being copied wait for them by themselves, a tensor changed
        otherwise needs this call; on CPU they are done already)."""
        wait_staged()

    def _sync_d2h(self) -> None:
        """Colossal-AI's name for :meth:`synchronize`."""
        self.synchronize()

    def release_staging(self) -> int:
        """Free the process's snapshot buffers (exact-size, pinned on CUDA: ``io/pinned.py``) that
        no save in flight uses, those of every IO and manager: the next async save allocates
        (and pins) again. Returns the bytes freed now; a set in use goes when its save ends.
        They are freed at exit too."""
        return POOL.release()

    def close(self) -> None:
        """Wait for the async save in flight (raising its error), then stop this IO's writer process.

        Every rank calls it. Optional: the writer stops at exit too; a later async save starts
        a new one.
        """
        self._async.close()

    # ------------------------------------------------------------------ lr scheduler
    def save_lr_scheduler(self, lr_scheduler: SchedulerState, checkpoint: str | os.PathLike[str]) -> str:
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
            _dist.Args("save_lr_scheduler", {"checkpoint": compared_location(checkpoint)}),
        )
        # A directory gets the scheduler's file; a .json name, or an existing file, is the file.
        path = side_file(checkpoint, SCHEDULER_FILE, ".json")
        err: BaseException | None = None
        if _dist.rank(self.group) == 0:
            try:
                maybe_fail("scheduler.save")
                write_small_file(path, lr_scheduler_json(lr_scheduler.state_dict()), self.storage_options)
            except BaseException as e:
                err = e
        _dist.agree(err, f"saving the LR scheduler to {path}", self.group)
        return path

    def load_lr_scheduler(self, lr_scheduler: SchedulerState, checkpoint: str | os.PathLike[str]) -> None:
        """Collective: every rank reads the scheduler JSON and loads it; an error on any rank raises on all."""
        self.wait()
        # Before any rank changes its scheduler.
        _dist.agree(
            None,
            "loading the LR scheduler",
            self.group,
            _dist.Args("load_lr_scheduler", {"checkpoint": compared_location(checkpoint)}),
        )
        path = side_file(checkpoint, SCHEDULER_FILE, ".json")  # as save_lr_scheduler names it
        given = os.fspath(checkpoint)
        _dist.agreed(
            lambda: self._load_lr_scheduler(lr_scheduler, path, given), f"loading {path}", self.group
        )

    def _load_lr_scheduler(self, lr_scheduler: SchedulerState, path: str, given: str) -> None:
        maybe_fail("scheduler.load")
        lr_scheduler.load_state_dict(read_lr_scheduler_state(path, self.storage_options, given))

    # ------------------------------------------------------------------ helpers
    @keeps_python_random
    def _open(
        self, checkpoint: str | os.PathLike[str], kind: str, args: _dist.Args | None = None
    ) -> CheckpointReader:
        # A URL's storage options come from the IO (given at construction) or the environment;
        # a local path ignores them.
        options = url_options(checkpoint, self.storage_options)
        return open_for_load(checkpoint, kind, self.group, options, args)

    def _local_slices_of(
        self, tensors: dict[str, torch.Tensor], ctx: HookContext
    ) -> dict[str, list[LocalSlice]]:
        return {name: self._local_slices(name, t, ctx) for name, t in tensors.items()}

    def _local_slices_fn(self, ctx: HookContext) -> Callable[[str, torch.Tensor], list[LocalSlice]]:
        """:meth:`_local_slices` of one call, as the loader asks for it."""
        return lambda name, tensor: self._local_slices(name, tensor, ctx)

    def _save_hf_config(self, model: torch.nn.Module, path: str) -> None:
        """Write config.json / generation_config.json beside the weights when the model has them."""
        if _dist.rank(self.group) != 0:
            return
        maybe_fail("model.hf_config")
        write_config_files(hf_config_files(self.unwrap_model(model)), path, self.storage_options)


class GeneralCheckpointIO(CheckpointIO):
    """Checkpoint IO for a model on one process (no parallelism).

    It is ``CheckpointIO`` with no mesh: the same planner, writer, hashes and commit as the
    distributed plugins, so its checkpoints load under any of them and the reverse.
    """

    plugin_name = "general"
