"""A tensor's slices as arrays: the in-memory form of every index, and the compact form of version 3.

A :class:`SliceTable` holds the S slices of one tensor as numpy arrays (offsets and shapes,
``(S, ndim)``; file ids into a file table, ``(S,)``), the hashes as one string of ``16 x S``
characters and the keys either as a list or by the rule ``NAME@K``. Nothing per slice is a Python
object until asked for: :meth:`SliceTable.entry` builds one ``SliceEntry`` on demand, and
:class:`LazySlices` (what ``TensorEntry.slices`` holds for a version 3 index) builds the whole
list the first time something iterates it.

Version 3 writes a tensor's slices compactly (docs/format.md section 3.1): ``grid`` (the cells
of a grid in C order: per dim a part count with ``torch.chunk`` semantics, or the parts'
extents) or ``boxes`` (offsets + shape per slice) or neither (one slice, the whole tensor);
``file`` (index into the block's ``files``, one or per slice); ``keys`` (absent when ``NAME@K``);
``xxh3`` (the hashes concatenated, 16 ``-`` for a slice without one).
The geometry those grids need is here too: ``torch.chunk`` part extents (``chunk_extents``,
``grid_extents``), a grid's cells in C order, and the distinct parts slices cut a dim into.

One slice of the index schema: the pydantic models ``SliceEntry`` and ``ByteRange``, and how
``SliceEntry`` objects are built in bulk from checked fields.

The bottom of the index's modules: the slice table builds ``SliceEntry`` objects from its
arrays, and the index (``index``: the schema, which re-exports everything here as part of it,
and its validator) stands on both. The field types
and bounds a slice declares (``NonNeg``, ``Hex16``, ``MAX_DIM``, ``HEX16``) are defined here, once,
for the whole schema.

``TensorEntry.slices`` of a version 3 index: a list whose ``SliceEntry`` objects are built when read.
"""

from __future__ import annotations

import collections
import itertools
import math
import operator
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, SupportsIndex, overload

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, Strict

from unickpt.spec.boxes import coverage_problem
from unickpt.spec.naming import shown, slice_key, slice_keys

__all__ = [
    "SliceTable",
    "NO_HASH",
    "chunk_extents",
    "grid_extents",
    "compact_fields",
    "compact_count",
    "compact_problem",
    "MAX_DIM",
    "HEX16_BODY",
    "HEX16",
    "NonNeg",
    "Hex16",
    "StrictModel",
    "ByteRange",
    "SliceEntry",
    "entries_from_records",
    "slice_problem",
    "ranges_problem",
    "SliceColumns",
    "LazySlices",
]


# The geometry of grids of slices: ``torch.chunk`` part extents, the cells of a grid, and the
# distinct parts a list of slices cuts a dim into (what the compact ``grid`` field needs).


def chunk_extents(g: int, k: int) -> list[int]:
    """The extents of ``torch.chunk``-style parts: ``k`` parts of ``ceil(g / k)``, the last ones
    smaller or empty (what FSDP2's and TP's ``Shard`` produce, empty trailing ranks included)."""
    c = -(-g // k) if k > 0 else 0  # f parts of c, then the rest (maybe 0), then empty ones:
    return [c] * (f := min(k, g // c) if c else 0) + [g - f * c] * (f < k) + [0] * max(0, k - f - 1)


def grid_extents(gshape: Sequence[int], grid: Sequence[int | Sequence[int]]) -> list[list[int]]:
    """Each dim's part extents of a ``grid`` field (an int: chunk parts; a list: the extents)."""
    return [chunk_extents(g, p) if isinstance(p, int) else list(p) for g, p in zip(gshape, grid, strict=True)]


def _grid_boxes(extents: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Offsets and shapes ``(S, nd)`` of the cells of a grid, in C order."""
    nd = len(extents)
    if nd == 0:
        return np.zeros((1, 0), dtype=np.int64), np.zeros((1, 0), dtype=np.int64)
    ext = [np.asarray(e, dtype=np.int64) for e in extents]
    starts = [np.concatenate(([0], np.cumsum(e)[:-1])).astype(np.int64) for e in ext]
    n = math.prod(len(e) for e in ext)
    offs = np.empty((n, nd), dtype=np.int64)
    shps = np.empty((n, nd), dtype=np.int64)
    for d in range(nd):
        before = math.prod(len(e) for e in ext[:d])
        after = math.prod(len(e) for e in ext[d + 1 :])
        offs[:, d] = np.tile(np.repeat(starts[d], after), before)
        shps[:, d] = np.tile(np.repeat(ext[d], after), before)
    return offs, shps


def _distinct_parts(offsets: np.ndarray, extents: np.ndarray, g: int) -> tuple[np.ndarray, np.ndarray]:
    """The distinct (offset, extent) pairs of slices along a dim of size ``g``, sorted by offset
    then extent: one 1-D ``np.unique`` of ``offset * (g + 1) + extent`` (exact while that fits
    in int64; the row-wise ``np.unique(axis=0)``, about 30x slower, past it)."""
    g1 = int(g) + 1
    if g1 < 1 << 31:
        u = np.unique(offsets.astype(np.int64) * g1 + extents)
        return u // g1, u % g1
    pairs = np.unique(np.stack([offsets, extents], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]


# ---------------------------------------------------------------- one slice's records (SliceEntry, ByteRange) and their field types
#: Exclusive bound of a dimension, an offset and a tensor's element count.
MAX_DIM = 1 << 62
#: Digests and fingerprints: 16 lower-case hex digits (``HEX16_BODY`` unanchored).
HEX16_BODY = "[0-9a-f]{16}"
HEX16 = f"^{HEX16_BODY}$"

# Strict: JSON true, 2.0 and "2" are not integers here (pydantic's lax mode would take them).
NonNeg = Annotated[int, Strict(), Field(ge=0, lt=MAX_DIM)]
Hex16 = Annotated[str, Field(pattern=HEX16)]


class StrictModel(BaseModel):
    """The base of the unickpt block's models: no unknown field, frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class ByteRange(StrictModel):
    """Bytes ``[start, end)`` of a slice's stored bytes and their xxh3-64 (docs/format.md 5.1)."""

    start: NonNeg
    end: NonNeg
    xxh3: Hex16


class SliceEntry(StrictModel):
    """One stored block of a global tensor: which file, which key, where it sits."""

    file: str = Field(description="data file name, relative to the checkpoint directory")
    key: str = Field(description="tensor name inside that safetensors file")
    offsets: list[NonNeg] = Field(description="global index of the block's first element, per dim")
    shape: list[NonNeg] = Field(description="block shape; the stored tensor has exactly this shape")
    xxh3: Hex16 | None = Field(default=None, description="xxh3-64 of the stored bytes, 16 hex digits")
    ranges: list[ByteRange] | None = Field(
        default=None,
        description="xxh3-64 of consecutive byte ranges tiling the stored bytes (gathered saves written "
        "by several ranks: one range per rank's run)",
    )


# ---------------------------------------------------------------- one slice's rules within its tensor
def slice_problem(
    key: str, file: str, offsets: Sequence[int], shape: Sequence[int], gshape: Sequence[int]
) -> str | None:
    """What is wrong with one slice of a tensor of shape ``gshape``: rank, or a block past its end."""
    nd = len(gshape)
    if len(offsets) != nd or len(shape) != nd:
        return (
            f"slice {shown(key)} in {shown(file)} has {len(offsets)}-dim offsets and "
            f"{len(shape)}-dim shape for a {nd}-dim tensor"
        )
    for d, (o, n, g) in enumerate(zip(offsets, shape, gshape, strict=True)):
        if o + n > g:
            return (
                f"slice {shown(key)} in {shown(file)} spans [{o}, {o + n}) on dim {d} of a tensor of size {g}"
            )
    return None


def ranges_problem(
    key: str, file: str, ranges: Sequence[Any] | None, shape: Sequence[int], isize: int
) -> str | None:
    """What is wrong with a slice's byte ranges, if it has any: they must tile its stored bytes in order."""
    if ranges is None:
        return None
    nbytes = math.prod(shape) * isize
    pos = 0
    for r in ranges:
        if r.start != pos or r.end <= r.start:
            return (
                f"slice {shown(key)} in {shown(file)}: range [{r.start}, {r.end}) does not continue at byte {pos} "
                f"(ranges tile the slice's {nbytes} bytes in order)"
            )
        pos = r.end
    if pos != nbytes:
        return f"slice {shown(key)} in {shown(file)}: ranges cover {pos} of its {nbytes} bytes"
    return None


def _attribute_setter(cls: type, name: str) -> Callable[[Any, Any], None]:
    """The ``__set__`` of the descriptor that ``object.__setattr__(obj, name, v)`` uses on ``cls``.

    Calling it directly skips the attribute lookup (about half the cost of a setattr).
    """
    for c in cls.__mro__:
        if name in c.__dict__:
            setter: Callable[[Any, Any], None] = c.__dict__[name].__set__
            return setter
    raise AttributeError(name)  # pragma: no cover - pydantic's BaseModel declares all four


_set_dict, _set_fields_set, _set_extra, _set_private = (
    _attribute_setter(SliceEntry, n)
    for n in ("__dict__", "__pydantic_fields_set__", "__pydantic_extra__", "__pydantic_private__")
)
_consume: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend
_object_new = object.__new__
# The fields set of a slice table's records: every field but ``ranges``, as the parser's listed
# slices without byte ranges have it (one set shared by every record).
_RECORD_FIELDS_SET = {f for f in SliceEntry.model_fields if f != "ranges"}
#: Bits of a table's per-slice mask of the optional fields a listed slice gave (its null mask:
#: an absent field and a given null read the same, None, but only a given one is in the fields set).
GIVEN_XXH3, GIVEN_RANGES = 1, 2
_REQUIRED_SET = {f for f in SliceEntry.model_fields if SliceEntry.model_fields[f].is_required()}
_FIELDS_SETS = [
    {
        f
        for f in SliceEntry.model_fields
        if f in _REQUIRED_SET or (f == "xxh3" and g & GIVEN_XXH3) or (f == "ranges" and g & GIVEN_RANGES)
    }
    for g in range(4)
]


def entries_from_records(
    records: list[dict[str, Any]], fields_sets: Iterable[set[str]] | None = None
) -> list[SliceEntry]:
    """``SliceEntry`` objects from checked dicts with every field in model order: what
    ``model_construct`` builds, in four C-level passes. The dicts become the entries' ``__dict__``
    as they are; ``fields_sets`` gives each entry its fields set (sets may be shared: pydantic never
    changes the set of a frozen model), by default one set shared by all, as a slice table's
    records have it."""
    n = len(records)
    objs: list[SliceEntry] = list(map(_object_new, itertools.repeat(SliceEntry, n)))
    _consume(map(_set_dict, objs, records))
    _consume(
        map(
            _set_fields_set,
            objs,
            itertools.repeat(_RECORD_FIELDS_SET) if fields_sets is None else fields_sets,
        )
    )
    none = itertools.repeat(None)
    _consume(map(_set_extra, objs, none))
    _consume(map(_set_private, objs, none))
    return objs


#: The 16 characters standing for a slice without a hash in a concatenated ``xxh3`` string.
NO_HASH = "-" * 16
_get_offsets = operator.attrgetter("offsets")
_get_shape = operator.attrgetter("shape")
_get_file = operator.attrgetter("file")
_get_key = operator.attrgetter("key")
_get_xxh3 = operator.attrgetter("xxh3")


class SliceTable:
    """The slices of one tensor, as arrays (see the module docstring).

    A version 3 grid is kept as its specification until asked: ``len``, the binary search of
    :meth:`overlapping`, the coverage proof and the file ids need no per-slice array, so parsing
    a tensor costs O(1) in its slice count beyond the JSON itself.
    """

    __slots__ = (
        "_file_ids",
        "_file_spec",
        "_given",
        "_grid",
        "_grid_spec",
        "_hashes",
        "_keys",
        "_n",
        "_offsets",
        "_ranges",
        "_shapes",
        "files",
        "gshape",
        "name",
    )

    def __init__(
        self,
        name: str,
        gshape: Sequence[int],
        offsets: np.ndarray | None,
        shapes: np.ndarray | None,
        file_ids: np.ndarray | None,
        files: Sequence[str],
        keys: list[str] | None,
        hashes: str | None,
        grid: list[list[int]] | None = None,
        *,
        grid_spec: Sequence[int | Sequence[int]] | None = None,
        file_spec: int | Sequence[int] | None = None,
        count: int | None = None,
    ) -> None:
        self.name = name
        self.gshape = tuple(gshape)
        self.files = files
        self._offsets = offsets
        self._shapes = shapes
        self._file_ids = file_ids
        self._file_spec = file_spec
        self._keys = keys
        self._hashes = hashes
        self._grid = grid  # part extents per dim when the slices are the cells of a grid in C order
        self._grid_spec = grid_spec
        if count is None:
            count = len(offsets) if offsets is not None else len(file_ids) if file_ids is not None else 0
        self._n = count
        # Slices written by several ranks carry per-range hashes instead of one xxh3
        # (docs/format.md 5.1): {slice position: its ByteRange list}, None when no slice has any.
        self._ranges: dict[int, list[Any]] | None = None
        # Per slice, the optional fields it gave (GIVEN_* bits), for a table of listed slices
        # read from a file; None: every slice gave its xxh3 and no ranges field.
        self._given: np.ndarray | None = None

    # ------------------------------------------------------------ building
    @classmethod
    def from_entries(cls, name: str, gshape: Sequence[int], slices: Sequence[Any]) -> SliceTable:
        """The table of a list of ``SliceEntry`` (versions 1 and 2, and what writers hand over)."""
        n, nd = len(slices), len(gshape)
        if n and any(len(s.offsets) != nd or len(s.shape) != nd for s in slices):
            nd = len(slices[0].offsets)  # a malformed list: coverage names it
        offs = np.fromiter(
            itertools.chain.from_iterable(map(_get_offsets, slices)), dtype=np.int64, count=n * nd
        )
        shps = np.fromiter(
            itertools.chain.from_iterable(map(_get_shape, slices)), dtype=np.int64, count=n * nd
        )
        names: dict[str, int] = {}
        # A new name gets the next id (len(names) is read before setdefault inserts it).
        ids = np.fromiter(
            [names.setdefault(f, len(names)) for f in map(_get_file, slices)], dtype=np.int64, count=n
        )
        order = sorted(names, key=names.__getitem__)
        hashes = list(map(_get_xxh3, slices))
        try:
            joined: str | None = "".join(hashes)
            if len(joined or "") != 16 * n:
                raise TypeError
        except TypeError:
            joined = "".join(h if h is not None else NO_HASH for h in hashes) if any(hashes) else None
        if joined == "":
            joined = None
        table = cls(
            name,
            gshape,
            offs.reshape(n, nd),
            shps.reshape(n, nd),
            ids,
            order,
            list(map(_get_key, slices)),
            joined,
        )
        ranges = {k: r for k, s in enumerate(slices) if (r := getattr(s, "ranges", None))}
        table._ranges = ranges or None
        return table

    @classmethod
    def from_columns(
        cls,
        name: str,
        gshape: Sequence[int],
        *,
        files: Sequence[str],
        keys: list[str],
        offsets: Any,
        shapes: Any,
        hashes: Sequence[str | None] | None = None,
        ranges: Mapping[int, list[Any]] | None = None,
        given: np.ndarray | None = None,
    ) -> SliceTable:
        """The table of whole columns: per slice its file name, key, offsets and shape (``(S, ndim)``
        array-likes, flat or not), hash (None: none), and ``ranges`` by slice position."""
        n, nd = len(keys), len(gshape)
        ids = {f: i for i, f in enumerate(dict.fromkeys(files))}  # in order of first use
        file_ids = np.fromiter(map(ids.__getitem__, files), dtype=np.int64, count=n)
        joined: str | None = None
        if hashes is not None and n:
            try:
                joined = "".join(hashes)  # type: ignore[arg-type]  # every slice has one (a TypeError if not)
            except TypeError:
                if any(h is not None for h in hashes):
                    joined = "".join(NO_HASH if h is None else h for h in hashes)
        table = cls(
            name,
            gshape,
            np.asarray(offsets, dtype=np.int64).reshape(n, nd),
            np.asarray(shapes, dtype=np.int64).reshape(n, nd),
            file_ids,
            list(ids),
            keys,
            joined,
        )
        table._ranges = dict(ranges) if ranges else None
        table._given = given
        return table

    @classmethod
    def whole(
        cls,
        name: str,
        gshape: Sequence[int],
        file: str,
        key: str | None = None,
        xxh3: str | None = None,
        ranges: list[Any] | None = None,
    ) -> SliceTable:
        """One slice holding the whole tensor (a Hugging Face file's tensor; key: the name)."""
        cols = SliceColumns(name, gshape)
        cols.add(file, name if key is None else key, [0] * len(gshape), list(gshape), xxh3, ranges)
        return cols.table()

    @classmethod
    def from_compact(
        cls,
        name: str,
        gshape: Sequence[int],
        files: Sequence[str],
        *,
        grid: Sequence[int | Sequence[int]] | None,
        boxes: Sequence[Sequence[int]] | None,
        file: int | Sequence[int] | None,
        keys: list[str] | None,
        xxh3: str | None,
    ) -> SliceTable:
        """The table of a version 3 tensor entry (fields already checked by ``compact_problem``;
        ``file`` None: slice K is in ``files[K]``)."""
        nd = len(gshape)
        if boxes is not None:
            arr = np.asarray(boxes, dtype=np.int64).reshape(len(boxes), 2 * nd)
            return cls(
                name,
                gshape,
                arr[:, :nd],
                arr[:, nd:],
                None,
                files,
                keys,
                xxh3,
                file_spec=file,
                count=len(boxes),
            )
        spec: list[int | Sequence[int]] = list(grid) if grid is not None else [1] * nd
        n = math.prod(p if isinstance(p, int) else len(p) for p in spec)
        return cls(name, gshape, None, None, None, files, keys, xxh3, grid_spec=spec, file_spec=file, count=n)

    # ------------------------------------------------------------ arrays, built when first asked
    @property
    def grid(self) -> list[list[int]] | None:
        """The part extents per dim when the slices are known to be a grid, else None."""
        if self._grid is None and self._grid_spec is not None:
            self._grid = grid_extents(self.gshape, self._grid_spec)
        return self._grid

    @grid.setter
    def grid(self, extents: list[list[int]] | None) -> None:
        self._grid = extents

    @property
    def offsets(self) -> np.ndarray:
        if self._offsets is None:
            self._offsets, self._shapes = _grid_boxes(self.grid or [])
        return self._offsets

    @property
    def shapes(self) -> np.ndarray:
        if self._shapes is None:
            self._offsets, self._shapes = _grid_boxes(self.grid or [])
        return self._shapes

    @property
    def file_ids(self) -> np.ndarray:
        if self._file_ids is None:
            spec = self._file_spec
            if spec is None:
                self._file_ids = np.arange(self._n, dtype=np.int64)
            elif isinstance(spec, int):
                self._file_ids = np.full(self._n, spec, dtype=np.int64)
            else:
                self._file_ids = np.asarray(spec, dtype=np.int64)
        return self._file_ids

    # ------------------------------------------------------------ per slice, on demand
    def __len__(self) -> int:
        return self._n

    def renamed(self, name: str) -> SliceTable:
        """The same slices under the tensor name ``name`` (keys by the ``NAME@K`` rule follow the
        name; listed keys stay as listed)."""
        if name == self.name:
            return self
        return SliceTable(
            name,
            self.gshape,
            self.offsets,
            self.shapes,
            self.file_ids,
            self.files,
            self._keys,
            self.hashes,
            self.grid,
        )

    @property
    def ruled_keys(self) -> bool:
        """True when every key is ``NAME@K`` by the rule (no key list kept)."""
        return self._keys is None

    def key(self, k: int) -> str:
        return self._keys[k] if self._keys is not None else slice_key(self.name, k)

    def keys(self) -> list[str]:
        if self._keys is not None:
            return self._keys
        return slice_keys(self.name, range(len(self)))

    def file(self, k: int) -> str:
        spec = self._file_spec
        if self._file_ids is None and (spec is None or isinstance(spec, int)):
            return self.files[k if spec is None else spec]
        return self.files[int(self.file_ids[k])]

    def xxh3(self, k: int) -> str | None:
        if self._hashes is None:
            return None
        h = self._hashes[16 * k : 16 * k + 16]
        return None if h == NO_HASH else h

    @property
    def hashes(self) -> str | None:
        """The concatenated hashes (16 characters per slice), or None when no slice has one."""
        return self._hashes

    def hashed_count(self) -> int:
        """How many slices have a hash: an xxh3, or byte-range hashes."""
        n = 0 if self._hashes is None else len(self) - self._hashes[::16].count("-")
        if self._ranges is not None:
            n += sum(1 for k in self._ranges if self.xxh3(k) is None)
        return n

    def ranges_count(self) -> int:  # how many slices carry byte-range hashes
        return 0 if self._ranges is None else len(self._ranges)

    def ranges(self, k: int) -> list[Any] | None:
        """Slice ``k``'s byte-range hashes (``ByteRange`` list), None when it has none."""
        return None if self._ranges is None else self._ranges.get(k)

    def hashed_mask(self) -> list[bool]:
        """Per slice: whether it has a hash (an xxh3, or byte-range hashes)."""
        rng = self._ranges or {}
        return [h is not None or k in rng for k, h in enumerate(self.hash_list())]

    def box(self, k: int) -> tuple[list[int], list[int]]:
        """Slice ``k``'s offsets and shape (of a grid spec, computed from it: no per-slice array)."""
        if self._offsets is not None or self._grid_spec is None:
            return self.offsets[k].tolist(), self.shapes[k].tolist()
        offs: list[int] = []
        shape: list[int] = []
        for g, p in reversed(list(zip(self.gshape, self._grid_spec, strict=True))):
            k, i = divmod(k, p if isinstance(p, int) else len(p))
            c = -(-g // p) if isinstance(p, int) else 0  # torch.chunk parts of c
            offs.append(min(i * c, g) if isinstance(p, int) else sum(p[:i]))
            shape.append(max(0, min(c, g - offs[-1])) if isinstance(p, int) else p[i])
        return offs[::-1], shape[::-1]

    def entry(self, k: int) -> SliceEntry:
        """Slice ``k`` as a ``SliceEntry`` (as the whole list builds it)."""
        offsets, shape = self.box(k)
        record = {
            "file": self.file(k),
            "key": self.key(k),
            "offsets": offsets,
            "shape": shape,
            "xxh3": self.xxh3(k),
            "ranges": self.ranges(k),
        }
        return entries_from_records([record], self._fields_sets([k]))[0]

    def _fields_sets(self, ks: Sequence[int] | None = None) -> list[set[str]] | None:
        """The fields sets of the slices at ``ks`` (all: None), None when all are the default."""
        if self._given is None:
            return None
        given = self._given if ks is None else self._given[np.asarray(ks, dtype=np.int64)]
        return list(map(_FIELDS_SETS.__getitem__, given.tolist()))

    def hash_list(self) -> list[str | None]:
        """Every slice's hash (None: none), in slice order."""
        h = self._hashes
        if h is None:
            return [None] * len(self)
        return [
            None if x == NO_HASH else x
            for x in map(h.__getitem__, map(slice, range(0, len(h), 16), range(16, len(h) + 16, 16)))
        ]

    def files_of(self, ks: np.ndarray) -> set[str]:
        """The distinct files of the slices at positions ``ks``."""
        return {self.files[i] for i in set(self.file_ids[ks].tolist())}

    def rows(self) -> Iterator[tuple[str, str, str | None, list[int], list[int]]]:
        """Each slice's ``(file, key, xxh3, offsets, shape)``, read from the columns (no
        ``SliceEntry`` built)."""
        return zip(
            self.file_list(),
            self.keys(),
            self.hash_list(),
            self.offsets.tolist(),
            self.shapes.tolist(),
            strict=True,
        )

    def file_list(self) -> list[str]:
        """Every slice's file name, in slice order."""
        return list(map(self.files.__getitem__, self.file_ids.tolist()))

    def records(self) -> list[dict[str, Any]]:
        """Every slice as a plain dict with the fields of ``SliceEntry``, built in bulk."""
        rng = self._ranges or {}
        return [
            {"file": f, "key": k, "offsets": o, "shape": s, "xxh3": h, "ranges": rng.get(i)}
            for i, (f, k, o, s, h) in enumerate(
                zip(
                    self.file_list(),
                    self.keys(),
                    self.offsets.tolist(),
                    self.shapes.tolist(),
                    self.hash_list(),
                    strict=True,
                )
            )
        ]

    def listed(self, exclude_none: bool = True) -> list[dict[str, Any]]:
        """Every slice as the JSON object of a listed slice: the fields of ``SliceEntry`` in its
        order, its ``ranges`` as ``start``/``end``/``xxh3`` objects; with ``exclude_none`` a field
        that is None is left out (what ``SliceEntry.model_dump(exclude_none=True)`` writes). Read
        from the columns: no ``SliceEntry`` built."""
        out: list[dict[str, Any]] = [
            {"file": f, "key": k, "offsets": o, "shape": s, "xxh3": h} for f, k, h, o, s in self.rows()
        ]
        hashes = self._hashes
        if exclude_none and hashes is None:
            for d in out:
                del d["xxh3"]
        elif exclude_none and hashes is not None and "-" in hashes:  # some slice has none (16 '-')
            for d in out:
                if d["xxh3"] is None:
                    del d["xxh3"]
        ranges = self._ranges or {}
        if not exclude_none:
            for d in out:
                d["ranges"] = None
        for k, rs in ranges.items():
            out[k]["ranges"] = [{"start": r.start, "end": r.end, "xxh3": r.xxh3} for r in rs]
        return out

    def entries(self) -> list[SliceEntry]:
        """Every slice as a ``SliceEntry`` (built in bulk, as the index parser builds them)."""
        return entries_from_records(self.records(), self._fields_sets())

    # ------------------------------------------------------------ in bulk
    def file_counts(self) -> dict[str, int]:
        """How many slices each file holds, from the file spec when there is one (no per-slice array)."""
        spec, n = self._file_spec, self._n
        if n and isinstance(spec, int) and self._file_ids is None:
            return {self.files[spec]: n}
        if not n or (spec is None and self._file_ids is None):
            return dict.fromkeys(self.files[:n], 1)
        ids = np.asarray(spec, dtype=np.int64) if self._file_ids is None else self.file_ids
        counts = np.bincount(ids, minlength=len(self.files)) if len(ids) else np.zeros(0, dtype=np.int64)
        return {self.files[i]: int(counts[i]) for i in np.flatnonzero(counts).tolist()}

    def distinct_files(self) -> list[str]:
        spec = self._file_spec
        if isinstance(spec, int):
            return [self.files[spec]] if self._n else []
        if spec is None and self._file_ids is None:
            return sorted(self.files[: self._n])
        ids = set(spec) if spec is not None else set(self.file_ids.tolist())
        return [self.files[i] for i in sorted(ids)]

    def problem(self, isize: int) -> str | None:
        """What is wrong with the slices within the tensor, checked at once (``slice_problem``'s
        rank and bounds, ``ranges_problem``'s tiling of each slice's bytes), the first slice at
        fault named; None when nothing is."""
        n, nd = len(self), len(self.gshape)
        if not n:
            return None
        if self._offsets is None and self._grid_spec is not None:
            return None  # a grid's cells lie inside the tensor by construction
        offs, shps = self.offsets, self.shapes
        if offs.shape[1:] != (nd,) or shps.shape[1:] != (nd,):  # a malformed list (from_entries)
            return next(
                p
                for e in self.entries()
                if (p := slice_problem(e.key, e.file, e.offsets, e.shape, self.gshape)) is not None
            )
        past = np.flatnonzero((offs + shps > np.asarray(self.gshape, dtype=np.int64)).any(axis=1))
        if len(past):
            k = int(past[0])
            return slice_problem(self.key(k), self.file(k), offs[k].tolist(), shps[k].tolist(), self.gshape)
        for k, rs in sorted((self._ranges or {}).items()):  # only the slices that carry ranges
            problem = ranges_problem(self.key(k), self.file(k), rs, shps[k].tolist(), isize)
            if problem is not None:
                return problem
        return None

    def volumes(self) -> np.ndarray:
        return np.prod(self.shapes, axis=1, dtype=np.int64) if len(self) else np.zeros(0, dtype=np.int64)

    def overlapping(self, offsets: Sequence[int], shape: Sequence[int]) -> list[int]:
        """The non-empty slices that share an element with the box (offsets, shape), in slice order.

        A grid is searched per dim (binary search on its cut points, O(nd log S)); other tables
        with one vectorised test per slice. A 0-dim box needs every slice (there is one element).
        """
        nd = len(self.gshape)
        if nd == 0 or len(offsets) == 0:
            return list(range(len(self)))
        if any(n == 0 for n in shape):
            return []
        if self.grid is not None:
            per_dim: list[np.ndarray] = []
            for ext, o, n in zip(self.grid, offsets, shape, strict=True):
                e = np.asarray(ext, dtype=np.int64)
                ends = np.cumsum(e)
                starts = ends - e
                first = int(np.searchsorted(ends, o, side="right"))
                stop = int(np.searchsorted(starts, o + n, side="left"))
                idx = np.arange(first, stop, dtype=np.int64)
                per_dim.append(idx[e[idx] > 0])
            if any(len(i) == 0 for i in per_dim):
                return []
            flat = np.zeros(1, dtype=np.int64)
            for ext, idx in zip(self.grid, per_dim, strict=True):
                flat = (flat[:, None] * len(ext) + idx[None, :]).reshape(-1)
            return flat.tolist()  # type: ignore[no-any-return]
        lo_box = np.asarray(offsets, dtype=np.int64)
        hi_box = lo_box + np.asarray(shape, dtype=np.int64)
        ends = self.offsets + self.shapes
        meet = ((self.offsets < hi_box) & (ends > lo_box) & (self.shapes > 0)).all(axis=1)
        return [int(k) for k in np.flatnonzero(meet).tolist()]

    def boxes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Every slice's ``(offsets, shape)`` as tuples (coverage messages, merges)."""
        return [
            (tuple(o), tuple(s)) for o, s in zip(self.offsets.tolist(), self.shapes.tolist(), strict=True)
        ]

    def coverage_problem(self) -> str | None:
        """How the slices fail to tile the tensor exactly once, or None.

        A grid tiles by construction (its extents sum to each dim, which the schema checks):
        O(1). Listed slices that form a grid are recognised as one (``detect_grid``, O(S log S)),
        which also makes later searches binary; the rest goes through
        ``coverage.coverage_problem``, O(S log S).
        """
        if self._grid is not None or self._grid_spec is not None:
            return None
        if len(self.gshape) and len(self) > 1 and self.offsets.shape[1:] == (len(self.gshape),):
            self.grid = self.detect_grid()
            if self.grid is not None:
                return None
        return coverage_problem(self.gshape, self.boxes())

    # ------------------------------------------------------------ writing version 3
    def detect_grid(self) -> list[list[int]] | None:
        """The part extents per dim when the slices are exactly the cells of a grid in C order."""
        n, nd = self.offsets.shape if self.offsets.ndim == 2 else (len(self), 0)
        if nd == 0 or n == 0:
            return None
        extents: list[list[int]] = []
        for d in range(nd):
            o, e = _distinct_parts(self.offsets[:, d], self.shapes[:, d], self.gshape[d])
            if o[0] != 0 or (o[1:] != o[:-1] + e[:-1]).any() or o[-1] + e[-1] != self.gshape[d]:
                return None
            extents.append(e.tolist())
        if math.prod(len(e) for e in extents) != n:
            return None
        offs, shps = _grid_boxes(extents)
        if not (np.array_equal(offs, self.offsets) and np.array_equal(shps, self.shapes)):
            return None
        return extents


class SliceColumns:
    """A tensor's slice table built one slice at a time, as writers produce them: :meth:`add`
    appends a slice's fields to the columns, :meth:`table` makes the :class:`SliceTable` (no
    ``SliceEntry`` on the way). ``SliceTable.from_columns`` takes the columns whole."""

    __slots__ = ("files", "gshape", "hashes", "keys", "name", "offsets", "ranges", "shapes")

    def __init__(self, name: str, gshape: Sequence[int]) -> None:
        self.name = name
        self.gshape = tuple(gshape)
        self.files: list[str] = []
        self.keys: list[str] = []
        self.offsets: list[int] = []  # flat, ndim per slice
        self.shapes: list[int] = []
        self.hashes: list[str | None] = []
        self.ranges: dict[int, list[Any]] = {}

    def __len__(self) -> int:
        return len(self.keys)

    def add(
        self,
        file: str,
        key: str,
        offsets: Sequence[int],
        shape: Sequence[int],
        xxh3: str | None = None,
        ranges: list[Any] | None = None,
    ) -> None:
        """Append one slice (``ranges``: its ``ByteRange`` list, for a slice written by several ranks)."""
        if len(offsets) != len(self.gshape) or len(shape) != len(self.gshape):
            raise ValueError(slice_problem(key, file, offsets, shape, self.gshape))
        if ranges:
            self.ranges[len(self.keys)] = ranges
        self.files.append(file)
        self.keys.append(key)
        self.offsets.extend(offsets)
        self.shapes.extend(shape)
        self.hashes.append(xxh3)

    def table(self) -> SliceTable:
        return SliceTable.from_columns(
            self.name,
            self.gshape,
            files=self.files,
            keys=self.keys,
            offsets=self.offsets,
            shapes=self.shapes,
            hashes=self.hashes,
            ranges=self.ranges,
        )


def compact_fields(
    table: SliceTable, file_index: Mapping[str, int], remap: np.ndarray | None = None
) -> dict[str, Any]:
    """The version 3 fields (``grid``/``boxes``, ``file``, ``keys``, ``xxh3``) of a table.

    ``file_index`` maps each file name to its position in the block's ``files`` table;
    ``remap``, when given, is that map applied to ``table.files`` already.
    """
    out: dict[str, Any] = {}
    n, nd = len(table), len(table.gshape)
    whole = n == 1 and not table.offsets.any() and list(table.shapes[0].tolist()) == list(table.gshape)
    if not whole:
        extents = table.detect_grid()
        if extents is not None:
            out["grid"] = [
                len(e) if e == chunk_extents(g, len(e)) else e
                for g, e in zip(table.gshape, extents, strict=True)
            ]
        else:
            out["boxes"] = np.concatenate([table.offsets, table.shapes], axis=1).reshape(n, 2 * nd).tolist()
    if remap is None:
        remap = np.asarray([file_index[f] for f in table.files], dtype=np.int64)
    ids = remap[table.file_ids] if n else table.file_ids
    if n == len(file_index) and n > 1 and (ids == np.arange(n)).all():
        pass  # slice K in files[K]: no 'file' (one file per rank, in rank order)
    elif n and (ids == ids[0]).all():
        out["file"] = int(ids[0])
    else:
        out["file"] = ids.tolist()
    keys = table.keys()
    if table._keys is not None and any(k != slice_key(table.name, i) for i, k in enumerate(keys)):
        out["keys"] = list(keys)
    if table.hashes is not None:
        out["xxh3"] = table.hashes
    return out


# ---------------------------------------------------------------- the compact fields' rules
# Checked once their types are: the index parser (``index.IndexParser``) calls them on what it
# reads, and the index models' validators on what code builds, so a rule is written once.
def compact_count(
    gshape: Sequence[int], grid: Sequence[int | Sequence[int]] | None, boxes: Sequence[Any] | None
) -> int:
    """The number of slices the compact fields describe (``grid`` checked to have ``len(gshape)`` items)."""
    if boxes is not None:
        return len(boxes)
    if grid is None:
        return 1
    return math.prod(p if isinstance(p, int) else len(p) for p in grid)


def compact_problem(
    gshape: Sequence[int],
    grid: Sequence[int | Sequence[int]] | None,
    boxes: Sequence[Sequence[int]] | None,
    file: int | Sequence[int] | None,
    keys: Sequence[str] | None,
    xxh3: str | None,
) -> str | None:
    """What is wrong with the compact slice fields of a version 3 tensor (types already checked)."""
    nd = len(gshape)
    if grid is not None and boxes is not None:
        return "has both 'grid' and 'boxes' (one describes the slices)"
    if grid is not None:
        if len(grid) != nd:
            return f"grid has {len(grid)} dims for a {nd}-dim tensor"
        for d, (p, g) in enumerate(zip(grid, gshape, strict=True)):
            if not isinstance(p, int) and (not p or sum(p) != g):
                return f"grid dim {d}: part extents {list(p)[:8]} do not add up to the tensor's size {g}"
    elif boxes is not None and len(boxes):
        # All boxes at once; the first box at fault (of either mask) is named.
        lengths = np.fromiter(map(len, boxes), np.int64, len(boxes))
        wrong = np.flatnonzero(lengths != 2 * nd)
        first = int(wrong[0]) if len(wrong) else len(boxes)  # the boxes before it have 2 x nd integers
        if nd and first:
            arr = np.asarray(boxes[:first], dtype=np.int64).reshape(first, 2 * nd)  # each < 2**62
            past = arr[:, :nd] + arr[:, nd:] > np.asarray(gshape, dtype=np.int64)
            rows = np.flatnonzero(past.any(axis=1))
            if len(rows):
                i = int(rows[0])
                d = int(np.argmax(past[i]))
                b = boxes[i]
                return (
                    f"box {i} spans [{b[d]}, {b[d] + b[nd + d]}) on dim {d} of a tensor of size {gshape[d]}"
                )
        if first < len(boxes):
            return f"box {first} has {len(boxes[first])} integers, expected {2 * nd} (offsets then shape)"
    n = compact_count(gshape, grid, boxes)
    if file is not None and not isinstance(file, int) and len(file) != n:
        return f"'file' lists {len(file)} file(s) for {n} slice(s)"
    if keys is not None and len(keys) != n:
        return f"'keys' lists {len(keys)} key(s) for {n} slice(s)"
    if xxh3 is not None and len(xxh3) != 16 * n:
        return f"'xxh3' holds {len(xxh3)} characters for {n} slice(s) (16 per slice)"
    return None


# ---------------------------------------------------------------- a tensor's slices list, built from its table when read
class LazySlices(list):  # type: ignore[type-arg]
    """A tensor's ``slices`` list that builds its ``SliceEntry`` objects the first time it is read.

    It carries the tensor's :class:`SliceTable` (``.table``); ``len`` needs no objects. Every way
    of reading the elements goes through the methods below, which build the list once.
    """

    __slots__ = ("_built", "table")

    def __init__(self, table: SliceTable, built: Iterable[Any] | None = None) -> None:
        super().__init__()
        self.table = table
        self._built = False
        if built is not None:
            list.extend(self, built)
            self._built = True

    def _build(self) -> None:
        if not self._built:
            list.extend(self, self.table.entries())
            self._built = True

    def __len__(self) -> int:
        return list.__len__(self) if self._built else len(self.table)

    def __iter__(self) -> Iterator[Any]:
        self._build()
        return list.__iter__(self)

    def __reversed__(self) -> Iterator[Any]:
        self._build()
        return list.__reversed__(self)

    @overload
    def __getitem__(self, i: SupportsIndex) -> Any: ...
    @overload
    def __getitem__(self, i: slice) -> list[Any]: ...
    def __getitem__(self, i: Any) -> Any:
        if not self._built and isinstance(i, int) and -len(self.table) <= i < len(self.table):
            return self.table.entry(i % len(self.table))
        self._build()
        return list.__getitem__(self, i)

    def __contains__(self, x: object) -> bool:
        self._build()
        return list.__contains__(self, x)

    def __eq__(self, other: object) -> bool:
        self._build()
        if isinstance(other, LazySlices):
            other._build()
        return list.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self.__eq__(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        self._build()
        return list.__repr__(self)

    def __bool__(self) -> bool:
        return len(self) > 0

    def copy(self) -> list[Any]:
        self._build()
        return list(list.__iter__(self))

    def index(self, *args: Any) -> int:
        self._build()
        return list.index(self, *args)

    def count(self, x: Any) -> int:
        self._build()
        return list.count(self, x)

    def __add__(self, other: Any) -> list[Any]:
        return self.copy() + list(other)

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        return (LazySlices, (self.table,))  # pickled as its table: no SliceEntry per slice

    def __copy__(self) -> list[Any]:
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> list[Any]:
        return self.copy()
