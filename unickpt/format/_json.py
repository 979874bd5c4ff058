"""Strict JSON for untrusted files: duplicate keys and pathological nesting are errors."""

from __future__ import annotations

import json
from typing import Any

from unickpt.errors import CheckpointFormatError

__all__ = ["strict_loads"]


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
        return json.loads(text, object_pairs_hook=_no_duplicates)
    except _Duplicate as e:
        raise error(f"{what} has a duplicate key {e.args[0]!r}") from None
    except RecursionError:
        raise error(f"{what} is nested too deeply to be a checkpoint file") from None
    except ValueError as e:
        raise error(f"{what} is not valid JSON ({e})") from None
