"""What an untrusted file can make unickpt do: its JSON parsed strictly, its names confined, its counts bounded.

Every checkpoint, ours or a peer's, is read as hostile input. Three defences live here, so that
each reader (our index and headers, DCP metadata, DeepSpeed and Colossal-AI pickles, Hugging
Face indexes) applies the same rules in bounded time and memory.

**Strict JSON** (:func:`strict_loads`, :func:`colon_budget`, :func:`json_depth`): duplicate
keys, lone surrogates and pathological nesting are errors, not silently resolved.

**Names confined to the checkpoint.** Every file name that comes from inside a checkpoint (a
DCP ``.metadata``'s storage entries, a DeepSpeed ``latest`` tag, a Colossal-AI or Hugging Face
index's ``weight_map``, our own index's slice files) becomes a path in one of two ways:

- :func:`plain_name`: the name must be a plain file name (letters, digits, ``._+=-``, no ``/``
  or ``\\``, no ``..``, not absolute, not hidden, at most 255 characters), so joined to the
  checkpoint's directory or URL prefix it names an entry of that directory or prefix and
  nothing else (``../other_run/x``, ``/etc/x``, ``a/../../x`` and ``s3://bucket/other/x`` all
  fail);
- :func:`confined_path`: a local path so joined must also *resolve* inside the directory: a
  symbolic link to a file elsewhere is refused. The one exception is the Hugging Face cache
  (``<repo>/snapshots/<rev>/<file>`` linking to ``<repo>/blobs/<sha>``).

:func:`check_graph` bounds what an allowlisted unpickler (``weights_only`` loading, DCP's
metadata unpickler) may still build from allowed types: nesting deeper than ``MAX_DEPTH``
and objects that contain themselves are refused before any code walks them recursively.
The walk is iterative and visits each object once (shared references are not re-walked),
so its time and memory are linear in the objects the pickle built, which is at most the
number of its opcodes, so bounded by the file's size.

**Counts bounded by the bytes that hold them.** A compact tensor entry (docs/format.md 3.1)
describes its slices by rule: ``grid: [1000000000]`` is 12 bytes of JSON and a billion slices.
Every slice is one entry of a data file's header, so the slices an index may declare are
bounded by what the data files can hold:

- **at parse time** (no file is opened; both paths of ``parse_index`` and a single file's
  unickpt block): the slices stored in one data file number at most :data:`MAX_FILE_ENTRIES`,
  the entries a header of at most :data:`MAX_HEADER_BYTES` bytes can hold, each entry taking at
  least :data:`MIN_ENTRY_BYTES` bytes of JSON (:func:`count_problem`);
- **when a checkpoint is opened** (the files' sizes known): the slices of a file at most the
  entries its size leaves room for, and the tensors' bytes at most the bytes of their files
  (:func:`capacity_problem`).

Both run in O(tensors + files + the bytes of per-slice lists present in the index) before any
per-slice array, list or object is built. A violation names the field at fault; callers raise
``IndexFileError`` naming the file.
"""

from __future__ import annotations

import enum
import errno
import itertools
import json
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from unickpt.errors import CheckpointFormatError, UnsafePathError
from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.naming import shown
from unickpt.spec.slice_table import compact_count

__all__ = [
    "strict_loads",
    "colon_budget",
    "count_pairs_and_colons",
    "check_unicode",
    "lone_surrogate",
    "SURROGATE_ESCAPE",
    "MAX_DEPTH",
    "is_plain_name",
    "plain_name",
    "confined_path",
    "check_graph",
    "show",
    "MAX_HEADER_BYTES",
    "MIN_ENTRY_BYTES",
    "MAX_FILE_ENTRIES",
    "SAFETENSORS_PREFIX",
    "entries_capacity",
    "slices_per_file",
    "entries_problem",
    "count_problem",
    "capacity_problem",
    "read_bounded",
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
        raise error(f"{what} has a duplicate key {shown(e.args[0])}") from None
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


_PLAIN = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._+=-]*$")
#: Deepest nesting of containers/objects accepted from a foreign pickle (real checkpoints: < 12).
MAX_DEPTH = 64

_ATOMS = (str, bytes, bytearray, int, float, complex, bool, type(None), enum.Enum, type, range, slice)
_ATOM_TYPES = frozenset({str, bytes, int, float, bool, type(None)})  # the common leaves, by exact type


def show(value: object, limit: int = 200) -> str:
    """``repr(value)`` for a message, at most ``limit`` characters; never raises (an unpickled
    integer too long for ``repr``, a self-containing or very deep object)."""
    try:
        text = repr(value)
    except (ValueError, RecursionError, MemoryError):
        return f"<a {type(value).__name__} too large to show>"
    except Exception:  # a stand-in's repr on hostile attributes
        return f"<a {type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def is_plain_name(name: object) -> bool:
    """Whether ``name`` is a plain file name (see the module docstring)."""
    return isinstance(name, str) and len(name) <= 255 and ".." not in name and _PLAIN.match(name) is not None


def plain_name(name: object, where: str, entry: str, error: type[Exception] = UnsafePathError) -> str:
    """``name`` unchanged when it is a plain file name; else ``error`` naming the file ``where``
    it was read from and the ``entry`` that holds it."""
    if not is_plain_name(name):
        raise error(
            f"{where}: {entry} names {show(name)}, which is not a plain file name inside the checkpoint "
            "(no '/', '\\', '..', absolute paths or hidden files); refusing to read outside it"
        )
    return name  # type: ignore[return-value]


def _hf_cache_blob(base: str, real: str) -> bool:
    """``real`` is ``<repo>/blobs/<sha>`` and ``base`` is ``<repo>/snapshots/<rev>``."""
    snaps, _rev = os.path.split(base)
    repo, tail = os.path.split(snaps)
    return tail == "snapshots" and os.path.dirname(real) == os.path.join(repo, "blobs")


def confined_path(base: str, name: str, where: str, entry: str) -> str:
    """``base/name`` for a plain ``name`` (:func:`plain_name`) when that path, symbolic links
    followed, stays inside the directory ``base``; else :class:`UnsafePathError`."""
    path = os.path.join(base, plain_name(name, where, entry))
    if not os.path.islink(path):
        return path  # a plain name in base, not a link: inside by construction
    real_base = os.path.realpath(base)
    real = os.path.realpath(path)
    if real.startswith(real_base + os.sep) or _hf_cache_blob(real_base, real):
        return path
    raise UnsafePathError(
        f"{where}: {entry} {shown(name)} is a symbolic link to {real}, outside {real_base}; "
        "refusing to read outside the checkpoint"
    )


def _children(obj: Any) -> Any:
    """The objects ``obj`` holds: a container's items (a dict's keys and values), another
    object's attributes (its ``__dict__``); objects without either hold nothing walked here."""
    if isinstance(obj, dict):
        return itertools.chain.from_iterable(obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return iter(obj)
    d = getattr(obj, "__dict__", None)
    return iter(d.values()) if isinstance(d, dict) else iter(())


def check_graph(
    obj: Any,
    where: str,
    what: str = "object",
    error: type[Exception] = CheckpointFormatError,
    max_depth: int = MAX_DEPTH,
) -> None:
    """Refuse (``error`` naming ``where`` and ``what``) an unpickled ``obj`` that contains itself
    or whose longest chain of nested objects (shared ones counted on every path) is longer than
    ``max_depth``. Each object and each reference is visited once, without recursion."""
    if isinstance(obj, _ATOMS):
        return
    height: dict[int, int] = {}  # id -> longest chain from it down, once walked
    on_path = {id(obj)}
    frames: list[list[Any]] = [[obj, _children(obj), 1]]  # [object, its children, longest chain]
    while frames:
        top = frames[-1]
        for c in top[1]:
            if type(c) in _ATOM_TYPES or isinstance(c, _ATOMS):
                continue
            cid = id(c)
            h = height.get(cid)
            if h is not None:
                if h + 1 > top[2]:
                    top[2] = h + 1
                continue
            if cid in on_path:
                raise error(
                    f"{where}: the {what} contains itself (a {type(c).__name__} that refers back to itself)"
                )
            if len(frames) >= max_depth:
                raise error(f"{where}: the {what} is nested more than {max_depth} levels deep")
            on_path.add(cid)
            frames.append([c, _children(c), 1])
            break
        else:
            frames.pop()
            o, _, h = top
            if h > max_depth:
                raise error(f"{where}: the {what} is nested more than {max_depth} levels deep")
            height[id(o)] = h
            on_path.discard(id(o))
            if frames and h + 1 > frames[-1][2]:
                frames[-1][2] = h + 1


#: The largest safetensors header a reader takes (docs/format.md section 2).
MAX_HEADER_BYTES = 100_000_000
#: The fewest bytes one tensor entry takes in a header: ``"":{"dtype":"U8","shape":[],"data_offsets":[0,0]},``
#: (the empty key, a 1-byte dtype, a 0-dim shape, no whitespace): 50 bytes.
MIN_ENTRY_BYTES = len('"":{"dtype":"U8","shape":[],"data_offsets":[0,0]},')
#: The most entries (so slices) one data file can hold: 2,000,000.
MAX_FILE_ENTRIES = MAX_HEADER_BYTES // MIN_ENTRY_BYTES
#: The 8-byte header length before a safetensors header.
SAFETENSORS_PREFIX = 8


def entries_capacity(size: int) -> int:
    """The most tensor entries a safetensors file of ``size`` bytes can hold."""
    return max(0, min(size - SAFETENSORS_PREFIX, MAX_HEADER_BYTES)) // MIN_ENTRY_BYTES


def _per_file(n_files: int, tensors: Mapping[str, Any], compact_only: bool) -> tuple[np.ndarray, list[Any]]:
    """(slices per file id, per tensor (name, count, the field that declares it, file ids or
    None: every file)), from the specs alone: nothing per slice is built for a grid."""
    counts = np.zeros(n_files, dtype=np.int64)
    described: list[Any] = []
    for name, t in tensors.items():
        if t.compact:
            n = compact_count(t.shape, t.grid, t.boxes)
            field = _field(t)
            spec = t.file
            if spec is None:  # slice K in files[K] (the schema checked n == len(files))
                if n_files:
                    counts[: min(n, n_files)] += 1
            elif isinstance(spec, int):
                if 0 <= spec < n_files:
                    counts[spec] += min(n, 1 << 62)
            elif spec:
                ids = np.asarray(spec, dtype=np.int64)
                ids = ids[(ids >= 0) & (ids < n_files)]
                counts += np.bincount(ids, minlength=n_files)[:n_files]
            described.append((name, n, field, spec))
        elif not compact_only:
            described.append((name, len(t.slices), "slices", None))
    return counts, described


def count_problem(files: Sequence[str] | None, tensors: Mapping[str, Any]) -> str | None:
    """Whether a block's compact tensors declare more slices in one data file than any file
    can hold (:data:`MAX_FILE_ENTRIES`), naming the tensor, its field and the file; or None."""
    if files is None:
        return None
    counts, described = _per_file(len(files), tensors, compact_only=True)
    if not len(counts) or int(counts.max()) <= MAX_FILE_ENTRIES:
        return None
    fid = int(np.argmax(counts))
    for name, n, field, spec in described:
        if spec == fid or (isinstance(spec, list) and fid in spec):
            return (
                f"unickpt.tensors[{shown(name)}].{field}: declares {n} slice(s) in data file {shown(files[fid])}, "
                f"which with the slices of other tensors comes to {int(counts[fid])}; a data file holds at "
                f"most {MAX_FILE_ENTRIES} entries (a header of at most {MAX_HEADER_BYTES} bytes, "
                f"{MIN_ENTRY_BYTES} bytes or more per entry)"
            )
    return (  # never: only a tensor naming the file adds to its count
        f"unickpt.files[{fid}]: {int(counts[fid])} slices declared in data file {shown(files[fid])}, more than "
        f"the {MAX_FILE_ENTRIES} entries a data file holds"
    )


def slices_per_file(tensors: Mapping[str, Any]) -> dict[str, int]:
    """How many slices the tensors store in each data file (from their slice tables' file specs:
    nothing per slice is built for a grid)."""
    counts: dict[str, int] = {}
    for t in tensors.values():
        for f, n in t.table.file_counts().items():
            counts[f] = counts.get(f, 0) + n
    return counts


def entries_problem(name: str, slices: int, size: int, path: str) -> str | None:
    """Whether ``slices`` slices exceed what data file ``name`` (``size`` bytes at ``path``) holds."""
    room = entries_capacity(size)
    if slices <= room:
        return None
    return (
        f"unickpt.tensors: the index stores {slices} slice(s) in data file {shown(name)}, whose {size} bytes "
        f"({path}) hold at most {room} header entries ({MIN_ENTRY_BYTES} bytes or more each)"
    )


def capacity_problem(
    tensors: Mapping[str, Any], size_of: Callable[[str], int | None], with_bytes: bool = True
) -> str | None:
    """Whether the tensors declare more slices, or (``with_bytes``) more bytes, than the data
    files there can hold; ``size_of(file name)`` is a file's size in bytes (None: unknown, not
    bounded here).

    Per file, its slices fit its header (:func:`entries_capacity`); per tensor and in all,
    the tensors' bytes (shape x dtype size: the slices tile each tensor once) fit the files
    their slices name. O(tensors x the files each names), nothing per slice.
    """
    sizes: dict[str, int | None] = {}

    def size(f: str) -> int | None:
        if f not in sizes:
            sizes[f] = size_of(f)
        return sizes[f]

    per_file: dict[str, int] = {}
    for name, t in tensors.items():
        table = t.table
        for f, n in table.file_counts().items():
            per_file[f] = per_file.get(f, 0) + n
            s = size(f)
            if s is not None and per_file[f] > entries_capacity(s):
                return (
                    f"unickpt.tensors[{shown(name)}].{_field(t)}: {n} slice(s) in data file {shown(f)} (with the slices "
                    f"of other tensors there: {per_file[f]}), but its {s} bytes hold at most "
                    f"{entries_capacity(s)} header entries ({MIN_ENTRY_BYTES} bytes or more each)"
                )
    if not with_bytes:
        return None
    total_data = 0
    known = True
    for f in per_file:
        s = size(f)
        if s is None:
            known = False
        else:
            total_data += max(0, s - SAFETENSORS_PREFIX)
    total = 0
    for name, t in tensors.items():
        nbytes = _nbytes(t)
        total += nbytes
        files = t.table.distinct_files()
        room = [size(f) for f in files]
        if None in room:
            continue
        held = sum(max(0, r - SAFETENSORS_PREFIX) for r in room if r is not None)
        if nbytes > held:
            return (
                f"unickpt.tensors[{shown(name)}].shape: {list(t.shape)} x {DTYPE_ITEMSIZE.get(t.dtype, '?')} "
                f"byte(s) ({t.dtype}) is {nbytes} bytes, more than the {held} bytes of the data file(s) "
                f"its slices name ({_few(files)})"
            )
    if known and total > total_data:
        return (
            f"unickpt.tensors: the tensors' shapes come to {total} bytes, more than the {total_data} bytes "
            f"of the {len(per_file)} data file(s) they name"
        )
    return None


def _nbytes(t: Any) -> int:
    n = DTYPE_ITEMSIZE.get(t.dtype, 1)
    for d in t.shape:
        n *= d
    return n


def _field(t: Any) -> str:
    """The field of a tensor entry that declares its slices."""
    if not t.compact:
        return "slices"
    return "grid" if t.grid is not None else "boxes" if t.boxes is not None else "file"


def _few(files: Sequence[str]) -> str:
    listed = ", ".join(shown(f) for f in files[:3])
    return listed + (f" and {len(files) - 3} more" if len(files) > 3 else "")


def read_bounded(path: str, limit: int) -> bytes:
    """A local file whole, refused (``OSError`` EFBIG naming it) past ``limit`` bytes, whatever
    size it reports: at most ``limit + 1`` bytes are read."""
    with open(path, "rb") as f:
        # The size the file reports (no buffer of ``limit`` bytes for a small file), then on to
        # the end: bounded even when the size lies (a /proc file reports 0 bytes).
        size = os.fstat(f.fileno()).st_size
        chunks = [f.read(min(size, limit) + 1)]
        total = len(chunks[0])
        while total <= limit:
            more = f.read(min(1 << 20, limit + 1 - total))
            if not more:
                break
            chunks.append(more)
            total += len(more)
    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"more than the {limit} bytes allowed for this file", path)
    return data
