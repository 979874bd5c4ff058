"""The block's text form: base64url digests and a default dtype (docs/format.md 3.2).

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
import posixpath
from typing import Any, Literal

import numpy as np

from unickpt.errors import IndexFileError
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.slice_table import compact_problem

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
        super().__init__(f"format_version {version} is not the version {FORMAT_VERSION} this unickpt reads")
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
            f"{path}: format_version {version} is not a version this unickpt reads (it reads "
            f"version {FORMAT_VERSION} only): a newer unickpt wrote it; read it with that one"
        )
    return IndexFileError(
        f"{path}: format_version {version} is no format version (unickpt reads version {FORMAT_VERSION})"
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
    return f"holds {c!r}, outside the base64url alphabet (A-Z a-z 0-9 - _; {NO_DIGEST!r}: no hash)"


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
            f"found {default!r}"
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
                    f"tensor {name!r}: 'fingerprint' holds {len(fp)} characters, not the "
                    f"{B64_DIGEST_LEN} base64url characters of a digest"
                )
            fps.append((name, fp))
        xxh = t.get("xxh3")
        if type(xxh) is str:
            count = None if "slices" in t else _slice_count(t)
            if count is not None and len(xxh) != B64_DIGEST_LEN * count:
                raise DigestTextError(
                    f"tensor {name!r}: 'xxh3' holds {len(xxh)} characters for {count} slice(s) "
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
                f"tensor {name!r}: {field!r} holds {len(s)} characters, not a multiple of {B64_DIGEST_LEN}"
            )
    try:
        hexs = b64_to_hex("".join(s for _, s in items))
    except _Bad as e:
        ends = np.cumsum(lengths)
        i = int(np.searchsorted(ends, e.group, side="right"))
        name, text = items[i]
        k = e.group - int(ends[i] - lengths[i])
        group = text[k * B64_DIGEST_LEN : (k + 1) * B64_DIGEST_LEN]
        raise DigestTextError(f"tensor {name!r}: {field!r}: digest {k} ({group!r}) {e.detail}") from None
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
