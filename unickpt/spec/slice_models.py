"""One slice of the index schema: the pydantic models ``SliceEntry`` and ``ByteRange``, and how
``SliceEntry`` objects are built in bulk from checked fields.

The bottom of the index's modules: the slice table (``slice_table``) builds ``SliceEntry``
objects from its arrays, and the index models (``index_models``, which re-exports everything
here as part of the schema) and the index parser's bulk checks (``index_bulk``) stand on both. The field types
and bounds a slice declares (``NonNeg``, ``Hex16``, ``MAX_DIM``, ``HEX16``) are defined here, once,
for the whole schema.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Iterable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, Strict

__all__ = [
    "MAX_DIM",
    "HEX16_BODY",
    "HEX16",
    "NonNeg",
    "Hex16",
    "StrictModel",
    "ByteRange",
    "SliceEntry",
    "entries_from_records",
]

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
