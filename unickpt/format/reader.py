"""Open a checkpoint from files alone: detect its layout, validate it, read and verify bytes.

No torch here. ``CheckpointReader`` is what ``load_model``, ``verify``, ``inspect``,
``merge`` and ``diff`` all stand on, so every one of them applies the same checks:

1. the index (or single file's header) parses against the schema and names only safe files;
2. every tensor's slices tile it exactly once (no gap, no overlap, nothing out of bounds);
3. every slice's key exists in its file with the recorded dtype and shape, and every
   file's header is itself valid (``validate_structure``);
4. optionally, every slice's bytes hash to the recorded xxh3-64 (``verify``).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from unickpt.errors import (
    CheckpointFormatError,
    HeaderError,
    IncompleteCheckpointError,
    IndexFileError,
    IntegrityFailure,
)
from unickpt.format._json import strict_loads
from unickpt.format.boxes import coverage_problem
from unickpt.format.dcp_hf import block_from_dcp_hf, dcp_hf_files
from unickpt.format.hashing import SliceHasher
from unickpt.format.index import (
    IndexFile,
    SliceEntry,
    TensorEntry,
    UnickptBlock,
    check_file_name,
    load_index,
)
from unickpt.format.naming import SLICED_SENTINEL, index_name, single_name
from unickpt.format.safetensors_io import SafetensorsHeader, iter_range, read_header, read_range

__all__ = ["CheckpointReader", "open_checkpoint", "UNICKPT_METADATA_KEY"]

UNICKPT_METADATA_KEY = "unickpt"


@dataclass
class CheckpointReader:
    """A validated, read-only view of one checkpoint (model or optimizer)."""

    directory: str
    kind: str
    block: UnickptBlock
    index_path: str | None  # None for a single-file checkpoint
    has_unickpt_block: bool

    def __post_init__(self) -> None:
        self._headers: dict[str, SafetensorsHeader] = {}
        self._fds: dict[str, int] = {}

    # ----------------------------------------------------------------- paths and files
    @property
    def tensors(self) -> dict[str, TensorEntry]:
        return self.block.tensors

    @property
    def files(self) -> list[str]:
        return sorted({s.file for t in self.block.tensors.values() for s in t.slices})

    def file_path(self, name: str) -> str:
        return os.path.join(self.directory, check_file_name(name))

    def header(self, name: str) -> SafetensorsHeader:
        h = self._headers.get(name)
        if h is None:
            h = read_header(self.file_path(name))
            self._headers[name] = h
        return h

    def _fd(self, name: str) -> int:
        fd = self._fds.get(name)
        if fd is None:
            try:
                fd = os.open(self.file_path(name), os.O_RDONLY)
            except FileNotFoundError as e:
                raise IncompleteCheckpointError(
                    f"{self.directory}: data file {name!r} named by the index is missing"
                ) from e
            self._fds[name] = fd
        return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ----------------------------------------------------------------- validation
    def check_coverage(self) -> None:
        """Every tensor's slices tile it exactly once. Reads no data file."""
        for name, t in self.block.tensors.items():
            problem = coverage_problem(t.shape, [(tuple(s.offsets), tuple(s.shape)) for s in t.slices])
            if problem:
                raise IndexFileError(f"{self.index_path or self.directory}: tensor {name!r}: {problem}")

    def validate_structure(self) -> None:
        """Coverage, plus every slice present in its file with the recorded dtype and shape.

        Reads every data file's header (small), no tensor data.
        """
        self.check_coverage()
        for name, t in self.block.tensors.items():
            for s in t.slices:
                self._check_slice(name, t, s)

    def _check_slice(self, name: str, t: TensorEntry, s: SliceEntry) -> None:
        """The slice's key is in its file's (valid) header with the dtype and shape the index records."""
        h = self.header(s.file)
        e = h.entries.get(s.key)
        if e is None:
            raise HeaderError(
                f"{h.path}: tensor {name!r} should be stored under key {s.key!r}, which the file lacks"
            )
        if e.dtype != t.dtype or list(e.shape) != list(s.shape):
            raise HeaderError(
                f"{h.path}: tensor {name!r} (key {s.key!r}): index says {t.dtype}{list(s.shape)}, "
                f"file holds {e.dtype}{list(e.shape)}"
            )

    # ----------------------------------------------------------------- reading bytes
    def slice_location(self, s: SliceEntry) -> tuple[str, int, int]:
        """(absolute path, absolute offset, byte length) of one stored slice."""
        h = self.header(s.file)
        if s.key not in h.entries:
            raise HeaderError(f"{h.path}: key {s.key!r} named by the index is not in the file")
        off, n = h.absolute(s.key)
        return h.path, off, n

    def read_slice(self, s: SliceEntry, out: memoryview | None = None) -> memoryview:
        _, off, n = self.slice_location(s)
        return read_range(self._fd(s.file), off, n, out)

    def read_bytes(
        self, s: SliceEntry, rel_offset: int, length: int, out: memoryview | None = None
    ) -> memoryview:
        """``length`` bytes starting ``rel_offset`` bytes into a stored slice."""
        _, off, n = self.slice_location(s)
        if rel_offset < 0 or rel_offset + length > n:
            raise HeaderError(f"{s.file}: read of {length} bytes at {rel_offset} outside slice {s.key!r}")
        return read_range(self._fd(s.file), off + rel_offset, length, out)

    def iter_slice(self, s: SliceEntry, chunk: int = 16 << 20) -> Iterator[bytes]:
        _, off, n = self.slice_location(s)
        yield from iter_range(self._fd(s.file), off, n, chunk)

    def hash_slice(self, s: SliceEntry) -> str:
        h = SliceHasher()
        for buf in self.iter_slice(s):
            h.update(buf)
        return h.hexdigest()

    def verify(
        self,
        names: list[str] | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[IntegrityFailure]:
        """Rehash every stored slice (of ``names``, default all). Returns the failures.

        A slice without a recorded hash (plain Hugging Face files) is skipped. ``progress``
        is called with the byte count of each slice checked.
        """
        failures: list[IntegrityFailure] = []
        for name in names if names is not None else list(self.block.tensors):
            t = self.block.tensors[name]
            for s in t.slices:
                if s.xxh3 is None:
                    continue
                try:
                    self._check_slice(name, t, s)
                    found = self.hash_slice(s)
                except (IncompleteCheckpointError, CheckpointFormatError) as e:
                    # Missing or truncated file, edited header, key absent: report it with the rest.
                    found = f"unreadable ({e})"
                if found != s.xxh3:
                    failures.append(IntegrityFailure(name, s.file, s.key, s.xxh3, found))
                if progress is not None:
                    progress(math.prod(s.shape) * _itemsize(t.dtype))
        return failures


def _itemsize(dtype: str) -> int:
    from unickpt.format.dtypes import itemsize

    return itemsize(dtype)


def _block_from_header(h: SafetensorsHeader, kind: str) -> tuple[UnickptBlock, bool]:
    """The unickpt block of a single-file checkpoint, or one synthesised for a plain file."""
    file = os.path.basename(h.path)
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
            return UnickptBlock.model_validate(obj), True
        except (ValueError, ValidationError, RecursionError) as e:
            raise IndexFileError(f"{h.path}: the unickpt metadata block is invalid: {e}") from None
    tensors = {
        k: TensorEntry(
            dtype=e.dtype,
            shape=list(e.shape),
            slices=[SliceEntry(file=file, key=k, offsets=[0] * len(e.shape), shape=list(e.shape))],
        )
        for k, e in h.entries.items()
    }
    return UnickptBlock(kind="model" if kind == "model" else "optimizer", tensors=tensors), False


def _block_from_plain_index(idx: IndexFile, directory: str, path: str, kind: str) -> UnickptBlock:
    """Synthesise the slice table of a plain Hugging Face sharded checkpoint from its headers."""
    tensors: dict[str, TensorEntry] = {}
    for file in sorted(set(idx.weight_map.values())):
        if file.endswith(".bin"):
            raise CheckpointFormatError(
                f"{path}: shard {file!r} is a pickle (.bin) file; convert it first with "
                "`unickpt convert --from bin` (read with torch.load(weights_only=True))"
            )
        h = read_header(os.path.join(directory, file))
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


def open_checkpoint(path: str | os.PathLike[str], kind: str = "model") -> CheckpointReader:
    """Open the checkpoint at ``path`` (a directory, an index file or a single .safetensors file).

    Raises ``IncompleteCheckpointError`` when there is no committed checkpoint there.
    """
    p = os.fspath(path)
    if os.path.isfile(p) and p.endswith(".index.json"):
        directory = os.path.dirname(os.path.abspath(p))
        return _from_index(p, directory, kind)
    if os.path.isfile(p):
        h = read_header(p)
        block, has = _block_from_header(h, kind)
        r = CheckpointReader(os.path.dirname(os.path.abspath(p)), kind, block, None, has)
        r._headers[os.path.basename(p)] = h
        return r
    if os.path.isdir(p):
        idx = os.path.join(p, index_name(kind))
        if os.path.isfile(idx):
            return _from_index(idx, p, kind)
        single = os.path.join(p, single_name(kind))
        if os.path.isfile(single):
            return open_checkpoint(single, kind)
        shards = dcp_hf_files(p) if kind == "model" else []
        if shards:  # torch's HuggingFaceStorageWriter(save_distributed=True): see format/dcp_hf.py
            r = CheckpointReader(p, kind, block_from_dcp_hf(p, shards), None, False)
            r.check_coverage()
            return r
        raise IncompleteCheckpointError(
            f"{p} holds no committed {kind} checkpoint: neither {index_name(kind)} nor {single_name(kind)} "
            "is present (an interrupted save leaves data files without an index; such a directory is "
            "never loaded)"
        )
    raise IncompleteCheckpointError(f"no checkpoint at {p}: the path does not exist")


def _from_index(idx_path: str, directory: str, kind: str) -> CheckpointReader:
    idx = load_index(idx_path)
    if idx.unickpt is None:
        block = _block_from_plain_index(idx, directory, idx_path, kind)
        return CheckpointReader(directory, kind, block, idx_path, False)
    block = idx.unickpt
    if block.kind != kind:
        raise IndexFileError(f"{idx_path}: holds a {block.kind} checkpoint, expected a {kind} checkpoint")
    gathered = all(f != SLICED_SENTINEL for f in idx.weight_map.values())
    if gathered:
        for name in block.tensors:
            if name not in idx.weight_map and name not in block.aliases:
                raise IndexFileError(
                    f"{idx_path}: tensor {name!r} is in the unickpt block but not in weight_map"
                )
    return CheckpointReader(directory, kind, block, idx_path, True)


def describe(reader: CheckpointReader) -> dict[str, Any]:
    """A plain-data summary (used by ``inspect --json``)."""
    b = reader.block
    return {
        "path": reader.index_path or reader.directory,
        "kind": b.kind,
        "layout": b.layout.model_dump(),
        "tensors": len(b.tensors),
        "total_bytes": sum(t.nbytes for t in b.tensors.values()),
    }
