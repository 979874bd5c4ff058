"""Many stored slices located and checked against their files' headers at once (no torch).

A sliced save of 70B on 512 ranks stores 370k slices, 723 in each of 512 files. Loading,
verifying or merging it needs, for every slice, its file's header entry: present under the
slice's key, of the tensor's dtype and the slice's shape, and where its bytes are. Asking the
header one key at a time costs a few Python calls per slice; here the slices of many tensors are
handled together:

1. every slice's key is formed once (``NAME@K`` by the rule, or the table's key list) and its
   file numbered across all tables;
2. per file, the keys are matched to the header's entry positions with one ``map`` over the
   header's key -> position dict (``HeaderEntries.positions``);
3. per tensor, the dtype codes, shapes and byte ranges of its entries are compared with the
   slice table with a few numpy operations over all its slices.

Any doubt (a key its file lacks, a dtype or a shape that differs, a header not validated in bulk)
answers None: the caller's slice-by-slice path then runs and raises the error it always raised,
naming the first slice at fault.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from unickpt.errors import UnickptError
from unickpt.format.safetensors_bulk import HeaderEntries, dtype_code
from unickpt.format.safetensors_io import SafetensorsHeader

__all__ = [
    "Part",
    "Spans",
    "FileNumbers",
    "all_referenced",
    "locate",
    "locate_all",
    "recorded_hashes",
    "slice_keys",
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
        name = table.name
        return [f"{name}@{k}" for k in ks.tolist()]
    keys: list[str] = table.keys()
    if len(ks) == len(keys) and (len(ks) == 0 or (ks[0] == 0 and ks[-1] == len(ks) - 1)):
        return keys  # every slice, in order (positions are sorted and unique)
    return list(map(keys.__getitem__, ks.tolist()))


def locate(
    header_of: Callable[[str], SafetensorsHeader], parts: list[Part]
) -> tuple[list[Spans], dict[str, int]] | None:
    """Per part, where its slices are: their files hold their keys with the part's dtype and each
    slice's shape. None at the first doubt (the caller's per-slice path names what is wrong).

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
    hpos = np.empty(n, dtype=np.int64)
    names = files.names
    cols: list[list[np.ndarray]] = [[], [], [], [], [], []]  # codes, begin, length, ndims, dim start, dims
    base = dim_base = 0
    matched: dict[str, int] = {}
    for seg in np.split(order, cuts):
        file = names[int(allf[seg[0]])]
        try:
            h = header_of(file)
        except (UnickptError, OSError):
            return None  # the per-slice path raises it, in its order
        ents = h.entries
        if not isinstance(ents, HeaderEntries):
            return None
        try:
            found = np.fromiter(map(ents.positions.__getitem__, key_arr[seg]), np.int64, len(seg))
        except KeyError:
            return None
        hpos[seg] = base + found
        seen = np.zeros(len(ents), dtype=bool)
        seen[found] = True
        matched[file] = int(np.count_nonzero(seen))  # each entry counted once
        codes, begin, end, ndims, dims = ents.arrays()
        vals = (codes, begin + h.data_start, end - begin, ndims, np.cumsum(ndims) - ndims + dim_base, dims)
        for col, a in zip(cols, vals, strict=True):
            col.append(a)
        base += len(codes)
        dim_base += len(dims)
    codes, begin, length, ndims, dstart, dims = (np.concatenate(c) for c in cols)
    out: list[Spans] = []
    at = 0
    for _, dtype, table, ks in parts:
        hp = hpos[at : at + len(ks)]
        at += len(ks)
        if len(ks):
            shapes = table.shapes[ks]
            nd = shapes.shape[1]
            if not (codes[hp] == dtype_code(dtype)).all() or not (ndims[hp] == nd).all():
                return None
            if nd and not np.array_equal(dims[dstart[hp][:, None] + np.arange(nd, dtype=np.int64)], shapes):
                return None
        out.append((begin[hp], length[hp]))
    return out, matched


def all_referenced(
    header_of: Callable[[str], SafetensorsHeader], files: list[str], matched: dict[str, int]
) -> bool:
    """True when every key of each of ``files`` was matched by a located slice (``locate``'s counts);
    False says only "not shown here" (the full check then decides)."""
    return all(matched.get(f, -1) == len(header_of(f).entries) for f in files)


def locate_all(reader: Any) -> dict[str, int] | None:
    """Every slice of a ``CheckpointReader`` located and checked (``locate``); the spans are kept in
    ``reader.spans``. Returns the per-file counts of ``locate``, None at the first doubt."""
    tensors = reader.tensors
    parts = [(n, t.dtype, t.table, np.arange(len(t.table), dtype=np.int64)) for n, t in tensors.items()]
    got = locate(reader.header, parts)
    if got is None:
        return None
    reader.spans.update(zip(tensors, got[0], strict=True))
    return got[1]


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
