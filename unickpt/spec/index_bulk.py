"""Bulk checks and construction of a tensor's slices for ``parse_index`` (``index_fast``).

Checks what the schema says of a :class:`~unickpt.spec.slice_models.SliceEntry` and of a
slice's bounds within its tensor, for the usual input (every slice an object with the fields in
model order), with C-level bulk operations over the whole table instead of a Python loop per
slice, and builds the slices as ``model_construct`` would. A table it does not take (None: an
unusual key order, byte ranges, or a problem) is checked row by row by
``IndexParser.slices_rows``, which names the first offending slice.
"""

from __future__ import annotations

import collections
import contextlib
import gc
import itertools
import operator
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel

from unickpt.spec.index_models import HASHES, MIN_POSITIVE, fields_of
from unickpt.spec.lazy_slices import LazySlices
from unickpt.spec.slice_models import MAX_DIM, SliceEntry, entries_from_records
from unickpt.spec.slice_table import NO_HASH, SliceTable

__all__ = [
    "construct",
    "bulk_slices",
    "compact_field_colons",
    "compact_field_problem",
    "found_text",
    "gc_paused",
    "SLICE_FIELDS",
    "SLICE_REQUIRED",
]

_M = TypeVar("_M", bound=BaseModel)

SLICE_FIELDS, SLICE_REQUIRED = fields_of(SliceEntry)
# Fields the bulk path never takes: a slice with byte ranges goes through slices_slow.
_SLOW_FIELDS = frozenset({"ranges"})
# Key orders of a slice object that the bulk path takes as is (what unickpt writes): every
# other field in model order, or the required ones only. Anything else goes through slices_slow.
_FULL_LAYOUT = tuple(f for f in SLICE_FIELDS if f not in _SLOW_FIELDS)
_SLICE_LAYOUTS = frozenset({_FULL_LAYOUT, tuple(f for f in SLICE_FIELDS if f in SLICE_REQUIRED)})
_HEX_DIGITS_COMMA = b"0123456789abcdef,"
_hashes = re.compile(HASHES).fullmatch
_get_file = operator.itemgetter("file")
_get_key = operator.itemgetter("key")
_get_offsets = operator.itemgetter("offsets")
_get_shape = operator.itemgetter("shape")
_get_xxh3 = operator.itemgetter("xxh3")
_setattr = object.__setattr__


_consume: Callable[[Iterable[Any]], None] = collections.deque(maxlen=0).extend
_DICT, _LIST, _INT, _STR = {dict}, {list}, {int}, {str}


def construct(cls: type[_M], given: dict[str, Any], fields_set: set[str], extra: dict[str, Any] | None) -> _M:
    """What validation builds from already-checked ``given`` fields (defaults filled by model_construct).

    ``fields_set`` is every key of the input object (pydantic counts extra keys as set too);
    ``extra`` the extra members of an ``extra="allow"`` model ({} when none), None otherwise.
    """
    m = cls.model_construct(_fields_set=fields_set, **given)
    if extra is not None:
        _setattr(m, "__pydantic_extra__", extra)
    return m


def bulk_slices(
    gshape: list[int], sl: list[Any], shared: dict[tuple[str, ...], set[str]]
) -> tuple[list[Any], int, int, set[str]] | None:
    """One tensor's slices checked and built with C-level bulk operations; None to take the slow path.

    Returns (slices: a ``LazySlices`` over the slices' table, object members, ':' in the slices'
    keys, distinct file names). Checks what
    ``SliceEntry`` and ``TensorEntry._slices_in_bounds`` check, for the usual input: every slice
    an object with the fields in model order (all, or the required ones), integers that are
    ints, strings that are strings. Nothing is modified before every check has passed.
    """
    n = len(sl)
    if not n:
        return [], 0, 0, set()
    if set(map(type, sl)) != _DICT:
        return None
    layouts = set(map(tuple, sl))
    if not layouts <= _SLICE_LAYOUTS:
        return None
    nd = len(gshape)
    offsets = list(map(_get_offsets, sl))
    shapes = list(map(_get_shape, sl))
    try:
        if set(map(len, offsets)) != {nd} or set(map(len, shapes)) != {nd}:
            return None
    except TypeError:  # a number, null or boolean
        return None
    if not nd:
        if set(map(type, offsets)) != _LIST or set(map(type, shapes)) != _LIST:
            return None
    else:
        # Flattening a string or an object of length nd gives strings, caught below with
        # everything else that is not an int: only lists get through.
        flat_o = list(itertools.chain.from_iterable(offsets))
        flat_n = list(itertools.chain.from_iterable(shapes))
        if set(map(type, flat_o)) != _INT or set(map(type, flat_n)) != _INT:
            return None
        if min(flat_o) < 0 or min(flat_n) < 0:
            return None
        # o + n <= g on every dim (g < 2**62, so every o and n is below the NonNeg bound too).
        if not all(map(operator.le, map(operator.add, flat_o, flat_n), itertools.cycle(gshape))):
            return None
    try:
        file_list = list(map(_get_file, sl))
        files = set(file_list)
        key_list = list(map(_get_key, sl))
        keys = "".join(key_list)  # TypeError unless every key is a str
    except TypeError:
        return None
    if set(map(type, files)) != _STR:
        return None
    complete = layouts == {_FULL_LAYOUT}
    hashes = list(map(_get_xxh3, sl)) if complete else [s.get("xxh3") for s in sl]
    try:
        joined = ",".join(hashes)
    except TypeError:  # a null (or not a string)
        hashes = [h for h in hashes if h is not None]
        try:
            joined = ",".join(hashes)
        except TypeError:
            return None
    # Every hash 16 lower-case hex digits: 17 x count - 1 ASCII characters, a ',' at every 17th
    # place and nowhere else, nothing but hex digits around them.
    if hashes and not (
        len(joined) == 17 * len(hashes) - 1
        and joined.isascii()
        and joined.count(",") == len(hashes) - 1
        and joined[16::17] == "," * (len(hashes) - 1)
        and not joined.encode().translate(None, _HEX_DIGITS_COMMA)
    ):
        return None
    pairs = len(_FULL_LAYOUT) * n if complete else sum(map(len, sl))
    if complete:
        # Every slice has every field (what writers write): the slices become their table's
        # arrays at once, no SliceEntry per slice (the list builds them from the table, with the
        # same fields and fields set, if anything iterates it: see LazySlices).
        ids = {f: i for i, f in enumerate(dict.fromkeys(file_list))}  # in order of first use
        file_ids = np.fromiter(map(ids.__getitem__, file_list), np.int64, n)
        if len(hashes) == n:
            stored: str | None = "".join(hashes)
        elif hashes:
            stored = "".join(NO_HASH if h is None else h for h in map(_get_xxh3, sl))
        else:
            stored = None
        table = SliceTable(
            "",
            gshape,
            np.array(flat_o if nd else [], dtype=np.int64).reshape(n, nd),
            np.array(flat_n if nd else [], dtype=np.int64).reshape(n, nd),
            file_ids,
            sorted(ids, key=ids.__getitem__),
            key_list,
            stored,
        )
        return LazySlices(table), pairs, keys.count(":"), files
    # What model_construct sets, in four C-level passes: the parsed objects become the slices'
    # __dict__ as they are (fields in model order). Slices with the same keys share one fields
    # set (``shared``, one per index): pydantic never changes the set of a frozen model (model_copy
    # copies it first), and a set of five names costs about 0.5 KB and 0.4 us per slice.
    for layout in layouts:
        if layout not in shared:
            shared[layout] = set(layout)
    fields_sets = list(map(shared.__getitem__, map(tuple, sl)))
    for s in sl:
        s.setdefault("xxh3", None)  # appended last: the field order holds
    for f in _SLOW_FIELDS:  # absent from every slice taken here; appended last, in model order
        _consume(map(dict.setdefault, sl, itertools.repeat(f), itertools.repeat(None)))
    return entries_from_records(sl, fields_sets), pairs, keys.count(":"), files


def compact_field_colons(k: str, x: Any) -> int | None:
    """Type checks of a version 3 tensor field (``grid``, ``boxes``, ``file``, ``keys``, ``xxh3``)
    in bulk, as the models declare them; returns the ':' its strings hold, or None when in doubt
    (the models then decide and word the error). ``compact_problem`` checks the rest."""
    if x is None:
        return 0
    if k == "xxh3":
        return 0 if type(x) is str and _concatenated_hashes(x) else None
    if k == "keys":
        if type(x) is not list or set(map(type, x)) - _STR:
            return None
        return "".join(x).count(":")
    if k == "file":
        ints = [x] if type(x) is int else x if type(x) is list else None
        if ints is None:
            return None
    else:  # grid: ints and lists of ints; boxes: lists of ints
        if type(x) is not list:
            return None
        lists = [i for i in x if type(i) is list]
        scalars = [i for i in x if type(i) is not list]
        if (k == "boxes" and scalars) or (
            scalars and (set(map(type, scalars)) - _INT or min(scalars) < MIN_POSITIVE)
        ):
            return None
        ints = list(itertools.chain.from_iterable(lists))
    if ints and (set(map(type, ints)) - _INT or min(ints) < 0 or max(ints) >= MAX_DIM):
        return None
    return 0


def compact_field_problem(k: str, x: Any) -> tuple[str, str, Any]:
    """Where ``compact_field_colons`` found a problem in compact field ``k``: (the item's path
    below the field, ``""`` or ``".3"`` or ``".1.0"``; what was expected there; what was found)."""
    if k == "xxh3":
        return "", "null or a string of 16 lower-case hex digits ('-' x 16: none) per slice", x
    if k == "file":
        if type(x) is list:
            for i, f in enumerate(x):
                if not _file_id(f):
                    return f".{i}", "a file index: an integer >= 0 below 2**62", f
        return "", "null, a file index (an integer >= 0 below 2**62) or an array of them", x
    what = {"keys": "strings", "grid": "part counts or arrays of extents", "boxes": "arrays of integers"}
    if type(x) is not list:
        return "", f"null or an array of {what[k]}", x
    for i, item in enumerate(x):
        if k == "keys":
            if type(item) is not str:
                return f".{i}", "a string", item
            continue
        if type(item) is not list:
            if k == "boxes":
                return f".{i}", "an array of integers (offsets then shape)", item
            if type(item) is not int or not MIN_POSITIVE <= item < MAX_DIM:
                return (
                    f".{i}",
                    f"a part count (an integer >= {MIN_POSITIVE} below 2**62) or an array of extents",
                    item,
                )
            continue
        for j, n in enumerate(item):
            if not _file_id(n):
                return f".{i}.{j}", "an integer >= 0 below 2**62", n
    raise AssertionError(f"compact field {k!r} has no problem")  # pragma: no cover - never


def _file_id(v: Any) -> bool:
    return type(v) is int and 0 <= v < MAX_DIM


def _concatenated_hashes(x: str) -> bool:
    """``x`` matches ``HASHES``: a regex pass costs about 0.1 us per character (0.6 s for 370k
    slices), so hex digits alone are checked with one C-level ``bytes.translate`` instead."""
    if "-" in x or len(x) % 16 or not x.isascii():
        return _hashes(x) is not None
    return not x.encode("ascii").translate(None, _HEX_DIGITS_COMMA[:16])


def found_text(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return repr(v) if len(v) <= 80 else f"{v[:77]!r}..."
    return "an array" if isinstance(v, list) else "an object" if isinstance(v, dict) else type(v).__name__


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector (process-wide) while a large JSON tree and its models are built.

    The tree and the models hold no reference cycles, so pausing frees nothing less; it spares
    the collector walking every new container again and again (about 2 us per slice). On success
    the new objects are then moved to the oldest generation (``gc.freeze()`` + ``gc.unfreeze()``,
    two list splices), as repeated collections would have done, instead of leaving millions of
    young objects for the next two collections to walk (about 1 us per slice more). Skipped when
    the process keeps objects frozen itself, so as not to unfreeze them.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
        if was and gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
    finally:
        if was:
            gc.enable()
