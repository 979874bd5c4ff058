"""Helpers shared by the offline tools: open a checkpoint of either kind, format sizes."""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Iterable
from typing import Any

from unickpt.ckpt.reader import (
    CheckpointReader,
    file_kind,
    hint_foreign,
    locate,
    open_checkpoint,
    open_located,
)
from unickpt.ckpt.writer import write_all
from unickpt.errors import IncompleteCheckpointError, OutputExistsError
from unickpt.spec.naming import index_name, single_name
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


def detect_kind(path: str | os.PathLike[str]) -> str:
    """``"model"`` or ``"optimizer"``: what the checkpoint at ``path`` holds (model wins when both)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        for kind in ("model", "optimizer"):
            # lexists: a directory or a broken link under a checkpoint's name is opened (and refused,
            # naming what it is) rather than reported as absent.
            if os.path.lexists(os.path.join(p, index_name(kind))) or os.path.lexists(
                os.path.join(p, single_name(kind))
            ):
                return kind
        from unickpt.ckpt.dcp_hf import dcp_hf_files

        if dcp_hf_files(p):  # HuggingFaceStorageWriter(save_distributed=True) output
            return "model"
        raise IncompleteCheckpointError(
            f"{p} holds no committed checkpoint: none of model/optimizer .safetensors(.index.json) is present"
            + hint_foreign(p)
        )
    if os.path.isfile(p) and not p.endswith(".json"):
        # A single file says what it holds, whatever the user renamed it to.
        recorded = file_kind(p)
        if recorded is not None:
            return recorded
    base = os.path.basename(p)
    return "optimizer" if base.startswith("optimizer") else "model"


def open_auto(path: str | os.PathLike[str], kind: str | None = None) -> CheckpointReader:
    """Open ``path`` as a ``kind`` checkpoint, or as whatever it holds when ``kind`` is None.

    A URL is read through the storage layer (its options from the environment or fsspec's
    configuration, where the CLI's ``--storage-option`` puts them); its index is fetched once.
    """
    storage, root = open_storage(path)
    if storage.local_path(root) is None:  # an object store: the kind is found from the listing
        return _open_url_auto(os.fspath(path), kind)
    return open_checkpoint(path, kind or detect_kind(path))


def _open_url_auto(url: str, kind: str | None) -> CheckpointReader:
    if kind is None:
        base = url.rstrip("/").rsplit("/", 1)[-1]
        if base.endswith((".json", ".safetensors")):
            kind = "optimizer" if base.startswith("optimizer") else "model"
        else:
            try:
                return open_located(locate(url, "model"), "model")
            except IncompleteCheckpointError as e:
                try:
                    return open_located(locate(url, "optimizer"), "optimizer")
                except IncompleteCheckpointError:
                    raise IncompleteCheckpointError(
                        f"{url.rstrip('/')} holds no committed checkpoint: none of "
                        "model/optimizer .safetensors(.index.json) is present"
                    ) from e
    return open_located(locate(url, kind), kind)


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
        sched = optional(storage.join(root, "lr_scheduler.json"), None) or (
            optional(storage.join(parent, "lr_scheduler.json"), None) if beside else None
        )
        return root, optim, sched, None
    if "model" in names and has(storage.join(root, "model"), "model"):
        if "COMMIT" in names:  # a CheckpointManager step
            try:
                step = int(
                    json.loads(storage.read_bytes(storage.join(root, "COMMIT"), limit=1 << 20))["step"]
                )
            except (OSError, ValueError, KeyError, TypeError):
                step = None
        return (
            storage.join(root, "model"),
            optional(storage.join(root, "optimizer"), "optimizer"),
            optional(storage.join(root, "lr_scheduler.json"), None),
            step,
        )
    raise IncompleteCheckpointError(
        f"{src} holds no committed model checkpoint to export (neither {index_name('model')} nor "
        f"{single_name('model')}, nor a model/ directory holding one)"
    )
