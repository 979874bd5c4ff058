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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unickpt import __version__
from unickpt.ckpt.writer import Block, CheckpointWriter, FileSpec, build_block, build_index, tensor_entry
from unickpt.spec.dtypes import itemsize
from unickpt.spec.index import LayoutInfo, index_to_json
from unickpt.spec.naming import index_name, shard_name, slice_key
from unickpt.spec.slice_table import SliceColumns
from unickpt.store.publish import Sink, checkpoint_sink, new_save_id
from unickpt.store.storage import Storage

__all__ = ["SliceData", "TensorData", "write_checkpoint"]

Bytes = bytes | bytearray | memoryview | np.ndarray


@dataclass
class SliceData:
    offsets: Sequence[int]
    shape: Sequence[int]
    data: Bytes | Callable[[], Bytes]  # raw C-order bytes of the slice, or a function producing them


@dataclass
class TensorData:
    dtype: str
    shape: Sequence[int]
    slices: list[SliceData]
    extras: dict[str, Any] = field(default_factory=dict)  # TensorEntry extras (param, state)


def _raw(d: Bytes | Callable[[], Bytes]) -> np.ndarray:
    v = d() if callable(d) else d
    if isinstance(v, np.ndarray):
        return np.ascontiguousarray(v).reshape(-1).view(np.uint8)
    return np.frombuffer(memoryview(v).cast("B"), dtype=np.uint8)


def write_checkpoint(
    directory: str | Sink,
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
    progress: Callable[[int], object] | None = None,
) -> str:
    """Write ``tensors`` as a committed unickpt checkpoint directory (index written last).

    ``progress(n)`` is told the bytes of each slice once it is handed to the writer.

    Slices are dealt round-robin over ``files`` data files, or (``max_shard_bytes``)
    packed in order into files of at most that many bytes. Files are staged and committed by
    ``store.publish.commit_directory`` under the directory's save lock, as a save does, so a
    checkpoint of either layout already there is replaced whole. Returns ``directory`` (a sink's
    ``url``).

    ``directory`` may be a tool's output (``store.publish.output_sink``): on a store prefix the
    data files are then streamed to the store under their final names and the index is handed to
    it as a commit point, written after everything else of the output.
    """
    options: dict[str, Any] = {
        "kind": kind,
        "sliced": sliced,
        "files": files,
        "max_shard_bytes": max_shard_bytes,
        "aliases": aliases,
        "layout": layout,
        "block_extras": block_extras,
        "hashes": hashes,
        "fingerprints": fingerprints,
        "created_by": created_by,
        "fsync": fsync,
        "progress": progress,
    }
    out = checkpoint_sink(directory)
    with out.writing(fsync=fsync):
        _write_locked(
            out.root,
            tensors,
            storage=out.storage,
            track=out.track,
            commit=lambda writer, index: out.commit_index(index_name(kind), index, writer.commit),
            **options,
        )
    return out.url


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
    storage: Storage,
    track: Callable[[str], object],
    commit: Callable[[CheckpointWriter, bytes], None],
    progress: Callable[[int], object] | None,
) -> None:
    """The checkpoint's files written through ``storage``; each data file's path is handed to
    ``track`` before any is written, and the index to ``commit`` (the writer's commit, or a
    commit point of the output)."""
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
    writer = CheckpointWriter(
        directory,
        kind,
        save_id=save_id,
        sliced=sliced,
        hashes=hashes,
        fingerprints=fingerprints,
        fsync=fsync,
        storage=storage,
    )

    def key(n: str, k: int) -> str:
        return slice_key(n, k) if sliced else n

    planned: list[FileSpec] = [
        (
            shard_name(kind, j + 1, len(groups)),
            [(key(n, k), tensors[n].dtype, tuple(int(d) for d in s.shape)) for n, k, s in group],
        )
        for j, group in enumerate(groups)
    ]

    def blocks() -> Iterator[Block]:
        for group in groups:
            for n, k, s in group:
                raw = _raw(s.data)
                # Told as the slice is handed over: the writer takes no block past the last, so
                # counting after the yield would never count the last slice.
                if progress is not None:
                    progress(raw.nbytes)
                yield key(n, k), raw, (tensors[n].shape, s.offsets, s.shape)

    # Staged files of a failed write are removed before the error propagates; on a store,
    # the output's abort removes them (tracked before any is written).
    for fname, _specs in planned:
        track(fname)
    written = writer.write(planned, blocks())
    file_of = {k: fname for fname, specs in planned for k, _, _ in specs}
    entries = {}
    for n, t in tensors.items():
        keys = [key(n, k) for k in range(len(t.slices))]
        slices = SliceColumns(n, t.shape)
        for k, s in zip(keys, t.slices, strict=True):
            slices.add(file_of[k], k, s.offsets, s.shape, written[k][0])
        partials = [written[k][1] for k in keys] if fingerprints else None
        entries[n] = tensor_entry(n, t.dtype, t.shape, slices.table(), partials, **t.extras)
    block = build_block(
        kind="model" if kind == "model" else "optimizer",
        created_by=created_by,
        layout=(layout or LayoutInfo()).model_copy(update={"gathered": not sliced}),
        tensors=entries,
        aliases=aliases,
        save_id=save_id,
        **(block_extras or {}),
    )
    commit(writer, index_to_json(build_index(block, sliced=sliced)))
