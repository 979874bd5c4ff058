"""Helpers shared by the offline tools: open a checkpoint of either kind, format sizes."""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterable
from typing import Any

from unickpt.ckpt.dcp_hf import SHARD_FILE
from unickpt.ckpt.reader import (
    CheckpointReader,
    file_kind,
    hint_foreign,
    open_checkpoint,
)
from unickpt.ckpt.writer import write_all
from unickpt.errors import IncompleteCheckpointError, OutputExistsError
from unickpt.spec.naming import index_name, single_name
from unickpt.spec.run_names import COMMIT_NAME, SCHEDULER_NAME
from unickpt.store.storage import open_storage

__all__ = [
    "checkpoint_parts",
    "read_side_files",
    "open_auto",
    "detect_kind",
    "human_bytes",
    "OutputExistsError",
    "write_all",
]


def detect_kind(path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None) -> str:
    """``"model"`` or ``"optimizer"``: what the checkpoint at ``path`` (a local path or a URL)
    holds; model wins when both. A directory says it by the names it holds (on a store, a HEAD
    request each, nothing fetched); a single file by the kind recorded in its header, whatever
    the user renamed it to, else by its name."""
    storage, _ = open_storage(path, storage_options)
    p = os.fspath(path).removeprefix("file://").rstrip("/") or "/"
    by_name = "optimizer" if posixpath.basename(p).startswith("optimizer") else "model"
    if p.endswith(".json"):
        return by_name
    if not p.endswith(".safetensors"):
        for kind in ("model", "optimizer"):
            # A directory or a broken link under a checkpoint's name counts too: it is opened
            # (and refused, naming what it is) rather than reported as absent.
            if any(storage.exists(storage.join(p, n)) for n in (index_name(kind), single_name(kind))):
                return kind
    if storage.is_file(p):
        return file_kind(storage, p) or by_name
    names = storage.listdir(p)
    if any(SHARD_FILE.match(n) for n in names):  # HuggingFaceStorageWriter(save_distributed=True) output
        return "model"
    if names:
        raise IncompleteCheckpointError(
            f"{p} holds no committed checkpoint: none of model/optimizer .safetensors(.index.json) is present"
            + hint_foreign(storage, p)
        )
    if not storage.exists(p):
        raise IncompleteCheckpointError(f"no checkpoint at {p}: the path does not exist")
    return "model"  # an empty directory, a FIFO...: opening it says what stands there


def open_auto(path: str | os.PathLike[str], kind: str | None = None) -> CheckpointReader:
    """Open ``path`` (a local path or a URL) as a ``kind`` checkpoint, or as whatever it holds
    when ``kind`` is None (:func:`detect_kind`).

    A URL is read through the storage layer (its options from the environment or fsspec's
    configuration, where the CLI's ``--storage-option`` puts them); its index is fetched once.
    """
    return open_checkpoint(path, kind or detect_kind(path))


def human_bytes(n: int) -> str:
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if x < 1024 or unit == "TiB":
            return f"{int(x)} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{n} B"  # pragma: no cover


#: The largest side file copied (a tokenizer.json of a large vocabulary is tens of MB).
SIDE_FILE_LIMIT = 256 << 20


def read_side_files(
    directory: str, names: Iterable[str], storage_options: dict[str, Any] | None = None
) -> list[tuple[str, bytes]]:
    """The files of ``names`` that ``directory`` (a local path or a URL) holds, whole, in that order."""
    storage, _ = open_storage(directory, storage_options)
    base = directory.removeprefix("file://").rstrip("/") or "/"
    present = set(storage.listdir(base))
    return [
        (n, storage.read_bytes(storage.confined(base, n, base, "side file"), limit=SIDE_FILE_LIMIT))
        for n in names
        if n in present
    ]


def checkpoint_parts(src: str) -> tuple[str, str | None, str | None, int | None]:
    """(model path, optimizer path or None, scheduler file or None, step or None) of ``src``.

    ``src`` is a model checkpoint (a directory, possibly holding the optimizer checkpoint too, or
    a single file), a directory holding ``model/`` (and ``optimizer/``, ``lr_scheduler.json``: the
    layout the README saves, or a manager ``step-<N>/``, whose ``COMMIT`` gives the step), or
    ``<dir>/model`` of such a directory, whose ``optimizer/`` and ``lr_scheduler.json`` beside it
    come along. Local paths and URLs alike, through the storage layer.
    """
    storage, _ = open_storage(src)
    # The storage's paths are the location as given (a URL keeps its scheme), "/"-separated.
    root = src.removeprefix("file://").rstrip("/") or "/"

    def has(directory: str, kind: str) -> bool:
        return any(storage.exists(storage.join(directory, n)) for n in (index_name(kind), single_name(kind)))

    def optional(path: str, kind: str | None) -> str | None:
        found = storage.exists(path) if kind is None else has(path, kind)
        return path if found else None

    names = storage.listdir(root)
    if not names:
        if not storage.exists(root):
            raise IncompleteCheckpointError(f"{src}: nothing there to export")
        return root, None, None, None  # a single model file
    step: int | None = None
    if has(root, "model"):
        parent = posixpath.dirname(root)
        beside = posixpath.basename(root) == "model"
        optim = optional(root, "optimizer") or (
            optional(storage.join(parent, "optimizer"), "optimizer") if beside else None
        )
        sched = optional(storage.join(root, SCHEDULER_NAME), None) or (
            optional(storage.join(parent, SCHEDULER_NAME), None) if beside else None
        )
        return root, optim, sched, None
    if "model" in names and has(storage.join(root, "model"), "model"):
        if COMMIT_NAME in names:  # a CheckpointManager step
            try:
                step = int(
                    json.loads(storage.read_bytes(storage.join(root, COMMIT_NAME), limit=1 << 20))["step"]
                )
            except (OSError, ValueError, KeyError, TypeError):
                step = None
        return (
            storage.join(root, "model"),
            optional(storage.join(root, "optimizer"), "optimizer"),
            optional(storage.join(root, SCHEDULER_NAME), None),
            step,
        )
    raise IncompleteCheckpointError(
        f"{src} holds no committed model checkpoint to export (neither {index_name('model')} nor "
        f"{single_name('model')}, nor a model/ directory holding one)"
    )
