"""Reading and writing index files: Hugging Face's ``*.safetensors.index.json`` plus a ``unickpt`` block.

The index is input, not truth: every index is checked against the schema before anything it
names is opened. The schema is defined once, in :mod:`unickpt.format.index_models` (the
pydantic models, their bounds and rules, every file name checked with
:func:`check_file_name`); :func:`parse_index` checks it with the fast path of
:mod:`unickpt.format.index_fast`, which reads the same definition, and falls back to the models
whenever that path does not vouch for the input. ``docs/format.md`` is the normative spec;
``docs/index.schema.json`` is exported from :class:`IndexFile` and a test keeps the two in step.
"""

from __future__ import annotations

import errno
import functools
import json
import logging
import os
from collections.abc import Callable

from pydantic import ValidationError

from unickpt.errors import IndexFileError, UnsafePathError
from unickpt.format._json import check_unicode, colon_budget, strict_loads
from unickpt.format.bounds import read_bounded
from unickpt.format.index_bulk import gc_paused
from unickpt.format.index_fast import FastIndex, NotFast

# The schema (index_models) is re-exported: callers import the models from here.
from unickpt.format.index_models import FORMAT_VERSION as FORMAT_VERSION
from unickpt.format.index_models import KNOWN_FORMAT_VERSIONS as KNOWN_FORMAT_VERSIONS
from unickpt.format.index_models import MAX_INDEX_BYTES as MAX_INDEX_BYTES
from unickpt.format.index_models import IndexFile as IndexFile
from unickpt.format.index_models import IndexMetadata as IndexMetadata
from unickpt.format.index_models import LayoutInfo as LayoutInfo
from unickpt.format.index_models import SliceEntry as SliceEntry
from unickpt.format.index_models import TensorEntry as TensorEntry
from unickpt.format.index_models import UnickptBlock as UnickptBlock
from unickpt.format.index_models import check_file_name as check_file_name
from unickpt.format.versioning import OtherFormatVersion, version_error

__all__ = ["parse_index", "parse_index_validated", "load_index", "index_to_json"]

logger = logging.getLogger(__name__)


def parse_index(raw: bytes, path: str) -> IndexFile:
    """Parse and validate index bytes; every failure is an ``IndexFileError`` naming ``path``.

    Checks exactly what :func:`parse_index_validated` (the pydantic models) checks, and returns
    an equal index, about 4x faster on large sliced indexes (see ``FastIndex``). Whenever the
    fast checks do not vouch for the input (an error, a value pydantic would coerce, an unusual
    layout), the full validation runs and its answer and messages are the ones reported.
    """
    return _parse_owned([raw], path, None)


def _parse_owned(box: list[bytes], path: str, reread: Callable[[], bytes] | None) -> IndexFile:
    """``parse_index`` of the bytes in ``box`` (taken out of it).

    With ``reread`` (``load_index``: the bytes can be read again), neither the bytes nor the
    decoded text are kept while the models are built, which lowers the peak memory of a parse by
    about twice the index's size; the rare fallback to the reference validation reads the file
    again. Without it, the text is kept for the fallback.
    """
    raw = box.pop()
    text_box = [_decode(raw, path)]
    budget = colon_budget(raw)
    del raw
    kept = text_box[0] if reread is None else None
    try:
        with gc_paused():
            return FastIndex(None, budget).parse(text_box)
    except NotFast as nf:
        text = kept if kept is not None else _decode(_again(reread), path)
        index = _validate(text, path)
        if nf.problem is not None:
            # The fast checks found a definite violation that the models let through: never
            # weaken a check, refuse anyway (a bug in one of the two; tests keep them in step).
            raise nf.error(f"{path}: {nf.problem}") from None
        return index
    except Exception as e:  # a bug in the fast path must cost time, never correctness
        logger.warning(
            "%s: fast index parse failed (%s: %s); validating with the models", path, type(e).__name__, e
        )
        text = kept if kept is not None else _decode(_again(reread), path)
        return _validate(text, path)


def parse_index_validated(raw: bytes, path: str) -> IndexFile:
    """Parse with ``strict_loads`` and validate with the pydantic models (the reference path)."""
    return _validate(_decode(raw, path), path)


def _decode(raw: bytes, path: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IndexFileError(f"{path}: index is not valid UTF-8 ({e})") from None
    check_unicode(text, IndexFileError, f"{path}: index")
    return text


def _validate(text: str, path: str) -> IndexFile:
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
            if isinstance(cause, OtherFormatVersion):
                raise version_error(path, cause.version) from None
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()[:10]
        )
        raise IndexFileError(f"{path}: index does not match the unickpt index schema: {problems}") from None


def _again(reread: Callable[[], bytes] | None) -> bytes:
    if reread is None:  # never: the text is kept whenever the bytes cannot be read again
        raise RuntimeError("index bytes were dropped but cannot be read again")
    return reread()


def load_index(path: str | os.PathLike[str]) -> IndexFile:
    p = os.fspath(path)
    size = os.path.getsize(p)
    if size > MAX_INDEX_BYTES:
        raise IndexFileError(f"{p}: {size} bytes exceeds the {MAX_INDEX_BYTES}-byte limit for an index")
    box = [_read_index_bytes(p)]
    return _parse_owned(box, p, lambda: _read_index_bytes(p))


def _read_index_bytes(p: str) -> bytes:
    """The index file whole, refused past ``MAX_INDEX_BYTES`` whatever size it reports."""
    try:
        return read_bounded(p, MAX_INDEX_BYTES)
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise
        raise IndexFileError(f"{p}: more than the {MAX_INDEX_BYTES}-byte limit for an index") from None


def index_to_json(index: IndexFile) -> bytes:
    """The index as UTF-8 JSON: a plain Hugging Face index indented; a unickpt index without
    whitespace (an index of 10^6 slices spends more on indentation than on the slices), one line
    per tensor."""
    obj = index.model_dump(mode="json", exclude_none=True)
    block = obj.get("unickpt")
    if block is None:
        return (json.dumps(obj, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    tensors = block.pop("tensors")
    dump = functools.partial(json.dumps, ensure_ascii=False, separators=(",", ":"))
    lines = ",\n".join(f"{dump(name)}:{dump(t)}" for name, t in tensors.items())
    head = dump({**obj, "unickpt": {**block, "tensors": None}})
    cut = head.rindex('"tensors":null')
    text = head[:cut] + '"tensors":{\n' + lines + "\n}" + head[cut + len('"tensors":null') :]
    return (text + "\n").encode("utf-8")
