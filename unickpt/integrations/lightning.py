"""Lightning's checkpoints as unickpt checkpoints: ``Trainer(plugins=[UnickptCheckpointIO()])``.

The checkpoint "file" Lightning names (``epoch=0-step=4.ckpt``, ``last.ckpt``) becomes a directory::

    <name>.ckpt/model/            the LightningModule's state_dict: Hugging Face sharded safetensors
                                  with unickpt's index, slice hashes and fingerprints
                                  (``unickpt verify <name>.ckpt/model``)
    <name>.ckpt/state/            every other tensor of the checkpoint dict (optimizer states,
                                  callback and loop tensors), the same kind of checkpoint
    <name>.ckpt/lightning.json    the rest of the dict (epoch, global_step, loops, callbacks,
                                  lr_schedulers, hyper_parameters...), tensors referenced by name

Nothing is pickled. ``lightning.json`` is the checkpoint's commit file, written last; the
directory is published as one (``store.publish.PartsOutput``). Locally it is written beside its
final name and renamed into place (an existing checkpoint of that name is swapped out
atomically): a crash leaves the previous checkpoint or the new one, never a half-written one.
An fsspec URL (``s3://...``, Lightning's ``dirpath`` on an object store; credentials and endpoint
from fsspec's configuration or the environment, as Lightning's own file system takes them) is
written in place under the prefix's save lock: a save over an existing checkpoint of that name
first un-commits it (deletes its ``lightning.json``), so a crash there leaves no checkpoint of
that name, never a mix. Loading rehashes every slice and returns the dict exactly as it was saved
(tensors bit for bit, tuples and integer keys kept).

Strategies: Lightning calls a ``CheckpointIO`` plugin from the single-device and DDP strategies
(``Strategy.save_checkpoint`` on global rank 0, ``load_checkpoint`` on every rank; unickpt then
works over a process group of the calling process alone). Lightning 2.6's ``FSDPStrategy`` and
``ModelParallelStrategy`` bypass it (they write and read DCP, or ``torch.save`` / ``torch.load``
a file, themselves): pass ``strategy=UnickptModelParallelStrategy(...)`` or
``UnickptFSDPStrategy(...)`` instead (same arguments). Their checkpoints are directories of the
same kind, with ``model/`` and ``optimizer_<i>/`` written by every rank: the DTensor slices each
holds under ``UnickptModelParallelStrategy`` (FSDP2 / TP), full state dicts gathered with torch's
``get_model_state_dict`` / ``get_optimizer_state_dict`` and written by rank 0 under
``UnickptFSDPStrategy`` (FSDP1's flat parameters are not DTensors). DeepSpeed's strategy saves
through DeepSpeed's engine.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

from unickpt.errors import (
    DistributedError,
    IncompleteCheckpointError,
    IndexFileError,
    StateMismatchError,
    UnsupportedError,
)
from unickpt.integrations._state import (
    decode_state,
    encode_state,
    load_tensors,
    parse_state,
    read_json,
    save_tensors,
    state_json,
    write_json,
)
from unickpt.io import CheckpointIO
from unickpt.store.publish import PartsOutput, open_parts, remove_parts
from unickpt.store.storage import join_location
from unickpt.wrappers import OptimizerWrapper

__all__ = [
    "UnickptCheckpointIO",
    "UnickptFSDPStrategy",
    "UnickptModelParallelStrategy",
    "STATE_FILE",
    "optimizer_dir",
]

STATE_FILE = "lightning.json"
_FORMAT = "unickpt-lightning"
_VERSION = 1


def _location(path: Any) -> str:
    """The checkpoint's location as Lightning names it: a path or an fsspec URL."""
    return str(os.fspath(path)).rstrip("/") or "/"


class UnickptCheckpointIO(_LightningCheckpointIO):
    """Lightning ``CheckpointIO`` that saves and loads through unickpt.

    Args:
        verify: rehash every slice while loading (default on; an ``IntegrityError`` names the tensor).
        size_per_shard: MB per safetensors file of each part.
        hashes / fingerprints: as ``GeneralCheckpointIO``'s (both on by default).
    """

    def __init__(
        self, verify: bool = True, size_per_shard: int = 1024, hashes: bool = True, fingerprints: bool = True
    ) -> None:
        super().__init__()
        self.verify = verify
        self.size_per_shard = size_per_shard
        self.hashes = hashes
        self.fingerprints = fingerprints

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        """Write Lightning's checkpoint dict as a unickpt checkpoint directory at ``path``, atomically."""
        if storage_options is not None:
            raise TypeError(
                f"UnickptCheckpointIO.save_checkpoint(storage_options={storage_options!r}): unickpt takes "
                "no per-save storage options here"
            )
        target = _location(path)
        if "state_dict" not in checkpoint:
            raise UnsupportedError(
                f"{target}: the checkpoint dict has no 'state_dict' (keys {sorted(checkpoint)})"
            )
        model_sd = checkpoint["state_dict"]
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        opts = self._opts()
        out = PartsOutput(target, STATE_FILE)
        try:
            save_tensors(dict(model_sd), out.location("model"), **opts)
            meta = _write_rest(out, rest, opts, {})
        except BaseException:
            out.abort()
            raise
        out.commit(meta)

    def _opts(self) -> dict[str, Any]:
        return {
            "size_per_shard": self.size_per_shard,
            "hashes": self.hashes,
            "fingerprints": self.fingerprints,
        }

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict saved at ``path``, every slice rehashed (``verify``).

        ``map_location`` may be a device (or its name) to put the tensors on; anything else
        (Lightning's default: a function keeping CPU storages) loads them on CPU. ``weights_only``
        changes nothing: nothing is unpickled.
        """
        del weights_only
        target = _location(path)
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        out, _parts, where = _read_rest(target, self.verify, device)
        out["state_dict"] = load_tensors(join_location(where, "model"), verify=self.verify, device=device)
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint this plugin wrote (or a plain file Lightning left at ``path``):
        its ``lightning.json`` first, so a half-removed one is never taken as a checkpoint."""
        remove_parts(_location(path), STATE_FILE)


def _write_rest(out: PartsOutput, rest: dict[str, Any], opts: dict[str, Any], parts: dict[str, Any]) -> bytes:
    """Write the checkpoint dict's other entries' tensors (``state/``); return ``lightning.json``,
    the commit file (the rest, tensors referenced by name; ``parts`` says how the model and
    optimizers were saved)."""
    js, tensors = encode_state(rest, "checkpoint")
    # The state's tensors get short names of their own; the JSON references them.
    renamed = {f"t{i}": t for i, t in enumerate(tensors.values())}
    ref = {old: f"t{i}" for i, old in enumerate(tensors)}
    js = _rename_refs(js, ref)
    if renamed:
        save_tensors(renamed, out.location("state"), **opts)
    meta: dict[str, Any] = {
        "format": _FORMAT,
        "version": _VERSION,
        "state_tensors": len(renamed),
        "checkpoint": js,
    }
    if parts:
        meta["parts"] = parts
    return state_json(meta)


def _read_rest(target: str, verify: bool, device: Any) -> tuple[dict[str, Any], dict[str, Any], str]:
    """The checkpoint dict without ``state_dict``, the ``parts`` record of ``target``, and where
    its committed copy lies (``store.publish.open_parts``: ``target`` itself, but for a copy an
    interrupted replacement left aside)."""
    try:
        where, raw = open_parts(target, STATE_FILE)
    except IncompleteCheckpointError as e:
        raise IncompleteCheckpointError(f"{e}; expected a committed unickpt Lightning checkpoint") from None
    except ValueError as e:  # larger than a state file may be
        raise IndexFileError(f"{join_location(target, STATE_FILE)}: {e}") from None
    meta_path = join_location(where, STATE_FILE)
    meta = parse_state(raw, meta_path)
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
        found = (
            {k: meta.get(k) for k in ("format", "version")} if isinstance(meta, dict) else type(meta).__name__
        )
        raise IndexFileError(f"{meta_path}: expected format {_FORMAT!r} version {_VERSION}, found {found}")
    n = meta.get("state_tensors")
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise IndexFileError(f"{meta_path}: 'state_tensors' must be a non-negative integer, found {n!r}")
    parts = meta.get("parts", {})
    if not isinstance(parts, dict):
        raise IndexFileError(f"{meta_path}: 'parts' must be an object, found {type(parts).__name__}")
    tensors = load_tensors(join_location(where, "state"), verify=verify, device=device) if n else {}
    if len(tensors) != n:
        raise IndexFileError(
            f"{join_location(where, 'state')}: {len(tensors)} tensors, {meta_path} names {n}"
        )
    out = decode_state(meta.get("checkpoint"), tensors, meta_path)
    if not isinstance(out, dict):
        raise IndexFileError(f"{meta_path}: 'checkpoint' must be an object, found {type(out).__name__}")
    return out, parts, where


def optimizer_dir(i: int) -> str:
    """The directory of the ``i``-th optimizer inside a checkpoint a unickpt strategy wrote."""
    return f"optimizer_{i}"


class _UnickptStrategyMixin:
    """``save_checkpoint`` / ``load_checkpoint`` of a sharded Lightning strategy through unickpt.

    Collective, as the strategies' own: every rank calls both. Rank 0 starts the checkpoint's
    ``PartsOutput`` (a staging directory beside its name, or its prefix on an object store); every
    rank writes its share of ``model/`` and ``optimizer_<i>/`` there; rank 0 writes ``state/``
    and, once every rank has written, commits ``lightning.json`` (as ``UnickptCheckpointIO``).
    """

    unickpt_verify: bool = True
    unickpt_size_per_shard: int = 1024
    _unickpt_layout = "sliced"

    # Lightning's dump_checkpoint asks for these on every rank; the model and the optimizers
    # are saved from the live objects instead, so nothing is gathered for them here.
    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}

    def _unickpt_optimizers(self) -> list[Any]:
        return [getattr(o, "_optimizer", o) for o in self.optimizers]  # type: ignore[attr-defined]

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        s: Any = self
        if storage_options is not None:
            raise TypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options={storage_options!r}): unickpt takes "
                "no per-save storage options here"
            )
        target = _location(s.broadcast(str(os.fspath(filepath))))
        rank0 = s.global_rank == 0
        out: PartsOutput | None = None
        failure: BaseException | None = None
        if rank0:
            try:
                out = PartsOutput(target, STATE_FILE)
            except Exception as e:
                failure = e
        self._unickpt_agree(failure, out, target, "starting")
        root = s.broadcast(out.root if out is not None else None)
        opts = {"size_per_shard": self.unickpt_size_per_shard}
        with_optim = "optimizer_states" in checkpoint
        optims = self._unickpt_optimizers() if with_optim else []
        meta = b""
        try:
            self._unickpt_save_parts(root, optims, opts)
            if out is not None:
                rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
                parts = {"layout": self._unickpt_layout, "optimizers": len(optims)}
                meta = _write_rest(out, rest, opts, parts)
        except Exception as e:  # rank 0's own writes fail on rank 0 alone: the others must hear of it
            failure = e
        self._unickpt_agree(failure, out, target, "writing")
        if out is not None:
            try:
                out.commit(meta)
            except Exception as e:
                failure = e
        self._unickpt_agree(failure, None, target, "committing")

    def _unickpt_agree(
        self, failure: BaseException | None, out: PartsOutput | None, target: str, doing: str
    ) -> None:
        """Every rank learns whether rank 0 failed (a broadcast every rank reaches, so none waits
        for a rank that gave up); on a failure what was written goes and every rank raises."""
        s: Any = self
        rank0 = s.global_rank == 0
        said = s.broadcast(f"{type(failure).__name__}: {failure}" if rank0 and failure is not None else None)
        if failure is None and said is None:
            return
        if out is not None:
            out.abort()
        if failure is not None:
            raise failure
        raise DistributedError(
            f"{target}: rank 0 failed {doing} the checkpoint ({said}); nothing was committed"
        )

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        del weights_only  # nothing is unpickled
        from lightning.pytorch.trainer.states import TrainerFn

        s: Any = self
        target = _location(s.broadcast(str(os.fspath(checkpoint_path))))
        out, parts, where = _read_rest(target, self.unickpt_verify, None)
        if parts.get("layout") not in ("sliced", "full"):
            raise UnsupportedError(
                f"{target}: written by UnickptCheckpointIO (no sharded parts); a sharded strategy resumes "
                f"only from checkpoints its unickpt strategy wrote, found parts {parts!r}"
            )
        module = s.lightning_module
        n = parts.get("optimizers", 0)
        optims = self._unickpt_optimizers() if module.trainer.state.fn == TrainerFn.FITTING and n else []
        if optims and len(optims) != n:
            raise StateMismatchError(f"{target}: holds {n} optimizer(s), this run configures {len(optims)}")
        self._unickpt_load_parts(where, parts["layout"], optims, bool(module.strict_loading))
        return out

    def _unickpt_save_parts(self, root: str, optims: list[Any], opts: dict[str, Any]) -> None:
        """Sliced: every rank writes the DTensor slices it holds (FSDP2 / tensor parallel)."""
        s: Any = self
        io = CheckpointIO()
        io.save_model(s.model, join_location(root, "model"), shard=True, gather_dtensor=False, **opts)
        for i, opt in enumerate(optims):
            io.save_optimizer(
                OptimizerWrapper(opt, s.model),
                join_location(root, optimizer_dir(i)),
                shard=True,
                gather_dtensor=False,
                **opts,
            )

    def _unickpt_load_parts(self, target: str, layout: str, optims: list[Any], strict: bool) -> None:
        s: Any = self
        io = CheckpointIO()
        io.load_model(s.model, join_location(target, "model"), strict=strict, verify=self.unickpt_verify)
        for i, opt in enumerate(optims):
            io.load_optimizer(
                OptimizerWrapper(opt, s.model),
                join_location(target, optimizer_dir(i)),
                verify=self.unickpt_verify,
            )


class UnickptModelParallelStrategy(_UnickptStrategyMixin, ModelParallelStrategy):  # type: ignore[misc]
    """Lightning's ``ModelParallelStrategy`` (FSDP2 / tensor parallel in ``configure_model``),
    saving and resuming through unickpt instead of DCP.

    Each checkpoint Lightning names is a directory: ``model/`` and ``optimizer_<i>/`` are unickpt
    checkpoints written sliced (each rank its own DTensor slices, with hashes and fingerprints;
    they load at any other world size or layout, and ``unickpt merge`` makes Hugging Face files of
    ``model/``), ``state/`` and ``lightning.json`` the rest of Lightning's checkpoint dict, as
    ``UnickptCheckpointIO`` writes them. Same arguments as ``ModelParallelStrategy``.
    """


class UnickptFSDPStrategy(_UnickptStrategyMixin, FSDPStrategy):  # type: ignore[misc]
    """Lightning's ``FSDPStrategy`` (torch's FSDP1) saving and resuming through unickpt instead of
    DCP or ``torch.save``.

    FSDP1 keeps flat parameters, not DTensors: the model and optimizer states are gathered with
    torch's ``get_model_state_dict`` / ``get_optimizer_state_dict`` (full state dicts, on every
    rank), rank 0 writes them as unickpt checkpoints (``model/``, ``optimizer_<i>/`` keyed by
    parameter name, ``param_groups`` in ``lightning.json``), and every rank reads them back whole
    and hands them to ``set_model_state_dict`` / ``set_optimizer_state_dict``. Same arguments as
    ``FSDPStrategy``.
    """

    _unickpt_layout = "full"

    def _unickpt_save_parts(self, root: str, optims: list[Any], opts: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        s: Any = self
        full = StateDictOptions(full_state_dict=True)
        msd: dict[str, Any] = get_model_state_dict(s.model, options=full)
        osds = [get_optimizer_state_dict(s.model, opt, options=full) for opt in optims]
        if s.global_rank != 0:
            return
        save_tensors(msd, join_location(root, "model"), **opts)
        for i, osd in enumerate(osds):
            js, tensors = encode_state(osd, f"optimizer_{i}")
            names = {k: f"t{j}" for j, k in enumerate(tensors)}
            where = join_location(root, optimizer_dir(i))
            save_tensors({names[k]: v for k, v in tensors.items()}, where, **opts)
            write_json(join_location(where, _OPTIM_FILE), _rename_refs(js, names))

    def _unickpt_load_parts(self, target: str, layout: str, optims: list[Any], strict: bool) -> None:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        s: Any = self
        if layout != "full":
            raise UnsupportedError(
                f"{target}: parts written {layout!r}; UnickptFSDPStrategy reads 'full' ones"
            )
        msd: dict[str, Any] = load_tensors(join_location(target, "model"), verify=self.unickpt_verify)
        set_model_state_dict(s.model, msd, options=StateDictOptions(full_state_dict=True, strict=strict))
        for i, opt in enumerate(optims):
            where = join_location(target, optimizer_dir(i))
            tensors = load_tensors(where, verify=self.unickpt_verify)
            osd = decode_state(read_json(join_location(where, _OPTIM_FILE)), tensors, where)
            set_optimizer_state_dict(s.model, opt, osd, options=StateDictOptions(full_state_dict=True))


_OPTIM_FILE = "optimizer.json"


def _rename_refs(value: Any, ref: dict[str, str]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__st__"} and value["__st__"] in ref:
            return {"__st__": ref[value["__st__"]]}
        return {k: _rename_refs(v, ref) for k, v in value.items()}
    if isinstance(value, list):
        return [_rename_refs(v, ref) for v in value]
    return value
