"""The load engine shared by every CheckpointIO: match, validate, verify, then copy.

Order of events (every rank calls ``load_tensors`` with its own targets):

1. names, shapes and dtypes of the checkpoint are matched against this rank's targets;
2. the structure the rank will read is validated (coverage of every tensor, headers of the
   files it touches) and, with ``verify=True``, the stored slices it will read are rehashed;
3. ranks agree: any problem on any rank raises the same error on every rank, before any
   rank has copied a byte, so no model is left half-loaded by a mismatch;
4. each rank reads only the byte ranges overlapping the blocks it owns: a range that is
   contiguous in the file goes with ``preadv`` straight into the destination tensor when that
   is a contiguous CPU tensor of the stored dtype, anything else through a buffer of one block.
   With ``atomic=True`` the rank's whole share is read into CPU buffers first and the ranks
   agree once more before copying, so even an I/O error leaves every model untouched.

Every read goes through the reader's ``Storage``: a local path and a URL take the same steps.
Reads straight into their tensors are gathered in a ``ReadBatch`` and done per file with one
vectored read (locally one ``preadv`` per run of adjacent slices, on an object store coalesced
ranged requests). On a store that fetches ahead (``Storage.fetch_ahead``), the blocks go in
windows of about ``URL_WINDOW`` bytes whose byte ranges are fetched first, coalesced and in flight
together (``CheckpointReader.prefetch``), and the window's reads are served from them.

``open_for_load`` is how every ``CheckpointIO`` opens a checkpoint (a local path or a URL); on a
URL in a distributed load, rank 0 alone fetches the index and broadcasts its bytes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt._rng import keeps_python_random
from unickpt.ckpt import reader as reader_mod
from unickpt.ckpt.consistency import check_keys_referenced
from unickpt.ckpt.read_batch import ReadBatch, table_spans
from unickpt.ckpt.reader import CheckpointReader, has_hashes, open_checkpoint, open_located, slice_failures
from unickpt.ckpt.slice_spans import FileNumbers, all_referenced, locate
from unickpt.errors import (
    HeaderError,
    IncompleteCheckpointError,
    IntegrityError,
    UnickptError,
)
from unickpt.io.cuda_load import DeviceLoader, copy_cast, off_host
from unickpt.io.load_match import LoadReport, Mapped, match_targets, raise_mismatch
from unickpt.io.load_rows import Located, add_row_box
from unickpt.io.load_rows import as_bytes as _as_bytes
from unickpt.io.tensors import LocalSlice, torch_dtype
from unickpt.spec.boxes import contiguous_start, intersect, runs
from unickpt.spec.dtypes import itemsize
from unickpt.spec.index import TensorEntry

__all__ = [  # LoadReport: io/load_match.py
    "LoadReport",
    "load_tensors",
    "read_box",
    "box_fetcher",
    "open_for_load",
    "each_block",
    "each_slice",
    "wanted_ranges",
    "URL_WINDOW",
    "URL_READ_THREADS",
    "URL_VERIFY_HOLD",
]

#: On a store that fetches ahead (an object store), the blocks of a load are read in windows of
#: about this many bytes: each window's ranges are fetched first (coalesced, in flight together,
#: ``URL_READ_THREADS`` files at once), then copied, so a load holds at most one window of
#: fetched bytes beyond its state.
URL_WINDOW = 128 << 20
URL_READ_THREADS = 8
#: A verified load on such a store keeps the slices it fetched to hash for its reads (each byte
#: fetched once) when they total at most this many bytes per rank; beyond, the reads fetch again.
URL_VERIFY_HOLD = 4 << 30


class _Files:
    """Lazily opened safetensors handles of one load."""

    def __init__(self, reader: CheckpointReader) -> None:
        self.reader = reader
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, Any] = {}

    def get(self, file: str) -> Any:
        h = self._handles.get(file)
        if h is None:
            self.reader.header(file)  # strict validation before safetensors sees the file
            # The very file whose header was checked, even if a save renamed a new one over its name.
            h = self._stack.enter_context(safe_open(self.reader.pinned_path(file), framework="pt"))
            self.reader.check_same_save(file, h.metadata())
            self._handles[file] = h
        return h

    def close(self) -> None:
        self._stack.close()


def read_box(
    files: _Files,
    entry: TensorEntry,
    offsets: tuple[int, ...],
    shape: tuple[int, ...],
    out: torch.Tensor | None = None,
    batch: ReadBatch | None = None,
) -> torch.Tensor:
    """Assemble the block (offsets, shape) of a stored tensor from the slices that overlap it.

    ``out``, when given, is a contiguous CPU tensor of ``shape`` and the stored dtype that
    receives the block in place. A part that is one contiguous run of bytes in the file is read
    with ``preadv`` (a ranged request on a URL) straight into its place (no mapping, no copy);
    other parts (a column range of a row-major slice) go through safetensors' ``get_slice`` where
    the file has an OS path to map, else as one vectored read of their runs (coalesced ranged
    requests). With ``batch``, row-block parts are only located and added to it: ``out`` holds
    the block once the batch has run (``ReadBatch.run``: adjacent bytes of a file in one call).
    """
    dtype = torch_dtype(entry.dtype)
    if out is None:
        out = torch.empty(shape, dtype=dtype)
    table = entry.table
    if len(shape) == 0:
        (s,) = [s for s in entry.slices if math.prod(s.shape) > 0] or entry.slices
        files.reader.read_slice(s, _as_bytes(out))
        return out
    if math.prod(shape) == 0:
        return out
    isz = out.element_size()
    ks = table.overlapping(offsets, shape)
    if _read_row_blocks(files, entry, ks, offsets, shape, out, batch):
        return out
    for s in table.entries_at(ks):
        inter = intersect(offsets, shape, s.offsets, s.shape)
        if inter is None:
            continue
        ioff, ishp = inter
        src_off = tuple(a - b for a, b in zip(ioff, s.offsets, strict=True))
        dst = tuple(slice(a - b, a - b + n) for a, b, n in zip(ioff, offsets, ishp, strict=True))
        start = contiguous_start(s.shape, src_off, ishp)
        if start is None:
            if files.reader.os_path(s.file) is None:  # no path to map: read the runs of the part
                part = torch.empty(ishp, dtype=dtype)
                wanted = [(a * isz, n * isz) for a, n in runs(s.shape, src_off, ishp)]
                files.reader.read_runs(s, wanted, _as_bytes(part))
                out[dst] = part
                continue
            src = tuple(slice(a, a + n) for a, n in zip(src_off, ishp, strict=True))
            out[dst] = files.get(s.file).get_slice(s.key)[src]
            continue
        target = out[dst]
        direct = target.is_contiguous()
        buf = target if direct else torch.empty(ishp, dtype=dtype)
        files.reader.read_bytes(s, start * isz, math.prod(ishp) * isz, _as_bytes(buf))
        if not direct:
            target.copy_(buf)
    return out


def _read_row_blocks(
    files: _Files,
    entry: TensorEntry,
    ks: list[int],
    offsets: tuple[int, ...],
    shape: tuple[int, ...],
    out: torch.Tensor,
    batch: ReadBatch | None = None,
) -> bool:
    """Read the box when it and the slices ``ks`` are all row blocks (every dim past the first
    whole: FSDP's and TP's ``Shard(0)``), each part straight into its byte range of ``out``.

    The parts are computed for all slices at once from the slice table; False (nothing read)
    when the shapes are not row blocks or ``out`` is not contiguous.
    """
    table = entry.table
    gshape = list(entry.shape)
    if not ks or len(gshape) < 1 or not out.is_contiguous() or list(shape[1:]) != gshape[1:]:
        return False
    sel = np.asarray(ks, dtype=np.int64)
    if len(gshape) > 1 and not (table.shapes[sel, 1:] == np.asarray(gshape[1:], dtype=np.int64)).all():
        return False
    row = math.prod(gshape[1:]) * out.element_size()
    starts = table.offsets[sel, 0]
    lo = np.maximum(starts, offsets[0])
    hi = np.minimum(starts + table.shapes[sel, 0], offsets[0] + shape[0])
    dst = _as_bytes(out)
    if batch is not None:  # located now, read later with the batch, coalesced per file
        reader = files.reader
        names, offs, lens = table_spans(reader.header, table, ks)
        for file, off, n, a, b, s0 in zip(
            names, offs, lens, lo.tolist(), hi.tolist(), starts.tolist(), strict=True
        ):
            if (b - s0) * row > n:
                raise HeaderError(
                    f"{file}: read of {(b - a) * row} bytes at {(a - s0) * row} outside a slice of {n}"
                )
            batch.add(file, off + (a - s0) * row, dst[(a - offsets[0]) * row : (b - offsets[0]) * row])
        return True
    read = files.reader.read_bytes
    for s, a, b, s0 in zip(table.entries_at(ks), lo.tolist(), hi.tolist(), starts.tolist(), strict=True):
        read(s, (a - s0) * row, (b - a) * row, dst[(a - offsets[0]) * row : (b - offsets[0]) * row])
    return True


def _direct_target(b: LocalSlice, dtype: torch.dtype) -> torch.Tensor | None:
    """A view of ``b.tensor`` shaped like the box if the box can be read straight into it."""
    t = b.tensor.detach()
    if t.device.type != "cpu" or t.dtype != dtype or not t.is_contiguous() or t.numel() != math.prod(b.shape):
        return None
    return t.view(b.shape)


def _needed_slices(entry: TensorEntry, boxes: list[LocalSlice]) -> list[int]:
    """The stored slices (by position) that share an element with one of this rank's boxes.

    A search in the tensor's slice table per box (binary per dim for a grid): O(boxes x log S),
    no per-slice object.
    """
    table = entry.table
    if len(entry.shape) == 0:
        return [k for k in range(len(table)) if boxes]
    ks: set[int] = set()
    for b in boxes:
        ks.update(table.overlapping(b.offsets, b.shape))
    return sorted(ks)


@keeps_python_random
def load_tensors(
    reader: CheckpointReader,
    targets: dict[str, torch.Tensor],
    boxes_fn: Callable[[str, torch.Tensor], list[LocalSlice]],
    *,
    strict: bool,
    verify: bool,
    allow_dtype_cast: bool = False,
    prefix: str = "",
    what: str = "model",
    group: Any = None,
    ignore_unexpected: Callable[[str], bool] | None = None,
    atomic: bool = False,
    transforms: list[Any] | None = None,
) -> LoadReport:
    """Collective. Copy the checkpoint's values into ``targets`` (name -> tensor/DTensor) in place.

    ``atomic`` reads this rank's whole share into CPU memory before copying anything, so that a
    read error leaves every target untouched; otherwise each block is read in place.
    ``transforms``: a weight mapping (``io/mapping.py``) for the targets the checkpoint holds
    under other names or as several tensors; each box of such a target is assembled from the
    boxes of the stored tensors it is made of, and only those are read.
    """
    err: BaseException | None = None
    held = False  # the reader holds the slices fetched to verify them (on a URL)
    report = LoadReport()
    located: tuple[Located, dict[str, int]] | None = None
    plan: list[tuple[str, str, list[LocalSlice]]] = []  # (target name, source name, boxes)
    mapped: list[Mapped] = []
    try:
        plan, mismatched = match_targets(
            reader,
            targets,
            boxes_fn,
            report,
            allow_dtype_cast=allow_dtype_cast,
            prefix=prefix,
            ignore_unexpected=ignore_unexpected,
            what=what,
            transforms=transforms,
            mapped=mapped,
        )
    except Exception as e:  # whatever it is, every rank must hear of it before the next collective
        err = e
        mismatched = []
    # A name is unexpected only if no rank loads it (pipeline stages each hold a part).
    if _dist.is_distributed(group):
        sets = _dist.all_gather_object(sorted(report.unexpected), group)
        common = set(sets[0]).intersection(*map(set, sets[1:]))
        report.unexpected = [n for n in report.unexpected if n in common]
    try:
        if err is not None:
            raise err
        maybe_fail("load.match")
        raise_mismatch(reader, report, mismatched, strict=strict, what=what)
        reader.check_coverage()
        needed: dict[str, list[int]] = {}
        for _, src, boxes in plan:
            ks = _needed_slices(reader.tensors[src], boxes)
            needed[src] = sorted(set(needed[src]) | set(ks)) if src in needed else ks
        for src, boxes in _mapped_leaves(mapped).items():
            ks = _needed_slices(reader.tensors[src], boxes)
            needed[src] = sorted(set(needed[src]) | set(ks)) if src in needed else ks
        # Every file this rank reads, opened at once (on a URL, several headers in flight).
        touched = _files_of(reader, needed)
        reader.open_files(touched)
        located = _locate(reader, needed)  # raises naming the first slice its file does not hold
        # Every key of a file this rank reads is a slice of the index (no data it does not account for);
        # shown by the location when the slices it matched are every entry of the files.
        bulk_refs = all_referenced(reader.header, touched, located[1])
        if reader.has_unickpt_block and not bulk_refs:
            check_keys_referenced(reader.block, touched, reader.header)
        if verify:
            from unickpt.errors import IntegrityFailure

            failures: list[IntegrityFailure] = []
            checked = [(src, reader.tensors[src].table.entry(k)) for src, ks in needed.items() for k in ks]

            def check(item: tuple[str, Any]) -> None:
                src, s = item
                failures.extend(slice_failures(src, s, reader.iter_slice(s)))

            # On a URL, the slices to hash are fetched a window at a time, coalesced, and kept
            # for the reads below (each byte fetched once) when they fit URL_VERIFY_HOLD.
            held = each_slice(reader, [(src, s) for src, s in checked if has_hashes(s)], check, keep=True)
            if failures:
                raise IntegrityError(failures, reader.index_path or reader.directory)
    except Exception as e:
        err = e
    try:
        _dist.agree(err, f"loading {what} from {reader.index_path or reader.directory}", group)
    except BaseException:
        reader.drop_prefetched()
        raise

    where = reader.index_path or reader.directory
    if atomic:
        _read_then_copy(reader, plan, what, where, group, held, located[0] if located else {}, mapped)
    else:
        _read_in_place(reader, plan, what, where, group, held, located[0] if located else {}, mapped)
    return report


def _mapped_leaves(mapped: list[Mapped]) -> dict[str, list[LocalSlice]]:
    """The boxes of stored tensors that this rank's boxes of the mapped targets are made of."""
    out: dict[str, list[LocalSlice]] = {}
    for _, node, boxes in mapped:
        for b in boxes:
            for src, off, shp in node.leaves(tuple(b.offsets), tuple(b.shape)):
                leaf = LocalSlice(src, "", (), tuple(off), tuple(shp), b.tensor)
                out.setdefault(src, []).append(leaf)
    return out


def box_fetcher(
    reader: CheckpointReader,
) -> tuple[Callable[[str, tuple[int, ...], tuple[int, ...]], torch.Tensor], Callable[[], None]]:
    """``(fetch, close)``: ``fetch(name, offsets, shape)`` reads that box of a stored tensor
    (only the bytes of the box, ``read_box``); ``close`` closes the files it opened."""
    files = _Files(reader)

    def fetch(name: str, off: tuple[int, ...], shp: tuple[int, ...]) -> torch.Tensor:
        return read_box(files, reader.tensors[name], off, shp)

    return fetch, files.close


def _build_mapped(
    files: _Files, reader: CheckpointReader, mapped: list[Mapped]
) -> Iterator[tuple[LocalSlice, torch.Tensor]]:
    """Each box of the mapped targets, assembled from the boxes of its stored tensors."""

    def fetch(name: str, off: tuple[int, ...], shp: tuple[int, ...]) -> torch.Tensor:
        return read_box(files, reader.tensors[name], off, shp)

    for _, node, boxes in mapped:
        for b in boxes:
            yield b, node.build(tuple(b.offsets), tuple(b.shape), fetch)


def _files_of(reader: CheckpointReader, needed: dict[str, list[int]]) -> list[str]:
    """The data files holding the slices ``needed`` (tensor name -> slice positions), sorted."""
    numbers = FileNumbers()
    ids = [
        numbers.of(reader.tensors[src].table, np.asarray(ks, dtype=np.int64)) for src, ks in needed.items()
    ]
    names = numbers.names
    return sorted(names[i] for i in np.unique(np.concatenate(ids)).tolist()) if ids else []


def _locate(reader: CheckpointReader, needed: dict[str, list[int]]) -> tuple[Located, dict[str, int]]:
    """The needed slices located and checked against their files' headers (``locate``: raises naming
    the first slice at fault). Also: per file, how many of its header's entries those slices matched."""
    parts = [
        (src, reader.tensors[src].dtype, reader.tensors[src].table, np.asarray(ks, dtype=np.int64))
        for src, ks in needed.items()
    ]
    spans, matched = locate(reader.header, parts)
    return {id(reader.tensors[p[0]]): (p[3], sp) for p, sp in zip(parts, spans, strict=True)}, matched


def _read_then_copy(
    reader: CheckpointReader,
    plan: list[tuple[str, str, list[LocalSlice]]],
    what: str,
    where: str,
    group: Any,
    held: bool = False,
    located: Located | None = None,
    mapped: list[Mapped] | None = None,
) -> None:
    """Read everything this rank needs before copying anything, and agree once more: a read error
    on any rank (a file vanishing, an I/O error) then leaves every model untouched. The price is
    one CPU copy of this rank's share of the state."""
    err: BaseException | None = None
    buffers: list[tuple[LocalSlice, torch.Tensor]] = []
    files = _Files(reader)
    try:
        maybe_fail("load.read")
        jobs = [(reader.tensors[src], b) for _, src, boxes in plan for b in boxes]
        batch = ReadBatch()

        def one(job: tuple[TensorEntry, LocalSlice]) -> torch.Tensor:
            entry, b = job
            if located:
                out = torch.empty(b.shape, dtype=torch_dtype(entry.dtype))
                if add_row_box(located, entry, b.offsets, b.shape, out, batch):
                    return out
            return read_box(files, entry, b.offsets, b.shape, batch=batch)

        datas = each_block(reader, jobs, one, held, batch)
        buffers = [(b, data) for (_, b), data in zip(jobs, datas, strict=True)]
        buffers.extend(_build_mapped(files, reader, mapped or []))
    except Exception as e:  # safetensors raises its own error types; every rank must hear of it
        err = _read_error(e, where)
    finally:
        files.close()
    _dist.agree(err, f"reading {what} from {where}", group)
    with torch.no_grad():
        for b, data in buffers:
            copy_cast(b.tensor, data)  # to a device first, then cast there


def _read_in_place(
    reader: CheckpointReader,
    plan: list[tuple[str, str, list[LocalSlice]]],
    what: str,
    where: str,
    group: Any,
    held: bool = False,
    located: Located | None = None,
    mapped: list[Mapped] | None = None,
) -> None:
    """Read each block straight into its tensor (CPU, same dtype) or through a buffer of that one
    block: memory stays at one block over the state. A read error mid-way leaves the state
    partly loaded; every rank raises, saying so."""
    err: BaseException | None = None
    files = _Files(reader)
    # Blocks read straight into their tensors are located first and read at the end (of each
    # window on a store that fetches ahead), coalesced per file (locally one preadv per run of
    # adjacent slices).
    batch = ReadBatch()
    # Blocks of device tensors: read through two pinned host buffers, copied chunk by chunk (io/cuda_load.py).
    device = DeviceLoader()
    try:

        def one(job: tuple[TensorEntry, LocalSlice]) -> None:
            entry, b = job
            direct = _direct_target(b, torch_dtype(entry.dtype))
            if direct is None and off_host(b.tensor):
                with torch.no_grad():
                    device.load(
                        b.tensor,
                        b.offsets,
                        b.shape,
                        torch_dtype(entry.dtype),
                        functools.partial(read_box, files, entry),
                    )
                maybe_fail("load.read")
                return
            bulk = direct is not None and bool(located)
            if bulk and add_row_box(located, entry, b.offsets, b.shape, direct, batch):  # type: ignore[arg-type]
                maybe_fail("load.read")
                return
            with torch.no_grad():
                data = read_box(
                    files, entry, b.offsets, b.shape, out=direct, batch=batch if direct is not None else None
                )
                maybe_fail("load.read")
                if direct is None:
                    b.tensor.copy_(data.to(b.tensor.dtype).reshape(b.tensor.shape))

        each_block(
            reader, [(reader.tensors[src], b) for _, src, boxes in plan for b in boxes], one, held, batch
        )
        with torch.no_grad():
            for b, data in _build_mapped(files, reader, mapped or []):
                copy_cast(b.tensor, data)
        device.close()
    except Exception as e:
        cause = _read_error(e, where)
        err = IncompleteCheckpointError(
            f"{where}: reading failed after part of the {what} was copied in place, so the {what} is "
            f"partly loaded; load it again (CheckpointIO(atomic_load=True) leaves it untouched on a "
            f"read error): {type(cause).__name__}: {cause}"
        )
        err.__cause__ = e
    finally:
        device.close()
        files.close()
    _dist.agree(err, f"reading {what} from {where}", group)


def _read_error(e: Exception, where: str) -> BaseException:
    if isinstance(e, (UnickptError, OSError)):
        return e
    return IncompleteCheckpointError(f"{where}: reading failed: {type(e).__name__}: {e}")


def each_block(
    reader: CheckpointReader,
    jobs: list[tuple[TensorEntry, LocalSlice]],
    fn: Callable[[Any], Any],
    held: bool = False,
    batch: ReadBatch | None = None,
) -> list[Any]:
    """``[fn(job) for job in jobs]``, then the reads ``fn`` gathered in ``batch`` run. On a store
    that fetches ahead (``Storage.fetch_ahead``), jobs go in windows of about ``URL_WINDOW`` bytes:
    every byte range a window's blocks need is fetched first (``reader.prefetch``: coalesced
    requests, all in flight, files in parallel), then the blocks (and the batch, at the end of
    each window) are copied from memory.

    ``held``: the reader still holds the whole slices ``each_slice(keep=True)`` fetched to hash
    them; ranges they cover are not fetched again, and they are dropped when this returns."""
    if not reader.storage.fetch_ahead:
        done = [fn(job) for job in jobs]
        if batch is not None:
            batch.run(reader.read_handle)
        return done
    out: list[Any] = []
    start = 0
    try:
        while start < len(jobs):
            stop, size = start, 0
            while stop < len(jobs) and (stop == start or size < URL_WINDOW):
                entry, b = jobs[stop]
                size += math.prod(b.shape) * itemsize(entry.dtype)
                stop += 1
            window = jobs[start:stop]
            # Ranges the reader already holds (``held``) are not fetched again (``Prefetched.fetch``).
            reader.prefetch(wanted_ranges(reader, window), URL_READ_THREADS)
            try:
                out += [fn(job) for job in window]
                if batch is not None:
                    batch.run(reader.read_handle)
            finally:
                if not held:
                    reader.drop_prefetched()
            start = stop
    finally:
        reader.drop_prefetched()
    return out


def wanted_ranges(
    reader: CheckpointReader, jobs: list[tuple[TensorEntry, LocalSlice]]
) -> dict[str, list[tuple[int, int]]]:
    """The ``(absolute offset, length)`` ranges of each data file that ``read_box`` reads for these blocks."""
    wanted: dict[str, list[tuple[int, int]]] = {}
    for entry, b in jobs:
        isz = itemsize(entry.dtype)
        if len(b.shape) == 0:
            (s,) = [s for s in entry.slices if math.prod(s.shape) > 0] or entry.slices
            _, off, n = reader.slice_location(s)
            wanted.setdefault(s.file, []).append((off, n))
            continue
        for s in entry.slices:
            inter = intersect(b.offsets, b.shape, s.offsets, s.shape)
            if inter is None:
                continue
            ioff, ishp = inter
            src_off = tuple(a - o for a, o in zip(ioff, s.offsets, strict=True))
            _, off, _ = reader.slice_location(s)
            wanted.setdefault(s.file, []).extend(
                (off + a * isz, k * isz) for a, k in runs(s.shape, src_off, ishp)
            )
    return wanted


def open_for_load(
    checkpoint: str | os.PathLike[str],
    kind: str,
    group: Any = None,
    storage_options: dict[str, Any] | None = None,
    args: _dist.Args | None = None,
) -> CheckpointReader:
    """Collective: every rank opens the checkpoint; an error on any rank raises on all.

    ``args``: the calling load's arguments, validated and checked equal on every rank by the
    first agreement (no extra exchange).

    In a distributed load from a store that fetches ahead (an object store), rank 0 alone finds
    the checkpoint and fetches its index, one broadcast hands the bytes to every rank, and each
    rank parses them: the store serves the index once, not once per rank. A single process opens (pins) every data file at once, so a
    save committed while the checkpoint is opened is retried once here, before anything is loaded.
    """
    where = os.fspath(checkpoint)
    alone = _dist.world_size(group) == 1
    located: reader_mod.Located | None = None
    if not alone and _fetches_ahead(where, storage_options):
        err: BaseException | None = None
        try:
            if args is not None and args.check is not None:
                args.check()
            if _dist.rank(group) == 0:
                located = reader_mod.locate(where, kind, storage_options)
        except BaseException as e:
            err = e
        _dist.agree(err, f"opening {where}", group, args)
        args = None  # checked
        located = _dist.broadcast_object(located, 0, group)
    reader: CheckpointReader | None = None
    err = None
    try:
        if args is not None and args.check is not None:
            args.check()
        maybe_fail("open")
        if located is not None:
            reader = open_located(located, kind, storage_options)
        else:
            reader = open_checkpoint(checkpoint, kind, pin=alone, storage_options=storage_options)
    except BaseException as e:
        err = e
    try:
        _dist.agree(err, f"opening {where}", group, args)
    except BaseException:
        if reader is not None:
            reader.close()
        raise
    if reader is None:  # never: agree() raised when opening failed on any rank
        raise RuntimeError(f"{where}: no reader after opening succeeded")
    return reader


def each_slice(
    reader: CheckpointReader,
    items: list[tuple[str, Any]],
    fn: Callable[[tuple[str, Any]], None],
    keep: bool = False,
) -> bool:
    """``fn((tensor name, stored slice))`` for each item; on a store that fetches ahead, the whole slices of about
    ``URL_WINDOW`` bytes at a time are fetched first (coalesced, in flight together), so hashing
    them (``verify=True``) costs a few large requests, not one round trip per slice.

    ``keep``: there, when the slices total at most ``URL_VERIFY_HOLD`` bytes, the fetched
    bytes stay in the reader for the load's reads (``each_block(held=True)``), so a verified load
    fetches each byte once. Returns whether they were kept (the caller must then read with
    ``held=True``, which drops them, or call ``reader.drop_prefetched()``)."""
    if not reader.storage.fetch_ahead:
        for item in items:
            fn(item)
        return False
    keep = keep and sum(reader.slice_location(s)[2] for _, s in items) <= URL_VERIFY_HOLD
    start = 0
    while start < len(items):
        stop, size = start, 0
        while stop < len(items) and (stop == start or size < URL_WINDOW):
            size += reader.slice_location(items[stop][1])[2]
            stop += 1
        wanted: dict[str, list[tuple[int, int]]] = {}
        for _, s in items[start:stop]:
            _, off, n = reader.slice_location(s)
            wanted.setdefault(s.file, []).append((off, n))
        reader.prefetch(wanted, URL_READ_THREADS)
        try:
            for item in items[start:stop]:
                fn(item)
        except BaseException:
            reader.drop_prefetched()
            raise
        if not keep:
            reader.drop_prefetched()
        start = stop
    return keep


def _fetches_ahead(location: str, storage_options: dict[str, Any] | None) -> bool:
    """Whether the storage of ``location`` fetches ahead (an object store): a distributed load
    then fetches the index once, on rank 0. Any error opening it is the open's own to raise."""
    from unickpt.store.storage import open_storage

    try:
        return open_storage(location, storage_options)[0].fetch_ahead
    except Exception:
        return False
