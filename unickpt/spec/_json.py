"""Strict JSON for untrusted files: duplicate keys and pathological nesting are errors."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np

from unickpt.errors import CheckpointFormatError

__all__ = [
    "strict_loads",
    "colon_budget",
    "count_pairs_and_colons",
    "check_unicode",
    "lone_surrogate",
    "SURROGATE_ESCAPE",
]


class _Duplicate(Exception):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise _Duplicate(k)
        out[k] = v
    return out


def strict_loads(text: str, error: type[CheckpointFormatError], what: str) -> Any:
    """``json.loads`` that raises ``error`` naming ``what`` for invalid JSON, duplicate keys, deep nesting.

    Nesting is bounded by the parser itself: past Python's recursion limit it raises
    RecursionError, reported like any other malformed input, before anything is allocated
    for the document's contents.
    """
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise error(f"{what} has a duplicate key {_show(e.args[0])}") from None
    except RecursionError:
        raise error(f"{what} is nested too deeply to be a checkpoint file") from None
    except ValueError as e:
        raise error(f"{what} is not valid JSON ({e})") from None
    if SURROGATE_ESCAPE.search(text):
        bad = lone_surrogate(obj)
        if bad is not None:
            raise error(_surrogate_message(what, bad))
    return obj


# A JSON text can hold a UTF-16 surrogate only as a \uD800-\uDFFF escape (UTF-8 cannot encode one).
# A pair of them decodes to one character; a lone one decodes to a str that cannot be encoded as
# UTF-8 again, so printing it, writing it into a header or an index, or comparing it with a name
# from a safetensors file (whose Rust reader refuses lone surrogates) would fail later, far from
# the file. Such text is refused where it is parsed.
SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _show(s: str) -> str:
    """``repr`` of an untrusted name, printable whatever it holds (lone surrogates escaped)."""
    return repr(s) if s.isprintable() else ascii(s)


def _surrogate_message(what: str, bad: str) -> str:
    return (
        f"{what} holds a lone UTF-16 surrogate escape in the string {ascii(bad)[:200]} "
        "(not valid Unicode: such a name cannot be written as UTF-8)"
    )


def json_depth(value: Any, limit: int) -> int:
    """Nesting depth of a decoded JSON value (a scalar is 0, ``[]`` is 1), counted up to ``limit``.

    Iterative, and stops at ``limit``: cheap on hostile input nested thousands deep.
    """
    deepest = 0
    stack = [(value, 0)]
    while stack:
        v, d = stack.pop()
        t = type(v)
        if t is dict or t is list:
            d += 1
            if d >= limit:
                return limit
            deepest = max(deepest, d)
            stack.extend((x, d) for x in (v.values() if t is dict else v))
    return deepest


def lone_surrogate(value: Any) -> str | None:
    """The first string (key or value) of a decoded JSON value that holds a lone surrogate, or None.

    Iterative: depth is bounded by the parser, not by this walk.
    """
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is str:
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return str(v)
        elif t is dict:
            stack.extend(v.keys())
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
    return None


def check_unicode(text: str, error: type[CheckpointFormatError], what: str) -> None:
    """Refuse a JSON ``text`` whose strings hold a lone surrogate escape (see ``SURROGATE_ESCAPE``).

    Free unless the text holds a surrogate escape at all; then the text is parsed once more.
    """
    if not SURROGATE_ESCAPE.search(text):
        return
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):
        return  # not JSON: the parser that follows says so
    bad = lone_surrogate(obj)
    if bad is not None:
        raise error(_surrogate_message(what, bad))


# ---------------------------------------------------------------------------------------------
# Duplicate keys without a per-object hook.
#
# ``strict_loads`` calls a Python function for every JSON object, which costs about as much as
# the C parser itself on a large index. The same question can be answered exactly by counting:
# in a document that ``json.loads`` accepts, a ':' is either a name separator (one per member of
# an object, duplicates included) or a character inside a string literal. JSON numbers, literals
# and whitespace hold none, and inside a string a ':' is written either as itself or as the
# escape \u003a / \u003A. So when the text holds no such escape,
#
#     text.count(":") == members of all objects as written + ':' in all decoded strings,
#
# while the decoded value (``json.loads`` keeps one entry per distinct key) has
#
#     sum(len(d) for every dict d) + ':' in all decoded strings (keys and values, every occurrence)
#
# which is smaller exactly when some object repeats a key (the dropped member takes at least
# its own separator with it). The two are equal if and only if no object has a duplicate key.
# ---------------------------------------------------------------------------------------------


def colon_budget(raw: bytes) -> int | None:
    """The ':' count of a UTF-8 JSON text, or None when it escapes a colon (``\\u003a``).

    ``raw`` must be valid UTF-8 (the byte 0x3A then only ever encodes ':'). A None answer is
    conservative: ``"\\\\u003a"`` (an escaped backslash then ``u003a``) also gives None.
    """
    if b"\\" in raw and (b"\\u003a" in raw or b"\\u003A" in raw):
        return None
    # numpy counts about 3x faster than bytes.count; chunks bound the temporary to 16 MiB.
    data = np.frombuffer(raw, dtype=np.uint8)
    step = 16 << 20
    return sum(int(np.count_nonzero(data[i : i + step] == 0x3A)) for i in range(0, len(data), step))


def count_pairs_and_colons(value: Any) -> tuple[int, int]:
    """(members of every dict, ':' in every string key and value) of a decoded JSON value.

    Iterative: depth is bounded by the parser, not by this walk.
    """
    pairs = colons = 0
    stack = [value]
    while stack:
        v = stack.pop()
        t = type(v)
        if t is str:
            colons += v.count(":")
        elif t is dict:
            pairs += len(v)
            colons += "".join(v).count(":")
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
    return pairs, colons
