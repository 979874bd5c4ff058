"""``unickpt convert``: import checkpoints users already have into the unickpt format.

- ``--from dcp``: a PyTorch Distributed Checkpoint directory (``.metadata`` + ``__N_M.distcp``),
  read through torch's own DCP reader (``FileSystemReader`` + ``dcp.load(no_dist=True)``),
  one batch of tensors at a time. **Security**: DCP's ``.metadata`` file is a pickle, which
  torch unpickles to read it; only convert DCP directories from a source you trust. The
  non-tensor entries of a DCP checkpoint (stored as pickled bytes) are never loaded: they
  are skipped with a warning.
- ``--from bin``: Hugging Face / Colossal-AI ``pytorch_model*.bin`` shards (with or without
  ``pytorch_model.bin.index.json``), read with ``torch.load(weights_only=True)`` only, which
  refuses arbitrary pickled objects.

The output is a gathered, sharded unickpt checkpoint (``model-0000k-of-0000n.safetensors``
+ ``model.safetensors.index.json`` with hashes and fingerprints), which is at the same time
a valid Hugging Face checkpoint; ``--to hf`` writes the same files. The output is written
under a temporary name and renamed when complete. Needs no process group.
"""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from unickpt import __version__
from unickpt._logging import get_logger
from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, UnsupportedError
from unickpt.format._json import strict_loads
from unickpt.format.index import LayoutInfo
from unickpt.tools._common import check_output, copy_small_file, staged_output
from unickpt.tools._write import SliceData, TensorData, write_checkpoint

__all__ = ["convert_checkpoint"]

logger = get_logger(__name__)
# Tensors are read from DCP in batches of about this many bytes (one dcp.load call each).
_BATCH_BYTES = 256 << 20
_SIDE_FILES = ("config.json", "generation_config.json")


def _parse_size(size: int | str) -> int:
    from huggingface_hub.serialization._base import parse_size_to_int

    return size if isinstance(size, int) else int(parse_size_to_int(size))


class _LazyTensors:
    """Loads tensors on demand in order, ``batch`` at a time, dropping each once handed out."""

    def __init__(self, order: list[tuple[str, int]], load: Callable[[list[str]], dict[str, Any]]) -> None:
        self.order = order
        self.load = load
        self.cache: dict[str, Any] = {}
        self.pos = {n: i for i, (n, _) in enumerate(order)}

    def get(self, name: str) -> np.ndarray:
        from unickpt.tools._torch import tensor_bytes

        if name not in self.cache:
            i = self.pos[name]
            batch: list[str] = []
            size = 0
            while i < len(self.order) and (not batch or size + self.order[i][1] <= _BATCH_BYTES):
                batch.append(self.order[i][0])
                size += self.order[i][1]
                i += 1
            self.cache.update(self.load(batch))
        return tensor_bytes(self.cache.pop(name))


def _dcp_tensors(src: str, strip_prefix: str | None) -> tuple[dict[str, TensorData], list[str]]:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from unickpt.tools._torch import st_of

    if not os.path.isfile(os.path.join(src, ".metadata")):
        raise IncompleteCheckpointError(f"{src} is not a DCP checkpoint: it has no .metadata file")
    try:
        md = FileSystemReader(src).read_metadata()
    except Exception as e:  # torch raises many types for a damaged pickle
        raise CheckpointFormatError(f"{src}/.metadata could not be read by torch's DCP reader: {e}") from e
    specs: dict[str, tuple[str, Any, list[int]]] = {}
    skipped = []
    for key, meta in md.state_dict_metadata.items():
        if not isinstance(meta, TensorStorageMetadata):
            skipped.append(key)
            continue
        name = key
        if strip_prefix:
            if not key.startswith(strip_prefix):
                continue
            name = key[len(strip_prefix) :]
        dtype = meta.properties.dtype
        specs[name] = (key, dtype, list(meta.size))
    if skipped:
        logger.warning(
            "skipped %d non-tensor DCP entries (pickled bytes, never loaded): %s", len(skipped), skipped[:10]
        )

    def load(names: list[str]) -> dict[str, Any]:
        import torch

        sd = {specs[n][0]: torch.empty(specs[n][2], dtype=specs[n][1]) for n in names}
        from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

        with warnings.catch_warnings():
            # "torch.distributed is disabled ... assuming ... a single process": exactly what we want.
            warnings.simplefilter("ignore", UserWarning)
            dcp_load(
                sd,
                storage_reader=FileSystemReader(src),
                planner=DefaultLoadPlanner(allow_partial_load=True),
                no_dist=True,
            )
        return {n: sd[specs[n][0]] for n in names}

    order = [(n, math.prod(s) * dt.itemsize) for n, (_, dt, s) in specs.items()]
    lazy = _LazyTensors(order, load)
    tensors = {}
    for n, (_, dt, shape) in specs.items():
        tensors[n] = TensorData(st_of(dt, n), shape, [SliceData([0] * len(shape), shape, _getter(lazy, n))])
    return tensors, skipped


def _getter(lazy: _LazyTensors, name: str) -> Callable[[], np.ndarray]:
    return lambda: lazy.get(name)


def _bin_files(src: str) -> list[str]:
    if os.path.isfile(src):
        return [src]
    idx = os.path.join(src, "pytorch_model.bin.index.json")
    if os.path.isfile(idx):
        from unickpt.format.index import check_file_name

        with open(idx, "rb") as f:
            try:
                obj = strict_loads(f.read().decode("utf-8"), CheckpointFormatError, f"{idx}: index")
            except UnicodeDecodeError as e:
                raise CheckpointFormatError(
                    f"{idx}: not a valid pytorch_model.bin.index.json ({e})"
                ) from None
        wm = obj.get("weight_map") if isinstance(obj, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
            raise CheckpointFormatError(
                f"{idx}: not a valid pytorch_model.bin.index.json (expected an object with a 'weight_map' "
                "object mapping names to file names)"
            )
        files = [os.path.join(src, check_file_name(fn, idx)) for fn in sorted(set(wm.values()))]
        for path in files:
            if not os.path.isfile(path):
                raise IncompleteCheckpointError(f"{idx}: names {os.path.basename(path)!r}, which is missing")
        return files
    single = os.path.join(src, "pytorch_model.bin")
    if os.path.isfile(single):
        return [single]
    raise IncompleteCheckpointError(f"{src} holds neither pytorch_model.bin nor pytorch_model.bin.index.json")


def _bin_tensors(src: str, strip_prefix: str | None) -> Iterator[tuple[str, Any]]:
    import pickle

    import torch

    for path in _bin_files(src):
        try:
            sd = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, ValueError) as e:
            raise UnsupportedError(
                f"{path}: torch.load(weights_only=True) refused it ({e}); unickpt never unpickles arbitrary objects"
            ) from None
        if not isinstance(sd, dict):
            raise CheckpointFormatError(f"{path}: holds a {type(sd).__name__}, not a state dict of tensors")
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                logger.warning("%s: skipping non-tensor entry %r", path, k)
                continue
            if strip_prefix:
                if not k.startswith(strip_prefix):
                    continue
                k = k[len(strip_prefix) :]
            yield k, v


def convert_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    source: str = "dcp",
    target: str = "unickpt",
    max_shard_size: int | str = "5GB",
    strip_prefix: str | None = None,
    progress: bool = False,
) -> str:
    """Convert the ``source`` ("dcp" or "bin") checkpoint at ``src`` into a unickpt checkpoint at ``out``.

    ``target`` "unickpt" or "hf" (the same files: a gathered unickpt checkpoint is a Hugging
    Face checkpoint). ``strip_prefix`` keeps only names starting with it, without it.
    Returns ``out``. See the module docstring for what is (never) unpickled.
    """
    if target not in ("unickpt", "hf"):
        raise UnsupportedError(f"convert --to {target!r}: choose unickpt or hf")
    src_s = os.fspath(src)
    out_s = check_output(os.fspath(out))
    shard_bytes = _parse_size(max_shard_size)
    if source == "dcp":
        tensors, _ = _dcp_tensors(src_s, strip_prefix)
        plugin = "dcp"
    elif source == "bin":
        from unickpt.tools._torch import st_of, tensor_bytes

        tensors = {}
        for k, v in _bin_tensors(src_s, strip_prefix):
            shape = list(v.shape)
            tensors[k] = TensorData(
                st_of(v.dtype, k), shape, [SliceData([0] * len(shape), shape, tensor_bytes(v))]
            )
        plugin = "bin"
    else:
        raise UnsupportedError(f"convert --from {source!r}: choose dcp or bin")
    if not tensors:
        raise CheckpointFormatError(
            f"{src_s}: no tensors to convert" + (f" under prefix {strip_prefix!r}" if strip_prefix else "")
        )
    with staged_output(out_s) as tmp:
        write_checkpoint(
            tmp,
            tensors,
            sliced=False,
            max_shard_bytes=shard_bytes,
            layout=LayoutInfo(plugin=plugin),
            created_by=f"unickpt {__version__} convert --from {source}",
        )
        src_dir = src_s if os.path.isdir(src_s) else os.path.dirname(os.path.abspath(src_s))
        for fname in _SIDE_FILES:
            p = os.path.join(src_dir, fname)
            if os.path.isfile(p):
                copy_small_file(p, os.path.join(tmp, fname))
    del progress  # conversions are bounded by torch's reader; no byte-level progress to report
    return out_s
