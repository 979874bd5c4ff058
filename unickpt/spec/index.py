"""The index: Hugging Face's ``*.safetensors.index.json`` plus a ``unickpt`` block, its schema
declared once and its one validator beside it, and reading and writing index files.

The index is input, not truth: every index is checked against the schema before anything it
names is opened. ``docs/format.md`` is the normative spec; ``docs/index.schema.json`` is
exported from :class:`IndexFile` (``unickpt.spec.schema``) and a test keeps the two in step.

The schema, declared once: the pydantic models (``IndexFile``, ``UnickptBlock``, ``TensorEntry``,
``LayoutInfo``, ``IndexMetadata``; one slice's models, ``SliceEntry`` and ``ByteRange``, and the
field types they declare are defined in ``slice_table``, with the table that holds them, and
re-exported here), the field types and bounds (the ``Annotated`` aliases and ``Literal`` choices),
and the rules that span fields (``shape_problem``, ``alias_problem``, ``files_problem``,
:func:`check_file_name`; a slice's own, ``slice_problem`` and ``ranges_problem``, are
``slice_table``'s). The models are the in-memory form of an index, too. Their validators check
what code builds (a writer's ``TensorEntry.of_table``, a tool's edit); no index read from a file
is validated through them.

The one validator, :class:`IndexParser`: ``parse_index`` goes through it and nowhere else. It
parses with plain ``json.loads`` and checks duplicate keys by counting colons
(``untrusted.colon_budget``); pauses the garbage collector while it builds the tree (``gc_paused``);
checks a tensor's listed slices in one vectorised pass over their columns (``IndexParser.slices``:
C-level passes and numpy, any key order, optional fields left out kept as a null mask, byte ranges
checked at once), where a failed check gives its first offending slice from its mask and that
slice's own fields word the refusal; and everything else with plain code driven by the models'
declaration (field lists, bounds and choices read from the models, and the same rule functions).
It builds the objects the models describe (``model_construct``, or the attributes it sets; listed
slices become their ``SliceTable``, no ``SliceEntry`` until read), and refuses with an
``IndexFileError`` (``UnsafePathError`` for a data file name) whose message names the file, the
field (``unickpt.tensors.NAME.slices.K.offsets.0``), what was expected and what was found.

Writing the compact encoding: every tensor's slices turned into the compact fields of
docs/format.md 3.1. Writers hand over tensors whose slices are a ``SliceTable``
(``slice_table.SliceColumns`` builds one, ``TensorEntry.of_table`` holds it);
:func:`compact_tensors` builds the block's file table and each tensor's ``grid`` (or ``boxes``),
``file``, ``keys`` and ``xxh3`` from the tables, in bulk: O(S) numpy work plus O(S log S) for the
grid detection, no per-slice model.

The block's text form (docs/format.md 3.2): base64url digests and a default dtype.
In memory a digest is 16 lower-case hex digits (a tensor's ``fingerprint``, the concatenated
hashes a ``SliceTable`` holds, 16 ``-`` for a slice without one) and every tensor has its
``dtype``. The JSON of a block differs, and it is converted at the two edges:

- :func:`block_from_json` (readers, before any other check): a block of another format version
  is refused (``check_version``, first); the block's ``dtype`` (the default) is given to
  every tensor that has none, and the tensors' ``fingerprint`` and compact ``xxh3`` go from 11
  base64url characters per digest (11 ``~`` for a slice without a hash) to 16 hex digits: all
  fingerprints of the block in one numpy pass, all ``xxh3`` in another, no object per slice.
- :func:`block_to_json` (the models' JSON serializer): the reverse.

Listed ``slices`` and their ``ranges`` keep 16 hex digits in JSON too.

The format's one version, checked first, and how a reader refuses any other (docs/format.md
section 7): unickpt reads and writes ``format_version`` 5 only. The drafts 1 to 4 that came before it are
converted by ``unickpt upgrade`` (``unickpt/tools/upgrade.py``, the only code that knows them);
every reader refuses them, and any version it does not know, with an ``IndexFileError`` that
names the file, the version found and what to do.
"""

from __future__ import annotations

import binascii
import collections
import contextlib
import errno
import functools
import gc
import itertools
import json
import math
import operator
import os
import posixpath
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Annotated, Any, Literal, NoReturn, TypeVar, cast, get_args

import numpy as np
from annotated_types import Ge, Lt
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    FieldSerializationInfo,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    Strict,
    field_serializer,
    field_validator,
    model_serializer,
    model_validator,
)

from unickpt.errors import CheckpointFormatError, IndexFileError, UnsafePathError
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.naming import shown
from unickpt.spec.slice_table import (
    GIVEN_RANGES,
    GIVEN_XXH3,
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
    compact_fields,
    compact_problem,
    ranges_problem,
    slice_problem,
)
from unickpt.spec.untrusted import (
    check_unicode,
    colon_budget,
    count_pairs_and_colons,
    count_problem,
    is_plain_name,
    json_depth,
    read_bounded,
    strict_loads,
)

__all__ = [
    "B64_DIGEST_LEN",
    "NO_DIGEST",
    "DigestTextError",
    "block_from_json",
    "block_to_json",
    "hex_to_b64",
    "b64_to_hex",
    "FORMAT_VERSION",
    "OtherFormatVersion",
    "check_version",
    "version_error",
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
    "parse_index",
    "load_index",
    "read_index",
    "index_to_json",
    "IndexParser",
    "SCHEMA_MISMATCH",
    "validate_block",
    "construct",
    "compact_field_colons",
    "compact_field_problem",
    "found_text",
    "gc_paused",
    "SLICE_FIELDS",
    "SLICE_REQUIRED",
    "compact_tensors",
    "named_table",
    "as_listed",
]


# ---------------------------------------------------------------- the format version, checked first
#: The version every writer stamps and the only one readers accept.
FORMAT_VERSION: Literal[5] = 5
#: The drafts before version 5, which ``unickpt upgrade`` converts.
_DRAFTS = range(1, FORMAT_VERSION)


class OtherFormatVersion(ValueError):
    """A block stamped with an integer ``format_version`` other than :data:`FORMAT_VERSION`
    (raised inside the models' validation; readers turn it into :func:`version_error`)."""

    def __init__(self, version: int) -> None:
        super().__init__(
            f"format_version {shown(version)} is not the version {FORMAT_VERSION} this unickpt reads"
        )
        self.version = version


def check_version(block: Any) -> None:
    """Raise :class:`OtherFormatVersion` for a block (a JSON object) of another integer version.

    A block without ``format_version`` is version 5 (every writer writes it); a value that is no
    integer is left to the schema, which refuses it."""
    if type(block) is dict:
        v = block.get("format_version", FORMAT_VERSION)
        if type(v) is int and v != FORMAT_VERSION:
            raise OtherFormatVersion(v)


def version_error(path: str, version: int) -> IndexFileError:
    """The error for a checkpoint at ``path`` (its index, or a single file) of ``version``."""
    index = path.endswith(".index.json")
    target = (posixpath.dirname(path) or ".") if index else path
    if version in _DRAFTS:
        return IndexFileError(
            f"{path}: format_version {version}, a draft this unickpt no longer reads (it reads "
            f"version {FORMAT_VERSION} only); convert the checkpoint once with "
            f"`unickpt upgrade {target}` (in place; `unickpt upgrade {target} "
            f"{'NEW_DIR' if index else 'NEW_FILE'}` writes a copy)"
        )
    if version > FORMAT_VERSION:
        return IndexFileError(
            f"{path}: format_version {shown(version)} is not a version this unickpt reads (it reads "
            f"version {FORMAT_VERSION} only): a newer unickpt wrote it; read it with that one"
        )
    return IndexFileError(
        f"{path}: format_version {shown(version)} is no format version (unickpt reads version {FORMAT_VERSION})"
    )


# ---------------------------------------------------------------- digests in base64url
#: Characters of one digest in base64url: 64 bits in 11 characters of 6 bits, the last 2 bits 0.
B64_DIGEST_LEN = 11
#: Stands for a slice without a hash in a compact ``xxh3`` string: ``~`` is outside base64url.
NO_DIGEST = "~" * B64_DIGEST_LEN
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
_CHARS = np.frombuffer(_ALPHABET, dtype=np.uint8)
_BAD = 255
_VALUE = np.full(256, _BAD, dtype=np.uint8)
_VALUE[_CHARS] = np.arange(64, dtype=np.uint8)
_LAST_CHARS = _ALPHABET[::4].decode()  # the characters whose 2 low bits are 0
# base64url <-> standard base64 for binascii; '+' and '/' (not base64url) become '!', which
# binascii's strict mode refuses.
_TO_STANDARD = bytes.maketrans(b"-_+/", b"+/!!")
_TO_URLSAFE = bytes.maketrans(b"+/", b"-_")


class DigestTextError(ValueError):
    """A digest string that is not one (``parse_index`` reports it as a schema error)."""


class _Bad(Exception):
    """Digest ``group`` (0-based, of the string decoded) is not one: ``detail`` says why."""

    def __init__(self, group: int, detail: str) -> None:
        super().__init__(detail)
        self.group = group
        self.detail = detail


def b64_to_hex(text: str) -> str:
    """Concatenated base64url digests (11 characters each, ``~`` x 11: none) as 16 hex digits each
    (``-`` x 16: none). Raises ``_Bad`` naming the first bad digest.

    Each group of 11 gets a 12th character ``A`` (6 zero bits): 12 characters are 9 whole bytes,
    the digest's 8 and a ninth holding the 2 padding bits, so the whole text decodes in one
    ``binascii`` call (strict: any character outside the alphabet fails it)."""
    n, rem = divmod(len(text), B64_DIGEST_LEN)
    if rem or not text.isascii():
        raise _first_bad(text)
    if not n:
        return ""
    raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8).reshape(n, B64_DIGEST_LEN)
    groups = np.full((n, B64_DIGEST_LEN + 1), ord("A"), dtype=np.uint8)
    groups[:, :B64_DIGEST_LEN] = raw
    none = None
    if NO_DIGEST[0] in text:
        none = (raw == ord("~")).all(axis=1)
        groups[none] = ord("A")
    try:
        data = binascii.a2b_base64(groups.tobytes().translate(_TO_STANDARD), strict_mode=True)
    except binascii.Error:
        raise _first_bad(text) from None
    decoded = np.frombuffer(data, dtype=np.uint8).reshape(n, 9)
    if decoded[:, 8].any():
        raise _first_bad(text)
    hexs: str = np.ascontiguousarray(decoded[:, :8]).tobytes().hex()
    if none is not None and none.any():
        out = np.frombuffer(hexs.encode("ascii"), dtype=np.uint8).reshape(n, 16).copy()
        out[none] = ord("-")
        hexs = out.tobytes().decode("ascii")
    return hexs


def _first_bad(text: str) -> _Bad:
    """What is wrong with the first digest of ``text`` that is not one (the slow, precise path,
    taken once the fast one refused ``text``)."""
    n, rem = divmod(len(text), B64_DIGEST_LEN)
    if rem:
        return _Bad(n, f"is cut short: {rem} character(s), not the {B64_DIGEST_LEN} of a digest")
    if not text.isascii():
        i = next(i for i, c in enumerate(text) if not c.isascii())
        return _Bad(i // B64_DIGEST_LEN, _outside(text[i]))
    raw = np.frombuffer(text.encode("ascii"), dtype=np.uint8).reshape(n, B64_DIGEST_LEN)
    codes = _VALUE[raw]
    bad = codes == _BAD
    bad[(raw == ord("~")).all(axis=1)] = False
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        return _Bad(i // B64_DIGEST_LEN, _outside(text[i]))
    odd = np.flatnonzero((codes[:, -1] & 3) * (codes[:, -1] != _BAD))
    if odd.size:
        return _Bad(
            int(odd[0]),
            f"ends in nonzero padding bits (11 characters carry 66 bits, the last 2 are 0: the last "
            f"character is one of {_LAST_CHARS})",
        )
    return _Bad(0, "is not base64url")  # never: binascii refuses only what the checks above name


def _outside(c: str) -> str:
    return f"holds {shown(c)}, outside the base64url alphabet (A-Z a-z 0-9 - _; {shown(NO_DIGEST)}: no hash)"


def hex_to_b64(hexs: str) -> str:
    """Concatenated 16-hex-digit digests (``-`` x 16: none) as base64url, 11 characters each: the
    8 bytes of each digest and a zero byte are 12 characters, the last of them dropped."""
    n = len(hexs) // 16
    if not n:
        return ""
    none = None
    if "-" in hexs:
        digits = np.frombuffer(hexs.encode("ascii"), dtype=np.uint8).reshape(n, 16).copy()
        none = digits[:, 0] == ord("-")
        digits[none] = ord("0")
        hexs = digits.tobytes().decode("ascii")
    data = np.zeros((n, 9), dtype=np.uint8)
    data[:, :8] = np.frombuffer(bytes.fromhex(hexs), dtype=np.uint8).reshape(n, 8)
    text = binascii.b2a_base64(data.tobytes(), newline=False).translate(_TO_URLSAFE)
    out = np.frombuffer(text, dtype=np.uint8).reshape(n, B64_DIGEST_LEN + 1)[:, :B64_DIGEST_LEN].copy()
    if none is not None:
        out[none] = ord("~")
    return out.tobytes().decode("ascii")


def block_from_json(block: Any) -> tuple[Any, int]:
    """A block's JSON object in the in-memory form (a new dict; the argument is not changed) and
    how many more object members the argument has than the result (the fast parser counts them).
    Anything it cannot make sense of is left for the schema checks that follow."""
    if type(block) is not dict:
        return block, 0
    check_version(block)
    out = {k: v for k, v in block.items() if k != "dtype"}
    default = block.get("dtype")
    if "dtype" in block and (type(default) is not str or default not in DTYPE_ITEMSIZE):
        raise DigestTextError(
            f"'dtype' (the tensors' default dtype) must be a dtype in {sorted(DTYPE_ITEMSIZE)}, "
            f"found {shown(default)}"
        )
    tensors = block.get("tensors")
    if type(tensors) is not dict:
        return out, len(block) - len(out)
    new = {name: dict(t) if type(t) is dict else t for name, t in tensors.items()}
    filled = 0
    fps: list[tuple[str, str]] = []
    hashes: list[tuple[str, str]] = []
    for name, t in new.items():
        if type(t) is not dict:
            continue
        if "dtype" not in t and default is not None:
            t["dtype"] = default
            filled += 1
        fp = t.get("fingerprint")
        if type(fp) is str:
            if len(fp) != B64_DIGEST_LEN:
                raise DigestTextError(
                    f"tensor {shown(name)}: 'fingerprint' holds {len(fp)} characters, not the "
                    f"{B64_DIGEST_LEN} base64url characters of a digest"
                )
            fps.append((name, fp))
        xxh = t.get("xxh3")
        if type(xxh) is str:
            count = None if "slices" in t else _slice_count(t)
            if count is not None and len(xxh) != B64_DIGEST_LEN * count:
                raise DigestTextError(
                    f"tensor {shown(name)}: 'xxh3' holds {len(xxh)} characters for {count} slice(s) "
                    f"({B64_DIGEST_LEN} base64url characters per slice)"
                )
            hashes.append((name, xxh))
    for field, items in (("fingerprint", fps), ("xxh3", hashes)):
        for name, hexs in zip((n for n, _ in items), _decode_all(field, items), strict=True):
            new[name][field] = hexs
    out["tensors"] = new
    return out, len(block) - len(out) - filled


def _decode_all(field: str, items: list[tuple[str, str]]) -> list[str]:
    """Every tensor's digest string of ``field`` decoded in one pass, in order."""
    if not items:
        return []
    lengths = [len(s) // B64_DIGEST_LEN for _, s in items]
    for (name, s), k in zip(items, lengths, strict=True):
        if len(s) != k * B64_DIGEST_LEN:
            raise DigestTextError(
                f"tensor {shown(name)}: {shown(field)} holds {len(s)} characters, not a multiple of {B64_DIGEST_LEN}"
            )
    try:
        hexs = b64_to_hex("".join(s for _, s in items))
    except _Bad as e:
        ends = np.cumsum(lengths)
        i = int(np.searchsorted(ends, e.group, side="right"))
        name, text = items[i]
        k = e.group - int(ends[i] - lengths[i])
        group = text[k * B64_DIGEST_LEN : (k + 1) * B64_DIGEST_LEN]
        raise DigestTextError(
            f"tensor {shown(name)}: {shown(field)}: digest {k} ({shown(group)}) {e.detail}"
        ) from None
    out = []
    pos = 0
    for k in lengths:
        out.append(hexs[pos : pos + 16 * k])
        pos += 16 * k
    return out


def _slice_count(t: dict[str, Any]) -> int | None:
    """How many slices a compact tensor entry describes, when its other fields are sound (else
    None: the schema checks that follow name the problem)."""
    count = _count(t)
    try:
        args = (t.get("grid"), t.get("boxes"), t.get("file"), t.get("keys"), None)
        return count if count is not None and compact_problem(t["shape"], *args) is None else None
    except (TypeError, ValueError, IndexError, OverflowError):
        return None


def _count(t: dict[str, Any]) -> int | None:
    boxes, grid, shape = t.get("boxes"), t.get("grid"), t.get("shape")
    if type(shape) is not list or set(map(type, shape)) - {int}:
        return None
    if type(boxes) is list:
        return len(boxes)
    if boxes is not None:
        return None
    if grid is None:
        return 1
    if type(grid) is not list or len(grid) != len(shape):
        return None
    count = 1
    for p, g in zip(grid, shape, strict=True):
        if type(p) is int and p >= 1:
            count *= p
        elif type(p) is list and p and all(type(x) is int for x in p) and sum(p) == g:
            count *= len(p)
        else:
            return None
    return count


def block_to_json(block: dict[str, Any]) -> dict[str, Any]:
    """A dumped block (``model_dump(mode="json")``) in its text form: the tensors' most frequent
    dtype becomes the block's ``dtype`` (placed after ``kind``) and the tensors that have it drop
    theirs, digests become base64url. Changed in place."""
    tensors = block.get("tensors")
    if type(tensors) is not dict or not tensors:
        return block
    counts = collections.Counter(t["dtype"] for t in tensors.values() if "dtype" in t)
    if counts:
        default = counts.most_common(1)[0][0]
        for t in tensors.values():
            if t.get("dtype") == default:
                del t["dtype"]
        members = list(block.items())
        block.clear()
        for key, value in members:
            block[key] = value
            if key == "kind":
                block["dtype"] = default
        block.setdefault("dtype", default)
    for field in ("fingerprint", "xxh3"):
        named = [t for t in tensors.values() if type(t.get(field)) is str]
        if not named:
            continue
        text = hex_to_b64("".join(t[field] for t in named))
        at = 0
        for t in named:
            width = len(t[field]) // 16 * B64_DIGEST_LEN
            t[field] = text[at : at + width]
            at += width
    return block


# ---------------------------------------------------------------- the schema: the models and their rules
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
# Free-form values (param_groups, param_state, metadata) keep every float when dumped as JSON:
# inf, -inf and nan as Python's json writes them (Infinity, -Infinity, NaN, as Hugging Face's
# trainer_state.json; json.load reads them back), never pydantic's default null. The setting of
# the model dumped is the one that counts, so each model dumped on its own carries it.
_KEEP_FLOATS = ConfigDict(ser_json_inf_nan="constants")


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
            return f"alias {shown(alias)} points at {shown(target)}, which is not a stored tensor"
        if alias in tensors:
            return f"alias {shown(alias)} is also a stored tensor"
    return None


def check_file_name(name: str, where: str = "") -> str:
    """Refuse any data-file name that could leave the checkpoint directory.

    Only plain file names are allowed (``spec.untrusted.is_plain_name``, the rule for every
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
            f"refusing data file name {shown(name)}{at}: names must be plain file names inside the checkpoint "
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
            out: dict[str, Any] = handler(self)  # its slices by _listed_slices
            return out
        # A compact entry writes its compact fields, never its slices (no per-slice objects).
        d = self.__dict__
        return {k: d[k] for k in _COMPACT_DUMP if d[k] is not None}

    @field_serializer("slices")
    def _listed_slices(self, _slices: Any, info: FieldSerializationInfo) -> list[dict[str, Any]]:
        # Written from the columns of its table: no SliceEntry built. A slice's default fields
        # (xxh3, ranges) are None, so exclude_defaults leaves out what exclude_none does.
        return self.table.listed(exclude_none=info.exclude_none or info.exclude_defaults)

    @field_validator("dtype")
    @classmethod
    def _dtype(cls, v: str) -> str:
        if v not in DTYPE_ITEMSIZE:
            raise ValueError(f"unknown dtype {shown(v)}")
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
    model_config = _KEEP_FLOATS
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
            raise ValueError(f"format_version must be an integer, found {shown(v)}")
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
    model_config = ConfigDict(extra="allow", frozen=True, **_KEEP_FLOATS)
    total_size: NonNeg = 0


def strict_metadata_ok(md: Any) -> bool:
    """``metadata`` as a unickpt index must have it: an object whose total_size, if any, is an int."""
    if type(md) is not dict:
        return False
    size = md.get("total_size", 0)
    return type(size) is int and 0 <= size < MAX_DIM


class IndexFile(BaseModel):
    """A ``*.safetensors.index.json`` file (Hugging Face keys plus the optional unickpt block)."""

    model_config = ConfigDict(extra="allow", frozen=True, **_KEEP_FLOATS)
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
            check_file_name(f, f"weight_map[{shown(k)}]")
        return v


_COMPACT_DUMP = ("dtype", "shape", "fingerprint", "param", "state", "grid", "boxes", "file", "keys", "xxh3")
_COMPACT_FIELDS = ("grid", "boxes", "file", "keys", "xxh3")


def files_problem(files: Sequence[str] | None, tensors: Mapping[str, TensorEntry]) -> str | None:
    """Tensors list their slices (``slices``) or describe them compactly (then the block has
    ``files``), never both; compact ``file`` indexes stay within ``files``."""
    for name, t in tensors.items():
        given = [f for f in _COMPACT_FIELDS if getattr(t, f) is not None]
        if not t.compact and given:
            return f"tensor {shown(name)} has both 'slices' and the compact field(s) {given}: one describes its slices"
        if t.compact:
            if files is None:
                return f"tensor {shown(name)} names its files by index, but the block has no 'files' table"
            if t.file is None:
                n = compact_count(t.shape, t.grid, t.boxes)
                if n != len(files):
                    return (
                        f"tensor {shown(name)} has no 'file' (slice K in files[K]) but {n} slice(s) for "
                        f"{len(files)} file(s)"
                    )
                continue
            ids = [t.file] if isinstance(t.file, int) else t.file
            if ids and max(ids) >= len(files):
                return (
                    f"tensor {shown(name)}: file index {max(ids)} is past the {len(files)} files of the block"
                )
    # What the data files can hold bounds what the compact fields declare (spec/untrusted.py).
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


# ---------------------------------------------------------------- a listed index's slices checked and built in bulk
_M = TypeVar("_M", bound=BaseModel)

SLICE_FIELDS, SLICE_REQUIRED = fields_of(SliceEntry)
_SLICE_FIELD_SET = frozenset(SLICE_FIELDS)
#: The key order of a slice as unickpt writes one: every field but ``ranges``, in model order.
_FULL_LAYOUT = tuple(f for f in SLICE_FIELDS if f != "ranges")
#: The key orders of slice objects met so far that hold every required field and no other
#: (a bounded set: the orders of at most six names).
_GOOD_LAYOUTS: set[tuple[str, ...]] = set()
_HEX_DIGITS_COMMA = b"0123456789abcdef,"
_hashes = re.compile(HASHES).fullmatch
_get_file = operator.itemgetter("file")
_get_key = operator.itemgetter("key")
_get_offsets = operator.itemgetter("offsets")
_get_shape = operator.itemgetter("shape")
_get_xxh3 = operator.itemgetter("xxh3")
_get_start = operator.itemgetter("start")
_get_end = operator.itemgetter("end")
_setattr = object.__setattr__


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
    raise AssertionError(f"compact field {shown(k)} has no problem")  # pragma: no cover - never


def _column(
    rows: list[dict[str, Any]], layouts: set[tuple[str, ...]], present: set[str], field: str
) -> list[Any] | None:
    """An optional field's column (None where a slice leaves it out), None when no slice gives it."""
    if field not in present:
        return None
    if all(field in lay for lay in layouts):
        return list(map(operator.itemgetter(field), rows))
    return list(map(dict.get, rows, itertools.repeat(field)))


def _first(flags: Iterable[Any], default: int) -> int:
    """The position of the first true flag (the first slice of a mask), or ``default``."""
    return next(itertools.compress(itertools.count(), flags), default)


def _good_layout(layout: tuple[str, ...]) -> bool:
    """A slice object's keys are ``SliceEntry``'s fields, every required one among them."""
    if layout in _GOOD_LAYOUTS:
        return True
    keys = set(layout)
    if keys <= _SLICE_FIELD_SET and keys >= SLICE_REQUIRED:
        _GOOD_LAYOUTS.add(layout)
        return True
    return False


def _not_dim(v: Any) -> bool:
    return type(v) is not int or not 0 <= v < MAX_DIM


def _not_hash(v: Any) -> bool:
    return v is not None and (type(v) is not str or _hex16(v) is None)


def _not_range_digest(v: Any) -> bool:
    return type(v) is not str or _hex16(v) is None


def _not_range_object(v: dict[str, Any]) -> bool:
    return tuple(sorted(v)) != _RANGE_SORTED


def _hex16_list(hashes: list[Any]) -> bool:
    """Every item a string of 16 lower-case hex digits, checked at once: joined by ',', they make
    17 x count - 1 ASCII characters, a ',' at every 17th place and nowhere else, hex digits around."""
    try:
        joined = ",".join(hashes)
    except TypeError:  # not a string
        return False
    return (
        len(joined) == 17 * len(hashes) - 1
        and joined.isascii()
        and joined.count(",") == len(hashes) - 1
        and joined[16::17] == "," * (len(hashes) - 1)
        and not joined.encode().translate(None, _HEX_DIGITS_COMMA)
    )


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
        return shown(v)  # a number in a file can be thousands of digits long
    if isinstance(v, str):
        return shown(v, 80)
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


# ---------------------------------------------------------------- the compact encoding written
def named_table(name: str, t: TensorEntry) -> SliceTable:
    """``t``'s slice table, with the tensor's name (the ``NAME@K`` key rule needs it)."""
    return t.table.renamed(name)


def compact_tensors(tensors: Mapping[str, TensorEntry]) -> tuple[dict[str, TensorEntry], list[str]]:
    """(the tensors in their compact form, the block's ``files`` table: sorted distinct names)."""
    tables = {name: named_table(name, t) for name, t in tensors.items()}
    # Tables often share one file list (a plan's): each distinct list is read once.
    tables_files = {id(table.files): table.files for table in tables.values()}
    files = sorted({f for names in tables_files.values() for f in names})
    index = {f: i for i, f in enumerate(files)}
    remaps = {k: np.asarray([index[f] for f in names], dtype=np.int64) for k, names in tables_files.items()}
    out: dict[str, TensorEntry] = {}
    for name, t in tensors.items():
        if t.table.ranges_count():
            out[name] = t  # byte-range hashes have no compact form: listed
            continue
        fields = compact_fields(tables[name], index, remaps[id(tables[name].files)])
        common = {k: v for k in ("fingerprint", "param", "state") if (v := getattr(t, k)) is not None}
        out[name] = TensorEntry(dtype=t.dtype, shape=list(t.shape), **common, **fields)
    return out, files


def as_listed(obj: dict[str, Any]) -> dict[str, Any]:
    """A parsed index JSON object (``json.loads``) with every compact tensor's slices listed
    (``slices``, as a tensor with byte-range hashes is written; readers take either form): tools
    and tests that edit slice objects. Changed in place, returned."""
    given = obj.get("unickpt")
    if not isinstance(given, dict):
        return obj
    block = obj["unickpt"] = block_from_json(given)[0]
    files = block.pop("files", None)
    for name, t in block["tensors"].items():
        if "slices" in t:
            continue
        fields = {k: t.pop(k, None) for k in ("grid", "boxes", "file", "keys", "xxh3")}
        table = SliceTable.from_compact(name, t["shape"], files or [], **fields)
        t["slices"] = table.listed()
    block_to_json(block)
    return obj


# ---------------------------------------------------------------- the one validator (IndexParser)
_TENSOR_FIELDS, _TENSOR_REQUIRED = fields_of(TensorEntry)
_LAYOUT_FIELDS, _LAYOUT_REQUIRED = fields_of(LayoutInfo)
_BLOCK_FIELDS, _BLOCK_REQUIRED = fields_of(UnickptBlock)
_RANGE_FIELDS, _RANGE_REQUIRED = fields_of(ByteRange)
_RANGE_SORTED = tuple(sorted(_RANGE_FIELDS))
_VERSIONS = " or ".join(map(str, KNOWN_FORMAT_VERSIONS))
_KIND_CHOICES = " or ".join(map(repr, KINDS))
_hex16 = re.compile(HEX16_BODY).fullmatch
_save_id = re.compile(SAVE_ID_BODY).fullmatch
#: The words every schema refusal of ``parse_index`` starts with (after the file's path).
SCHEMA_MISMATCH = "index does not match the unickpt index schema"
# The fields whose checks IndexParser writes out (a rule, a bulk path or a case of their own),
# per model. Every other field is checked by the plain check its declared type calls for
# (_plain_check, read from the models above: str, str | None, a bounded strict int, a strict bool,
# list[NonNeg], Hex16 | None); a field of any other type fails at import until it gets a check.
CUSTOM_FIELDS: dict[type[BaseModel], frozenset[str]] = {
    IndexFile: frozenset({"metadata", "weight_map", "unickpt"}),
    IndexMetadata: frozenset(),
    UnickptBlock: frozenset(
        {"format_version", "kind", "files", "layout", "tensors", "aliases"}
        | {"param_groups", "param_state", "save_id"}
    ),
    LayoutInfo: frozenset({"mesh"}),
    TensorEntry: frozenset({"dtype", "slices", "grid", "boxes", "file", "keys", "xxh3"}),
    SliceEntry: frozenset({"file", "ranges"}),
    ByteRange: frozenset({"xxh3"}),  # a range's digest is not optional
}


class IndexParser:
    """One pass over the decoded index of ``path``: checks, counts members and colons, builds the models.

    ``again`` gives the index's text once more, for the rare refusals that need it: a duplicate
    key (the colon count finds one, ``strict_loads`` names it) and a schema problem found in a
    text that may also hold a duplicate key (reported first, as the JSON's own problem).
    """

    __slots__ = ("again", "budget", "colons", "files", "mismatch", "pairs", "path")

    def __init__(self, path: str, budget: int | None, again: Callable[[], str], what: str = "index") -> None:
        self.path = path
        self.mismatch = f"{path}: {what} does not match the unickpt index schema"
        self.budget = budget  # colon_budget(raw): None when the text escapes a colon
        self.again = again
        self.pairs = 0  # members of every JSON object met
        self.colons = 0  # ':' in every string met that may hold one
        self.files: set[str] = set()  # distinct slice file names

    def parse(self, box: list[str]) -> IndexFile:
        """Parse the text in the one-item list ``box``, taken out of it and dropped once decoded."""
        what = f"{self.path}: index"
        text = box.pop()
        if self.budget is None:  # an escaped colon: the count cannot tell duplicates apart
            obj = strict_loads(text, IndexFileError, what)
        else:
            try:
                obj = json.loads(text)
            except (ValueError, RecursionError):
                strict_loads(text, IndexFileError, what)  # words the problem
                raise IndexFileError(f"{what} is not valid JSON") from None
        del text
        if type(obj) is not dict:
            raise IndexFileError(f"{what} must be a JSON object with a 'weight_map'")
        try:
            index = self.index(obj)
        except CheckpointFormatError:
            if self.budget is not None:
                strict_loads(self.again(), IndexFileError, what)  # a duplicate key is reported first
            raise
        except DigestTextError as e:
            if self.budget is not None:
                strict_loads(self.again(), IndexFileError, what)
            raise IndexFileError(f"{self.mismatch}: unickpt: {e}") from None
        except OtherFormatVersion as e:
            raise version_error(self.path, e.version) from None
        if self.budget is not None and self.pairs + self.colons != self.budget:
            strict_loads(self.again(), IndexFileError, what)  # names the duplicate key
            raise IndexFileError(f"{what} has a duplicate key")  # never: the count is exact
        return index

    # ------------------------------------------------------------------ refusals
    def refuse(
        self, where: str, problem: str, error: type[CheckpointFormatError] = IndexFileError
    ) -> NoReturn:
        raise error(f"{self.mismatch}: {where}: {problem}")

    def expected(self, where: str, expected: str, value: Any) -> NoReturn:
        self.refuse(where, f"expected {expected}, found {found_text(value)}")

    # ------------------------------------------------------------------ values
    def walk(self, v: Any) -> None:
        p, c = count_pairs_and_colons(v)
        self.pairs += p
        self.colons += c

    def string(self, v: Any, where: str, colons: bool = True) -> str:
        if type(v) is not str:
            self.expected(where, "a string", v)
        if colons:
            self.colons += v.count(":")
        return v

    def integer(self, v: Any, where: str, lo: int, hi: int | None = None) -> int:
        if type(v) is int and v >= lo and (hi is None or v < hi):
            return v
        bound = (
            f" below 2**{hi.bit_length() - 1}" if hi == MAX_DIM else f" below {hi}" if hi is not None else ""
        )
        self.expected(where, f"an integer >= {lo}{bound}", v)

    def optional_string(self, v: Any, where: str) -> str | None:
        return None if v is None else self.string(v, where)

    def boolean(self, v: Any, where: str) -> bool:
        if type(v) is not bool:
            self.expected(where, "true or false", v)
        return v

    def dims(self, v: Any, where: str) -> list[int]:
        if type(v) is not list:
            self.expected(where, "an array of integers", v)
        for i, x in enumerate(v):
            self.integer(x, f"{where}.{i}", 0, MAX_DIM)
        return v

    def hex16(self, v: Any, where: str) -> str | None:
        if v is None or (type(v) is str and _hex16(v)):
            return v
        self.expected(where, f"null or a string matching {HEX16}", v)

    def obj(self, v: Any, where: str, fields: tuple[str, ...], required: frozenset[str]) -> dict[str, Any]:
        """An object of an ``extra="forbid"`` model: no unknown key, every required key."""
        if type(v) is not dict:
            self.expected(where, "an object", v)
        for k in v:
            if k not in fields:
                self.refuse(f"{where}.{k}", f"unexpected key (the fields are {', '.join(fields)})")
        for k in fields:
            if k in required and k not in v:
                self.refuse(f"{where}.{k}", "missing (a required field)")
        self.pairs += len(v)
        return v

    # ------------------------------------------------------------------ the index
    def index(self, obj: dict[str, Any]) -> IndexFile:
        self.pairs += len(obj)
        given: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, v in obj.items():
            if k == "metadata":
                if obj.get("unickpt") is None and not strict_metadata_ok(v):
                    given[k] = self.informational_metadata(v)
                else:
                    given[k] = self.metadata(v)
            elif k == "weight_map":
                given[k] = self.weight_map(v)
            elif k == "unickpt":
                given[k] = None if v is None else self.block(v)
            else:
                self.colons += k.count(":")
                self.walk(v)
                extra[k] = v
        if "weight_map" not in given:
            self.refuse("weight_map", "missing (a required field)")
        return construct(IndexFile, given, set(obj), extra)

    def metadata(self, v: Any) -> IndexMetadata:
        if type(v) is not dict:
            self.expected("metadata", "an object", v)
        self.pairs += len(v)
        given: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for k, x in v.items():
            check = _META_PLAIN.get(k)
            if check is not None:
                given[k] = check(self, x, f"metadata.{k}")
            else:
                self.colons += k.count(":")
                self.walk(x)
                extra[k] = x
        return construct(IndexMetadata, given, set(v), extra)

    def informational_metadata(self, v: Any) -> IndexMetadata:
        """A plain Hugging Face index's metadata that a unickpt index could not have: Hugging Face
        reads only ``weight_map`` (Colossal-AI writes total_size in MB as a float), so its
        ``total_size`` is dropped (and the whole of anything that is not an object)."""
        self.walk(v)
        kept = {k: x for k, x in v.items() if k != "total_size"} if type(v) is dict else {}
        return construct(IndexMetadata, {}, set(kept), kept)

    def weight_map(self, v: Any) -> dict[str, str]:
        if type(v) is not dict:
            self.expected("weight_map", "an object", v)
        self.pairs += len(v)
        self.colons += "".join(v).count(":")
        for k, f in v.items():
            if type(f) is not str:
                self.expected(f"weight_map.{k}", "a string", f)
        for name in set(v.values()):  # a safe name holds no ':' (the colon count skips them)
            try:
                check_file_name(name)
            except UnsafePathError:
                k = next(k for k, f in v.items() if f == name)
                self.safe_names({name}, f"weight_map[{shown(k)}]")
        return v

    def safe_names(self, names: set[str], where: str = "") -> None:
        for name in names:
            try:
                check_file_name(name, where)
            except UnsafePathError as e:
                raise UnsafePathError(f"{self.path}: {e}") from None

    def block(self, v: Any) -> UnickptBlock:
        v, fewer = block_from_json(v)  # the text form (base64url digests, default dtype)
        self.pairs += fewer
        b = self.obj(v, "unickpt", _BLOCK_FIELDS, _BLOCK_REQUIRED)
        given: dict[str, Any] = {}
        for k, x in b.items():
            where = f"unickpt.{k}"
            check = _BLOCK_PLAIN.get(k)
            if check is not None:
                given[k] = check(self, x, where)
            elif k == "format_version":
                if type(x) is not int:
                    self.expected(where, f"the integer {_VERSIONS}", x)
                if x not in KNOWN_FORMAT_VERSIONS:
                    self.expected(where, f"{_VERSIONS} (a format version this reader knows)", x)
                given[k] = x
            elif k == "kind":
                if type(x) is not str or x not in KINDS:
                    self.expected(where, _KIND_CHOICES, x)
                given[k] = x
            elif k == "layout":
                given[k] = self.layout(x)
            elif k == "files":
                if x is not None:
                    if type(x) is not list:
                        self.expected(where, "null or an array of file names", x)
                    for i, f in enumerate(x):
                        self.string(f, f"{where}.{i}", colons=False)  # safe names hold no ':'
                    self.files |= set(x)
                given[k] = x
            elif k == "tensors":
                given[k] = self.tensors(x)
            elif k == "aliases":
                if type(x) is not dict:
                    self.expected(where, "an object", x)
                for a, t in x.items():
                    if type(t) is not str:
                        self.expected(f"{where}.{a}", "a string", t)
                self.walk(x)
                given[k] = dict(x)
            elif k == "param_groups":
                if x is not None:
                    if type(x) is not list:
                        self.expected(where, "null or an array of objects", x)
                    for i, g in enumerate(x):
                        if type(g) is not dict:
                            self.expected(f"{where}.{i}", "an object", g)
                    self.state_depth(x, where)
                    self.walk(x)
                    x = [dict(g) for g in x]
                given[k] = x
            elif k == "save_id":
                if x is not None and (type(x) is not str or _save_id(x) is None):
                    self.expected(where, f"null or a string matching {SAVE_ID}", x)
                given[k] = x
            else:  # param_state
                if type(x) is not dict:
                    self.expected(where, "an object", x)
                for p, st in x.items():
                    if type(st) is not dict:
                        self.expected(f"{where}.{p}", "an object", st)
                self.state_depth(x, where)
                self.walk(x)
                given[k] = {p: dict(st) for p, st in x.items()}
        # The rules that span the block's fields.
        tensors = given["tensors"]
        problem = files_problem(given.get("files"), tensors)
        if problem is not None:
            self.refuse("unickpt", problem)
        self.safe_names(self.files)
        problem = alias_problem(given.get("aliases", {}), tensors)
        if problem is not None:
            self.refuse("unickpt.aliases", problem)
        attach_tables(given.get("files"), tensors)
        return construct(UnickptBlock, given, set(b), None)

    def state_depth(self, x: Any, where: str) -> None:
        if json_depth(x, MAX_STATE_DEPTH + 1) > MAX_STATE_DEPTH:
            self.refuse(where, f"nested deeper than {MAX_STATE_DEPTH} levels")

    def layout(self, v: Any) -> LayoutInfo:
        d = self.obj(v, "unickpt.layout", _LAYOUT_FIELDS, _LAYOUT_REQUIRED)
        given: dict[str, Any] = {}
        for k, x in d.items():
            where = f"unickpt.layout.{k}"
            check = _LAYOUT_PLAIN.get(k)
            if check is not None:
                given[k] = check(self, x, where)
            else:  # mesh
                if type(x) is not dict:
                    self.expected(where, "an object", x)
                self.pairs += len(x)
                self.colons += "".join(x).count(":")
                for axis, size in x.items():
                    self.integer(size, f"{where}.{axis}", MIN_POSITIVE)
                given[k] = dict(x)
        return construct(LayoutInfo, given, set(d), None)

    def tensors(self, v: Any) -> dict[str, TensorEntry]:
        if type(v) is not dict:
            self.expected("unickpt.tensors", "an object", v)
        self.pairs += len(v)
        self.colons += "".join(v).count(":")
        return {name: self.tensor(name, t) for name, t in v.items()}

    def tensor(self, name: str, v: Any) -> TensorEntry:
        where = f"unickpt.tensors.{name}"
        t = self.obj(v, where, _TENSOR_FIELDS, _TENSOR_REQUIRED)
        given: dict[str, Any] = {}
        for k, x in t.items():
            check = _TENSOR_PLAIN.get(k)
            if check is not None:
                given[k] = check(self, x, f"{where}.{k}")
            elif k == "dtype":
                if type(x) is not str or x not in DTYPE_ITEMSIZE:
                    self.expected(f"{where}.dtype", f"a dtype in {sorted(DTYPE_ITEMSIZE)}", x)
                given[k] = x
            elif k == "slices":
                if type(x) is not list:
                    self.expected(f"{where}.slices", "an array of slice objects", x)
                given[k] = x
            else:  # the compact fields
                given[k] = self.compact_field(k, x, f"{where}.{k}")
        shape = given["shape"]
        problem = shape_problem(shape)
        if problem is not None:
            self.refuse(where, problem)
        if "slices" not in given:
            # Whether or not 'file' is given (absent: slice K in files[K]).
            problem = compact_problem(
                shape,
                given.get("grid"),
                given.get("boxes"),
                given.get("file"),
                given.get("keys"),
                given.get("xxh3"),
            )
            if problem is not None:
                self.refuse(where, problem)
            given["slices"] = []  # replaced by attach_tables (a default_factory costs 1 ms here)
            return construct(TensorEntry, given, set(t), None)
        given["slices"] = self.slices(where, shape, given["slices"], DTYPE_ITEMSIZE[given["dtype"]])
        return construct(TensorEntry, given, set(t), None)

    def ranges(self, v: Any, where: str) -> list[ByteRange] | None:
        """A slice's byte ranges, each an object of ``ByteRange``'s fields (their tiling is
        ``ranges_problem``'s)."""
        if v is None:
            return None
        if type(v) is not list:
            self.expected(where, "null or an array of range objects", v)
        out = []
        for j, r in enumerate(v):
            w = f"{where}.{j}"
            d = self.obj(r, w, _RANGE_FIELDS, _RANGE_REQUIRED)
            given = {k: _RANGE_PLAIN[k](self, x, f"{w}.{k}") for k, x in d.items() if k != "xxh3"}
            h = d["xxh3"]
            if type(h) is not str or not _hex16(h):
                self.expected(f"{w}.xxh3", f"a string matching {HEX16}", h)
            given["xxh3"] = h
            out.append(construct(ByteRange, given, set(d), None))
        return out

    def compact_field(self, k: str, x: Any, where: str) -> Any:
        """A compact field of a tensor, type-checked in bulk; the first bad item named when it fails."""
        colons = compact_field_colons(k, x)
        if colons is None:
            found, expected, value = compact_field_problem(k, x)
            self.expected(f"{where}{found}", expected, value)
        self.colons += colons
        return x

    def slices(self, where: str, gshape: list[int], sl: list[Any], isize: int) -> LazySlices:
        """A tensor's listed slices checked in one vectorised pass and kept as their table's columns.

        Every check runs over a whole column at once (C-level passes and numpy): objects with
        the fields of ``SliceEntry`` in any order, strings, dims, ``offsets + shape`` within the
        tensor, hashes, byte ranges tiling each slice's bytes. A check that fails gives the
        position of its first offending slice (the first of its mask); the columns are cut there,
        so the later checks look only at the slices before it, and the first slice at fault is
        the first failure of all. Its own fields (``slice_refusal``) then word the refusal: the
        slice's number, the field, what was expected and what was found. Optional fields a slice
        leaves out are columns with a null mask (``SliceTable``'s given-fields mask).
        """
        n, nd = len(sl), len(gshape)
        bad = n  # every slice before it has passed every check so far
        if set(map(type, sl)) != _DICT:
            bad = _first(map(operator.is_not, map(type, sl), itertools.repeat(dict)), bad)
        rows = sl[:bad] if bad < n else sl
        layouts = set(map(tuple, rows))
        wrong = {lay for lay in layouts if not _good_layout(lay)}
        if wrong:
            bad = _first(map(wrong.__contains__, map(tuple, rows)), bad)
            rows = rows[:bad]
            layouts -= wrong
        present = set(itertools.chain.from_iterable(layouts))
        files = list(map(_get_file, rows))
        keys = list(map(_get_key, rows))
        offsets = list(map(_get_offsets, rows))
        shapes = list(map(_get_shape, rows))
        hashes = _column(rows, layouts, present, "xxh3")
        ranges = _column(rows, layouts, present, "ranges")
        columns = [files, keys, offsets, shapes, hashes, ranges]

        def cut(k: int) -> None:  # the first slice at fault so far is slice k
            nonlocal bad
            bad = k
            for col in columns:
                if col is not None:
                    del col[k:]

        for col in (files, keys):  # strings
            if set(map(type, col)) - _STR:
                cut(_first(map(operator.is_not, map(type, col), itertools.repeat(str)), bad))
        for col in (offsets, shapes):  # arrays of nd integers
            if set(map(type, col)) - _LIST:
                cut(_first(map(operator.is_not, map(type, col), itertools.repeat(list)), bad))
            if set(map(len, col)) - {nd}:
                cut(_first(map(operator.ne, map(len, col), itertools.repeat(nd)), bad))
        flats = []
        for col in (offsets, shapes):  # each an integer >= 0 below 2**62
            flat = list(itertools.chain.from_iterable(col))
            if flat and (set(map(type, flat)) - _INT or min(flat) < 0 or max(flat) >= MAX_DIM):
                cut(_first(map(_not_dim, flat), bad * nd) // nd)
            flats.append(flat)
        m = len(files)
        lo, ext = (
            np.array(f if len(f) == m * nd else f[: m * nd], dtype=np.int64).reshape(m, nd) for f in flats
        )
        if nd:  # offset + size <= the tensor's size on every dim
            past = np.flatnonzero((lo + ext > np.asarray(gshape, dtype=np.int64)).any(axis=1))
            if len(past):
                cut(int(past[0]))
        if hashes is not None:  # null, or 16 lower-case hex digits
            given_hashes = (
                hashes
                if None not in hashes
                else list(itertools.compress(hashes, map(operator.is_not, hashes, itertools.repeat(None))))
            )
            if given_hashes and not _hex16_list(given_hashes):
                cut(_first(map(_not_hash, hashes), bad))
        ranged: dict[int, list[ByteRange]] = {}
        if ranges is not None:
            k = self.ranges_column(ranges, shapes, isize, ranged)
            if k is not None:
                cut(k)
        if bad < n:
            self.slice_refusal(f"{where}.slices.{bad}", gshape, sl[bad], isize)
        self.pairs += (len(_FULL_LAYOUT) * n if layouts == {_FULL_LAYOUT} else sum(map(len, sl))) + 3 * sum(
            map(len, ranged.values())
        )
        self.colons += "".join(keys).count(":")
        self.files.update(files)
        given = None
        bits = {lay: ("xxh3" in lay) * GIVEN_XXH3 + ("ranges" in lay) * GIVEN_RANGES for lay in layouts}
        if set(bits.values()) - {GIVEN_XXH3}:  # some slice leaves its xxh3 out, or names its ranges
            given = np.fromiter(map(bits.__getitem__, map(tuple, rows)), np.uint8, n)
        table = SliceTable.from_columns(
            "",
            gshape,
            files=files,
            keys=keys,
            offsets=lo[:n],
            shapes=ext[:n],
            hashes=hashes,
            ranges=ranged,
            given=given,
        )
        return LazySlices(table)

    def ranges_column(
        self, ranges: list[Any], shapes: list[list[int]], isize: int, out: dict[int, list[ByteRange]]
    ) -> int | None:
        """The ``ranges`` column checked at once: every range of every slice an object of
        ``ByteRange``'s fields, and each slice's ranges tiling its bytes in order. Returns the
        first slice at fault (None: none) and fills ``out`` with the ranges of the slices before it."""
        rk = list(itertools.compress(itertools.count(), map(operator.is_not, ranges, itertools.repeat(None))))
        if not rk:
            return None
        lists = list(map(ranges.__getitem__, rk))
        first = len(rk)  # among the slices with ranges
        if set(map(type, lists)) - _LIST:
            first = _first(map(operator.is_not, map(type, lists), itertools.repeat(list)), first)
            lists = lists[:first]
        counts = np.fromiter(map(len, lists), np.int64, len(lists))
        items = list(itertools.chain.from_iterable(lists))
        owner = np.repeat(np.arange(len(lists)), counts)  # each range's slice, among rk
        item_bad = len(items)
        if set(map(type, items)) - _DICT:
            item_bad = _first(map(operator.is_not, map(type, items), itertools.repeat(dict)), item_bad)
        good = items[:item_bad]
        if set(map(tuple, good)) - {_RANGE_FIELDS}:  # every field required: only their order may vary
            item_bad = _first(map(_not_range_object, good), item_bad)
            good = items[:item_bad]
        starts = list(map(_get_start, good))
        ends = list(map(_get_end, good))
        digests = list(map(_get_xxh3, good))
        for col in (starts, ends):
            if col and (set(map(type, col)) - _INT or min(col) < 0 or max(col) >= MAX_DIM):
                item_bad = min(item_bad, _first(map(_not_dim, col), item_bad))
        if digests and not (set(map(type, digests)) == _STR and _hex16_list(digests)):
            item_bad = min(item_bad, _first(map(_not_range_digest, digests), item_bad))
        if item_bad < len(items):
            first = min(first, int(owner[item_bad]))
        # The tiling, over the ranges of the slices before the first at fault.
        within = int(counts[:first].sum())
        st = np.array(starts[:within], dtype=np.int64)
        en = np.array(ends[:within], dtype=np.int64)
        heads = np.concatenate([[0], np.cumsum(counts[:first])[:-1]]).astype(np.int64)
        prev = np.concatenate([[0], en[:-1]]) if within else en
        if within:
            prev[heads[counts[:first] > 0]] = 0  # a slice's first range starts at byte 0
        gap = (st != prev) | (en <= st)
        if gap.any():
            first = min(first, int(owner[int(np.argmax(gap))]))
        nbytes = [math.prod(shapes[rk[j]]) * isize for j in range(first)]
        last = np.cumsum(counts[:first]) - 1
        covered = [
            int(en[i]) if c else 0 for i, c in zip(last.tolist(), counts[:first].tolist(), strict=True)
        ]
        short = _first(map(operator.ne, covered, nbytes), first)
        first = min(first, short)
        shared = set(_RANGE_FIELDS)
        pos = 0
        for j in range(first):  # the ranges of the slices that passed, built
            c = int(counts[j])
            out[rk[j]] = [
                construct(ByteRange, {"start": a, "end": b, "xxh3": h}, shared, None)
                for a, b, h in zip(
                    starts[pos : pos + c], ends[pos : pos + c], digests[pos : pos + c], strict=True
                )
            ]
            pos += c
        return rk[first] if first < len(rk) else None

    def slice_refusal(self, w: str, gshape: list[int], v: Any, isize: int) -> NoReturn:
        """The refusal of the slice ``v`` that the bulk checks found at fault (``w``: its path):
        its first field at fault (in its key order) or its rule, worded."""
        s = self.obj(v, w, SLICE_FIELDS, SLICE_REQUIRED)
        given: dict[str, Any] = {}
        for k, x in s.items():
            check = _SLICE_PLAIN.get(k)
            if check is not None:
                given[k] = check(self, x, f"{w}.{k}")
            elif k == "ranges":
                given[k] = self.ranges(x, f"{w}.ranges")
            else:  # file
                given[k] = self.string(x, f"{w}.file", colons=False)
        file = given["file"]
        problem = slice_problem(given["key"], file, given["offsets"], given["shape"], gshape)
        problem = problem or ranges_problem(given["key"], file, given.get("ranges"), given["shape"], isize)
        if problem is None:  # never: the bulk checks and the slice's own agree
            raise AssertionError(f"{w}: found at fault by the bulk checks, but not by its own")
        self.refuse(w, problem)


def validate_block(obj: Any, path: str, what: str) -> UnickptBlock:
    """A unickpt block read on its own (``obj`` from ``strict_loads``, which refused duplicate
    keys): checked as the block of an index, refusals naming ``path`` and ``what`` it is."""
    parser = IndexParser(path, None, _no_text, what)
    try:
        return parser.block(obj)
    except DigestTextError as e:
        raise IndexFileError(f"{parser.mismatch}: unickpt: {e}") from None
    except OtherFormatVersion as e:
        raise version_error(path, e.version) from None


def _no_text() -> str:  # pragma: no cover - never: a parser without a budget never asks
    raise RuntimeError("the text of a block validated on its own is not kept")


_Check = Callable[[IndexParser, Any, str], Any]


def _plain_check(cls: type[BaseModel], name: str) -> _Check:
    """The check of a field declared with one of the schema's plain types, read from its declaration."""
    field = cls.model_fields[name]
    ann, meta = field.annotation, field.metadata
    if ann is str:
        return IndexParser.string
    if ann == str | None and not meta:
        return IndexParser.optional_string
    if ann is bool and Strict(strict=True) in meta:
        return IndexParser.boolean
    if ann is int and Strict(strict=True) in meta:
        lo = next(cast(int, m.ge) for m in meta if isinstance(m, Ge))
        hi = next((cast(int, m.lt) for m in meta if isinstance(m, Lt)), None)
        return lambda parser, v, where: parser.integer(v, where, lo, hi)
    if ann == list[NonNeg]:
        return IndexParser.dims
    if ann == Hex16 | None:
        return IndexParser.hex16
    raise TypeError(f"{cls.__name__}.{name}: the index parser has no check for {shown(ann)}")


#: The plain checks, by model and field: every field not in CUSTOM_FIELDS.
PLAIN_CHECKS: dict[type[BaseModel], dict[str, _Check]] = {
    cls: {name: _plain_check(cls, name) for name in cls.model_fields if name not in custom}
    for cls, custom in CUSTOM_FIELDS.items()
}
_META_PLAIN = PLAIN_CHECKS[IndexMetadata]
_BLOCK_PLAIN = PLAIN_CHECKS[UnickptBlock]
_LAYOUT_PLAIN = PLAIN_CHECKS[LayoutInfo]
_TENSOR_PLAIN = PLAIN_CHECKS[TensorEntry]
_SLICE_PLAIN = PLAIN_CHECKS[SliceEntry]
_RANGE_PLAIN = PLAIN_CHECKS[ByteRange]


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


def read_index(read: Callable[[], bytes], path: str) -> IndexFile:
    """Parse the index that ``read()`` returns whole (``path`` names it in messages). Its bytes
    and text are dropped while the models are built; the rare refusal that needs the text again
    (naming a duplicate key) calls ``read`` again."""
    return _parse_owned([read()], path, read)


def load_index(path: str | os.PathLike[str]) -> IndexFile:
    """:func:`read_index` of the local index file at ``path`` (refused past ``MAX_INDEX_BYTES``)."""
    p = os.fspath(path)
    size = os.path.getsize(p)
    if size > MAX_INDEX_BYTES:
        raise IndexFileError(f"{p}: {size} bytes exceeds the {MAX_INDEX_BYTES}-byte limit for an index")
    return read_index(lambda: _read_index_bytes(p), p)


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
    per tensor. A listed tensor's slices are written from its table's columns (no ``SliceEntry``
    built); the collector is paused while the JSON tree is built (``gc_paused``: it holds no
    cycles, and walking its containers again and again cost more than the dump itself)."""
    with gc_paused():
        return _index_json(index)


def _index_json(index: IndexFile) -> bytes:
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
