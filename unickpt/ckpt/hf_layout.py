"""The Hugging Face files of a gathered save, planned up front from global shapes (no torch).

A gathered save writes ordinary Hugging Face safetensors files: each tensor whole, under its
own name, in save order, split into shard files as huggingface_hub splits them. Everything
about those files follows from the tensors' names, dtypes and global shapes: which file holds
which tensor, the headers, and where each tensor's bytes start. ``plan_hf_layout`` computes it
once, identically on every rank, so that every rank can write the bytes of the slices it holds
straight into place (``io/hf_save.py``) while rank 0 writes the headers.

Integrity without gathering: no rank holds a whole tensor, and the xxh3-64 of a whole tensor
cannot be combined from pieces. Each tensor's bytes are therefore cut into **ranges**, the
maximal byte runs written by one rank (``writer_ranges``); each rank hashes the ranges it
wrote, and the index records them per slice (``SliceEntry.ranges``, docs/format.md 5.1). A
tensor written by one rank has one range, and its hash is the slice's ``xxh3`` as before.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from unickpt.ckpt.safetensors_io import encode_header
from unickpt.ckpt.writer import group_files
from unickpt.spec.dtypes import itemsize
from unickpt.spec.naming import shard_name, single_name

__all__ = [
    "HFFile",
    "HFLayout",
    "HFPlace",
    "box_runs",
    "plan_hf_layout",
    "writer_ranges",
]

# (name, dtype, global shape), in save order.
TensorDesc = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True)
class HFPlace:
    """Where a tensor's bytes live: its file and the byte position of its first byte in it."""

    file: str
    pos: int  # absolute position in the file (header included)
    nbytes: int


@dataclass(frozen=True)
class HFFile:
    name: str
    specs: tuple[TensorDesc, ...]  # (key, dtype, shape) in file order; key = tensor name
    header_len: int  # bytes before the data section (8-byte length + padded JSON)
    size: int  # the whole file's size

    def header(self, metadata: Mapping[str, str]) -> bytes:
        """The file's header with ``metadata`` (same-length metadata gives the same length)."""
        raw, _ = encode_header(list(self.specs), dict(metadata))
        return raw


@dataclass(frozen=True)
class HFLayout:
    files: tuple[HFFile, ...]
    places: dict[str, HFPlace]


def plan_hf_layout(
    tensors: Sequence[TensorDesc],
    *,
    kind: str,
    size_per_shard_bytes: int | None,
    metadata_for: Mapping[str, Mapping[str, str]] | None = None,
    metadata: Mapping[str, str] | None = None,
    single_file: str | None = None,
) -> HFLayout:
    """The files of a gathered save of ``tensors`` (the order a gathered save has always used).

    ``size_per_shard_bytes=None`` is one file (``single_file``, or ``<kind>.safetensors``);
    otherwise the tensors are grouped by huggingface_hub's splitter into
    ``<kind>-0000k-of-0000N.safetensors``. ``metadata`` is every file's header metadata
    (``metadata_for`` by file name overrides it); header lengths depend on it, so a header
    rewritten later must keep every value's length.
    """
    by_name = {n: (d, tuple(s)) for n, d, s in tensors}
    if size_per_shard_bytes is None:
        groups = [[n for n, _, _ in tensors]]
        names = [single_file or single_name(kind)]
    else:
        sizes = {n: math.prod(s) * itemsize(d) for n, d, s in tensors}
        groups = group_files(sizes, max(1, size_per_shard_bytes)) if tensors else [[]]
        names = [shard_name(kind, j + 1, len(groups)) for j in range(len(groups))]
    files: list[HFFile] = []
    places: dict[str, HFPlace] = {}
    for fname, members in zip(names, groups, strict=True):
        specs = tuple((n, by_name[n][0], by_name[n][1]) for n in members)
        md = (metadata_for or {}).get(fname, metadata or {})
        header, spans = encode_header(list(specs), dict(md))
        end = spans[-1][1] if spans else 0
        files.append(HFFile(fname, specs, len(header), len(header) + end))
        for (n, _, _), (b, e) in zip(specs, spans, strict=True):
            places[n] = HFPlace(fname, len(header) + b, e - b)
    return HFLayout(tuple(files), places)


def box_runs(
    gshape: Sequence[int], offsets: Sequence[int], shape: Sequence[int], isize: int
) -> list[tuple[int, int]]:
    """The contiguous byte runs of a box in its tensor's C-order bytes, as (start, end) relative
    to the tensor's first byte, in the box's own C order: the box's bytes are its runs one after
    the other, all of the same length. A row slice (``Shard(0)``) is one run; a column slice has
    one run per row.
    """
    nd = len(gshape)
    if math.prod(shape) == 0:
        return []
    if nd == 0:
        return [(0, isize)]
    strides = [math.prod(gshape[d + 1 :]) * isize for d in range(nd)]
    # Dims after k are whole: one run spans shape[k] x the bytes of one index of dim k.
    k = nd - 1
    while k > 0 and shape[k] == gshape[k] and offsets[k] == 0:
        k -= 1
    run = shape[k] * strides[k]
    start = sum(o * st for o, st in zip(offsets, strides, strict=True))
    outer = shape[:k]
    out: list[tuple[int, int]] = []
    for flat in range(math.prod(outer)):
        pos, rem = start, flat
        for d in range(k - 1, -1, -1):
            pos += (rem % outer[d]) * strides[d]
            rem //= outer[d]
        out.append((pos, pos + run))
    return out


def writer_ranges(
    gshape: Sequence[int], dtype: str, boxes: Sequence[tuple[Sequence[int], Sequence[int], int]]
) -> list[tuple[int, int, int]]:
    """A tensor's ranges: (start, end, writer) byte runs relative to the tensor, in order.

    ``boxes`` are the tensor's written slices as (offsets, shape, writer rank); they tile the
    tensor. Adjacent runs of the same writer merge into one range, so a row slice, or a flat
    range (ZeRO) cut into several boxes, is one range; a column slice is one range per row.
    """
    isize = itemsize(dtype)
    runs = sorted((b, e, w) for off, shp, w in boxes for b, e in box_runs(gshape, off, shp, isize))
    out: list[tuple[int, int, int]] = []
    for b, e, w in runs:
        if out and out[-1][1] == b and out[-1][2] == w:
            out[-1] = (out[-1][0], e, w)
        else:
            out.append((b, e, w))
    return out
