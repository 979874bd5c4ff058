"""``unickpt diff``: compare two checkpoints tensor by tensor from their index files alone.

Every tensor of a unickpt checkpoint carries a layout-invariant fingerprint (see
``unickpt.spec.hashing``): the same weights saved under FSDP2 x4, TP x2 or merged into a
Hugging Face checkpoint have equal fingerprints. Comparing them needs only the two index
files, so diff is fast on checkpoints of any size and works when the data files are absent.
Tied names are resolved through each checkpoint's aliases before comparing.

``deep=True`` reads the data: every slice is rehashed and every recorded fingerprint recomputed
(integrity), and the two tensors are compared element by element,
streamed chunk by chunk in bounded memory (:func:`compare_tensors`): the report names the first differing
element and how many differ. This also compares checkpoints without fingerprints, such as
plain Hugging Face ones. No torch.

**``--deep``: element by element**, two stored tensors compared streamed in bounded memory.
Each tensor is read in global C order, a flat range of elements at a time, whatever its slices:
the range is split into boxes that are contiguous runs of the global tensor
(:func:`~unickpt.spec.boxes.flat_range_to_boxes`); the part of a box that one slice holds is
a contiguous run of that slice's bytes, read with one ``pread`` and put in place. Elements are
compared as raw words of the item size, so ``-0.0`` differs from ``0.0`` and a NaN payload
counts: the question is whether the stored bits are equal.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from unickpt.ckpt.reader import CheckpointReader
from unickpt.errors import CheckpointFormatError
from unickpt.spec.boxes import contiguous_start, flat_range_to_boxes, intersect
from unickpt.spec.dtypes import itemsize, word_dtype
from unickpt.spec.hashing import (
    SliceHasher,
    combine_partials,
    finalize_fingerprint,
    fingerprint_partial,
)
from unickpt.spec.index import TensorEntry
from unickpt.spec.naming import shown
from unickpt.tools._bands import band_first, bands
from unickpt.tools._common import open_auto
from unickpt.tools._progress import progress_bar
from unickpt.tools.inspect import printable

__all__ = ["DataDifference", "compare_tensors", "read_flat", "DiffReport", "ShapeChange", "diff_checkpoints"]


#: Bytes of data read per side and step (the deep comparison's flat ranges, the data sums' bands):
#: memory stays a few times this whatever the tensor.
CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class DataDifference:
    """Where two stored tensors of equal dtype and shape differ."""

    name: str
    first_index: list[int]  # the first differing element (C order), as a multi-index
    first_flat: int
    count: int  # differing elements
    numel: int

    def __str__(self) -> str:
        return (
            f"{self.name}: {self.count} of {self.numel} element(s) differ, "
            f"first at index {self.first_index} (flat {self.first_flat})"
        )


def read_flat(r: CheckpointReader, t: TensorEntry, start: int, stop: int) -> np.ndarray:
    """Elements [start, stop) of the global C-order tensor as unsigned words of the item size.

    The slices are read from the tensor's table (``SliceTable``: file, key and box from its
    columns, the slices a box meets by ``overlapping``): no ``SliceEntry`` built."""
    wd = word_dtype(t.dtype)
    out = np.empty(stop - start, dtype=wd)
    if stop == start:
        return out
    table = t.table
    isz = wd.itemsize
    if len(t.shape) == 0:  # one element: any slice holds it
        r.read_key_bytes(table.file(0), table.key(0), 0, isz, memoryview(out.view(np.uint8)))  # type: ignore[arg-type]
        return out
    for (boff, bshape), flat0 in flat_range_to_boxes(t.shape, start, stop):
        box = out[flat0 - start : flat0 - start + math.prod(bshape)].reshape(bshape)
        got = 0
        for k in table.overlapping(boff, bshape):
            offsets, shape = table.box(k)
            inter = intersect(boff, bshape, offsets, shape)
            if inter is None:  # pragma: no cover - overlapping gives the slices that meet the box
                continue
            ioff, ishp = inter
            src_off = [a - b for a, b in zip(ioff, offsets, strict=True)]
            first = contiguous_start(shape, src_off, ishp)
            if first is None:  # pragma: no cover - a run of the global tensor is a run of any slice
                raise CheckpointFormatError(f"tensor: internal: box {ioff}+{ishp} is not a run of a slice")
            n = math.prod(ishp)
            buf = np.empty(n, dtype=wd)
            view = memoryview(buf.view(np.uint8))  # type: ignore[arg-type]
            r.read_key_bytes(table.file(k), table.key(k), first * isz, n * isz, view)
            dst = tuple(slice(a - b, a - b + c) for a, b, c in zip(ioff, boff, ishp, strict=True))
            box[dst] = buf.reshape(ishp)
            got += n
        if got != math.prod(bshape):
            raise CheckpointFormatError(
                f"{r.index_path or r.directory}: the slices of a tensor of shape {t.shape} hold {got} "
                f"of the {math.prod(bshape)} elements of box {list(boff)}+{list(bshape)} "
                "(overlapping or missing slices)"
            )
    return out


def compare_tensors(
    name: str, ra: CheckpointReader, ta: TensorEntry, rb: CheckpointReader, tb: TensorEntry
) -> DataDifference | None:
    """None when the two tensors (equal dtype and shape) hold the same bits, else where they differ."""
    numel = math.prod(ta.shape)
    step = max(1, CHUNK_BYTES // word_dtype(ta.dtype).itemsize)
    first = -1
    count = 0
    for start in range(0, numel, step):
        stop = min(numel, start + step)
        neq = read_flat(ra, ta, start, stop) != read_flat(rb, tb, start, stop)
        k = int(np.count_nonzero(neq))
        if k and first < 0:
            first = start + int(np.argmax(neq))
        count += k
    if count == 0:
        return None
    index = [int(i) for i in np.unravel_index(first, ta.shape)] if ta.shape else []
    return DataDifference(name, index, first, count, numel)


@dataclass(frozen=True)
class ShapeChange:
    name: str
    a_dtype: str
    a_shape: list[int]
    b_dtype: str
    b_shape: list[int]

    def __str__(self) -> str:
        return f"{self.name}: {self.a_dtype}{self.a_shape} -> {self.b_dtype}{self.b_shape}"


@dataclass
class DiffReport:
    """The result of :func:`diff_checkpoints`. Names are tensor names (tied names resolved).

    ``identical`` is True only when every tensor of both checkpoints was proven equal.
    ``unverifiable`` lists tensors present in both with equal dtype and shape that could not
    be compared without reading data (no fingerprint, or tied differently): rerun with
    ``deep=True``. ``integrity_failures`` (deep only)
    lists slices whose bytes do not match their recorded hash, and recorded fingerprints that
    do not match the data. ``data_differences`` (deep only) says, per changed tensor, the first
    differing element and how many differ.
    """

    a: str
    b: str
    deep: bool
    same: list[str] = field(default_factory=list)
    changed: list[str] = field(default_factory=list)
    only_in_a: list[str] = field(default_factory=list)
    only_in_b: list[str] = field(default_factory=list)
    dtype_or_shape_changed: list[ShapeChange] = field(default_factory=list)
    unverifiable: list[str] = field(default_factory=list)
    integrity_failures: list[str] = field(default_factory=list)
    data_differences: list[DataDifference] = field(default_factory=list)

    @property
    def different(self) -> bool:
        return bool(
            self.changed
            or self.only_in_a
            or self.only_in_b
            or self.dtype_or_shape_changed
            or self.integrity_failures
        )

    @property
    def identical(self) -> bool:
        return not self.different and not self.unverifiable

    @property
    def exit_code(self) -> int:
        """0 identical, 1 different, 2 could not tell (unverifiable tensors only)."""
        if self.different:
            return 1
        return 2 if self.unverifiable else 0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["identical"] = self.identical
        d["exit_code"] = self.exit_code
        return d

    def format(self) -> str:
        lines = [f"A: {self.a}", f"B: {self.b}", f"same: {len(self.same)} tensor(s)"]

        def section(title: str, items: list[Any]) -> None:
            if items:
                lines.append(f"{title} ({len(items)}):")
                lines.extend(f"  {printable(x)}" for x in items)

        section("changed", self.changed)
        section("data differences", self.data_differences)
        section("only in A", self.only_in_a)
        section("only in B", self.only_in_b)
        section("dtype or shape changed", self.dtype_or_shape_changed)
        section("unverifiable without --deep (no fingerprint, or tied differently)", self.unverifiable)
        section("integrity failures", self.integrity_failures)
        if self.identical:
            verdict = "identical"
        elif self.different:
            verdict = "different"
        else:
            verdict = "undetermined: rerun with --deep to compare the data"
        lines.append(f"result: {verdict}")
        return "\n".join(lines)


def _resolve(r: CheckpointReader, name: str) -> str:
    return r.block.aliases.get(name, name)


def _names(r: CheckpointReader) -> list[str]:
    return list(r.block.tensors) + [a for a in r.block.aliases if a not in r.block.tensors]


def _data_sum(
    r: CheckpointReader,
    name: str,
    t: TensorEntry,
    failures: list[str],
    progress: Callable[[int], object],
) -> int:
    """The fingerprint partial total of a stored tensor, from its data;
    slice hashes checked on the way."""
    isz = itemsize(t.dtype)
    partials = []
    table = t.table  # the slices read from its columns, taken whole: no per-slice object
    columns = table.rows()
    for file, key, xxh3, offsets, shape in columns:
        n = math.prod(shape) * isz
        h = SliceHasher()
        if len(shape) == 0:
            data = r.read_key_bytes(file, key, 0, r.key_location(file, key)[2])  # the whole slice
            h.update(data)
            partials.append(
                fingerprint_partial(np.frombuffer(data, dtype=f"<u{isz}"), t.shape, offsets, shape)
            )
        elif n:
            # Bands of at most CHUNK_BYTES bytes (ranges of rows, or of one row when a row is larger).
            for band in bands(shape, isz, CHUNK_BYTES):
                data = r.read_key_bytes(file, key, band_first(band, shape) * isz, math.prod(band.shape) * isz)
                h.update(data)
                off = [o + b for o, b in zip(offsets, band.offsets(len(shape)), strict=True)]
                partials.append(
                    fingerprint_partial(np.frombuffer(data, dtype=f"<u{isz}"), t.shape, off, band.box_shape())
                )
        progress(n)
        found = h.hexdigest()
        if xxh3 is not None and found != xxh3:
            failures.append(
                f"{r.directory}: tensor {shown(name)} in file {shown(file)} (key {shown(key)}): "
                f"expected xxh3-64 {xxh3}, found {found}"
            )
    return combine_partials(partials)


def diff_checkpoints(
    a: str | os.PathLike[str],
    b: str | os.PathLike[str],
    deep: bool = False,
    *,
    kind: str | None = None,
    progress: bool = False,
    index_only: bool = False,
) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (any layouts); return a :class:`DiffReport`.

    Without ``deep``, tensors are compared by the fingerprints their indexes record; a tensor
    whose fingerprint one side does not record (a plain Hugging Face checkpoint, a save without
    fingerprints) or cannot be compared (tied under another name) gets it computed from that
    side's data, its slice hashes checked on the way; ``index_only=True`` reads nothing but the
    indexes (and a plain checkpoint's headers) and reports such tensors as ``unverifiable``.
    Raises ``UnickptError`` subclasses or ``OSError`` when either input is not a usable checkpoint.
    """
    with open_auto(a, kind) as ra, open_auto(b, kind or ra.kind) as rb:
        report = DiffReport(os.fspath(a), os.fspath(b), deep)
        names_a = _names(ra)
        names_b = set(_names(rb))
        set_a = set(names_a)
        report.only_in_a = [n for n in names_a if n not in names_b]
        report.only_in_b = [n for n in _names(rb) if n not in set_a]
        common = [n for n in names_a if n in names_b]
        checked: set[tuple[int, str]] = set()
        pending: list[tuple[str, str, str, TensorEntry, TensorEntry]] = []
        total = 0
        if deep:
            ra.validate_structure()
            rb.validate_structure()
            total = 2 * sum(
                ra.tensors[_resolve(ra, n)].nbytes + rb.tensors[_resolve(rb, n)].nbytes for n in common
            )
        with progress_bar(total, "diff --deep", progress and deep) as update:
            for n in common:
                ta, tb = _resolve(ra, n), _resolve(rb, n)
                ea, eb = ra.tensors[ta], rb.tensors[tb]
                if ea.dtype != eb.dtype or ea.shape != eb.shape:
                    report.dtype_or_shape_changed.append(
                        ShapeChange(n, ea.dtype, ea.shape, eb.dtype, eb.shape)
                    )
                    continue
                if deep:
                    for side, (r, t, e) in enumerate(((ra, ta, ea), (rb, tb, eb))):
                        if (side, t) in checked:
                            continue
                        checked.add((side, t))
                        s = _data_sum(r, t, e, report.integrity_failures, update)
                        if e.fingerprint is not None:
                            fp = finalize_fingerprint(t, e.dtype, e.shape, s)
                            if fp != e.fingerprint:
                                report.integrity_failures.append(
                                    f"{r.index_path or r.directory}: tensor {shown(t)}: recorded fingerprint "
                                    f"{e.fingerprint}, data gives {fp}"
                                )
                    d = compare_tensors(n, ra, ea, rb, eb)
                    update(ea.nbytes + eb.nbytes)
                    if d is None:
                        report.same.append(n)
                    else:
                        report.changed.append(n)
                        report.data_differences.append(d)
                elif ta == tb and ea.fingerprint is not None and eb.fingerprint is not None:
                    (report.same if ea.fingerprint == eb.fingerprint else report.changed).append(n)
                elif index_only:
                    report.unverifiable.append(n)
                else:
                    pending.append((n, ta, tb, ea, eb))
        if pending:
            _from_data(report, ra, rb, pending, progress)
        return report


def _from_data(
    report: DiffReport,
    ra: CheckpointReader,
    rb: CheckpointReader,
    pending: list[tuple[str, str, str, TensorEntry, TensorEntry]],
    progress: bool,
) -> None:
    """Decide the tensors the indexes could not, from fingerprints computed from the data.

    A side whose recorded fingerprint can be compared (the same stored name on both sides) keeps
    it, and the other side's is computed; otherwise both are computed under the common name.
    Only the sides computed are read.
    """
    # (name, fingerprint name, [(reader, stored name, entry) of each side to compute], kept)
    plans: list[tuple[str, str, list[tuple[CheckpointReader, str, TensorEntry]], str | None]] = []
    for n, ta, tb, ea, eb in pending:
        if ta == tb and ea.fingerprint is not None:
            plans.append((n, ta, [(rb, tb, eb)], ea.fingerprint))
        elif ta == tb and eb.fingerprint is not None:
            plans.append((n, tb, [(ra, ta, ea)], eb.fingerprint))
        else:
            plans.append((n, n, [(ra, ta, ea), (rb, tb, eb)], None))
    total = sum(e.nbytes for *_, sides, _ in plans for _, _, e in sides)
    with progress_bar(total, "diff: fingerprints from the data", progress) as update:
        for n, name, sides, kept in plans:
            found = [
                finalize_fingerprint(
                    name, e.dtype, e.shape, _data_sum(r, t, e, report.integrity_failures, update)
                )
                for r, t, e in sides
            ]
            if kept is not None:
                found.append(kept)
            (report.same if found[0] == found[1] else report.changed).append(n)
