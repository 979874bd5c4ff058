"""The entries of a safetensors header: one (``HeaderEntry``), and all of a header's, validated
in bulk and kept in arrays (``HeaderEntries``: no per-entry object until one is asked for).

``safetensors_io`` (the strict parser, the readers and the writer) builds on this module, never
the reverse.

A data file of a sliced save holds one entry per slice: 723 per file for 70B, 370k over the
512 files of a 512-rank save. :func:`parse_header_bulk` applies every check of the strict
per-entry parser (``safetensors_io.parse_header``) as whole-header operations: the JSON is
parsed once without a per-object hook (duplicate keys are found by counting colons, as the
index parser does: ``_json.colon_budget``), the types of all entries are checked with
``map``/``set`` over the decoded values, and the offsets, byte counts and the tiling of the
data section with numpy over all entries at once. It answers None at the first thing it does
not accept, and the strict parser then runs and names the entry at fault: an error is always
the strict parser's, with its class and message.

:class:`HeaderEntries` is the result: a read-only mapping key -> ``HeaderEntry`` that builds an
entry only when one is asked for, and answers byte ranges of many keys at once (``spans``).
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from unickpt.format._json import SURROGATE_ESCAPE, colon_budget
from unickpt.format.dtypes import DTYPE_ITEMSIZE

__all__ = ["HeaderEntry", "HeaderEntries", "dtype_code", "parse_header_bulk"]

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

    :meth:`arrays` hands the arrays themselves to bulk readers (``format/slice_spans.py``), which
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


def _metadata_ok(meta: Any) -> bool:
    return isinstance(meta, dict) and all(type(k) is str and type(v) is str for k, v in meta.items())


def _meta_colons(meta: dict[str, str]) -> int:
    return sum(k.count(":") + v.count(":") for k, v in meta.items())


def parse_header_bulk(text: str, raw: bytes, data_len: int) -> tuple[HeaderEntries, dict[str, str]] | None:
    """Every check of the strict parser over all entries at once; None at the first doubt.

    ``text`` is ``raw`` decoded (valid UTF-8, starting with '{'). None means: let the strict
    parser decide (and word the error); a result means the strict parser would accept the header
    and return the same entries and metadata.
    """
    canonical = _parse_canonical(text, data_len)
    if canonical is not None:
        return canonical
    budget = colon_budget(raw)
    if budget is None or SURROGATE_ESCAPE.search(text):
        return None
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if type(obj) is not dict:
        return None
    had_meta = "__metadata__" in obj
    meta = obj.pop("__metadata__", {})
    if not _metadata_ok(meta):
        return None
    keys = list(obj)
    values = list(obj.values())
    n = len(keys)
    if n == 0:
        if data_len != 0 or budget != had_meta + len(meta) + _meta_colons(meta):
            return None
        z = np.zeros(0, dtype=np.int64)
        return HeaderEntries([], z, [], z, z, z, z), meta
    # Every entry a dict of exactly dtype, shape and data_offsets.
    if set(map(type, values)) != {dict} or set(map(len, values)) != {3}:
        return None
    try:
        fields = list(map(_FIELDS, values))
    except KeyError:
        return None
    dtypes, shapes, offsets = (list(x) for x in zip(*fields, strict=True))
    # Duplicate keys: with every entry well-formed, the colons of the text are exactly the members
    # of every object plus the colons inside strings (see _json.py); a repeated key drops a member.
    # Dtype names hold no colon (a name that does is no dtype: refused below either way).
    members = n + had_meta + 3 * n + len(meta)
    if budget != members + "\n".join(keys).count(":") + _meta_colons(meta):
        return None
    if data_len >= 1 << 58:  # byte counts below are int64 products: no real file comes near
        return None
    try:
        codes = np.fromiter(map(_DTYPE_CODE.__getitem__, dtypes), dtype=np.int64, count=n)
    except (KeyError, TypeError):
        return None
    # Shapes: lists of at most 64 non-negative ints (bool is not an int here); offsets: two ints.
    if set(map(type, shapes)) != {list} or set(map(type, offsets)) != {list}:
        return None
    ndims = np.fromiter(map(len, shapes), dtype=np.int64, count=n)
    if int(ndims.max()) > 64 or set(map(len, offsets)) != {2}:
        return None
    flat_dims = list(chain.from_iterable(shapes))
    flat_offs = list(chain.from_iterable(offsets))
    if not set(map(type, flat_dims)) <= {int} or set(map(type, flat_offs)) != {int}:
        return None
    try:
        dims = np.asarray(flat_dims, dtype=np.int64)
        offs = np.asarray(flat_offs, dtype=np.int64).reshape(n, 2)
    except OverflowError:
        return None
    numel = list(map(math.prod, shapes))  # Python ints: no overflow
    return _entries(keys, codes, shapes, ndims, dims, numel, offs, data_len, meta)


def _entries(
    keys: list[str],
    codes: np.ndarray,
    shapes: list[list[int]],
    ndims: np.ndarray,
    dims: np.ndarray,
    numel: list[int],
    offs: np.ndarray,
    data_len: int,
    meta: dict[str, str],
) -> tuple[HeaderEntries, dict[str, str]] | None:
    """The numeric checks of every entry at once (dims, byte counts, the tiling of the data section)."""
    if dims.size and (int(dims.min()) < 0 or int(dims.max()) >= 1 << 62):
        return None
    if max(numel) > data_len:  # (a byte count past the data section fails below anyway)
        return None
    begin, end = offs[:, 0], offs[:, 1]
    if int(begin.min()) < 0 or bool((end < begin).any()) or int(end.max()) > data_len:
        return None
    if not np.array_equal(end - begin, np.asarray(numel, dtype=np.int64) * _ITEMSIZE[codes]):
        return None
    # The entries tile the data section exactly: sorted by (begin, end), each starts where the
    # previous ended, the first at 0, the last ends at the data section's end.
    order = np.lexsort((end, begin))
    b, e = begin[order], end[order]
    if int(b[0]) != 0 or int(e[-1]) != data_len or not np.array_equal(b[1:], e[:-1]):
        return None
    return HeaderEntries(keys, codes, shapes, begin.copy(), end.copy(), ndims, dims), meta


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
        rf'"{g}{_CHARS})":\{{"dtype":"{g}{_CHARS})","shape":\[{g}(?:{_INT}(?:,{_INT})*)?)\],'
        rf'"data_offsets":\[{g}{_INT}),{g}{_INT})\]\}}'
    )


_ENTRY = _entry("(")
_META = rf"\{{(?:{_STR}:{_STR}(?:,{_STR}:{_STR})*)?\}}"
_HEAD = re.compile(rf'\{{(?:"__metadata__":({_META}),)?')
_ENTRIES = re.compile(_ENTRY)
_META_PAIR = re.compile(rf"({_STR}):({_STR})")


def _parse_canonical(text: str, data_len: int) -> tuple[HeaderEntries, dict[str, str]] | None:
    """The header in the writers' compact form, checked whole; None when it is in any other form."""
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
    if len(set(keys)) != n or "__metadata__" in keys or data_len >= 1 << 58:
        return None  # a repeated key (the strict parser names it) or a metadata entry out of place
    try:
        codes = np.fromiter(map(_DTYPE_CODE.__getitem__, dtypes), dtype=np.int64, count=n)
    except KeyError:
        return None
    distinct = dict.fromkeys(shape_texts)
    parsed = {t: [int(d) for d in t.split(",")] if t else [] for t in distinct}
    if max(map(len, parsed.values())) > 64 or max(max(d, default=0) for d in parsed.values()) >= 1 << 62:
        return None
    shapes = list(map(parsed.__getitem__, shape_texts))  # entries of one shape share its list
    ndims = np.fromiter(map(len, shapes), dtype=np.int64, count=n)
    dims = np.fromiter(chain.from_iterable(shapes), dtype=np.int64, count=int(ndims.sum()))
    sizes = {t: math.prod(d) for t, d in parsed.items()}
    numel = list(map(sizes.__getitem__, shape_texts))
    if max(map(len, begins)) > 18 or max(map(len, ends)) > 18:
        return None  # (past 2^58 bytes: no file holds that; the JSON path says what is wrong)
    offs = np.empty((n, 2), dtype=np.int64)  # digits only (the pattern), below 10^18: exact
    offs[:, 0] = np.fromstring(",".join(begins), dtype=np.int64, sep=",")
    offs[:, 1] = np.fromstring(",".join(ends), dtype=np.int64, sep=",")
    return _entries(keys, codes, shapes, ndims, dims, numel, offs, data_len, meta)
