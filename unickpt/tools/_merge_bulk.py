"""Merge of small row-sliced tensors from local files: runs copied, not slices (no torch).

FSDP's and TP's ``Shard(0)`` store a tensor as row blocks, one per rank's file; the files hold
the blocks of every tensor back to back. Streaming such tensors slice by slice costs a read, a
write and their bookkeeping per slice. Here, consecutive output tensors of at most ``SMALL``
bytes whose slices are row blocks tiling them (:func:`row_order`, from the slice table: no
per-slice object) are merged a group of about ``GROUP_BYTES`` at a time: every slice of the
group is located in bulk and read with a ``ReadBatch`` (one ``preadv`` per run of adjacent
slices in a file) straight into its place in the group's buffer, each slice is rehashed there
(``verify``), and each run of adjacent output tensors is written with one ``pwrite``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import numpy as np
import xxhash

from unickpt.ckpt.reader import CheckpointReader
from unickpt.ckpt.stored_slices import ReadBatch, recorded_hashes
from unickpt.errors import IntegrityError, IntegrityFailure
from unickpt.spec.dtypes import itemsize
from unickpt.spec.index import TensorEntry

__all__ = ["GROUP_BYTES", "SMALL", "row_order", "merge_rows", "groups"]

#: A tensor of at most this many bytes may be merged in a group; larger ones are streamed.
SMALL = 4 << 20
#: A group's buffer: about this many bytes of output tensors at a time.
GROUP_BYTES = 64 << 20

_EMPTY = xxhash.xxh3_64_intdigest(b"")


def row_order(t: TensorEntry) -> np.ndarray | None:
    """The non-empty slices of ``t`` in row order when every slice is a row block (whole in every
    dim but the first) and they tile the tensor exactly once; else None (the general path decides)."""
    table = t.table
    g = list(t.shape)
    if not g or len(table) == 0:
        return None
    off, shp = table.offsets, table.shapes
    if off.shape[1] != len(g) or shp.shape[1] != len(g):
        return None
    if len(g) > 1 and not ((off[:, 1:] == 0).all() and (shp[:, 1:] == np.asarray(g[1:])).all()):
        return None
    nonempty = np.flatnonzero(shp[:, 0] > 0) if math.prod(g[1:]) else np.arange(0)
    if math.prod(g) == 0 or (off[:, 0] < 0).any():
        return None
    ks = nonempty[np.argsort(off[nonempty, 0], kind="stable")]
    starts, rows = off[ks, 0], shp[ks, 0]
    ends = starts + rows
    if len(ks) == 0 or starts[0] != 0 or ends[-1] != g[0] or not np.array_equal(starts[1:], ends[:-1]):
        return None
    return ks


def groups(
    items: list[tuple[str, TensorEntry, int]], bulk: Callable[[str, TensorEntry], bool]
) -> Iterator[tuple[bool, list[tuple[str, TensorEntry, int]]]]:
    """``items`` in order, as (merged in bulk?, items): consecutive bulk tensors grouped up to
    ``GROUP_BYTES``, every other tensor alone."""
    cur: list[tuple[str, TensorEntry, int]] = []
    size = 0
    for it in items:
        name, t, _ = it
        if bulk(name, t) and t.nbytes <= SMALL:
            if cur and size + t.nbytes > GROUP_BYTES:
                yield True, cur
                cur, size = [], 0
            cur.append(it)
            size += t.nbytes
            continue
        if cur:
            yield True, cur
            cur, size = [], 0
        yield False, [it]
    if cur:
        yield True, cur


def merge_rows(
    r: CheckpointReader,
    group: list[tuple[str, TensorEntry, int]],
    order: Callable[[str], np.ndarray],
    write: Callable[[memoryview, int], None],
    *,
    verify: bool,
    src: str,
    progress: Callable[[int], object],
) -> dict[str, tuple[str | None, str | None]]:
    """Merge ``group`` (name, entry, output position) of row-sliced tensors; name -> (xxh3, fingerprint)."""
    total = sum(t.nbytes for _, t, _ in group)
    buf = np.empty(total, dtype=np.uint8).data.cast("B")
    batch = ReadBatch()
    placed: list[tuple[str, TensorEntry, int, int, np.ndarray, np.ndarray, np.ndarray]] = []
    at = 0
    for name, t, pos in group:
        ks = order(name)
        spans = r.spans[name]  # every slice located by the structure check (``_merge_runs.validate_runs``)
        offs, lens = spans[0][ks], spans[1][ks]
        row = math.prod(t.shape[1:]) * itemsize(t.dtype)
        starts = t.table.offsets[ks, 0] * row + at
        batch.add_many(t.table, ks, offs, starts, starts + lens, buf)
        placed.append((name, t, pos, at, ks, starts - at, lens))
        at += t.nbytes
    batch.run(r.read_handle)
    out: dict[str, tuple[str | None, str | None]] = {}
    for name, t, _pos, at, klist, starts, lens in placed:
        view = buf[at : at + t.nbytes]
        if verify:
            _check(name, t, view, klist, starts, lens, src)
        out[name] = (xxhash.xxh3_64_hexdigest(view), t.fingerprint)
    # Adjacent output tensors are written together.
    i = 0
    while i < len(placed):
        j = i
        while j + 1 < len(placed) and placed[j + 1][2] == placed[j][2] + placed[j][1].nbytes:
            j += 1
        a, b = placed[i][3], placed[j][3] + placed[j][1].nbytes
        write(buf[a:b], placed[i][2])
        progress(b - a)
        i = j + 1
    return out


def _check(
    name: str,
    t: TensorEntry,
    view: memoryview,
    ks: np.ndarray,
    starts: np.ndarray,
    lens: np.ndarray,
    src: str,
) -> None:
    """Every recorded slice hash of the tensor against the bytes read (empty slices: the empty hash)."""
    table = t.table
    found = np.full(len(table), _EMPTY, dtype=np.uint64)
    pieces = map(view.__getitem__, map(slice, starts.tolist(), (starts + lens).tolist()))
    found[ks] = np.fromiter(map(xxhash.xxh3_64_intdigest, pieces), np.uint64, len(ks))
    hashed, want = recorded_hashes(table)
    bad = np.flatnonzero(found[hashed] != want)
    if len(bad):
        k = int(hashed[bad[0]])
        failure = IntegrityFailure(
            name, table.file(k), table.key(k), table.xxh3(k) or "-", f"{int(found[k]):016x}"
        )
        raise IntegrityError([failure], checkpoint=src)
