"""Lightning's checkpoints as unickpt checkpoints: ``Trainer(plugins=[UnickptCheckpointIO()])``.

The checkpoint "file" Lightning names (``epoch=0-step=4.ckpt``, ``last.ckpt``) becomes a directory::

    <name>.ckpt/model/            the LightningModule's state_dict: Hugging Face sharded safetensors
                                  with unickpt's index, slice hashes and fingerprints
                                  (``unickpt verify <name>.ckpt/model``)
    <name>.ckpt/state/            every other tensor of the checkpoint dict (optimizer states,
                                  callback and loop tensors), the same kind of checkpoint
    <name>.ckpt/lightning.json    the rest of the dict (epoch, global_step, loops, callbacks,
                                  lr_schedulers, hyper_parameters...), tensors referenced by name

Nothing is pickled. The directory is written beside its final name and renamed into place
(an existing checkpoint of that name is swapped out atomically): a crash leaves the previous
checkpoint or the new one, never a half-written one. Loading rehashes every slice and returns
the dict exactly as it was saved (tensors bit for bit, tuples and integer keys kept).

Strategies: Lightning calls a ``CheckpointIO`` plugin from the single-device and DDP strategies
(``Strategy.save_checkpoint`` on global rank 0, ``load_checkpoint`` on every rank; unickpt then
works over a process group of the calling process alone). Lightning 2.6's ``FSDPStrategy`` and
``ModelParallelStrategy`` bypass it: with sharded state dicts they write and read DCP themselves;
with full ones they save through the plugin but load with ``torch.load`` of a file, so they cannot
resume from these directories. DeepSpeed's strategy saves through DeepSpeed's engine. For sharded
checkpoints under FSDP2/TP use unickpt's own plugins (``unickpt.Booster``) or the
``CheckpointManager``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO as _LightningCheckpointIO

from unickpt.errors import IncompleteCheckpointError, IndexFileError, UnsupportedError
from unickpt.integrations._state import (
    commit_dir,
    decode_state,
    encode_state,
    load_tensors,
    read_json,
    save_tensors,
    staging_dir,
    write_json,
)

__all__ = ["UnickptCheckpointIO", "STATE_FILE"]

STATE_FILE = "lightning.json"
_FORMAT = "unickpt-lightning"
_VERSION = 1


def _local_path(path: Any) -> str:
    p = str(os.fspath(path))
    if "://" in p:
        raise UnsupportedError(
            f"{p}: UnickptCheckpointIO writes local (or mounted) directories; for object stores use "
            "unickpt's CheckpointManager, which takes s3:// and other fsspec URLs"
        )
    return p


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
        target = _local_path(path)
        if "state_dict" not in checkpoint:
            raise UnsupportedError(
                f"{target}: the checkpoint dict has no 'state_dict' (keys {sorted(checkpoint)})"
            )
        model_sd = checkpoint["state_dict"]
        rest = {k: v for k, v in checkpoint.items() if k != "state_dict"}
        js, tensors = encode_state(rest, "checkpoint")
        # The state's tensors get short names of their own; the JSON references them.
        renamed = {f"t{i}": t for i, t in enumerate(tensors.values())}
        ref = {old: f"t{i}" for i, old in enumerate(tensors)}
        js = _rename_refs(js, ref)
        staged = staging_dir(target)
        opts: dict[str, Any] = {
            "size_per_shard": self.size_per_shard,
            "hashes": self.hashes,
            "fingerprints": self.fingerprints,
        }
        try:
            save_tensors(dict(model_sd), os.path.join(staged, "model"), **opts)
            if renamed:
                save_tensors(renamed, os.path.join(staged, "state"), **opts)
            write_json(
                os.path.join(staged, STATE_FILE),
                {"format": _FORMAT, "version": _VERSION, "state_tensors": len(renamed), "checkpoint": js},
            )
            commit_dir(staged, target)
        except BaseException:
            import shutil

            shutil.rmtree(staged, ignore_errors=True)
            raise

    def load_checkpoint(
        self, path: Any, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """The checkpoint dict saved at ``path``, every slice rehashed (``verify``).

        ``map_location`` may be a device (or its name) to put the tensors on; anything else
        (Lightning's default: a function keeping CPU storages) loads them on CPU. ``weights_only``
        changes nothing: nothing is unpickled.
        """
        del weights_only
        target = _local_path(path)
        meta_path = os.path.join(target, STATE_FILE)
        if not os.path.isdir(target):
            what = "a file (not a unickpt Lightning checkpoint)" if os.path.exists(target) else "missing"
            raise IncompleteCheckpointError(
                f"{target}: expected a unickpt Lightning checkpoint directory, found {what}"
            )
        if not os.path.isfile(meta_path):
            raise IncompleteCheckpointError(
                f"{target}: no {STATE_FILE}; not a committed unickpt Lightning checkpoint"
            )
        meta = read_json(meta_path)
        if not isinstance(meta, dict) or meta.get("format") != _FORMAT or meta.get("version") != _VERSION:
            found = (
                {k: meta.get(k) for k in ("format", "version")}
                if isinstance(meta, dict)
                else type(meta).__name__
            )
            raise IndexFileError(
                f"{meta_path}: expected format {_FORMAT!r} version {_VERSION}, found {found}"
            )
        n = meta.get("state_tensors")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise IndexFileError(f"{meta_path}: 'state_tensors' must be a non-negative integer, found {n!r}")
        device = map_location if isinstance(map_location, (str, torch.device)) else None
        tensors = load_tensors(os.path.join(target, "state"), verify=self.verify, device=device) if n else {}
        if len(tensors) != n:
            raise IndexFileError(f"{target}/state: {len(tensors)} tensors, {meta_path} names {n}")
        out = decode_state(meta.get("checkpoint"), tensors, meta_path)
        if not isinstance(out, dict):
            raise IndexFileError(f"{meta_path}: 'checkpoint' must be an object, found {type(out).__name__}")
        out["state_dict"] = load_tensors(os.path.join(target, "model"), verify=self.verify, device=device)
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Remove a checkpoint this plugin wrote (or a plain file Lightning left at ``path``)."""
        import shutil

        target = _local_path(path)
        if os.path.isdir(target) and not os.path.islink(target):
            if not os.path.isfile(os.path.join(target, STATE_FILE)):
                raise UnsupportedError(f"{target}: a directory without {STATE_FILE}; refusing to remove it")
            shutil.rmtree(target)
        elif os.path.lexists(target):
            os.unlink(target)


def _rename_refs(value: Any, ref: dict[str, str]) -> Any:
    if isinstance(value, dict):
        if set(value) == {"__st__"} and value["__st__"] in ref:
            return {"__st__": ref[value["__st__"]]}
        return {k: _rename_refs(v, ref) for k, v in value.items()}
    if isinstance(value, list):
        return [_rename_refs(v, ref) for v in value]
    return value
