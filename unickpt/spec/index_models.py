"""The index schema, defined once: the pydantic models of ``*.safetensors.index.json``.

Hugging Face's keys plus a versioned ``unickpt`` block. Everything the schema says lives here
(one slice's models, ``SliceEntry`` and ``ByteRange``, and the field types they declare are
defined in ``slice_table``, with the table that builds them, and re-exported here):
the field types and bounds (the ``Annotated`` aliases and ``Literal`` choices below), and the
rules that span fields (:func:`slice_problem`, :func:`shape_problem`, :func:`alias_problem`,
:func:`check_file_name`). ``docs/index.schema.json`` is exported from :class:`IndexFile`
(``unickpt.spec.schema``). The models are the in-memory form of an index, too.

No index read from a file is validated through the models: ``parse_index`` checks it with its
own validator (``index.IndexParser``), which reads the field lists, bounds and choices from here and
calls the same rule functions, and builds the models without validation (``model_construct``).
The models' validators check what code builds (a writer's ``TensorEntry(...)``, a tool's edit).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    Strict,
    field_validator,
    model_serializer,
    model_validator,
)

from unickpt.errors import UnsafePathError
from unickpt.spec._json import json_depth
from unickpt.spec.bounds import count_problem
from unickpt.spec.confine import is_plain_name
from unickpt.spec.digest_text import FORMAT_VERSION, block_from_json, block_to_json
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.slice_table import (
    HEX16,
    HEX16_BODY,
    MAX_DIM,
    ByteRange,
    Hex16,
    LazySlices,
    NonNeg,
    SliceEntry,
    SliceTable,
    StrictModel,
    compact_count,
    compact_problem,
    ranges_problem,
    slice_problem,
)

__all__ = [
    "FORMAT_VERSION",
    "KNOWN_FORMAT_VERSIONS",
    "KINDS",
    "MAX_INDEX_BYTES",
    "MAX_DIM",
    "MAX_STATE_DEPTH",
    "HEX16",
    "HEX16_BODY",
    "NonNeg",
    "Hex16",
    "SAVE_ID",
    "ByteRange",
    "SliceEntry",
    "TensorEntry",
    "LayoutInfo",
    "UnickptBlock",
    "IndexMetadata",
    "IndexFile",
    "check_file_name",
    "strict_metadata_ok",
    "shape_problem",
    "slice_problem",
    "alias_problem",
    "ranges_problem",
    "fields_of",
    "compact_problem",
    "files_problem",
    "attach_tables",
]

#: The one format version unickpt reads and writes (docs/format.md 7); the drafts before it are
#: converted by ``unickpt upgrade`` (``tools/upgrade.py``) and refused by every reader.
FormatVersion = Literal[5]
KNOWN_FORMAT_VERSIONS: tuple[int, ...] = get_args(FormatVersion)
Kind = Literal["model", "optimizer"]
KINDS: tuple[str, ...] = get_args(Kind)
# An index describes tensors, never holds them: 405B parameters over 2048 ranks is 2.3 x 10^6
# slices, about 46 MB of compact JSON (docs/performance.md). Larger files are refused unread.
MAX_INDEX_BYTES = 512 << 20
#: The most dims of a tensor (a safetensors header entry's bound).
MAX_NDIM = 64
#: Smallest world size and mesh axis size.
MIN_POSITIVE = 1
#: A save id: 32 lower-case hex digits (``SAVE_ID_BODY`` unanchored).
SAVE_ID_BODY = "[0-9a-f]{32}"
SAVE_ID = f"^{SAVE_ID_BODY}$"

# Strict: JSON true, 2.0 and "2" are not integers here (pydantic's lax mode would take them).
# NonNeg and Hex16, the types of a slice's fields, are defined with SliceEntry (slice_table).
Positive = Annotated[int, Strict(), Field(ge=MIN_POSITIVE)]
#: A grid item: the number of parts (torch.chunk semantics) or the parts' extents.
GridItem = Annotated[int, Strict(), Field(ge=MIN_POSITIVE, lt=MAX_DIM)] | list[NonNeg]
FileId = Annotated[int, Strict(), Field(ge=0, lt=MAX_DIM)]
#: Concatenated slice hashes: 16 lower-case hex digits (or 16 '-': no hash) per slice.
HASHES = "^([0-9a-f]{16}|-{16})*$"
# Free-form JSON state (param_groups, param_state) nests at most this deep, so that the whole
# index stays within the 64 levels of the spec.
MAX_STATE_DEPTH = 48


def shape_problem(shape: Sequence[int]) -> str | None:
    """What is wrong with a tensor's shape as a whole (each dim is checked as a ``NonNeg``)."""
    if len(shape) > MAX_NDIM:  # what a data file's header holds (docs/format.md section 2)
        return f"shape has {len(shape)} dims, more than the {MAX_NDIM} of a safetensors entry"
    if math.prod(shape) >= MAX_DIM:
        return f"shape {list(shape)} has too many elements"
    return None


def alias_problem(aliases: Mapping[str, str], tensors: Mapping[str, Any]) -> str | None:
    """What is wrong with the aliases of a block: one naming no stored tensor, or one that is stored."""
    for alias, target in aliases.items():
        if target not in tensors:
            return f"alias {alias!r} points at {target!r}, which is not a stored tensor"
        if alias in tensors:
            return f"alias {alias!r} is also a stored tensor"
    return None


def check_file_name(name: str, where: str = "") -> str:
    """Refuse any data-file name that could leave the checkpoint directory.

    Only plain file names are allowed (``format.confine.is_plain_name``, the rule for every
    name read from a checkpoint file): no directory separators (either kind), no absolute
    paths or drive letters, no ``..``, no hidden files; here also not starting with ``_`` and
    ending in ``.safetensors`` (or ``.bin`` for legacy Hugging Face / Colossal-AI checkpoints,
    read without pickle).
    """
    at = f" ({where})" if where else ""
    if (
        not is_plain_name(name)
        or name.startswith("_")
        or not (name.endswith(".safetensors") or name.endswith(".bin"))
    ):
        raise UnsafePathError(
            f"refusing data file name {name!r}{at}: names must be plain file names inside the checkpoint "
            "directory (no '/', '\\', '..', absolute paths or hidden files) ending in .safetensors"
        )
    return name


class TensorEntry(StrictModel):
    """A global tensor: dtype, shape, fingerprint and the slices that tile it.

    A tensor lists its slices (``slices``: one whose slices carry ``ranges``) or describes them
    compactly (``grid`` or ``boxes``, ``file``, ``keys``, ``xxh3``: docs/format.md section 3.1) and,
    once the block is validated, ``slices`` is a ``LazySlices`` over its ``SliceTable`` (``table``).
    """

    dtype: str
    shape: list[NonNeg]
    fingerprint: Hex16 | None = Field(default=None, description="layout-invariant fingerprint")
    slices: list[SliceEntry] = Field(
        default_factory=list, description="listed: every slice (tensors with byte-range hashes)"
    )
    param: str | None = Field(default=None, description="optimizer tensors: the parameter FQN")
    state: str | None = Field(default=None, description="optimizer tensors: the state key")
    grid: list[GridItem] | None = Field(
        default=None,
        description="compact: the slices are the cells of this grid in C order; per dim the number "
        "of parts (torch.chunk semantics) or the parts' extents",
    )
    boxes: list[list[NonNeg]] | None = Field(
        default=None, description="compact, no grid: each slice's offsets then shape"
    )
    file: FileId | list[FileId] | None = Field(
        default=None,
        description="compact: index into the block's files, for all slices or per slice; "
        "absent: slice K is in files[K]",
    )
    keys: list[str] | None = Field(default=None, description="compact: the slices' keys when not NAME@K")
    xxh3: Annotated[str, Field(pattern=HASHES)] | None = Field(
        default=None, description="compact: the slice hashes, 16 characters each ('-' x 16: none)"
    )

    @property
    def compact(self) -> bool:
        """True for an entry that does not list its slices (grid/boxes, file, keys, xxh3)."""
        return "slices" not in self.model_fields_set

    @classmethod
    def of_table(cls, dtype: str, shape: Sequence[int], table: SliceTable, **fields: Any) -> TensorEntry:
        """The entry of a tensor whose slices are ``table`` (what every writer builds): the other
        fields validated as the model's, the slices checked at once (``SliceTable.problem``), no
        ``SliceEntry`` built. Raises ``ValueError`` naming the first slice at fault."""
        entry = cls(dtype=dtype, shape=list(shape), **fields)
        problem = table.problem(DTYPE_ITEMSIZE[entry.dtype])
        if problem is not None:
            raise ValueError(problem)
        entry.__dict__["slices"] = LazySlices(table)
        # Listed, as a tensor built from SliceEntry objects is (build_block writes it compactly).
        entry.__pydantic_fields_set__.add("slices")
        return entry

    @property
    def table(self) -> SliceTable:
        """The slices as a :class:`SliceTable` (built once from listed ``slices``)."""
        sl = self.__dict__["slices"]
        if isinstance(sl, LazySlices):
            return sl.table
        table = SliceTable.from_entries("", self.shape, sl)
        self.__dict__["slices"] = LazySlices(table, sl)
        return table

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        if not self.compact:
            sl = self.__dict__["slices"]
            if isinstance(sl, LazySlices):
                sl.built()  # the serializer reads the list's storage, not its methods
            out: dict[str, Any] = handler(self)
            return out
        # A compact entry writes its compact fields, never its slices (no per-slice objects).
        d = self.__dict__
        return {k: d[k] for k in _COMPACT_DUMP if d[k] is not None}

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in DTYPE_ITEMSIZE:
            raise ValueError(f"unknown dtype {v!r}")
        return v

    @model_validator(mode="after")
    def _slices_in_bounds(self) -> TensorEntry:
        problem = shape_problem(self.shape)
        for s in self.slices:
            if problem is not None:
                break
            problem = slice_problem(s.key, s.file, s.offsets, s.shape, self.shape)
            problem = problem or ranges_problem(s.key, s.file, s.ranges, s.shape, DTYPE_ITEMSIZE[self.dtype])
        if problem is None and self.compact:
            problem = compact_problem(self.shape, self.grid, self.boxes, self.file, self.keys, self.xxh3)
        if problem is not None:
            raise ValueError(problem)
        return self

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPE_ITEMSIZE[self.dtype]


class LayoutInfo(StrictModel):
    """The parallel layout a checkpoint was saved from (informational: loading never needs it)."""

    plugin: str = "general"
    world_size: Positive = 1
    mesh: dict[str, Positive] = Field(default_factory=dict)
    gathered: Annotated[bool, Strict()] = True


class UnickptBlock(StrictModel):
    format_version: FormatVersion = FORMAT_VERSION
    kind: Kind
    files: list[str] | None = Field(
        default=None, description="the data files, which tensors' 'file' fields index"
    )
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
    save_id: str | None = Field(
        default=None,
        pattern=SAVE_ID,
        description="random id of the save that wrote this checkpoint; every data file's header "
        "metadata carries it under 'unickpt_save'",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_text_form(cls, data: Any) -> Any:  # base64url digests and the default dtype, as in memory
        return block_from_json(data)[0]

    @model_serializer(mode="wrap")
    def _to_text_form(
        self, handler: SerializerFunctionWrapHandler, info: SerializationInfo
    ) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        return block_to_json(out) if info.mode_is_json() else out

    @field_validator("format_version", mode="before")
    @classmethod
    def _version_is_an_integer(cls, v: Any) -> Any:
        if type(v) is not int:
            raise ValueError(f"format_version must be an integer, found {v!r}")
        return v

    @field_validator("param_groups", "param_state")
    @classmethod
    def _state_not_too_deep(cls, v: Any) -> Any:
        if json_depth(v, MAX_STATE_DEPTH + 1) > MAX_STATE_DEPTH:
            raise ValueError(f"nested deeper than {MAX_STATE_DEPTH} levels")
        return v

    @model_validator(mode="after")
    def _files_are_safe(self) -> UnickptBlock:
        problem = files_problem(self.files, self.tensors)
        if problem is not None:
            raise ValueError(problem)
        # Checked once per distinct name (an index of 10^5 slices names a few hundred files).
        names = set(self.files or ())
        names.update(s.file for t in self.tensors.values() if not t.compact for s in t.slices)
        for name in names:
            check_file_name(name)
        attach_tables(self.files, self.tensors)
        return self

    @model_validator(mode="after")
    def _aliases_resolve(self) -> UnickptBlock:
        problem = alias_problem(self.aliases, self.tensors)
        if problem is not None:
            raise ValueError(problem)
        return self


class IndexMetadata(BaseModel):
    model_config = ConfigDict(extra="allow", frozen=True)
    total_size: NonNeg = 0


def strict_metadata_ok(md: Any) -> bool:
    """``metadata`` as a unickpt index must have it: an object whose total_size, if any, is an int."""
    if type(md) is not dict:
        return False
    size = md.get("total_size", 0)
    return type(size) is int and 0 <= size < MAX_DIM


class IndexFile(BaseModel):
    """A ``*.safetensors.index.json`` file (Hugging Face keys plus the optional unickpt block)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    metadata: IndexMetadata = Field(default_factory=IndexMetadata)
    weight_map: dict[str, str]
    unickpt: UnickptBlock | None = None

    @model_validator(mode="before")
    @classmethod
    def _plain_metadata_is_informational(cls, data: Any) -> Any:
        # Hugging Face reads only weight_map of a plain index: its metadata is informational
        # (Colossal-AI writes total_size in MB as a float). A unickpt index stays strict.
        plain = isinstance(data, dict) and data.get("unickpt") is None
        if plain and "metadata" in data and not strict_metadata_ok(data["metadata"]):
            md = data["metadata"]
            kept = {k: v for k, v in md.items() if k != "total_size"} if isinstance(md, dict) else {}
            data = {**data, "metadata": kept}
        return data

    @field_validator("weight_map")
    @classmethod
    def _safe_files(cls, v: dict[str, str]) -> dict[str, str]:
        for k, f in v.items():
            check_file_name(f, f"weight_map[{k!r}]")
        return v


_COMPACT_DUMP = ("dtype", "shape", "fingerprint", "param", "state", "grid", "boxes", "file", "keys", "xxh3")
_COMPACT_FIELDS = ("grid", "boxes", "file", "keys", "xxh3")


def files_problem(files: Sequence[str] | None, tensors: Mapping[str, TensorEntry]) -> str | None:
    """Tensors list their slices (``slices``) or describe them compactly (then the block has
    ``files``), never both; compact ``file`` indexes stay within ``files``."""
    for name, t in tensors.items():
        given = [f for f in _COMPACT_FIELDS if getattr(t, f) is not None]
        if not t.compact and given:
            return f"tensor {name!r} has both 'slices' and the compact field(s) {given}: one describes its slices"
        if t.compact:
            if files is None:
                return f"tensor {name!r} names its files by index, but the block has no 'files' table"
            if t.file is None:
                n = compact_count(t.shape, t.grid, t.boxes)
                if n != len(files):
                    return (
                        f"tensor {name!r} has no 'file' (slice K in files[K]) but {n} slice(s) for "
                        f"{len(files)} file(s)"
                    )
                continue
            ids = [t.file] if isinstance(t.file, int) else t.file
            if ids and max(ids) >= len(files):
                return f"tensor {name!r}: file index {max(ids)} is past the {len(files)} files of the block"
    # What the data files can hold bounds what the compact fields declare (spec/bounds.py).
    return count_problem(files, tensors)


def attach_tables(files: Sequence[str] | None, tensors: Mapping[str, TensorEntry]) -> None:
    """Give every compact tensor its ``SliceTable`` and the lazy ``slices`` list over it."""
    if files is None:
        return
    for name, t in tensors.items():
        if not t.compact:
            continue
        table = SliceTable.from_compact(
            name, t.shape, files, grid=t.grid, boxes=t.boxes, file=t.file, keys=t.keys, xxh3=t.xxh3
        )
        t.__dict__["slices"] = LazySlices(table)


def fields_of(cls: type[BaseModel]) -> tuple[tuple[str, ...], frozenset[str]]:
    """(all fields of a model in declaration order, the required ones)."""
    fields = cls.model_fields
    return tuple(fields), frozenset(n for n, f in fields.items() if f.is_required())
