"""What the bytes of a checkpoint can hold: bounds on the counts an index declares.

A compact tensor entry (docs/format.md 3.1) describes its slices by rule: ``grid: [1000000000]``
is 12 bytes of JSON and a billion slices. Every slice is one entry of a data file's header,
so the slices an index may declare are bounded by what the data files can hold:

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

import errno
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from unickpt.spec.dtypes import DTYPE_ITEMSIZE
from unickpt.spec.slice_table import compact_count

__all__ = [
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
                f"unickpt.tensors[{_q(name)}].{field}: declares {n} slice(s) in data file {files[fid]!r}, "
                f"which with the slices of other tensors comes to {int(counts[fid])}; a data file holds at "
                f"most {MAX_FILE_ENTRIES} entries (a header of at most {MAX_HEADER_BYTES} bytes, "
                f"{MIN_ENTRY_BYTES} bytes or more per entry)"
            )
    return (  # never: only a tensor naming the file adds to its count
        f"unickpt.files[{fid}]: {int(counts[fid])} slices declared in data file {files[fid]!r}, more than "
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
        f"unickpt.tensors: the index stores {slices} slice(s) in data file {name!r}, whose {size} bytes "
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
                    f"unickpt.tensors[{_q(name)}].{_field(t)}: {n} slice(s) in data file {f!r} (with the slices "
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
                f"unickpt.tensors[{_q(name)}].shape: {list(t.shape)} x {DTYPE_ITEMSIZE.get(t.dtype, '?')} "
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


def _q(name: str) -> str:
    """A tensor name as a message shows it: escaped, cut to 80 characters (names can be any length)."""
    r = ascii(name)
    return r if len(r) <= 80 else f"{r[:77]}..."


def _field(t: Any) -> str:
    """The field of a tensor entry that declares its slices."""
    if not t.compact:
        return "slices"
    return "grid" if t.grid is not None else "boxes" if t.boxes is not None else "file"


def _few(files: Sequence[str]) -> str:
    shown = ", ".join(repr(f) for f in files[:3])
    return shown + (f" and {len(files) - 3} more" if len(files) > 3 else "")


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
