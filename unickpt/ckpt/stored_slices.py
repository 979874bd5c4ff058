"""Stored slices, many at once (no torch): located in their files, checked against the headers, read coalesced.

**Locating and checking.** A sliced save of 70B on 512 ranks stores 370k slices, 723 in each of 512 files. Loading,
verifying or merging it needs, for every slice, its file's header entry: present under the
slice's key, of the tensor's dtype and the slice's shape, and where its bytes are. This module is
the one place that answers it (load, verify, merge and the reader's structure check all call
:func:`locate`, the byte ranges alone come from :func:`table_spans`); asking the header one key at
a time would cost a few Python calls per slice, so the slices of many tensors are handled together:

1. every slice's key is formed once (``NAME@K`` by the rule, or the table's key list) and its
   file numbered across all tables;
2. per file, the keys are matched to the header's entry positions with one ``map`` over the
   header's key -> position dict (``HeaderEntries.positions``);
3. per tensor, the dtype codes, shapes and byte ranges of its entries are compared with the
   slice table with a few numpy operations over all its slices.

A slice whose file lacks its key or holds another dtype or shape is refused with a
``HeaderError`` naming the file, the tensor, the key, what the index says and what the file
holds: the first such slice in the order asked (tensor by tensor, slice by slice), found from the
same arrays.

**Reading, coalesced per file.** A sliced checkpoint's data file holds one slice of every tensor its rank saved, back to back; a
load or a merge that needs many of them would issue one read per slice. A :class:`ReadBatch`
collects ``(file, absolute offset, destination buffer)`` reads, then per file sorts them by
offset, joins those adjacent in the file and in one buffer, and hands the file's pieces to its
read handle's vectored read (``ReadHandle.readv``, ``store/storage.py``): on a local
file one ``preadv`` per run of adjacent pieces straight into their destinations (up to
``IOV_MAX`` buffers a call), on an object store coalesced ranged requests. A file that ends
before a read is complete raises ``IncompleteCheckpointError`` naming the file and the bytes
missing.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Any

import numpy as np

from unickpt.ckpt.safetensors_io import SafetensorsHeader
from unickpt.errors import HeaderError
from unickpt.spec.naming import shown
from unickpt.spec.naming import slice_keys as ruled_keys
from unickpt.spec.safetensors_bulk import dtype_code
from unickpt.store.storage import IOV_MAX, RUN_BYTES, Buffers, ReadHandle

__all__ = [
    "Part",
    "Spans",
    "FileNumbers",
    "all_referenced",
    "locate",
    "locate_all",
    "recorded_hashes",
    "slice_error",
    "slice_keys",
    "table_spans",
    "ReadBatch",
    "IOV_MAX",
    "RUN_BYTES",
]


#: (tensor name, stored dtype, its ``SliceTable``, the slice positions to locate)
Part = tuple[str, str, Any, np.ndarray]
#: Per part: (absolute offsets, byte lengths) of its slices, in the order asked (int64).
Spans = tuple[np.ndarray, np.ndarray]


class FileNumbers:
    """One number per data file across the tables of a checkpoint (each table lists its own files)."""

    def __init__(self) -> None:
        self.ids: dict[str, int] = {}
        self._maps: dict[int, tuple[Sequence[str], np.ndarray]] = {}

    @property
    def names(self) -> list[str]:
        return list(self.ids)

    def of(self, table: Any, ks: np.ndarray) -> np.ndarray:
        """The file numbers of the slices ``ks`` of ``table``."""
        files = table.files
        got = self._maps.get(id(files))
        if got is None or got[0] is not files:
            ids = self.ids
            try:  # every name already numbered (tables of one checkpoint list the same files)
                m = np.fromiter(map(ids.__getitem__, files), dtype=np.int64, count=len(files))
            except KeyError:
                m = np.fromiter(
                    (ids.setdefault(f, len(ids)) for f in files), dtype=np.int64, count=len(files)
                )
            got = (files, m)
            self._maps[id(files)] = got
        out: np.ndarray = got[1][table.file_ids[ks]]
        return out


def slice_keys(table: Any, ks: np.ndarray) -> list[str]:
    """The keys of the slices ``ks`` of ``table`` (formed once each)."""
    if table.ruled_keys:
        return ruled_keys(table.name, ks.tolist())
    keys: list[str] = table.keys()
    if len(ks) == len(keys) and (len(ks) == 0 or (ks[0] == 0 and ks[-1] == len(ks) - 1)):
        return keys  # every slice, in order (positions are sorted and unique)
    return list(map(keys.__getitem__, ks.tolist()))


def locate(
    header_of: Callable[[str], SafetensorsHeader], parts: list[Part]
) -> tuple[list[Spans], dict[str, int]]:
    """Per part, where its slices are: their files hold their keys with the part's dtype and each
    slice's shape, or ``HeaderError`` names the first slice that is not so (in the order of
    ``parts``, then of each part's positions). ``header_of`` raises what a file's header does.

    Also returns, per file touched, how many of its header's entries the slices matched (each
    counted once): when that is the header's length, every key of the file is referenced.
    """
    files = FileNumbers()
    fids = [files.of(table, ks) for _, _, table, ks in parts]
    keys: list[str] = []
    for _, _, table, ks in parts:
        keys.extend(slice_keys(table, ks))
    n = len(keys)
    if n == 0:
        return [(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)) for _ in parts], {}
    allf = np.concatenate(fids)
    order = np.argsort(allf, kind="stable")
    cuts = np.flatnonzero(np.diff(allf[order])) + 1
    key_arr = np.empty(n, dtype=object)
    key_arr[:] = keys
    hpos = np.empty(n, dtype=np.int64)  # the slice's entry in the arrays of all files; -1: none
    names = files.names
    headers: dict[int, SafetensorsHeader] = {}
    cols: list[list[np.ndarray]] = [[], [], [], [], [], []]  # codes, begin, length, ndims, dim start, dims
    base = dim_base = 0
    matched: dict[str, int] = {}
    missing = False
    for seg in np.split(order, cuts):
        fid = int(allf[seg[0]])
        h = headers[fid] = header_of(names[fid])
        ents = h.entries
        pos = ents.positions
        seen = np.zeros(len(ents) + 1, dtype=bool)  # (the extra last place: -1, a missing key)
        try:
            found = np.fromiter(map(pos.__getitem__, key_arr[seg]), np.int64, len(seg))
            hpos[seg] = base + found
        except KeyError:  # some key missing: -1 for those (named below, in order)
            found = np.fromiter(map(pos.get, key_arr[seg], repeat(-1)), np.int64, len(seg))
            hpos[seg] = np.where(found >= 0, base + found, -1)
            missing = True
        seen[found] = True
        matched[names[fid]] = int(np.count_nonzero(seen[:-1]))  # each entry counted once
        codes, begin, end, ndims, dims = ents.arrays()
        vals = (codes, begin + h.data_start, end - begin, ndims, np.cumsum(ndims) - ndims + dim_base, dims)
        for col, a in zip(cols, vals, strict=True):
            col.append(a)
        base += len(codes)
        dim_base += len(dims)
    codes, begin, length, ndims, dstart, dims = (np.concatenate(c) for c in cols)
    out: list[Spans] = []
    at = 0
    for (name, dtype, table, ks), part_fids in zip(parts, fids, strict=True):
        hp = hpos[at : at + len(ks)]
        at += len(ks)
        if len(ks):
            shapes = table.shapes[ks]
            nd = shapes.shape[1]
            code = dtype_code(dtype)
            fine = (
                (not missing or int(hp.min()) >= 0)
                and bool((codes[hp] == code).all())
                and bool((ndims[hp] == nd).all())
                and (
                    not nd
                    or np.array_equal(dims[dstart[hp][:, None] + np.arange(nd, dtype=np.int64)], shapes)
                )
            )
            if not fine:  # the first bad slice, from the same arrays
                safe = np.maximum(hp, 0)
                ok = (hp >= 0) & (codes[safe] == code) & (ndims[safe] == nd)
                if nd and ok.any():
                    got = dims[
                        np.minimum(dstart[safe][:, None] + np.arange(nd, dtype=np.int64), len(dims) - 1)
                    ]
                    ok &= (got == shapes).all(axis=1)
                j = int(np.flatnonzero(~ok)[0])
                h = headers[int(part_fids[j])]
                key = keys[at - len(ks) + j]
                err = slice_error(h, name, dtype, key, shapes[j].tolist())
                if err is None:  # the arrays and the entry disagree: a defect here, not in the file
                    raise RuntimeError(
                        f"internal: {h.path}: slice {key!r} of {name!r} flagged but found in order"
                    )
                raise err
        out.append((begin[hp], length[hp]))
    return out, matched


def slice_error(
    h: SafetensorsHeader, name: str, dtype: str, key: str, shape: list[int]
) -> HeaderError | None:
    """The error of one slice of tensor ``name`` stored under ``key`` as ``dtype``/``shape`` in the
    file of header ``h`` (the file lacks the key, or holds another dtype or shape); None when it
    holds it so. ``locate`` checks many at once and raises this for the first bad one."""
    e = h.entries.describe(key)
    if e is not None and e[0] == dtype and e[1] == shape:
        return None
    found = "nothing under that key" if e is None else f"{e[0]}{shown(e[1])}"
    return HeaderError(
        f"{h.path}: tensor {shown(name)} (key {shown(key)}): index says {dtype}{shown(shape)}, file holds {found}"
    )


def table_spans(
    header_of: Callable[[str], SafetensorsHeader], table: Any, ks: list[int]
) -> tuple[list[str], list[int], list[int]]:
    """(file, absolute offset, byte length) of the stored slices ``ks`` of a ``SliceTable``, their
    dtypes and shapes unchecked (``locate`` checks them); ``HeaderError`` names the first key its
    file lacks."""
    sel = np.asarray(ks, dtype=np.int64)
    files = FileNumbers()
    fids = files.of(table, sel)
    keys = slice_keys(table, sel)
    names = files.names
    offs = np.empty(len(keys), dtype=np.int64)
    lens = np.empty(len(keys), dtype=np.int64)
    key_arr = np.empty(len(keys), dtype=object)
    key_arr[:] = keys
    found = np.empty(len(keys), dtype=np.int64)
    order = np.argsort(fids, kind="stable")
    for seg in np.split(order, np.flatnonzero(np.diff(fids[order])) + 1) if len(keys) else ():
        h = header_of(names[int(fids[seg[0]])])
        got = np.fromiter(map(h.entries.positions.get, key_arr[seg], repeat(-1)), np.int64, len(seg))
        found[seg] = got
        _, begin, end, _, _ = h.entries.arrays()
        at = np.maximum(got, 0)
        offs[seg] = begin[at] + h.data_start if len(begin) else 0
        lens[seg] = end[at] - begin[at] if len(begin) else 0
    if (found < 0).any():
        first = int(np.flatnonzero(found < 0)[0])
        h = header_of(names[int(fids[first])])
        raise HeaderError(f"{h.path}: key {shown(keys[first])} named by the index is not in the file")
    return [names[i] for i in fids.tolist()], offs.tolist(), lens.tolist()


def all_referenced(
    header_of: Callable[[str], SafetensorsHeader], files: list[str], matched: dict[str, int]
) -> bool:
    """True when every key of each of ``files`` was matched by a located slice (``locate``'s counts);
    False says only "not shown here" (the full check then decides)."""
    return all(matched.get(f, -1) == len(header_of(f).entries) for f in files)


def locate_all(reader: Any) -> dict[str, int]:
    """Every slice of a ``CheckpointReader`` located and checked (``locate``, which raises naming the
    first bad slice); the spans are kept in ``reader.spans``. Returns the per-file counts of ``locate``."""
    tensors = reader.tensors
    parts = [(n, t.dtype, t.table, np.arange(len(t.table), dtype=np.int64)) for n, t in tensors.items()]
    spans, matched = locate(reader.header, parts)
    reader.spans.update(zip(tensors, spans, strict=True))
    return matched


_NO_HASH = b"-" * 16


def recorded_hashes(table: Any) -> tuple[np.ndarray, np.ndarray]:
    """(positions, recorded xxh3-64 as uint64) of the slices of ``table`` that have one, read
    from the table's concatenated hashes at once (its ``hash_list`` when they are not a string)."""
    h = table.hashes
    if isinstance(h, str) and len(h) == 16 * len(table):
        try:
            want = np.frombuffer(bytes.fromhex(h.replace("-", "0")), dtype=">u8").astype(np.uint64)
            ks = np.flatnonzero(np.frombuffer(h.encode("ascii"), dtype="S16") != _NO_HASH)
            return ks, want[ks]
        except (ValueError, UnicodeEncodeError):
            pass
    listed = table.hash_list()
    ks = np.asarray([k for k, x in enumerate(listed) if x is not None], dtype=np.int64)
    return ks, np.asarray([int(listed[k], 16) for k in ks.tolist()], dtype=np.uint64)


class ReadBatch:
    """Reads gathered first, done per file in runs of adjacent bytes (locally one ``preadv`` each).

    Reads are kept as arrays (file numbers, offsets, destination ranges), added one at a time
    (:meth:`add`) or many into one destination buffer at once (:meth:`add_many`). At :meth:`run`
    they are sorted per file with numpy; pieces adjacent both in the file and in the same
    destination are joined into one buffer (a tensor's row slices stored back to back are read in
    one piece), and each run of adjacent pieces is one ``preadv``.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self._files = FileNumbers()
        self._views: list[memoryview] = []
        self._cols: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]] = []
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def add(self, file: str, offset: int, out: memoryview) -> None:
        """Read ``out.nbytes`` bytes of ``file`` at absolute ``offset`` into ``out`` (at :meth:`run`)."""
        if out.nbytes:
            one = np.zeros(1, dtype=np.int64)
            self.add_many(_One(file), one, np.asarray([offset], dtype=np.int64), one, one + out.nbytes, out)

    def add_many(
        self,
        table: Any,
        ks: np.ndarray,
        offsets: np.ndarray,
        begin: np.ndarray,
        end: np.ndarray,
        out: memoryview,
    ) -> None:
        """Read, for each ``i``, ``out[begin[i]:end[i]]`` from the file of slice ``ks[i]`` of ``table``
        (a ``SliceTable``: its ``files`` and ``file_ids``) at absolute ``offsets[i]``."""
        keep = end > begin
        if not keep.all():
            ks, offsets, begin, end = ks[keep], offsets[keep], begin[keep], end[keep]
        if len(ks):
            self._cols.append((self._files.of(table, ks), offsets, begin, end - begin, len(self._views)))
            self._views.append(out)
            self._count += len(ks)

    def run(self, handle_of: Callable[[str], ReadHandle]) -> None:
        """Do every read gathered, file by file, through ``handle_of(file)`` (a ``ReadHandle``:
        locally one ``preadv`` per run of adjacent pieces, on an object store coalesced ranged
        requests); the batch is empty afterwards."""
        cols, views, names = self._cols, self._views, self._files.names
        self._reset()
        if not cols:
            return
        f, src, dst, size = (np.concatenate([c[i] for c in cols]) for i in range(4))
        buf = np.concatenate([np.full(len(c[0]), c[4], dtype=np.int64) for c in cols])
        order = np.lexsort((src, f))
        f, src, dst, size, buf = f[order], src[order], dst[order], size[order], buf[order]
        # One piece per run adjacent in the file and in one destination buffer.
        join = (f[1:] == f[:-1]) & (src[1:] == src[:-1] + size[:-1])
        join &= (buf[1:] == buf[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
        first = np.concatenate(([0], np.flatnonzero(~join) + 1))
        total = np.add.reduceat(size, first)
        f, src, dst, buf = f[first], src[first], dst[first], buf[first]
        buffers = Buffers(views)
        buffers.check(buf, dst, total)
        # The pieces of each file (sorted by offset) in one vectored read of its handle.
        cut = np.concatenate(([0], np.flatnonzero(f[1:] != f[:-1]) + 1, [len(f)])).tolist()
        for a, b in itertools.pairwise(cut):
            handle_of(names[int(f[a])]).readv(src[a:b], total[a:b], buf[a:b], dst[a:b], buffers)


class _One:
    """The file table of one read added alone (``ReadBatch.add``)."""

    __slots__ = ("files",)
    file_ids = np.zeros(1, dtype=np.int64)

    def __init__(self, file: str) -> None:
        self.files = [file]
