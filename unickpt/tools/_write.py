"""Write a unickpt checkpoint from raw slice bytes, through the format layer (no torch).

Used by ``convert`` (whole tensors produced one at a time) and by tests that need
hand-made layouts (column splits, ZeRO flat ranges, ...) without a process group. The
files follow ``docs/format.md`` exactly as the save engine writes them: in a sliced
checkpoint, keys are ``name@k``, files are tagged ``unickpt-sliced`` and ``weight_map``
points at the sentinel name; in a gathered one, keys are tensor names and ``weight_map``
names the real files.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unickpt import __version__
from unickpt.format.commit import (
    SAVE_ID_KEY,
    commit_directory,
    directory_lock,
    new_save_id,
    temp_name,
)
from unickpt.format.dtypes import itemsize
from unickpt.format.hashing import combine_partials, finalize_fingerprint, fingerprint_partial, slice_hash
from unickpt.format.index import IndexFile, LayoutInfo, SliceEntry, TensorEntry, UnickptBlock, index_to_json
from unickpt.format.naming import SLICED_SENTINEL, shard_name, slice_key
from unickpt.format.safetensors_io import SafetensorsWriter

__all__ = ["SliceData", "TensorData", "write_checkpoint"]

Bytes = bytes | bytearray | memoryview | np.ndarray


@dataclass
class SliceData:
    offsets: Sequence[int]
    shape: Sequence[int]
    data: Bytes | Callable[[], Bytes]  # raw C-order bytes of the block, or a function producing them


@dataclass
class TensorData:
    dtype: str
    shape: Sequence[int]
    slices: list[SliceData]
    extras: dict[str, Any] = field(default_factory=dict)  # TensorEntry extras (param, state)


def _raw(d: Bytes | Callable[[], Bytes]) -> memoryview:
    v = d() if callable(d) else d
    if isinstance(v, np.ndarray):
        return np.ascontiguousarray(v).reshape(-1).view(np.uint8).data
    return memoryview(v).cast("B")


def write_checkpoint(
    directory: str,
    tensors: dict[str, TensorData],
    *,
    kind: str = "model",
    sliced: bool = True,
    files: int = 1,
    max_shard_bytes: int | None = None,
    aliases: dict[str, str] | None = None,
    layout: LayoutInfo | None = None,
    block_extras: dict[str, Any] | None = None,
    hashes: bool = True,
    fingerprints: bool = True,
    created_by: str = f"unickpt {__version__}",
    fsync: bool = True,
) -> str:
    """Write ``tensors`` as a committed unickpt checkpoint directory (index written last).

    Slices are dealt round-robin over ``files`` data files, or (``max_shard_bytes``)
    packed in order into files of at most that many bytes. Files are staged and committed by
    ``format.commit.commit_directory`` under the directory's save lock, as a save does, so a
    checkpoint of either layout already there is replaced whole. Returns ``directory``.
    """
    os.makedirs(directory, exist_ok=True)
    with directory_lock(directory):
        _write_locked(
            directory,
            tensors,
            kind=kind,
            sliced=sliced,
            files=files,
            max_shard_bytes=max_shard_bytes,
            aliases=aliases,
            layout=layout,
            block_extras=block_extras,
            hashes=hashes,
            fingerprints=fingerprints,
            created_by=created_by,
            fsync=fsync,
        )
    return directory


def _write_locked(
    directory: str,
    tensors: dict[str, TensorData],
    *,
    kind: str,
    sliced: bool,
    files: int,
    max_shard_bytes: int | None,
    aliases: dict[str, str] | None,
    layout: LayoutInfo | None,
    block_extras: dict[str, Any] | None,
    hashes: bool,
    fingerprints: bool,
    created_by: str,
    fsync: bool,
) -> None:
    save_id = new_save_id()
    items = [(n, k, s) for n, t in tensors.items() for k, s in enumerate(t.slices)]
    groups: list[list[tuple[str, int, SliceData]]] = []
    if max_shard_bytes is not None:
        cur: list[tuple[str, int, SliceData]] = []
        size = 0
        for it in items:
            nb = math.prod(it[2].shape) * itemsize(tensors[it[0]].dtype)
            if cur and size + nb > max_shard_bytes:
                groups.append(cur)
                cur, size = [], 0
            cur.append(it)
            size += nb
        groups.append(cur)
    else:
        groups = [items[i :: max(1, files)] for i in range(max(1, files))]
    groups = [g for g in groups if g] or [[]]
    results: dict[tuple[str, int], tuple[str, str | None, int]] = {}
    # Staged files of a failed write are removed by the next save into the directory (leftovers).
    staged: dict[str, str] = {}
    for j, group in enumerate(groups):
        fname = shard_name(kind, j + 1, len(groups))
        key_of = {(n, k): (slice_key(n, k) if sliced else n) for n, k, _ in group}
        specs = [(key_of[(n, k)], tensors[n].dtype, tuple(int(d) for d in s.shape)) for n, k, s in group]
        path = temp_name(os.path.join(directory, fname), save_id)
        meta = {"format": "unickpt-sliced" if sliced else "pt", SAVE_ID_KEY: save_id}
        w = SafetensorsWriter(path, specs, meta)
        staged[fname] = path
        try:
            for n, k, s in group:
                t = tensors[n]
                data = _raw(s.data)
                partial = 0
                if fingerprints and data.nbytes:
                    words = np.frombuffer(data, dtype=f"<u{itemsize(t.dtype)}")
                    partial = fingerprint_partial(words, list(t.shape), list(s.offsets), list(s.shape))
                results[(n, k)] = (fname, slice_hash(data) if hashes else None, partial)
                w.write(key_of[(n, k)], data)
                del data
            w.close(fsync=fsync)
        except BaseException:
            w.abort()
            raise
    entries = {}
    for n, t in tensors.items():
        total = 0
        slices = []
        for k, s in enumerate(t.slices):
            fname, xxh, partial = results[(n, k)]
            total = combine_partials((total, partial))
            slices.append(
                SliceEntry(
                    file=fname,
                    key=slice_key(n, k) if sliced else n,
                    offsets=list(s.offsets),
                    shape=list(s.shape),
                    xxh3=xxh,
                )
            )
        fp = finalize_fingerprint(n, t.dtype, list(t.shape), total) if fingerprints else None
        entries[n] = TensorEntry(
            dtype=t.dtype, shape=list(t.shape), fingerprint=fp, slices=slices, **t.extras
        )
    lay = (layout or LayoutInfo()).model_copy(update={"gathered": not sliced})
    block = UnickptBlock(
        kind="model" if kind == "model" else "optimizer",
        created_by=created_by,
        layout=lay,
        tensors=entries,
        aliases=dict(aliases or {}),
        save_id=save_id,
        **(block_extras or {}),
    )
    weight_map = {n: (SLICED_SENTINEL if sliced else entries[n].slices[0].file) for n in entries}
    total_size = sum(e.nbytes for e in entries.values())
    index = IndexFile.model_validate(
        {"metadata": {"total_size": total_size}, "weight_map": weight_map, "unickpt": block.model_dump()}
    )
    commit_directory(directory, kind, staged, index_to_json(index), save_id=save_id, fsync=fsync)
