"""The safetensors header parser: every entry of a header validated at once and kept in arrays
(``HeaderEntries``: no per-entry object until one is asked for); ``HeaderEntry`` is one entry.

``safetensors_io`` (the readers and the writer) builds on this module, never the reverse.

A data file of a sliced save holds one entry per slice: 723 per file for 70B, 370k over the
512 files of a 512-rank save. :func:`parse_header` checks a header as whole-header operations:
the compact form the writers produce is read with one regular expression (``_parse_canonical``),
any other form with one ``json.loads`` without a per-object hook (duplicate keys are found by
counting colons, as the index parser does: ``untrusted.colon_budget``); the types of all entries are
checked with ``map``/``set`` over the decoded values, and the offsets, byte counts and the
tiling of the data section with numpy over all entries at once.

The checks run one field at a time over all entries, in this order: the JSON itself (valid,
no duplicate key, no lone surrogate), ``__metadata__``, each entry's form (exactly dtype, shape
and data_offsets), dtype, shape, element count, data_offsets' form, their range, the byte count
(shape x item size), the tiling (no gap, no overlap, nothing left over). A header that fails one
is refused with a ``HeaderError`` naming the file, the first entry in header order that fails
it (for the tiling: in data order), the field, what was expected and what was found. The cost
of a refusal is that of the checks that ran before it plus one scan for the entry at fault:
bounded by the header's length (capped at ``bounds.MAX_HEADER_BYTES`` before anything is read),
whatever the entry count, key lengths, shape ranks or numbers in it; a quoted value is cut to a
few hundred characters.

:class:`HeaderEntries` is the result: a read-only mapping key -> ``HeaderEntry`` that builds an
entry only when one is asked for, and hands its arrays to bulk readers (``arrays``).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from unickpt.errors import HeaderError
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.naming import shown
from unickpt.spec.untrusted import SURROGATE_ESCAPE, colon_budget, strict_loads

__all__ = ["HeaderEntry", "HeaderEntries", "MAX_NDIM", "MAX_ELEMENTS", "dtype_code", "parse_header"]

#: Dims of a shape at most (byte counts cannot overflow, allocations stay sane).
MAX_NDIM = 64
#: Elements (and each dim) of an entry below this.
MAX_ELEMENTS = 1 << 62

_FIELDS = operator.itemgetter("dtype", "shape", "data_offsets")
_DTYPES = sorted(DTYPE_ITEMSIZE)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_ITEMSIZE = np.asarray([DTYPE_ITEMSIZE[d] for d in _DTYPES], dtype=np.int64)


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor of a validated header: its dtype, shape and byte range in the data section."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # relative to the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class HeaderEntries(Mapping[str, HeaderEntry]):
    """key -> ``HeaderEntry`` of one validated header, kept as arrays; an entry is built when asked.

    :meth:`arrays` hands the arrays themselves to bulk readers (``ckpt/stored_slices.py``), which
    locate and check thousands of slices with a few numpy operations.
    """

    __slots__ = ("_begin", "_codes", "_dims", "_end", "_keys", "_ndims", "_pos", "_shapes")

    def __init__(
        self,
        keys: list[str],
        codes: np.ndarray,
        shapes: list[list[int]],
        begin: np.ndarray,
        end: np.ndarray,
        ndims: np.ndarray | None = None,
        dims: np.ndarray | None = None,
    ) -> None:
        self._pos = dict(zip(keys, range(len(keys)), strict=True))
        self._keys = keys
        self._codes = codes  # index into _DTYPES
        self._shapes = shapes
        self._begin = begin
        self._end = end
        self._ndims = ndims
        self._dims = dims

    def __getitem__(self, key: str) -> HeaderEntry:
        i = self._pos[key]
        return HeaderEntry(
            key, _DTYPES[int(self._codes[i])], tuple(self._shapes[i]), int(self._begin[i]), int(self._end[i])
        )

    def __contains__(self, key: object) -> bool:
        return key in self._pos

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def span(self, key: str) -> tuple[int, int] | None:
        """(begin, end) of ``key`` relative to the data section, None when the file lacks it."""
        i = self._pos.get(key)
        return None if i is None else (int(self._begin[i]), int(self._end[i]))

    def describe(self, key: str) -> tuple[str, list[int]] | None:
        """(dtype, shape as a list) of ``key``, None when the file lacks it (no entry object built)."""
        i = self._pos.get(key)
        return None if i is None else (_DTYPES[int(self._codes[i])], list(self._shapes[i]))

    @property
    def positions(self) -> dict[str, int]:
        """key -> its entry's position in the arrays of :meth:`arrays`."""
        return self._pos

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(dtype codes, begin, end, ndims, flat dims) of every entry, in key order (int64)."""
        if self._ndims is None or self._dims is None:
            self._ndims = np.fromiter(map(len, self._shapes), dtype=np.int64, count=len(self._shapes))
            self._dims = np.fromiter(chain.from_iterable(self._shapes), dtype=np.int64)
        return self._codes, self._begin, self._end, self._ndims, self._dims


def dtype_code(dtype: str) -> int:
    """The code of a safetensors dtype name in :meth:`HeaderEntries.arrays` (-1: not one)."""
    return _DTYPE_CODE.get(dtype, -1)


def _first(ok: Callable[[Any], bool], items: list[Any]) -> int:
    """The position of the first of ``items`` that ``ok`` refuses (the caller knows one does)."""
    return next(i for i, x in enumerate(items) if not ok(x))


class _Entries:
    """Raises the ``HeaderError`` of one header, naming the entry at fault."""

    def __init__(self, path: str, keys: list[str]) -> None:
        self.path = path
        self.keys = keys

    def fail(self, i: int, message: str) -> HeaderError:
        return HeaderError(f"{self.path}: tensor {shown(self.keys[i])}: {message}")


def _is_dim(d: Any) -> bool:
    return type(d) is int and 0 <= d < MAX_ELEMENTS


def _shape_ok(shape: Any) -> bool:
    return type(shape) is list and len(shape) <= MAX_NDIM and all(map(_is_dim, shape))


def _offsets_ok(offsets: Any) -> bool:
    return type(offsets) is list and len(offsets) == 2 and all(type(o) is int for o in offsets)


_ENTRY_FIELDS = {"dtype", "shape", "data_offsets"}


def _form_ok(value: Any) -> bool:
    return type(value) is dict and value.keys() == _ENTRY_FIELDS


def _form_found(value: Any) -> str:
    if type(value) is dict:
        return f"fields {shown(list(value))}"
    return f"a JSON {type(value).__name__} {shown(value, 80)}"


def parse_header(raw: bytes, data_len: int, path: str) -> tuple[HeaderEntries, dict[str, str]]:
    """The entries and metadata of a safetensors header's JSON bytes, checked against a data
    section of ``data_len`` bytes; ``HeaderError`` naming ``path``, the entry and the field at fault.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(f"{path}: safetensors header is not valid UTF-8 ({e})") from e
    if not text.startswith("{"):
        raise HeaderError(f"{path}: safetensors header must be a JSON object starting with '{{'")
    canonical = _parse_canonical(text, data_len, path)
    if canonical is not None:
        return canonical
    what = f"{path}: safetensors header"
    budget = colon_budget(raw)
    if budget is None or SURROGATE_ESCAPE.search(text):
        obj = strict_loads(text, HeaderError, what)  # (rare) names a duplicate or a lone surrogate
        budget = None  # duplicates already ruled out
    else:
        try:
            obj = json.loads(text)
        except (ValueError, RecursionError):
            obj = strict_loads(text, HeaderError, what)  # raises, worded as for any JSON file
    if type(obj) is not dict:
        raise HeaderError(f"{what} must be a JSON object")
    had_meta = "__metadata__" in obj
    meta = obj.pop("__metadata__", {})
    if not (type(meta) is dict and all(type(v) is str for v in meta.values())):
        raise HeaderError(f"{path}: __metadata__ must map strings to strings, found {shown(meta)}")
    keys = list(obj)
    values = list(obj.values())
    n = len(keys)
    at = _Entries(path, keys)
    # Every entry a dict of exactly dtype, shape and data_offsets.
    if n and (set(map(type, values)) != {dict} or set(map(len, values)) != {3}):
        i = _first(_form_ok, values)
        raise at.fail(
            i, f"entry must have exactly dtype, shape and data_offsets, found {_form_found(values[i])}"
        )
    try:
        fields = list(map(_FIELDS, values))
    except KeyError:
        i = _first(_form_ok, values)
        raise at.fail(
            i, f"entry must have exactly dtype, shape and data_offsets, found {_form_found(values[i])}"
        ) from None
    dtypes, shapes, offsets = (list(x) for x in zip(*fields, strict=True)) if n else ([], [], [])
    # Duplicate keys: with every entry of three members, the colons of the text are exactly the
    # members of every object plus the colons inside strings (see spec/untrusted.py); a repeated key drops
    # a member. Any other count (a colon in a dtype name, objects nested in a shape ...) is
    # settled by the parser with a per-object hook, which names a duplicate if there is one.
    if budget is not None and budget != (
        n + had_meta + 3 * n + len(meta) + "\n".join(keys).count(":") + _meta_colons(meta)
    ):
        strict_loads(text, HeaderError, what)
    try:
        codes = np.fromiter(map(_DTYPE_CODE.__getitem__, dtypes), dtype=np.int64, count=n)
    except (KeyError, TypeError):
        i = _first(lambda d: type(d) is str and d in _DTYPE_CODE, dtypes)
        raise at.fail(
            i, f"unknown or unsupported dtype {shown(dtypes[i])} (expected one of {', '.join(_DTYPES)})"
        ) from None
    # Shapes: lists of at most 64 ints in [0, 2^62) (bool is not an int here).
    ok = not n or set(map(type, shapes)) == {list}
    ndims = np.fromiter(map(len, shapes), dtype=np.int64, count=n) if ok else None
    flat_dims = list(chain.from_iterable(shapes)) if ok else []
    if (
        not ok
        or ndims is None
        or (n and int(ndims.max()) > MAX_NDIM)
        or not set(map(type, flat_dims)) <= {int}
        or (flat_dims and (min(flat_dims) < 0 or max(flat_dims) >= MAX_ELEMENTS))
    ):
        i = _first(_shape_ok, shapes)
        raise at.fail(
            i,
            f"shape must be a list of at most {MAX_NDIM} non-negative integers below 2^62, "
            f"found {shown(shapes[i])}",
        )
    dims = np.asarray(flat_dims, dtype=np.int64)
    numel = list(map(math.prod, shapes))  # Python ints: no overflow (64 dims below 2^62 each)
    _check_elements(at, shapes, numel)
    if n and (set(map(type, offsets)) != {list} or set(map(len, offsets)) != {2}):
        i = _first(_offsets_ok, offsets)
        raise at.fail(i, f"data_offsets must be two integers, found {shown(offsets[i])}")
    flat_offs = list(chain.from_iterable(offsets))
    if not set(map(type, flat_offs)) <= {int}:
        i = _first(_offsets_ok, offsets)
        raise at.fail(i, f"data_offsets must be two integers, found {shown(offsets[i])}")
    if flat_offs and (min(flat_offs) < 0 or max(flat_offs) > data_len):  # (beyond int64 too)
        i = _first(lambda o: 0 <= o[0] <= o[1] <= data_len, offsets)
        lo, hi = offsets[i]
        raise at.fail(
            i,
            f"data_offsets [{shown(lo)}, {shown(hi)}] out of range of the {data_len}-byte data section",
        )
    offs = np.asarray(flat_offs, dtype=np.int64).reshape(n, 2)
    return _entries(at, codes, shapes, ndims, dims, numel, offs, data_len), meta


def _meta_colons(meta: dict[str, str]) -> int:
    return sum(k.count(":") + v.count(":") for k, v in meta.items())


def _check_elements(at: _Entries, shapes: list[list[int]], numel: list[int]) -> None:
    if numel and max(numel) >= MAX_ELEMENTS:
        i = _first(lambda x: x < MAX_ELEMENTS, numel)
        raise at.fail(i, f"shape {shown(shapes[i])} has too many elements ({numel[i]}, at most 2^62 - 1)")


def _entries(
    at: _Entries,
    codes: np.ndarray,
    shapes: list[list[int]],
    ndims: np.ndarray,
    dims: np.ndarray,
    numel: list[int],
    offs: np.ndarray,
    data_len: int,
) -> HeaderEntries:
    """The numeric checks of every entry at once: data_offsets inside the data section, byte
    counts of shape x item size, the entries tiling the data section. ``offs`` fit int64."""
    n = len(at.keys)
    begin, end = offs[:, 0], offs[:, 1]
    if n and (int(begin.min()) < 0 or bool((end < begin).any()) or int(end.max()) > data_len):
        i = int(np.flatnonzero((begin < 0) | (end < begin) | (end > data_len))[0])
        raise at.fail(
            i, f"data_offsets [{begin[i]}, {end[i]}] out of range of the {data_len}-byte data section"
        )
    # Byte counts: (end - begin) == numel x item size. Every numel is below 2^62 (checked), so the
    # product fits int64 below 2^60 elements; past that the span is divided instead (no overflow).
    isz = _ITEMSIZE[codes]
    span = end - begin
    num = np.asarray(numel, dtype=np.int64)
    if n and int(num.max()) >= 1 << 60:
        good = bool(np.array_equal(span // isz, num) and not (span % isz).any())
    else:
        good = np.array_equal(span, num * isz)
    if not good:
        i = int(np.flatnonzero((span // isz != num) | (span % isz != 0))[0])
        d = _DTYPES[int(codes[i])]
        raise at.fail(
            i,
            f"{d}{shown(shapes[i])} needs {numel[i] * DTYPE_ITEMSIZE[d]} bytes but data_offsets span {int(span[i])}",
        )
    # The entries tile the data section exactly: sorted by (begin, end), each starts where the
    # previous ended, the first at 0, the last ends at the data section's end.
    order = np.lexsort((end, begin))
    b, e = begin[order], end[order]
    if n and (int(b[0]) != 0 or not np.array_equal(b[1:], e[:-1])):
        prev = np.concatenate([np.zeros(1, dtype=np.int64), e[:-1]])
        k = int(np.flatnonzero(b != prev)[0])
        pos, at_byte = int(prev[k]), int(b[k])
        kind = "overlaps the previous tensor" if at_byte < pos else "leaves a gap before it"
        raise HeaderError(
            f"{at.path}: tensor {shown(at.keys[int(order[k])])} at byte {at_byte} {kind} (expected byte {pos})"
        )
    covered = int(e[-1]) if n else 0
    if covered != data_len:
        raise HeaderError(f"{at.path}: tensors cover {covered} bytes but the data section holds {data_len}")
    return HeaderEntries(at.keys, codes, shapes, begin.copy(), end.copy(), ndims, dims)


# The compact form unickpt's writer (and safetensors') produces: no whitespace but the trailing
# padding, no escape in any string, entry fields in the order dtype, shape, data_offsets, JSON
# integers. Its entries are read with one ``findall`` and the text rebuilt from them must be the
# text read: no JSON object per entry. Anything else goes to ``json.loads`` above.
_CHARS = r'[^"\\\x00-\x1f]*'  # a JSON string's characters without escapes or control characters
_STR = f'"{_CHARS}"'
_INT = r"(?:0|[1-9][0-9]{0,18})"  # at most 19 digits: longer numbers take the JSON path


def _entry(group: str) -> str:
    """One entry's text; ``group`` opens each of its five fields: "(" captures, "(?:" does not."""
    g = group
    return (
        rf'"{g}{_CHARS})":\{{"dtype":"{g}{_CHARS})","shape":\[{g}(?:{_INT}(?:,{_INT}){{0,63}})?)\],'
        rf'"data_offsets":\[{g}{_INT}),{g}{_INT})\]\}}'
    )


_ENTRY = _entry("(")
_META = rf"\{{(?:{_STR}:{_STR}(?:,{_STR}:{_STR})*)?\}}"
_HEAD = re.compile(rf'\{{(?:"__metadata__":({_META}),)?')
_ENTRIES = re.compile(_ENTRY)
_META_PAIR = re.compile(rf"({_STR}):({_STR})")


def _parse_canonical(text: str, data_len: int, path: str) -> tuple[HeaderEntries, dict[str, str]] | None:
    """The header in the writers' compact form, checked whole (``HeaderError`` as ``parse_header``);
    None when it is in any other form, or holds what the JSON reading words better (a repeated
    key, an unknown dtype, a shape out of bounds, a number of more than 18 digits)."""
    m = _HEAD.match(text)
    end = len(text.rstrip(" \t\n\r")) - 1
    if m is None or end < m.end() or text[end] != "}":
        return None
    meta: dict[str, str] = {}
    if m.group(1) is not None:
        pairs = _META_PAIR.findall(m.group(1))
        meta = {k[1:-1]: v[1:-1] for k, v in pairs}
        if len(meta) != len(pairs):  # a repeated metadata key
            return None
    found = _ENTRIES.findall(text, m.end(), end)
    # The entries must be the whole text between the head and the closing brace: rebuilt from
    # the fields read, joined by commas, they give it back exactly (nothing skipped between them).
    rebuilt = ",".join(
        [f'"{k}":{{"dtype":"{d}","shape":[{s}],"data_offsets":[{b},{e}]}}' for k, d, s, b, e in found]
    )
    if not found or rebuilt != text[m.end() : end]:
        return None
    keys, dtypes, shape_texts, begins, ends = (list(c) for c in zip(*found, strict=True))
    n = len(keys)
    if len(set(keys)) != n or "__metadata__" in keys:
        return None  # a repeated key (the JSON reading names it) or a metadata entry out of place
    try:
        codes = np.fromiter(map(_DTYPE_CODE.__getitem__, dtypes), dtype=np.int64, count=n)
    except KeyError:
        return None
    distinct = dict.fromkeys(shape_texts)
    parsed = {t: [int(d) for d in t.split(",")] if t else [] for t in distinct}
    if (
        max(map(len, parsed.values())) > MAX_NDIM
        or max(max(d, default=0) for d in parsed.values()) >= MAX_ELEMENTS
    ):
        return None
    shapes = list(map(parsed.__getitem__, shape_texts))  # entries of one shape share its list
    ndims = np.fromiter(map(len, shapes), dtype=np.int64, count=n)
    dims = np.fromiter(chain.from_iterable(shapes), dtype=np.int64, count=int(ndims.sum()))
    sizes = {t: math.prod(d) for t, d in parsed.items()}
    numel = list(map(sizes.__getitem__, shape_texts))
    at = _Entries(path, keys)
    _check_elements(at, shapes, numel)
    if max(map(len, begins)) > 18 or max(map(len, ends)) > 18:
        return None  # (past 10^18 bytes: no file holds that; the JSON reading says what is wrong)
    offs = np.empty((n, 2), dtype=np.int64)  # digits only (the pattern), below 10^18: exact
    offs[:, 0] = np.fromstring(",".join(begins), dtype=np.int64, sep=",")
    offs[:, 1] = np.fromstring(",".join(ends), dtype=np.int64, sep=",")
    return _entries(at, codes, shapes, ndims, dims, numel, offs, data_len), meta
