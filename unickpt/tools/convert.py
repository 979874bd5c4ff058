"""``unickpt convert``: bring checkpoints users already have in, and take unickpt ones out to DCP.

- ``--from dcp``: a PyTorch Distributed Checkpoint directory (``.metadata`` + ``__N_M.distcp``;
  imported by ``unickpt.tools.convert_dcp``, its tensors loaded a batch at a time), a torchtitan
  folder of ``step-<N>/`` (the latest), or the per-rank files of
  ``HuggingFaceStorageWriter(save_distributed=True)``. A whole training checkpoint (model,
  optimizer, LR scheduler, train state) becomes model and optimizer checkpoints, or with
  ``--to run`` a ``CheckpointManager`` step. Read through ``unickpt.tools.dcp_read``:
  ``.metadata`` with an allowlist unpickler, non-tensor entries with
  ``torch.load(weights_only=True)``; no code from the checkpoint runs.
- ``--from bin``: Hugging Face / Colossal-AI ``pytorch_model*.bin`` shards (with or without
  ``pytorch_model.bin.index.json``), read with ``torch.load(weights_only=True)`` only, which
  refuses arbitrary pickled objects.
- ``--from colossalai``: a Colossal-AI sharded optimizer checkpoint
  (``unickpt.tools.convert_colossalai``).
- ``--from deepspeed``: a DeepSpeed ZeRO stage 1/2/3 checkpoint (``unickpt.tools.convert_deepspeed``).
- ``--to dcp``: a unickpt checkpoint written back as DCP (``unickpt.tools.export_dcp``).
- ``--to colossalai``: as Colossal-AI's ``GeneralCheckpointIO`` reads it (``unickpt.tools.export_colossalai``).
- ``--to deepspeed``: as a DeepSpeed universal checkpoint (``unickpt.tools.export_deepspeed``).

The unickpt output is a gathered, sharded checkpoint (``model-0000k-of-0000n.safetensors``
+ ``model.safetensors.index.json`` with hashes and fingerprints), which is at the same time
a valid Hugging Face checkpoint; ``--to hf`` writes the same files. Every output, whatever the
target, is written through one ``store.publish.Sink`` (``output_sink``): into a local directory
staged under a temporary name and renamed when complete, or onto an object-store prefix (which
must hold nothing) with its commit points (indexes, a run step's ``COMMIT`` and ``latest``,
DeepSpeed's ``latest_universal``) written last; a failure leaves no output. Needs no process group.
"""

from __future__ import annotations

import math
import os
import posixpath
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from unickpt import __version__
from unickpt._logging import get_logger
from unickpt.ckpt.dcp_hf import dcp_hf_files
from unickpt.errors import CheckpointFormatError, UnsupportedError
from unickpt.spec.dtypes import itemsize
from unickpt.spec.index import LayoutInfo
from unickpt.spec.naming import HF_SIDE_FILES, shown
from unickpt.spec.untrusted import check_graph
from unickpt.store.publish import Sink, output_location, output_sink, read_small_file
from unickpt.store.storage import confined_location, is_file_location, join_location, open_storage
from unickpt.tools._common import read_side_files
from unickpt.tools._merge_mapped import hub_tensor_data
from unickpt.tools._progress import progress_bar
from unickpt.tools._write import SliceData, TensorData, write_checkpoint
from unickpt.tools.convert_dcp import (
    DcpLayout,
    classify,
    dcp_tensors,
    import_training,
    read_train_state,
    writer_ranks,
)
from unickpt.tools.convert_src import BIN_INDEX, bin_shard_names, latest_step

__all__ = ["convert_checkpoint"]

logger = get_logger(__name__)


def _parse_size(size: int | str) -> int:
    from huggingface_hub.serialization._base import parse_size_to_int

    return size if isinstance(size, int) else int(parse_size_to_int(size))


def _bin_files(src: str) -> list[str]:
    """The locations of the ``.bin`` shards of ``src`` (a path or a URL): the file itself, or
    those its ``pytorch_model.bin.index.json`` names (each a plain name of the directory, no link
    out of it), or its ``pytorch_model.bin``."""
    if is_file_location(src):
        return [src]
    names = bin_shard_names(
        src,
        lambda n: is_file_location(join_location(src, n)),
        lambda n: read_small_file(join_location(src, n)),
        partial(join_location, src),
    )
    return [confined_location(src, n, join_location(src, BIN_INDEX), "weight_map file") for n in names]


def _bin_shards(src: str) -> Iterator[tuple[str, Callable[[], Any]]]:
    """Each ``.bin`` shard of ``src``: its location as messages show it, and its ``torch.load``
    (``weights_only``)."""
    for file in _bin_files(src):
        yield file, partial(_load_bin, file)


def _load_bin(location: str) -> Any:
    """``torch.load(weights_only=True)`` of the ``.bin`` file ``location``: memory-mapped where the
    store has OS paths (the shard is not read whole), else from a file object on the store
    (ranged reads, no local copy)."""
    import torch

    storage, path = open_storage(location)
    local = storage.local_path(path)
    if local is not None:
        return torch.load(local, map_location="cpu", weights_only=True, mmap=True)
    with storage.open_file(path) as f:
        return torch.load(f, map_location="cpu", weights_only=True)


def _bin_tensors(src: str, strip_prefix: str | None) -> Iterator[tuple[str, Any]]:
    import pickle

    import torch

    for path, load in _bin_shards(src):
        try:
            sd = load()
        except (pickle.UnpicklingError, RuntimeError, ValueError) as e:
            raise UnsupportedError(
                f"{path}: torch.load(weights_only=True) refused it ({e}); unickpt never unpickles arbitrary objects"
            ) from None
        if not isinstance(sd, dict):
            raise CheckpointFormatError(f"{path}: holds a {type(sd).__name__}, not a state dict of tensors")
        check_graph(sd, path, "state dict", CheckpointFormatError)
        for k, v in sd.items():
            if not isinstance(v, torch.Tensor):
                logger.warning("%s: skipping non-tensor entry %r", path, k)
                continue
            if strip_prefix:
                if not k.startswith(strip_prefix):
                    continue
                k = k[len(strip_prefix) :]
            yield k, v


SOURCES = ("dcp", "bin", "colossalai", "deepspeed", "unickpt")
TARGETS = ("unickpt", "hf", "run", "dcp", "colossalai", "deepspeed")
# What a unickpt checkpoint is exported to (from --from unickpt only).
EXPORTS = ("dcp", "colossalai", "deepspeed")


def _dcp_source(src: str) -> tuple[str, list[str]]:
    """``src`` itself, or for a torchtitan checkpoint folder (``step-<N>/`` DCP directories) its
    latest step; with the names that directory holds. A path or a URL alike, through its store."""
    storage, root = open_storage(src)
    names = storage.listdir(root)
    if ".metadata" in names:
        return src, names
    step = latest_step(names, lambda n: storage.is_file(storage.join(root, n, ".metadata")))
    if step is None:
        return src, names
    chosen = confined_location(src, step, src, "step directory")
    logger.info("%s holds step directories; converting the latest, %s", src, chosen)
    step_storage, step_root = open_storage(chosen)
    return chosen, step_storage.listdir(step_root)


def convert_checkpoint(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    source: str = "dcp",
    target: str = "unickpt",
    max_shard_size: int | str = "5GB",
    strip_prefix: str | None = None,
    step: int | None = None,
    model: str | os.PathLike[str] | Any = None,
    optimizer: Any = None,
    progress: bool = False,
) -> str:
    """Convert the ``source`` checkpoint at ``src`` into ``target`` at ``out``; returns ``out``.

    - ``source="dcp"``: a DCP directory (or a torchtitan folder of ``step-<N>/``: the latest),
      or what ``HuggingFaceStorageWriter(save_distributed=True)`` writes (per-rank
      ``shard-*-model-*.safetensors``, see ``unickpt.ckpt.dcp_hf``), merged into whole tensors.
      A training checkpoint (optimizer / scheduler / train state entries, see
      ``unickpt.tools.convert_dcp``) gives a model and an optimizer checkpoint in ``out`` plus
      ``lr_scheduler.json``; ``target="run"`` writes them as ``step-<N>/`` of a
      ``CheckpointManager`` directory (``step`` or the checkpoint's ``train_state.step``).
      A model-only DCP checkpoint keeps its full names (``strip_prefix`` selects and strips).
    - ``source="bin"``: ``pytorch_model*.bin`` shards (``torch.load(weights_only=True)`` only).
    - ``source="colossalai"``: a Colossal-AI sharded optimizer checkpoint
      (``pytorch_optim.bin.index.json``); ``model`` maps its integer ids to FQNs: a model
      checkpoint directory, or a ``torch.nn.Module`` (its ``named_parameters()`` order, or with
      ``optimizer`` the optimizer's parameter order); default the ``model/`` directory beside ``src``.
    - ``source="deepspeed"``: a DeepSpeed ZeRO stage 1/2/3 checkpoint (``latest`` + ``global_stepN/``):
      fp32 master weights, Adam moments per FQN and param groups (``unickpt.tools.convert_deepspeed``);
      ``target="run"`` as for DCP (``step`` or the engine's ``global_steps``).
    - ``target="dcp"`` (``source="unickpt"``): a DCP checkpoint of the unickpt model (and
      optimizer, when ``src`` holds one) in the ``get_state_dict`` layout.
    - ``target="colossalai"`` / ``"deepspeed"`` (``source="unickpt"``): Colossal-AI's model and
      optimizer files, or a DeepSpeed universal checkpoint (``step``: its ``global_steps``).

    ``target`` "unickpt" and "hf" write the same files (a gathered unickpt checkpoint is a
    Hugging Face checkpoint). See the module docstring for what is (never) unpickled.
    """
    if source not in SOURCES:
        raise UnsupportedError(f"convert --from {shown(source)}: choose one of {', '.join(SOURCES)}")
    if target not in TARGETS:
        raise UnsupportedError(f"convert --to {shown(target)}: choose one of {', '.join(TARGETS)}")
    if (target in EXPORTS) != (source == "unickpt"):
        raise UnsupportedError(
            f"convert --from {source} --to {target}: DCP, Colossal-AI and DeepSpeed output is written from a "
            "unickpt checkpoint (--from unickpt --to dcp|colossalai|deepspeed); other sources convert to "
            "unickpt, hf or run"
        )
    if target == "run" and source not in ("dcp", "deepspeed"):
        raise UnsupportedError(
            f"convert --to run: only a DCP / torchtitan or DeepSpeed training checkpoint becomes a run (got --from {source})"
        )
    src_s = os.fspath(src)
    # Where the side files may be besides the directory converted: a torchtitan folder's root.
    origin: tuple[str, ...] = (src_s,)
    out_s = os.fspath(out)
    # What a location can be written or read as is asked of its storage: OS paths, or objects.
    open_storage(src_s)  # a source without a file system installed is refused before anything else
    out_s = output_location(out_s)  # refused in use before anything is read
    shard_bytes = _parse_size(max_shard_size)
    created_by = f"unickpt {__version__} convert --from {source}"
    if source == "unickpt" and target == "colossalai":
        from unickpt.tools.export_colossalai import export_colossalai

        return export_colossalai(src_s, out_s, max_shard_bytes=shard_bytes, progress=progress)
    if source == "unickpt" and target == "deepspeed":
        from unickpt.tools.export_deepspeed import export_deepspeed

        return export_deepspeed(src_s, out_s, step=step, progress=progress)
    if source == "unickpt":
        from unickpt.tools.export_dcp import export_dcp

        return export_dcp(src_s, out_s)
    if source == "deepspeed":
        from unickpt.tools.convert_deepspeed import convert_deepspeed

        return convert_deepspeed(
            src_s,
            out_s,
            target=target,
            step=step,
            shard_bytes=shard_bytes,
            created_by=created_by,
            progress=progress,
        )
    if source == "colossalai":
        from unickpt.tools.convert_colossalai import convert_colossalai_optimizer

        with output_sink(out_s) as sink:
            convert_colossalai_optimizer(
                src_s,
                sink,
                model=model,
                optimizer=optimizer,
                shard_bytes=shard_bytes,
                created_by=created_by,
                progress=progress,
            )
        return out_s
    if source == "dcp":
        from unickpt.tools.dcp_read import read_metadata

        src_s, names = _dcp_source(src_s)
        if ".metadata" not in names and dcp_hf_files(names):
            # HuggingFaceStorageWriter(save_distributed=True): per-rank safetensors, read as slices
            return _merge_dcp_hf(src_s, out_s, max_shard_size)
        md = read_metadata(src_s)
        lay = classify(md)
        if strip_prefix is None and (lay.is_training or target == "run"):
            if not lay.model and not lay.optim_tensors:
                raise CheckpointFormatError(f"{src_s}: no model or optimizer tensors to convert")
            if target == "run":
                return _write_run(src_s, md, lay, out_s, step, shard_bytes, created_by)
            with output_sink(out_s) as sink:
                import_training(
                    src_s,
                    md,
                    lay,
                    sink,
                    sink,
                    sink,
                    shard_bytes=shard_bytes,
                    created_by=created_by,
                    progress=progress,
                )
                _copy_side_files(sink, src_s, *origin)
            return out_s
        tensors, _ = dcp_tensors(src_s, strip_prefix, md)
        plugin = "dcp"
    else:
        from unickpt.tools._torch import st_of, tensor_bytes

        tensors = {}
        for k, v in _bin_tensors(src_s, strip_prefix):
            shape = list(v.shape)
            tensors[k] = TensorData(
                st_of(v.dtype, k), shape, [SliceData([0] * len(shape), shape, tensor_bytes(v))]
            )
        plugin = "bin"
    if not tensors:
        raise CheckpointFormatError(
            f"{src_s}: no tensors to convert"
            + (f" under prefix {shown(strip_prefix)}" if strip_prefix else "")
        )
    tensors = hub_tensor_data(tensors, _config_json(src_s, *origin))
    total = sum(math.prod(t.shape) * itemsize(t.dtype) for t in tensors.values())
    with output_sink(out_s) as sink, progress_bar(total, f"convert --from {source}", progress) as update:
        write_checkpoint(
            sink,
            tensors,
            sliced=False,
            max_shard_bytes=shard_bytes,
            layout=LayoutInfo(plugin=plugin),
            created_by=created_by,
            progress=update,
        )
        _copy_side_files(sink, src_s, *origin)
    return out_s


def _merge_dcp_hf(src: str, out: str, max_shard_size: int | str) -> str:
    from unickpt.tools.merge import merge_checkpoint

    merge_checkpoint(src, out, max_shard_size=max_shard_size)
    return out


def _config_json(*sources: str) -> bytes | None:
    """The ``config.json`` that ``_copy_side_files`` copies into the output, or None."""
    for src in sources:
        storage, _ = open_storage(src)
        base = src.removeprefix("file://").rstrip("/") or "/"
        directory = base if storage.listdir(base) else posixpath.dirname(base) or "."
        for _, data in read_side_files(directory, ["config.json"]):
            return data
    return None


def _copy_side_files(sink: Sink, *sources: str) -> None:
    """The Hugging Face side files (``config.json``, ``generation_config.json``, the tokenizer's:
    ``format.naming.HF_SIDE_FILES``) of the first of ``sources`` that holds each (a file stands
    for its directory), locally or at a URL."""
    done: set[str] = set()
    for src in sources:
        storage, _ = open_storage(src)
        base = src.removeprefix("file://").rstrip("/") or "/"
        directory = base if storage.listdir(base) else posixpath.dirname(base) or "."
        for fname, data in read_side_files(directory, [n for n in HF_SIDE_FILES if n not in done]):
            sink.put(fname, data)
            done.add(fname)


def _write_run(
    src: str, md: Any, lay: DcpLayout, out: str, step: int | None, shard_bytes: int, created_by: str
) -> str:
    """A ``CheckpointManager`` directory at ``out`` holding ``step-<N>`` of the DCP checkpoint ``src``.

    The checkpoint's ``train_state.*`` values become the manager's extra state ``train_state``
    (``manager.load(..., train_state=obj)`` calls ``obj.load_state_dict`` with them).
    """
    from unickpt.ckpt.run_layout import write_step

    train = read_train_state(src, md, lay)
    n = step
    if n is None and "step" in train:
        try:
            n = int(train["step"])
        except (TypeError, ValueError):
            raise CheckpointFormatError(
                f"{src}: train_state.step is {shown(train['step'])}, not a step number"
            ) from None
    if n is None:
        raise CheckpointFormatError(
            f"{src}: holds no train_state.step; give the step number (--step N) for the run directory"
        )

    def fill(stage: Sink) -> None:
        part = stage.within
        import_training(
            src,
            md,
            lay,
            part("model"),
            part("optimizer"),
            stage,
            shard_bytes=shard_bytes,
            created_by=created_by,
        )

    with output_sink(out) as run:
        extra = {"train_state": train} if train else {}
        write_step(run, int(n), fill, extra=extra, world_size=writer_ranks(md), plugin=lay.flavour)
    return out
