"""Bounded-memory pieces of ``unickpt merge``: bands of a tensor, and holes of sparse files.

A tensor whose slices are not contiguous runs of it (column splits, 2-D meshes), or that is
cast, cannot be copied byte range by byte range. It is rebuilt one *band* at a time: a box
of consecutive elements in C order (a range of rows, or of a row when one row is too large)
of at most ``budget`` bytes. Within a band, every stored slice contributes one contiguous
piece of its own bytes, and across the bands of a tensor each slice's pieces come in its
own storage order, so a slice's hash is checked by streaming its pieces in turn.

Sparse files: a merge of a file holding holes (a header claiming terabytes backed by a sparse
file) must neither read nor write the holes byte by byte into memory or onto disk. Holes of the
source are found with ``SEEK_DATA``; zero bands are not written, leaving holes in the output.
"""

from __future__ import annotations

import errno
import itertools
import math
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Band", "Piece", "bands", "band_first", "pieces", "is_sparse", "next_data"]


@dataclass(frozen=True)
class Band:
    """Elements ``prefix`` (fixed indices of dims ``< dim``), ``start:stop`` on ``dim``, all of the rest."""

    prefix: tuple[int, ...]
    dim: int
    start: int
    stop: int
    shape: tuple[int, ...]  # the band as a box: (stop - start, *global_shape[dim + 1:])

    def offsets(self, ndim: int) -> list[int]:
        """The band's first element as a global index (its box offsets)."""
        return [*self.prefix, self.start] + [0] * (ndim - self.dim - 1)

    def box_shape(self) -> list[int]:
        """The band's box shape in the tensor's own rank: 1 on the prefix dims."""
        return [1] * len(self.prefix) + list(self.shape)


def bands(shape: Sequence[int], itemsize: int, budget: int) -> Iterator[Band]:
    """The bands of a tensor of ``shape``, in C order, each at most ``budget`` bytes (or one element).

    A 0-dim tensor is one band of one element; a tensor with no elements has no band.
    """
    nd = len(shape)
    if math.prod(shape) == 0:
        return
    if nd == 0:
        yield Band((), 0, 0, 1, ())
        return
    # The outermost dim whose rows (all the dims after it) fit the budget.
    dim = nd - 1
    for d in range(nd):
        if math.prod(shape[d + 1 :]) * itemsize <= budget:
            dim = d
            break
    row = math.prod(shape[dim + 1 :]) * itemsize
    step = max(1, budget // row)
    rest = tuple(shape[dim + 1 :])
    for prefix in itertools.product(*(range(n) for n in shape[:dim])):
        for a in range(0, shape[dim], step):
            b = min(shape[dim], a + step)
            yield Band(tuple(prefix), dim, a, b, (b - a, *rest))


def band_first(band: Band, shape: Sequence[int]) -> int:
    """The flat (C-order) index of a band's first element in a tensor of ``shape``."""
    first = 0
    for d, i in enumerate([*band.prefix, band.start]):
        first += i * math.prod(shape[d + 1 :])
    return first


@dataclass(frozen=True)
class Piece:
    """The part of one stored slice inside one band: contiguous in the slice's bytes."""

    first: int  # first element, counted in the slice's own C order
    count: int  # elements
    lo: int  # its rows within the band (on the band's dim)
    hi: int
    inner: tuple[slice, ...]  # its place on the dims after the band's dim


def pieces(band: Band, offsets: Sequence[int], shape: Sequence[int]) -> Piece | None:
    """The piece of the slice at ``offsets`` of ``shape`` inside ``band``, or None."""
    if len(shape) == 0:  # a 0-dim tensor's one slice
        return Piece(0, 1, 0, 1, ())
    k = band.dim
    first = 0
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    for d, i in enumerate(band.prefix):
        if not offsets[d] <= i < offsets[d] + shape[d]:
            return None
        first += (i - offsets[d]) * strides[d]
    lo = max(band.start, offsets[k])
    hi = min(band.stop, offsets[k] + shape[k])
    if lo >= hi:
        return None
    first += (lo - offsets[k]) * strides[k]
    inner = tuple(slice(o, o + n) for o, n in zip(offsets[k + 1 :], shape[k + 1 :], strict=True))
    return Piece(first, (hi - lo) * strides[k], lo - band.start, hi - band.start, inner)


def is_sparse(fd: int) -> bool:
    """True when the file holds fewer allocated bytes than its size (it may have holes)."""
    st = os.fstat(fd)
    return st.st_blocks * 512 < st.st_size


def next_data(fd: int, pos: int, end: int) -> int:
    """The first offset >= ``pos`` holding data, or ``end`` when ``[pos, end)`` is all hole.

    Where the file system cannot say (no ``SEEK_DATA``), every byte counts as data.
    """
    seek_data = getattr(os, "SEEK_DATA", None)
    if seek_data is None:  # pragma: no cover - not Linux/BSD
        return pos
    try:
        return min(os.lseek(fd, pos, seek_data), end)
    except OSError as e:
        if e.errno == errno.ENXIO:  # no data after pos: the rest of the file is a hole
            return end
        return pos
