"""Read a PyTorch Distributed Checkpoint (DCP) directory without running code from it.

torch's own ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with ``pickle.load``,
and its ``DefaultLoadPlanner`` reads every non-tensor entry with
``torch.load(weights_only=False)``: both execute whatever a crafted file asks. Here:

- ``.metadata`` is unpickled by :class:`_MetadataUnpickler`, which resolves only the classes a
  DCP metadata file is made of (``torch.distributed.checkpoint`` metadata and storage-info
  classes, ``torch.Size``, torch dtypes, layouts and memory formats, ``pathlib`` paths) and
  refuses every other global with :class:`UnsupportedError`;
- non-tensor entries (``param_groups``, scheduler and train state, stored as pickled bytes)
  are read with ``torch.load(weights_only=True)``, torch's restricted unpickler, which builds
  only tensors and plain containers of numbers and strings;
- tensors are read by torch's reader, which already uses ``torch.load(weights_only=True)``.

So converting a DCP checkpoint runs no code from it; a hostile file can still make the
conversion fail (with a ``UnickptError``) or produce wrong numbers, as any data file can.
Imported lazily (needs torch).
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, UnsupportedError
from unickpt.format.storage import is_url, open_storage

__all__ = ["read_metadata", "load_entries", "tensor_specs"]

_METADATA = ".metadata"
# module -> names that may be resolved while unpickling .metadata (None: any class defined there).
_ALLOWED: dict[str, set[str] | None] = {
    "torch.distributed.checkpoint.metadata": None,
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint._hf_utils": {"_HFStorageInfo"},
    "torch.distributed.checkpoint.planner": {"WriteItemType", "LoadItemType"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath", "Path"},
    "collections": {"OrderedDict"},
    "builtins": {"set", "frozenset", "slice"},
}


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, f: Any, where: str) -> None:
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        allowed = _ALLOWED.get(module, set())
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.memory_format, torch.layout)
        ):
            return getattr(torch, name)
        if allowed is None or name in allowed:
            obj = super().find_class(module, name)
            if allowed is None and not (isinstance(obj, type) and obj.__module__ == module):
                # only the classes defined there, not whatever the module imports
                raise UnsupportedError(
                    f"{self.where}: refers to {module}.{name}, which is not a metadata class"
                )
            return obj
        raise UnsupportedError(
            f"{self.where}: refers to {module}.{name}, which a DCP metadata file never needs; "
            "refusing to unpickle it (unickpt never runs code from a checkpoint)"
        )


def read_metadata(src: str) -> Metadata:
    """The DCP ``Metadata`` of the directory ``src`` (a path or a URL), unpickled with the
    allowlist above."""
    if is_url(src):
        storage, root = open_storage(src)
        try:  # one request: a missing object is the store's answer to the read
            raw = storage.read_bytes(storage.join(root, _METADATA))
        except IncompleteCheckpointError:
            raise IncompleteCheckpointError(
                f"{src} is not a DCP checkpoint: it has no .metadata object"
            ) from None
        return _unpickle(io.BytesIO(raw), f"{src.rstrip('/')}/{_METADATA}")
    path = os.path.join(src, _METADATA)
    if not os.path.isfile(path):
        raise IncompleteCheckpointError(f"{src} is not a DCP checkpoint: it has no .metadata file")
    with open(path, "rb") as f:
        return _unpickle(f, path)


def _unpickle(f: Any, path: str) -> Metadata:
    try:
        md = _MetadataUnpickler(f, path).load()
    except UnsupportedError:
        raise
    except Exception as e:  # a damaged pickle raises many types
        raise CheckpointFormatError(
            f"{path}: not a readable DCP metadata file ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(md, Metadata):
        raise CheckpointFormatError(f"{path}: holds a {type(md).__name__}, not DCP Metadata")
    return md


class _SafeMetadata:
    """torch's reader, with the metadata read through :func:`read_metadata`, or the ``known``
    metadata of the checkpoint when the caller has it already (no second read per load)."""

    path: Any
    load_id: Any
    known: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        from torch.distributed.checkpoint.metadata import StorageMeta

        if self.known is None:
            md = read_metadata(os.fspath(self.path))
            storage_meta = getattr(md, "storage_meta", None) or StorageMeta()
        else:  # a copy: each load stamps its own load id, the caller's metadata stays as it was
            md = dataclasses.replace(self.known)
            storage_meta = dataclasses.replace(md.storage_meta) if md.storage_meta else StorageMeta()
        storage_meta.load_id = self.load_id
        md.storage_meta = storage_meta
        return md


class _SafeReader(_SafeMetadata, FileSystemReader):
    """A local DCP directory."""


class _RangedFileSystem(FileSystem):
    """torch's fsspec file system, with files opened for reading through a cache of aligned
    ``_BLOCK`` blocks instead of the store's default read-ahead (50 MiB on s3fs, and refetched
    whenever torch's reader seeks back into an entry's header): each entry costs its own byte
    range rounded out to blocks, so converting part of a checkpoint fetches about that part."""

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[Any]:
        if mode != "rb" or self.fs is None:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with self.fs.open(os.fspath(path), "rb", cache_type="blockcache", block_size=_BLOCK) as stream:
            yield stream


_BLOCK = 4 << 20


class _SafeFsspecReader(_SafeMetadata, FsspecReader):
    """A DCP checkpoint at a URL: torch's fsspec reader opens each data file on the store and
    reads the byte ranges of the entries asked for (nothing is downloaded whole)."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        ranged = _RangedFileSystem()
        self.path = ranged.init_path(path)
        self.fs = cast(Any, ranged)  # torch declares the attribute as its local FileSystem


def _reader(src: str, md: Metadata) -> FileSystemReader:
    reader = _SafeFsspecReader(src) if is_url(src) else _SafeReader(src)
    reader.known = md
    return reader


class _SafePlanner(DefaultLoadPlanner):
    """torch's load planner, reading non-tensor entries with ``torch.load(weights_only=True)``."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsupportedError(
                f"DCP entry {fqn!r} holds objects torch.load(weights_only=True) refuses ({e}); "
                "unickpt never unpickles arbitrary objects"
            ) from None
        self.original_state_dict[fqn] = obj


def tensor_specs(md: Metadata) -> dict[str, tuple[torch.dtype, list[int]]]:
    """``{flat key: (dtype, global shape)}`` of every tensor entry."""
    return {
        k: (m.properties.dtype, list(m.size))
        for k, m in md.state_dict_metadata.items()
        if isinstance(m, TensorStorageMetadata)
    }


def load_entries(src: str, keys: list[str], md: Metadata) -> dict[str, Any]:
    """Load the flat ``keys`` of the DCP checkpoint ``src`` (tensors whole, on CPU; other entries
    through the restricted unpickler). One ``dcp.load`` call, no process group."""
    # The private _load_state_dict (torch's load without its Stateful handling) fills ``sd`` in
    # place, bytes entries included; the public load() copies the dict and drops them.
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    specs = tensor_specs(md)
    sd: dict[str, Any] = {}
    for k in keys:
        if k in specs:
            dt, shape = specs[k]
            sd[k] = torch.empty(shape, dtype=dt)
        else:
            sd[k] = None  # a bytes entry: replaced by the planner
    with warnings.catch_warnings():
        # "torch.distributed is disabled ... assuming ... a single process": exactly what we want.
        warnings.simplefilter("ignore", UserWarning)
        try:
            _load_state_dict(
                sd,
                storage_reader=_reader(src, md),
                planner=_SafePlanner(
                    flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True
                ),
                no_dist=True,
            )
        except UnsupportedError:
            raise
        except (Exception, CheckpointException) as e:
            # DCP wraps errors of its reader in CheckpointException (a BaseException).
            cause = _unickpt_cause(e)
            if cause is not None:
                raise cause from None
            raise CheckpointFormatError(f"{src}: torch's DCP reader failed: {type(e).__name__}: {e}") from e
    return sd


def _unickpt_cause(e: BaseException) -> BaseException | None:
    from unickpt.errors import UnickptError

    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        for v in failures.values():
            inner = v[0] if isinstance(v, tuple) and v else v  # (exception, traceback) pairs
            if isinstance(inner, UnickptError):
                return inner
    return e.__cause__ if isinstance(e.__cause__, UnickptError) else None
