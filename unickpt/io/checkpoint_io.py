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

import dataclasses
import os
from typing import Any

import torch

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt._logging import get_logger
from unickpt.errors import IncompleteCheckpointError
from unickpt.format.storage import is_url
from unickpt.io.async_save import check_use_safetensors
from unickpt.io.core import check_size_per_shard
from unickpt.io.hooks import FINAL_METHODS, HookContext
from unickpt.io.load import LoadReport, load_tensors
from unickpt.io.mapping import map_payload, resolve_mapping
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
from unickpt.io.tensors import LocalSlice
from unickpt.store.publish import write_small_file

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
        mapping: Any = None,
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
        mapping: Any = None,
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
                "checkpoint": _dist.path_arg(checkpoint),
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
                sep = "/" if is_url(directory) else os.sep
                write_small_file(f"{directory}{sep}{ADAPTER_CONFIG}", config, self.storage_options)

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
                "checkpoint": _dist.path_arg(checkpoint),
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
        options = self.storage_options if is_url(directory) else None
        try:
            found = read_adapter_config(directory, options)
        except IncompleteCheckpointError:
            return  # a bare weights file: its tensors' shapes are still checked
        sep = "/" if is_url(directory) else os.sep
        check_adapter_config(module, adapter_name, found, f"{directory}{sep}{ADAPTER_CONFIG}", "load_adapter")

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
        mapping: Any = False,
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
