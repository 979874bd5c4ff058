"""Blocks a reader builds for itself: from a single file's header metadata, from a plain Hugging
Face index, and what kind of checkpoint a file is (``file_kind``).

No file handle is kept here: each function reads what it needs and returns plain values.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from unickpt.ckpt.safetensors_io import SafetensorsHeader, read_header
from unickpt.errors import CheckpointFormatError, IndexFileError, UnsafePathError
from unickpt.spec._json import strict_loads
from unickpt.spec.index import IndexFile, SliceEntry, TensorEntry, UnickptBlock, check_file_name
from unickpt.spec.index_fast import validate_block
from unickpt.spec.naming import single_name

__all__ = [
    "UNICKPT_METADATA_KEY",
    "block_from_header",
    "block_from_plain_index",
    "single_file_name",
    "file_kind",
]

UNICKPT_METADATA_KEY = "unickpt"


def block_from_header(h: SafetensorsHeader, kind: str) -> tuple[UnickptBlock, bool]:
    """The unickpt block of a single-file checkpoint, or one synthesised for a plain file."""
    file = single_file_name(h.path, kind)
    raw = h.metadata.get(UNICKPT_METADATA_KEY)
    if raw is not None:
        try:
            obj = strict_loads(raw, IndexFileError, f"{h.path}: the unickpt metadata block")
            tensors = obj.get("tensors") if isinstance(obj, dict) else None
            if isinstance(tensors, dict):
                # Slices of a single file live in that file, whatever it was renamed to.
                for t in tensors.values():
                    slices = t.get("slices") if isinstance(t, dict) else None
                    for s in slices if isinstance(slices, list) else []:
                        if isinstance(s, dict):
                            s["file"] = file
                if isinstance(obj.get("files"), list):  # the compact encoding's file table
                    obj["files"] = [file] * len(obj["files"])
            block = validate_block(obj, h.path, "the unickpt metadata block")
        except CheckpointFormatError:
            raise
        except (ValueError, RecursionError) as e:
            raise IndexFileError(f"{h.path}: the unickpt metadata block is invalid: {e}") from None
        if block.kind != kind:
            raise IndexFileError(
                f"{h.path}: holds a checkpoint of kind {block.kind!r} (its unickpt metadata), expected {kind!r}"
            )
        return block, True
    tensors = {
        k: TensorEntry(
            dtype=e.dtype,
            shape=list(e.shape),
            slices=[SliceEntry(file=file, key=k, offsets=[0] * len(e.shape), shape=list(e.shape))],
        )
        for k, e in h.entries.items()
    }
    return UnickptBlock(kind="model" if kind == "model" else "optimizer", tensors=tensors), False


def single_file_name(path: str, kind: str) -> str:
    """The data-file name a single-file checkpoint's slices record: its own name when that is a
    valid data-file name, else ``<kind>.safetensors`` (a file saved onto e.g. a temporary file
    named ``tmpab12cd``); the reader maps every slice to the file it opened either way."""
    name = os.path.basename(path)
    try:
        check_file_name(name)
    except UnsafePathError:
        return single_name("model" if kind == "model" else "optimizer")
    return name


def block_from_plain_index(
    idx: IndexFile,
    directory: str,
    path: str,
    kind: str,
    header_of: Callable[[str], SafetensorsHeader] | None = None,
) -> UnickptBlock:
    """Synthesise the slice table of a plain Hugging Face sharded checkpoint from its headers,
    read with ``header_of(file name)`` (the reader's: through its Storage; left out, the local
    files of ``directory``)."""
    tensors: dict[str, TensorEntry] = {}
    for file in sorted(set(idx.weight_map.values())):
        if file.endswith(".bin"):
            raise CheckpointFormatError(
                f"{path}: shard {file!r} is a pickle (.bin) file; convert it first with "
                "`unickpt convert --from bin` (read with torch.load(weights_only=True))"
            )
        h = header_of(file) if header_of is not None else read_header(os.path.join(directory, file))
        for k, e in h.entries.items():
            if idx.weight_map.get(k) != file:
                continue
            tensors[k] = TensorEntry(
                dtype=e.dtype,
                shape=list(e.shape),
                slices=[SliceEntry(file=file, key=k, offsets=[0] * len(e.shape), shape=list(e.shape))],
            )
    missing = sorted(set(idx.weight_map) - set(tensors))
    if missing:
        raise IndexFileError(
            f"{path}: weight_map names {len(missing)} tensor(s) absent from their files, e.g. {missing[:3]}"
        )
    return UnickptBlock(kind="model" if kind == "model" else "optimizer", tensors=tensors)


def file_kind(path: str) -> str | None:
    """The ``kind`` recorded in a single safetensors file's unickpt metadata, or None (plain file,
    unreadable metadata: opening the file reports it)."""
    try:
        raw = read_header(path).metadata.get(UNICKPT_METADATA_KEY)
        obj = strict_loads(raw, IndexFileError, path) if raw is not None else None
    except CheckpointFormatError:
        return None
    kind = obj.get("kind") if isinstance(obj, dict) else None
    return kind if kind in ("model", "optimizer") else None
