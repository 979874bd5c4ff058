"""The index schema: Hugging Face's ``*.safetensors.index.json`` plus a versioned ``unickpt`` block.

The index is input, not truth: every index is parsed with these pydantic models (unknown
keys refused inside the unickpt block), and every file name it holds is checked with
:func:`check_file_name` before anything is opened. ``docs/format.md`` is the normative
spec; ``docs/index.schema.json`` is exported from :class:`IndexFile` and a test keeps the
two in step.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from unickpt.errors import IndexFileError, UnsafePathError
from unickpt.format._json import strict_loads
from unickpt.format.dtypes import DTYPE_ITEMSIZE

__all__ = [
    "FORMAT_VERSION",
    "MAX_INDEX_BYTES",
    "SliceEntry",
    "TensorEntry",
    "LayoutInfo",
    "UnickptBlock",
    "IndexFile",
    "check_file_name",
    "parse_index",
    "load_index",
    "index_to_json",
]

FORMAT_VERSION = 1
# An index describes tensors, never holds them: 70B parameters over 512 ranks is on the
# order of 10^5 slices, a few tens of MB of JSON. Larger files are refused unread.
MAX_INDEX_BYTES = 512 << 20
_HEX16 = r"^[0-9a-f]{16}$"
_MAX_DIM = 1 << 62

NonNeg = Annotated[int, Field(ge=0, lt=_MAX_DIM)]
Hex16 = Annotated[str, Field(pattern=_HEX16)]

_SAFE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]*$")


def check_file_name(name: str, where: str = "") -> str:
    """Refuse any data-file name that could leave the checkpoint directory.

    Only plain file names are allowed: no directory separators (either kind), no
    absolute paths or drive letters, no ``..``, no hidden files, ending in ``.safetensors``
    (or ``.bin`` for legacy Hugging Face / Colossal-AI checkpoints, read without pickle).
    """
    at = f" ({where})" if where else ""
    if (
        not isinstance(name, str)
        or not _SAFE_NAME.match(name)
        or ".." in name
        or len(name) > 255
        or not (name.endswith(".safetensors") or name.endswith(".bin"))
    ):
        raise UnsafePathError(
            f"refusing data file name {name!r}{at}: names must be plain file names inside the checkpoint "
            "directory (no '/', '\\', '..', absolute paths or hidden files) ending in .safetensors"
        )
    return name


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SliceEntry(_Strict):
    """One stored block of a global tensor: which file, which key, where it sits."""

    file: str = Field(description="data file name, relative to the checkpoint directory")
    key: str = Field(description="tensor name inside that safetensors file")
    offsets: list[NonNeg] = Field(description="global index of the block's first element, per dim")
    shape: list[NonNeg] = Field(description="block shape; the stored tensor has exactly this shape")
    xxh3: Hex16 | None = Field(default=None, description="xxh3-64 of the stored bytes, 16 hex digits")


class TensorEntry(_Strict):
    """A global tensor: dtype, shape, fingerprint and the slices that tile it."""

    dtype: str
    shape: list[NonNeg]
    fingerprint: Hex16 | None = Field(default=None, description="layout-invariant fingerprint")
    slices: list[SliceEntry]
    param: str | None = Field(default=None, description="optimizer tensors: the parameter FQN")
    state: str | None = Field(default=None, description="optimizer tensors: the state key")

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in DTYPE_ITEMSIZE:
            raise ValueError(f"unknown dtype {v!r}")
        return v

    @model_validator(mode="after")
    def _slices_in_bounds(self) -> TensorEntry:
        nd = len(self.shape)
        if math.prod(self.shape) >= _MAX_DIM:
            raise ValueError(f"shape {self.shape} has too many elements")
        for s in self.slices:
            if len(s.offsets) != nd or len(s.shape) != nd:
                raise ValueError(
                    f"slice {s.key!r} in {s.file!r} has {len(s.offsets)}-dim offsets and "
                    f"{len(s.shape)}-dim shape for a {nd}-dim tensor"
                )
            for d, (o, n, g) in enumerate(zip(s.offsets, s.shape, self.shape, strict=True)):
                if o + n > g:
                    raise ValueError(
                        f"slice {s.key!r} in {s.file!r} spans [{o}, {o + n}) on dim {d} of a tensor of size {g}"
                    )
        return self

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


class LayoutInfo(_Strict):
    """The parallel layout a checkpoint was saved from (informational: loading never needs it)."""

    plugin: str = "general"
    world_size: Annotated[int, Field(ge=1)] = 1
    mesh: dict[str, Annotated[int, Field(ge=1)]] = Field(default_factory=dict)
    gathered: bool = True


class UnickptBlock(_Strict):
    format_version: Literal[1] = 1
    kind: Literal["model", "optimizer"]
    created_by: str = "unickpt"
    layout: LayoutInfo = Field(default_factory=LayoutInfo)
    tensors: dict[str, TensorEntry]
    aliases: dict[str, str] = Field(
        default_factory=dict, description="tied names -> the stored name they share storage with"
    )
    param_groups: list[dict[str, Any]] | None = Field(
        default=None, description="optimizer: hyperparameters, 'params' lists parameter FQNs"
    )
    param_state: dict[str, dict[str, Any]] = Field(
        default_factory=dict, description="optimizer: non-tensor per-parameter state, by FQN"
    )

    @model_validator(mode="after")
    def _files_are_safe(self) -> UnickptBlock:
        # Checked once per distinct name (an index of 10^5 slices names a few hundred files).
        for name in {s.file for t in self.tensors.values() for s in t.slices}:
            check_file_name(name)
        return self

    @model_validator(mode="after")
    def _aliases_resolve(self) -> UnickptBlock:
        for alias, target in self.aliases.items():
            if target not in self.tensors:
                raise ValueError(f"alias {alias!r} points at {target!r}, which is not a stored tensor")
            if alias in self.tensors:
                raise ValueError(f"alias {alias!r} is also a stored tensor")
        return self


class IndexMetadata(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    total_size: NonNeg = 0


class IndexFile(BaseModel):
    """A ``*.safetensors.index.json`` file (Hugging Face keys plus the optional unickpt block)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    metadata: IndexMetadata = Field(default_factory=IndexMetadata)
    weight_map: dict[str, str]
    unickpt: UnickptBlock | None = None

    @field_validator("weight_map")
    @classmethod
    def _safe_files(cls, v: dict[str, str]) -> dict[str, str]:
        for k, f in v.items():
            check_file_name(f, f"weight_map[{k!r}]")
        return v


def parse_index(raw: bytes, path: str) -> IndexFile:
    """Parse and validate index bytes; every failure is an ``IndexFileError`` naming ``path``."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IndexFileError(f"{path}: index is not valid UTF-8 ({e})") from None
    obj = strict_loads(text, IndexFileError, f"{path}: index")
    if not isinstance(obj, dict):
        raise IndexFileError(f"{path}: index must be a JSON object with a 'weight_map'")
    try:
        return IndexFile.model_validate(obj)
    except ValidationError as e:
        for err in e.errors():
            cause = (err.get("ctx") or {}).get("error")
            if isinstance(cause, UnsafePathError):
                raise UnsafePathError(f"{path}: {cause}") from None
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()[:10]
        )
        raise IndexFileError(f"{path}: index does not match the unickpt index schema: {problems}") from None


def load_index(path: str | os.PathLike[str]) -> IndexFile:
    p = os.fspath(path)
    size = os.path.getsize(p)
    if size > MAX_INDEX_BYTES:
        raise IndexFileError(f"{p}: {size} bytes exceeds the {MAX_INDEX_BYTES}-byte limit for an index")
    with open(p, "rb") as f:
        # Bounded even when the size lied (a symlink to a /proc file reports 0 bytes).
        raw = f.read(MAX_INDEX_BYTES + 1)
    if len(raw) > MAX_INDEX_BYTES:
        raise IndexFileError(f"{p}: more than the {MAX_INDEX_BYTES}-byte limit for an index")
    return parse_index(raw, p)


def index_to_json(index: IndexFile) -> bytes:
    obj = index.model_dump(mode="json", exclude_none=True)
    return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
