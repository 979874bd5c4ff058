"""Reading and writing index files: Hugging Face's ``*.safetensors.index.json`` plus a ``unickpt`` block.

The index is input, not truth: every index is checked against the schema before anything it
names is opened. The schema is declared once, in :mod:`unickpt.spec.index_models` (the
pydantic models, their bounds and rules, every file name checked with
:func:`check_file_name`); :func:`parse_index` checks it with the one validator of
:mod:`unickpt.spec.index_fast`, which reads that declaration and calls the same rule functions
(no index is validated through the models). ``docs/format.md`` is the normative spec;
``docs/index.schema.json`` is exported from :class:`IndexFile` and a test keeps the two in step.
"""

from __future__ import annotations

import errno
import functools
import json
import os
from collections.abc import Callable

from unickpt.errors import IndexFileError
from unickpt.spec._json import check_unicode, colon_budget
from unickpt.spec.bounds import read_bounded
from unickpt.spec.index_bulk import gc_paused
from unickpt.spec.index_fast import IndexParser

# The schema (index_models) is re-exported: callers import the models from here.
from unickpt.spec.index_models import FORMAT_VERSION as FORMAT_VERSION
from unickpt.spec.index_models import KNOWN_FORMAT_VERSIONS as KNOWN_FORMAT_VERSIONS
from unickpt.spec.index_models import MAX_INDEX_BYTES as MAX_INDEX_BYTES
from unickpt.spec.index_models import IndexFile as IndexFile
from unickpt.spec.index_models import IndexMetadata as IndexMetadata
from unickpt.spec.index_models import LayoutInfo as LayoutInfo
from unickpt.spec.index_models import SliceEntry as SliceEntry
from unickpt.spec.index_models import TensorEntry as TensorEntry
from unickpt.spec.index_models import UnickptBlock as UnickptBlock
from unickpt.spec.index_models import check_file_name as check_file_name

__all__ = ["parse_index", "load_index", "index_to_json"]


def parse_index(raw: bytes, path: str) -> IndexFile:
    """Parse and validate index bytes; every failure is an ``IndexFileError`` (``UnsafePathError``
    for a data file name) naming ``path``, the field, what was expected and what was found."""
    return _parse_owned([raw], path, None)


def _parse_owned(box: list[bytes], path: str, reread: Callable[[], bytes] | None) -> IndexFile:
    """``parse_index`` of the bytes in ``box`` (taken out of it).

    With ``reread`` (``load_index``: the bytes can be read again), neither the bytes nor the
    decoded text are kept while the models are built, which lowers the peak memory of a parse by
    about twice the index's size; the rare refusal that needs the text again (naming a duplicate
    key) reads the file again. Without it, the bytes are kept for that.
    """
    raw = box.pop()
    text_box = [_decode(raw, path)]
    budget = colon_budget(raw)
    kept = raw if reread is None else None
    del raw

    def again() -> str:
        return _decode(kept if kept is not None else _again(reread), path)

    with gc_paused():
        return IndexParser(path, budget, again).parse(text_box)


def _decode(raw: bytes, path: str) -> str:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise IndexFileError(f"{path}: index is not valid UTF-8 ({e})") from None
    check_unicode(text, IndexFileError, f"{path}: index")
    return text


def _again(reread: Callable[[], bytes] | None) -> bytes:
    if reread is None:  # never: the bytes are kept whenever they cannot be read again
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
