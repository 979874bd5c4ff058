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

What the unpickled metadata says is then checked before anything is allocated or opened
(:func:`check_metadata`): no self-reference and no nesting deeper than
``spec.untrusted.MAX_DEPTH``; every storage entry names a plain file of the checkpoint's own
directory or URL prefix (``spec.untrusted``: ``../other_run/__0_0.distcp``, an absolute path or
a symbolic link out of the directory is refused with :class:`UnsafePathError`), a regular file,
at a byte range inside it, ranges of one file never overlapping; every tensor has at most
``MAX_NDIM`` dims and chunks that lie inside it, tile it exactly and each fit the bytes its
storage entry holds. So the tensors allocated for a load are never larger than the data files
present, and none is left partly uninitialised.

So converting a DCP checkpoint runs no code from it; a hostile file can still make the
conversion fail (with a ``UnickptError``) or produce wrong numbers, as any data file can.
Imported lazily (needs torch).
"""

from __future__ import annotations

import dataclasses
import io
import itertools
import os
import pickle
import stat
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
from unickpt.spec.boxes import box_volume, coverage_problem
from unickpt.spec.naming import shown
from unickpt.spec.untrusted import check_graph, confined_path, plain_name, show
from unickpt.store.storage import Storage, open_storage

__all__ = ["read_metadata", "check_metadata", "load_entries", "tensor_specs"]

#: Most dims of a DCP tensor accepted (as in a safetensors header).
MAX_NDIM = 64
#: Largest extent of one dim (as in a unickpt index; numpy's int64 arithmetic stays exact).
MAX_EXTENT = (1 << 62) - 1
#: Most corners (chunks x 2^dims) the general tiling check is given for one tensor; the common
#: case (chunks cut along one dim) is checked without it.
_MAX_CORNERS = 1 << 22

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
    storage, root = open_storage(src)
    if storage.local_path(root) is None:
        try:  # one request: a missing object is the store's answer to the read
            raw = storage.read_bytes(storage.join(root, _METADATA))
        except IncompleteCheckpointError:
            raise IncompleteCheckpointError(
                f"{src} is not a DCP checkpoint: it has no .metadata object"
            ) from None
        where = f"{src.rstrip('/')}/{_METADATA}"
        md = _unpickle(io.BytesIO(raw), where)
        check_metadata(md, where, lambda name, entry: _store_size(storage, root, src, name))
        return md
    path = os.path.join(src, _METADATA)
    if not os.path.isfile(path):
        raise IncompleteCheckpointError(f"{src} is not a DCP checkpoint: it has no .metadata file")
    with open(path, "rb") as f:
        md = _unpickle(f, path)
    check_metadata(md, path, lambda name, entry: _local_size(src, name, path, entry))
    return md


def _local_size(src: str, name: str, where: str, entry: str) -> int:
    p = confined_path(src, name, where, entry)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{where}: {entry} is in {p}, which is missing") from None
    except OSError as e:
        raise CheckpointFormatError(
            f"{where}: {entry} is in {p}, which cannot be read ({e.strerror})"
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointFormatError(f"{where}: {entry} is in {p}, which is not a regular file")
    return st.st_size


def _store_size(storage: Storage, root: str, src: str, name: str) -> int:
    try:
        return storage.size(storage.join(root, name))
    except (FileNotFoundError, IncompleteCheckpointError):
        raise IncompleteCheckpointError(
            f"{src.rstrip('/')}/{_METADATA}: names data file {shown(name)}, which {src} does not hold"
        ) from None


def _ints(v: Any, n: int | None = None) -> list[int] | None:
    """``v`` as a list of non-negative ints (of length ``n`` when given), or None."""
    if not isinstance(v, (tuple, list)) or (n is not None and len(v) != n) or len(v) > MAX_NDIM:
        return None
    if not all(type(x) is int and 0 <= x <= MAX_EXTENT for x in v):
        return None
    return list(v)


def check_metadata(md: Metadata, where: str, size_of: Any) -> None:
    """Refuse DCP metadata ``md`` (read from ``where``) that could read outside its checkpoint or
    allocate more than its data files hold (see the module docstring). ``size_of(name, entry)``
    is the byte size of the data file ``name`` of the checkpoint (a plain name: checked here
    first), raising when it is missing, not a regular file or a link out of the directory."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

    check_graph(md, where, "DCP metadata", CheckpointFormatError)
    sdm = md.state_dict_metadata
    if not isinstance(sdm, dict) or not all(isinstance(k, str) for k in sdm):
        raise CheckpointFormatError(f"{where}: state_dict_metadata is not a dict of entry names")
    planner = md.planner_data
    for k, p in (planner if isinstance(planner, dict) else {}).items():
        if isinstance(p, (tuple, list)) and not all(
            type(x) is str or (type(x) is int and 0 <= x < 1 << 63) for x in p
        ):  # the entry's path in the saved state dict: names and list indices
            raise CheckpointFormatError(
                f"{where}: planner_data[{show(k)}] is {show(p)}; expected the entry's path (names and indices)"
            )
    storage = md.storage_data
    if not isinstance(storage, dict):
        raise CheckpointFormatError(f"{where}: storage_data is {type(storage).__name__}, not a dict")
    sizes: dict[str, int] = {}
    ranges: dict[str, list[tuple[int, int, str]]] = {}
    lengths: dict[tuple[str, tuple[int, ...] | None], int] = {}
    for idx, info in storage.items():
        fqn = getattr(idx, "fqn", None) if isinstance(idx, MetadataIndex) else None
        off = getattr(idx, "offset", None)
        if not isinstance(fqn, str) or (off is not None and _ints(off) is None):
            raise CheckpointFormatError(f"{where}: storage_data key {show(idx)} is not a DCP MetadataIndex")
        entry = f"storage_data[{shown(fqn)}{'' if off is None else f' at {list(off)}'}]"
        name = plain_name(getattr(info, "relative_path", None), where, f"{entry}.relative_path")
        start, length = getattr(info, "offset", None), getattr(info, "length", None)
        if (
            type(start) is not int
            or type(length) is not int
            or not (0 <= start < 1 << 63 and 0 <= length < 1 << 63)
        ):
            raise CheckpointFormatError(
                f"{where}: {entry} has offset {show(start)} and length {show(length)}; expected non-negative "
                "integers below 2**63"
            )
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedError(
                f"{where}: {entry} is stored through transforms {show(info.transform_descriptors)}; "
                "unickpt reads DCP entries stored as they are only"
            )
        if name not in sizes:
            sizes[name] = size_of(name, f"{entry}.relative_path")
        if start + length > sizes[name]:
            raise CheckpointFormatError(
                f"{where}: {entry} claims bytes [{start}, {start + length}) of {shown(name)}, which holds {sizes[name]} bytes"
            )
        ranges.setdefault(name, []).append((start, length, entry))
        lengths[(fqn, None if off is None else tuple(off))] = length
    for name, rs in ranges.items():
        rs.sort()
        for (a, la, ea), (b, _, eb) in itertools.pairwise(rs):
            if b < a + la:
                raise CheckpointFormatError(
                    f"{where}: {ea} and {eb} claim overlapping bytes of {shown(name)} (at {a} and {b})"
                )
    for fqn, m in sdm.items():
        if isinstance(m, BytesStorageMetadata):
            if (fqn, None) not in lengths:
                raise CheckpointFormatError(f"{where}: entry {shown(fqn)} has no storage_data entry")
            continue
        if not isinstance(m, TensorStorageMetadata):
            raise CheckpointFormatError(
                f"{where}: entry {shown(fqn)} is a {type(m).__name__}, not tensor or bytes metadata"
            )
        _check_tensor(fqn, m, lengths, where)


def _one_dim_problem(shape: list[int], boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> str | None:
    """For chunks that span the tensor on every dim but one (the common cut), how they fail to
    tile it ("" when they do); None for chunks cut along several dims."""
    cut = {k for o, s in boxes for k in range(len(shape)) if o[k] != 0 or s[k] != shape[k]}
    if len(cut) > 1:
        return None
    k = cut.pop() if cut else 0
    at = 0
    for o, s in sorted(boxes, key=lambda b: b[0][k]):
        if o[k] != at:
            return f"along dim {k}, a chunk starts at {o[k]} where {at} was expected"
        at += s[k]
    return "" if at == shape[k] else f"along dim {k} the chunks end at {at}, not {shape[k]}"


def _check_tensor(fqn: str, m: TensorStorageMetadata, lengths: dict[Any, int], where: str) -> None:
    dtype = getattr(getattr(m, "properties", None), "dtype", None)
    shape = _ints(getattr(m, "size", None))
    chunks = getattr(m, "chunks", None)
    if not isinstance(dtype, torch.dtype) or shape is None or not isinstance(chunks, list):
        raise CheckpointFormatError(
            f"{where}: tensor {shown(fqn)} has no valid dtype, size (at most {MAX_NDIM} non-negative integers) "
            "and chunk list"
        )
    item = dtype.itemsize
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    total = 0
    for i, c in enumerate(chunks):
        offs = _ints(getattr(c, "offsets", None), len(shape))
        sub = _ints(getattr(c, "sizes", None), len(shape))
        if offs is None or sub is None or any(o + s > g for o, s, g in zip(offs, sub, shape, strict=True)):
            raise CheckpointFormatError(
                f"{where}: tensor {shown(fqn)} chunk {i} (offsets {show(getattr(c, 'offsets', None))}, sizes "
                f"{show(getattr(c, 'sizes', None))}) does not lie inside its size {shape}"
            )
        stored = lengths.get((fqn, tuple(offs)))
        if stored is None:
            raise CheckpointFormatError(
                f"{where}: tensor {shown(fqn)} chunk {i} at {offs} has no storage_data entry"
            )
        n = box_volume(sub)
        if n * item > stored:
            raise CheckpointFormatError(
                f"{where}: tensor {shown(fqn)} chunk {i} of sizes {sub} needs {n * item} bytes but its storage "
                f"entry holds {stored}"
            )
        total += n
        boxes.append((tuple(offs), tuple(sub)))
    volume = box_volume(shape)
    if total != volume:
        raise CheckpointFormatError(
            f"{where}: tensor {shown(fqn)} of size {shape} ({volume} elements) has chunks of {total} elements in all"
        )
    boxes = [b for b in boxes if all(b[1])]  # empty chunks hold nothing
    if volume and len(boxes) > 1:
        problem = _one_dim_problem(shape, boxes)
        if problem is None:
            if len(boxes) << len(shape) > _MAX_CORNERS:
                raise UnsupportedError(
                    f"{where}: tensor {shown(fqn)} has {len(shape)} dims and {len(boxes)} chunks cut along "
                    f"several dims; unickpt checks such tilings up to {_MAX_CORNERS} chunk corners"
                )
            problem = coverage_problem(shape, boxes)
        if problem:
            raise CheckpointFormatError(
                f"{where}: the chunks of tensor {shown(fqn)} do not tile it: {problem}"
            )


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
    storage, root = open_storage(src)
    reader = _SafeFsspecReader(src) if storage.local_path(root) is None else _SafeReader(src)
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
                f"DCP entry {shown(fqn)} holds objects torch.load(weights_only=True) refuses ({e}); "
                "unickpt never unpickles arbitrary objects"
            ) from None
        check_graph(obj, f"DCP entry {shown(fqn)}", "unpickled value", CheckpointFormatError)
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
