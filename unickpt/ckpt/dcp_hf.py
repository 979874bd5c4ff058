"""Read what torch's ``HuggingFaceStorageWriter(save_distributed=True)`` writes, as slices.

With ``save_distributed=True`` and no consolidation, ``dcp.save`` writes one safetensors file
per rank, ``shard-<rank+1:05d>-model-<k:05d>-of-<n:05d>.safetensors``, holding that rank's
local shards under the plain tensor names, with the global offset of each in the header
metadata ``DCP_SHARDING_INFO`` (``{"name": {"saved_offsets": [...]}}``) and
``DCP_VERSION``. No index, no ``.metadata`` and no global shapes are written: the global
shape of a tensor is the end of its farthest slice on every dim, and the slices must tile it
exactly (the reader's coverage check), so a missing rank file is refused, not loaded as
zeros. A tensor written whole by one rank (replicated, deduplicated by DCP) is refused by the
model's strict name check if its file is missing. There are no hashes. No torch needed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable

import numpy as np

from unickpt.ckpt.safetensors_io import SafetensorsHeader
from unickpt.errors import CheckpointFormatError
from unickpt.spec.index import LayoutInfo, TensorEntry, UnickptBlock
from unickpt.spec.naming import shown
from unickpt.spec.slice_table import MAX_DIM, SliceTable

__all__ = ["SHARD_FILE", "dcp_hf_files", "block_from_dcp_hf"]

SHARD_FILE = re.compile(r"^shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors$")
SHARDING_KEY = "DCP_SHARDING_INFO"


def dcp_hf_files(names: Iterable[str]) -> list[str]:
    """The ``shard-*-model-*.safetensors`` files among the ``names`` of a directory, sorted."""
    return sorted(n for n in names if SHARD_FILE.match(n))


def block_from_dcp_hf(
    directory: str, files: list[str], header_of: Callable[[str], SafetensorsHeader]
) -> UnickptBlock:
    """The slice table of a distributed Hugging Face DCP save (see the module docstring), its
    per-rank ``files`` read with ``header_of(file name)`` (the reader's: confined below
    ``directory``, through its Storage)."""
    # Per tensor, its slices' (file, offsets, shape), the global shape known once all are read.
    slices: dict[str, list[tuple[str, list[int], tuple[int, ...]]]] = {}
    dtypes: dict[str, str] = {}
    for fname in files:
        h = header_of(fname)
        path = h.path
        raw = h.metadata.get(SHARDING_KEY)
        if raw is None:
            raise CheckpointFormatError(
                f"{path}: no {SHARDING_KEY} in its metadata; not a distributed DCP save"
            )
        try:
            info = json.loads(raw)
        except ValueError as err:
            raise CheckpointFormatError(f"{path}: {SHARDING_KEY} is not JSON ({err})") from None
        if not isinstance(info, dict):
            raise CheckpointFormatError(f"{path}: {SHARDING_KEY} is not a JSON object")
        for name, e in h.entries.items():
            item = info.get(name)
            offs = item.get("saved_offsets") if isinstance(item, dict) else None
            if (
                not isinstance(offs, list)
                or len(offs) != len(e.shape)
                or not all(type(o) is int and 0 <= o < MAX_DIM for o in offs)
            ):
                raise CheckpointFormatError(
                    f"{path}: tensor {shown(name)} has no valid saved_offsets in {SHARDING_KEY} "
                    f"(expected {len(e.shape)} non-negative integers below 2**62, found {shown(offs)})"
                )
            if dtypes.setdefault(name, e.dtype) != e.dtype:
                raise CheckpointFormatError(
                    f"{path}: tensor {shown(name)} is {e.dtype} here but {dtypes[name]} in another rank's file"
                )
            slices.setdefault(name, []).append((fname, offs, tuple(e.shape)))
    tensors = {}
    for name, rows in slices.items():
        ndim = len(rows[0][2])
        if any(len(shp) != ndim for _, _, shp in rows):
            raise CheckpointFormatError(f"{directory}: tensor {shown(name)} has slices of different ranks")
        offsets = np.array([o for _, o, _ in rows], dtype=np.int64).reshape(len(rows), ndim)
        shapes = np.array([shp for _, _, shp in rows], dtype=np.int64).reshape(len(rows), ndim)
        shape = (offsets + shapes).max(axis=0).tolist()
        keep = np.flatnonzero((shapes > 0).all(axis=1))
        if not len(keep):
            keep = np.zeros(1, dtype=np.int64)
        table = SliceTable.from_columns(
            name,
            shape,
            files=[rows[k][0] for k in keep.tolist()],
            keys=[name] * len(keep),
            offsets=offsets[keep],
            shapes=shapes[keep],
        )
        try:
            tensors[name] = TensorEntry.of_table(dtypes[name], shape, table)
        except ValueError as err:
            raise CheckpointFormatError(f"{directory}: tensor {shown(name)}: {err}") from None
    return UnickptBlock(
        kind="model",
        created_by="torch HuggingFaceStorageWriter(save_distributed=True)",
        layout=LayoutInfo(plugin="dcp-hf", world_size=len(files), gathered=False),
        tensors=tensors,
    )
