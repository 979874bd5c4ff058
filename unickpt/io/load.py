"""The load engine shared by every CheckpointIO: match, validate, verify, then copy.

Order of events (every rank calls ``load_tensors`` with its own targets):

1. names, shapes and dtypes of the checkpoint are matched against this rank's targets
   (``match_targets``; through a weight mapping, ``io/mapping.py``, for the targets the
   checkpoint holds under other names or as several tensors); ``LoadReport`` says what was
   loaded, missing and unexpected;
2. the structure the rank will read is validated (coverage of every tensor, headers of the
   files it touches) and, with ``verify=True``, the stored slices it will read are rehashed;
3. ranks agree: any problem on any rank raises the same error on every rank, before any
   rank has copied a byte, so no model is left half-loaded by a mismatch;
4. each rank reads only the byte ranges overlapping the blocks it owns. Every block takes the
   same steps: a read into host memory, then the device step. A block whose target can be read
   into (a contiguous CPU tensor of the stored dtype) is read straight into it, with no device
   step: a range contiguous in the file with ``preadv``, a row-block box located from arrays
   and added to the load's ``ReadBatch`` (``add_row_box``). Any other block (a device tensor, a
   cast, a non-contiguous view, a target built through a mapping) goes through the load's
   ``DeviceLoader``: a chunk at a time into one of two reused host buffers leased from the
   process's pool (``io/pinned.POOL``; pinned on CUDA), then copied into the target (on CUDA one
   non-blocking host-to-device copy per chunk on a side stream, the cast on the device; on CPU
   a plain copy), so that the CPU tests run the code a CUDA load runs. A mapped target's box is
   never assembled: each stored box it is made of is read into a host buffer and its parts
   copied to where they land (``Node.pieces``).
   With ``atomic=True`` the rank's whole share is read into host buffers first (exact sizes,
   leased from the pool and handed back after the copy when the target is on a device) and the
   ranks agree once more before copying, so even an I/O error leaves every model untouched.

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
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from safetensors import safe_open

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt._rng import keeps_python_random
from unickpt.ckpt import reader as reader_mod
from unickpt.ckpt.reader import (
    CheckpointReader,
    check_keys_referenced,
    open_in,
    open_located,
    slice_failures,
)
from unickpt.ckpt.stored_slices import FileNumbers, ReadBatch, Spans, all_referenced, locate, table_spans
from unickpt.errors import (
    HeaderError,
    IncompleteCheckpointError,
    IntegrityError,
    StateMismatchError,
    UnickptError,
)
from unickpt.io.mapping import Node, plan_load
from unickpt.io.pinned import POOL, StagingSet, side_stream
from unickpt.io.tensors import LocalSlice, global_shape, is_dtensor, st_dtype, torch_dtype
from unickpt.spec.boxes import contiguous_start, intersect, runs
from unickpt.spec.dtypes import itemsize
from unickpt.spec.index import TensorEntry
from unickpt.spec.naming import shown
from unickpt.store.storage import Storage, open_storage

__all__ = [
    "LoadReport",
    "Mapped",
    "match_targets",
    "raise_mismatch",
    "load_tensors",
    "read_box",
    "box_fetcher",
    "open_for_load",
    "each_block",
    "each_slice",
    "wanted_ranges",
    "Located",
    "add_row_box",
    "CHUNK_BYTES",
    "DeviceLoader",
    "copy_cast",
    "off_host",
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
#: The bytes of one chunk read and copied at a time through the host buffers (two per load).
CHUNK_BYTES = 64 << 20


# ---------------------------------------------------------------------------- 1. matching
#: A live tensor built through a mapping: (its name, the tree of stored tensors, this rank's boxes)
Mapped = tuple[str, Node, list[LocalSlice]]


@dataclass
class LoadReport:
    """What a load did: ``missing`` targets the checkpoint lacks, ``unexpected`` names it has extra."""

    loaded: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    # Mirrors torch's _IncompatibleKeys so code that reads these names keeps working.
    @property
    def missing_keys(self) -> list[str]:
        return self.missing

    @property
    def unexpected_keys(self) -> list[str]:
        return self.unexpected


def match_targets(
    reader: CheckpointReader,
    targets: dict[str, torch.Tensor],
    boxes_fn: Callable[[str, torch.Tensor], list[LocalSlice]],
    report: LoadReport,
    *,
    allow_dtype_cast: bool,
    prefix: str,
    what: str,
    ignore_unexpected: Callable[[str], bool] | None,
    transforms: list[Any] | None = None,
    mapped: list[Mapped] | None = None,
) -> tuple[list[tuple[str, str, list[LocalSlice]]], list[str]]:
    """The (target, stored tensor, boxes) each target loads from, and the mismatches found.

    With ``transforms`` (``io/mapping.py``), the targets the checkpoint does not hold by name are
    looked for through them: a renamed stored tensor joins the plan like any other, a tensor
    built from several stored ones (stacked experts, concatenated projections) is appended to
    ``mapped``, and what does not fit the mapping is a mismatch naming the tensor."""
    block = reader.block
    available: dict[str, str] = {}  # name without prefix -> stored name
    for stored in list(block.tensors) + list(block.aliases):
        if prefix:
            if not stored.startswith(prefix):
                continue
            available[stored[len(prefix) :]] = stored
        else:
            available[stored] = stored
    used: set[str] = set()
    mismatched: list[str] = []
    plan: list[tuple[str, str, list[LocalSlice]]] = []
    done_ids: dict[int, str] = {}
    built: dict[str, Node] = {}
    boxes_of: dict[str, list[LocalSlice]] = {}
    lacking = {n: t for n, t in targets.items() if n not in available} if transforms else {}
    if lacking:
        shapes = {}
        for n, t in lacking.items():
            boxes_of[n] = bx = boxes_fn(n, t)
            shapes[n] = tuple(bx[0].global_shape) if bx else tuple(global_shape(t))
        src_of = {k: block.aliases.get(full, full) for k, full in available.items()}
        stored_of = {k: (block.tensors[s].dtype, tuple(block.tensors[s].shape)) for k, s in src_of.items()}
        lp = plan_load(transforms or [], stored_of, shapes, skip=set(targets), src_of=src_of)
        mismatched.extend(lp.problems)
        for live, s in lp.renames.items():
            available[live] = available[s]
        built = lp.built
    for name, t in targets.items():
        found = available.get(name)
        if found is None:
            if id(t) in done_ids:  # tied to a target that is loaded already
                continue
            node = built.get(name)
            if node is None:
                report.missing.append(name)
                continue
            if node.dtype != st_dtype(t.dtype, name) and not allow_dtype_cast:
                mismatched.append(
                    f"{name}: checkpoint has dtype {node.dtype}, {what} has {st_dtype(t.dtype, name)} "
                    "(pass allow_dtype_cast=True to cast on load)"
                )
                continue
            used.update(node.sources())
            done_ids[id(t)] = name
            report.loaded.append(name)
            if mapped is not None:
                mapped.append((name, node, boxes_of[name]))
            continue
        stored = found
        used.add(stored)
        src = block.aliases.get(stored, stored)
        used.add(src)
        entry = block.tensors[src]
        boxes = boxes_of[name] if name in boxes_of else boxes_fn(name, t)
        # The boxes know the global tensor (a ZeRO target is a flat view of part of it).
        want_shape = list(boxes[0].global_shape) if boxes else list(global_shape(t))
        want_dtype = st_dtype(t.dtype, name)
        # A plain tensor with no boxes is a view of a rank's empty share (ZeRO): nothing to check.
        if entry.shape != want_shape and (boxes or is_dtensor(t)):
            mismatched.append(f"{name}: checkpoint has shape {shown(entry.shape)}, {what} has {want_shape}")
            continue
        if entry.dtype != want_dtype and not allow_dtype_cast:
            mismatched.append(
                f"{name}: checkpoint has dtype {entry.dtype}, {what} has {want_dtype} "
                "(pass allow_dtype_cast=True to cast on load)"
            )
            continue
        if id(t) in done_ids:
            continue
        done_ids[id(t)] = name
        report.loaded.append(name)
        plan.append((name, src, boxes))
    for stored, full in available.items():
        if full not in used and (ignore_unexpected is None or not ignore_unexpected(stored)):
            report.unexpected.append(stored)
    return plan, mismatched


def raise_mismatch(
    reader: CheckpointReader, report: LoadReport, mismatched: list[str], *, strict: bool, what: str
) -> None:
    # Each list is named up to 20 entries, the names a checkpoint gives cut (``shown``): a report of
    # bounded size however many and however long the names are.
    problems = []
    if mismatched:
        more = f"\n    (and {len(mismatched) - 20} more)" if len(mismatched) > 20 else ""
        problems.append("size or dtype mismatch:\n    " + "\n    ".join(mismatched[:20]) + more)
    if strict and report.missing:
        problems.append(f"missing from the checkpoint ({len(report.missing)}): {shown(report.missing[:20])}")
    if strict and report.unexpected:
        problems.append(
            f"in the checkpoint but not in the {what} ({len(report.unexpected)}): {shown(report.unexpected[:20])}"
        )
    hint = _prefix_hint(report) if strict else ""
    if hint:
        problems.append(hint)
    if problems:
        where = reader.index_path or reader.directory
        raise StateMismatchError(
            f"{where} does not match the {what}; nothing was loaded:\n  " + "\n  ".join(problems),
            missing=report.missing if strict else [],
            unexpected=report.unexpected if strict else [],
            mismatched=mismatched,
        )


def _prefix_hint(report: LoadReport) -> str:
    """What to pass when the mismatch is a name prefix: the checkpoint was saved with ``prefix``
    (Colossal-AI's ``prefix`` names files; unickpt's prefixes every tensor name) or the load gave one."""
    missing, unexpected = set(report.missing), set(report.unexpected)
    if not missing or not unexpected:
        return ""
    for extra, fewer, say in (
        (unexpected, missing, "the checkpoint's"),
        (missing, unexpected, "the model's"),
    ):
        heads = {n.split(".", 1)[0] for n in extra}
        if len(heads) == 1 and all("." in n for n in extra):
            head = heads.pop()
            if fewer <= {n[len(head) + 1 :] for n in extra}:
                if say == "the checkpoint's":
                    return (
                        f"{say} names carry the prefix {shown(head + '.')} (saved with prefix={shown(head)}): "
                        f"load with prefix={shown(head)}"
                    )
                return f"{say} names carry the prefix {shown(head + '.')} that the checkpoint's lack"
    return ""


# ---------------------------------------------------------------------------- row blocks as arrays
# FSDP's and TP's ``Shard(0)`` store a tensor as row blocks, one per rank's file, and a rank's box
# of the tensor is a row range of it. For such a box read straight into its contiguous target,
# every part (the rows a stored slice shares with the box) is computed for all its slices at once
# from the slice table and the spans located by ``ckpt/stored_slices.py`` (no per-slice lookup),
# then added to the load's ``ReadBatch`` as arrays: per file, adjacent parts become one vectored
# read (locally one ``preadv``, on an object store coalesced ranged requests), and the parts of
# one tensor stored back to back become one buffer.

#: ``id`` of a ``TensorEntry`` -> (the sorted positions of its slices located, their spans)
Located = dict[int, tuple[np.ndarray, Spans]]


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, writable in place."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def add_row_box(
    located: Located,
    entry: TensorEntry,
    offsets: tuple[int, ...],
    shape: tuple[int, ...],
    out: torch.Tensor,
    batch: ReadBatch,
) -> bool:
    """Add the reads of the box (offsets, shape) of ``entry`` into ``out`` (contiguous, CPU,
    the stored dtype) to ``batch``. False (nothing added) when the box or its slices are not row
    blocks, a slice was not located, or a part would fall outside its slice's bytes: the per-box
    path (``read_box``) then reads it, or names what is wrong."""
    got = located.get(id(entry))
    gshape = list(entry.shape)
    if got is None or len(gshape) < 1 or len(shape) != len(gshape) or list(shape[1:]) != gshape[1:]:
        return False
    if not out.is_contiguous() or math.prod(shape) == 0:
        return False
    table = entry.table
    known, (offs, lens) = got
    whole = not any(offsets) and list(shape) == gshape  # then the slices located are exactly those it needs
    sel = known if whole else np.asarray(table.overlapping(offsets, shape), dtype=np.int64)
    if not len(sel):
        return False
    if len(gshape) > 1 and not (table.shapes[sel, 1:] == np.asarray(gshape[1:], dtype=np.int64)).all():
        return False
    at = np.searchsorted(known, sel)
    if (at >= len(known)).any() or not np.array_equal(known[np.minimum(at, len(known) - 1)], sel):
        return False
    row = math.prod(gshape[1:]) * out.element_size()
    starts = table.offsets[sel, 0]
    lo = np.maximum(starts, offsets[0])
    hi = np.minimum(starts + table.shapes[sel, 0], offsets[0] + shape[0])
    if ((hi - starts) * row > lens[at]).any():
        return False
    batch.add_many(
        table,
        sel,
        offs[at] + (lo - starts) * row,
        (lo - offsets[0]) * row,
        (hi - offsets[0]) * row,
        _as_bytes(out),
    )
    return True


# ---------------------------------------------------------------------------- host buffers, device step
# A block whose target cannot be read into (a device tensor, a cast, a non-contiguous view, a
# mapped target) is read a chunk at a time (rows of the box, about ``CHUNK_BYTES`` each) into one
# of two host buffers leased from the process's pool (``io/pinned.POOL``: exact sizes, pinned with
# ``cudaHostRegister`` on CUDA, kept for the next load), then copied into the target: on CUDA one
# ``non_blocking`` host-to-device copy on a side stream, so that the copy of one chunk overlaps the
# read of the next, a buffer read into again only once its last copy is done (its event), and a
# cast after the copy, on the device. The compute stream waits for the side stream when the load
# finishes (``DeviceLoader.close``), and the host too, so a loaded tensor is ready when the load
# returns. On CPU the device step is a plain copy (a cast on the CPU), and the rest is the same code.

# read(offsets, shape, out): the box (offsets, shape) of the stored tensor into ``out``, a
# contiguous host tensor of that shape and the stored dtype.
Reader = Callable[[tuple[int, ...], tuple[int, ...], torch.Tensor], object]


def off_host(t: torch.Tensor) -> bool:
    """Whether ``t`` lives on a device (not in CPU memory, not a meta tensor)."""
    return t.device.type not in ("cpu", "meta")


def copy_cast(target: torch.Tensor, data: torch.Tensor) -> None:
    """``target.copy_(data)`` for ``data`` read on the host in the checkpoint's dtype: a device
    target gets the bytes first and casts on the device; a CPU target casts on the CPU."""
    if off_host(target) and data.dtype != target.dtype:
        data = data.to(target.device)
    elif data.dtype != target.dtype:
        data = data.to(target.dtype)
    target.copy_(data.reshape(target.shape))


def _box_view(target: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor | None:
    """``target`` seen with the box's shape (a flat ZeRO run reshaped), or None if no view can."""
    target = target.detach()
    if tuple(target.shape) == tuple(shape):
        return target
    return target.view(shape) if target.is_contiguous() else None


class _Slot:
    def __init__(self, key: tuple[str, int]) -> None:
        self.key = key
        self.event: Any = None


class DeviceLoader:
    """The host buffers and the device step of one load (see above). Use it as a context
    manager, or call :meth:`close` (it waits for every copy and hands the buffers back)."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES) -> None:
        self.chunk_bytes = max(1, int(chunk_bytes))
        self._buffers: StagingSet | None = None
        self._staged: StagingSet | None = None  # an atomic load's share, held until it is copied
        self._count = 0  # boxes staged
        self._slots = [_Slot(("load", 0)), _Slot(("load", 1))]
        self._next = 0
        self._streams: dict[torch.device, Any] = {}
        self.chunks = 0

    def __enter__(self) -> DeviceLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _host(self, nbytes: int) -> tuple[_Slot, torch.Tensor]:
        """The next slot and its host buffer, at least ``nbytes`` long, free to be read into."""
        slot = self._slots[self._next]
        self._next = 1 - self._next
        if slot.event is not None:
            slot.event.synchronize()  # its last copy to the device is done
            slot.event = None
        if self._buffers is None:
            self._buffers = POOL.lease("load", shared=False)
        return slot, self._buffers.at_least(slot.key, nbytes)

    def _stream(self, device: torch.device) -> Any:
        if device.type != "cuda":
            return None
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = side_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # the target's earlier work first
        return stream

    def load(
        self,
        target: torch.Tensor,
        offsets: tuple[int, ...],
        shape: tuple[int, ...],
        stored: torch.dtype,
        read: Reader,
    ) -> None:
        """Fill ``target`` (``shape``'s elements, any device and dtype) with the box (``offsets``,
        ``shape``) of a stored tensor of dtype ``stored``, read by ``read`` a chunk of rows at a time."""
        target = target.detach()
        if math.prod(shape) == 0:
            return
        view = _box_view(target, shape)
        isz = torch.empty((), dtype=stored).element_size()
        if view is None or len(shape) == 0:  # one chunk: the whole box
            spans = [(0, shape[0] if shape else 0)]
        else:
            row = math.prod(shape[1:]) * isz
            step = max(1, self.chunk_bytes // max(1, row))
            spans = [(r, min(r + step, shape[0])) for r in range(0, shape[0], step)]
        for r0, r1 in spans:
            cshape = (r1 - r0, *shape[1:]) if shape else ()
            coffs = (offsets[0] + r0, *offsets[1:]) if shape else ()
            nbytes = math.prod(cshape) * isz
            slot, buf = self._host(nbytes)
            host = buf[:nbytes].view(stored).view(cshape)
            read(coffs, cshape, host)
            self.send(view[r0:r1] if view is not None and shape else target, host, slot)

    def load_mapped(self, box: LocalSlice, node: Node, read: Callable[[str], Reader]) -> None:
        """Fill ``box.tensor`` with its box of a tensor built through a mapping: each box of a
        stored tensor it is made of (``node.leaves``) is read (``read(name)``) into a host buffer
        and its parts copied to where they land (``node.pieces``); nothing is assembled."""
        stored = torch_dtype(node.dtype)
        view = _box_view(box.tensor, box.shape)
        whole = torch.empty(box.shape, dtype=stored) if view is None else None  # never for a view
        for src, off, shp in node.leaves(tuple(box.offsets), tuple(box.shape)):
            nbytes = math.prod(shp) * torch.empty((), dtype=stored).element_size()
            slot, buf = self._host(nbytes)
            host = buf[:nbytes].view(stored).view(shp)
            read(src)(off, shp, host)
            for region, part in _pieces_in(node, box, src, off, shp, host):
                if whole is not None:
                    whole[region].copy_(part)
                else:
                    self.send(view[region], part, slot)  # type: ignore[index]
        if whole is not None:
            self.send(box.tensor.detach(), whole, None)

    def stage(self, target: torch.Tensor, shape: tuple[int, ...], stored: torch.dtype) -> torch.Tensor:
        """A host buffer of ``shape`` and ``stored`` that holds a box until the copy (an atomic
        load): for a device target leased from the pool (exact size, pinned on CUDA, handed back
        by :meth:`close`), else a tensor of its own."""
        if not off_host(target):
            return torch.empty(shape, dtype=stored)
        if self._staged is None:
            self._staged = POOL.lease("load-staged", shared=False)
        nbytes = math.prod(shape) * torch.empty((), dtype=stored).element_size()
        self._count += 1
        return self._staged.at_least(("staged", self._count), nbytes)[:nbytes].view(stored).view(shape)

    def send(self, dst: torch.Tensor, host: torch.Tensor, slot: _Slot | None) -> None:
        """The device step: ``host`` (the checkpoint's dtype) into ``dst``; on CUDA a
        non-blocking copy on the side stream, ``slot``'s buffer busy until it is done."""
        self.chunks += 1
        stream = self._stream(dst.device)
        if stream is None:  # no CUDA: a synchronous copy (a cast on the CPU)
            copy_cast(dst, host)
            return
        with torch.cuda.stream(stream):
            src = host.reshape(dst.shape)
            if src.dtype != dst.dtype:  # the bytes first, the cast on the device
                src = src.to(dst.device, non_blocking=True)
            dst.copy_(src, non_blocking=True)
        if slot is not None:
            slot.event = torch.cuda.Event()
            slot.event.record(stream)

    def close(self) -> None:
        """Wait for every copy (the compute streams wait for the side streams, then the host),
        then hand the host buffers back to the pool for the next load."""
        try:
            for device, stream in self._streams.items():
                torch.cuda.current_stream(device).wait_stream(stream)
                stream.synchronize()
        finally:
            self._streams = {}
            for slot in self._slots:
                slot.event = None
            for held in (self._buffers, self._staged):
                if held is not None:
                    POOL.give_back(held)
            self._buffers = self._staged = None
            self._count = 0


def _pieces_in(
    node: Node, box: LocalSlice, src: str, off: tuple[int, ...], shp: tuple[int, ...], data: torch.Tensor
) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
    """Where the box (off, shp) of the stored tensor ``src`` (its bytes ``data``) lands in ``box``:
    (the region of the box, the view of ``data`` that fills it) for each part inside the box."""
    for o, n, x in node.pieces(src, off, shp, data):
        region: list[slice] = []
        for d, (a, k, b0, m) in enumerate(zip(o, n, box.offsets, box.shape, strict=True)):
            lo, hi = max(a, b0), min(a + k, b0 + m)
            if lo >= hi:
                break
            if lo != a or hi - lo != k:
                x = x.narrow(d, lo - a, hi - lo)
            region.append(slice(lo - b0, hi - b0))
        else:
            yield tuple(region), x


# ---------------------------------------------------------------------------- reading
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
        # a 0-d tensor's slices tile it exactly once (checked when the index was read): one slice
        files.reader.read_key_bytes(table.file(0), table.key(0), 0, out.element_size(), _as_bytes(out))
        return out
    if math.prod(shape) == 0:
        return out
    isz = out.element_size()
    ks = table.overlapping(offsets, shape)
    if _read_row_blocks(files, entry, ks, offsets, shape, out, batch):
        return out
    for k in ks:  # each slice's box, file and key read from the table's columns
        s_offsets, s_shape = table.box(k)
        inter = intersect(offsets, shape, s_offsets, s_shape)
        if inter is None:
            continue
        file, key = table.file(k), table.key(k)
        ioff, ishp = inter
        src_off = tuple(a - b for a, b in zip(ioff, s_offsets, strict=True))
        dst = tuple(slice(a - b, a - b + n) for a, b, n in zip(ioff, offsets, ishp, strict=True))
        start = contiguous_start(s_shape, src_off, ishp)
        if start is None:
            if files.reader.os_path(file) is None:  # no path to map: read the runs of the part
                part = torch.empty(ishp, dtype=dtype)
                wanted = [(a * isz, n * isz) for a, n in runs(s_shape, src_off, ishp)]
                files.reader.read_runs(file, key, wanted, _as_bytes(part))
                out[dst] = part
                continue
            src = tuple(slice(a, a + n) for a, n in zip(src_off, ishp, strict=True))
            out[dst] = files.get(file).get_slice(key)[src]
            continue
        target = out[dst]
        direct = target.is_contiguous()
        buf = target if direct else torch.empty(ishp, dtype=dtype)
        files.reader.read_key_bytes(file, key, start * isz, math.prod(ishp) * isz, _as_bytes(buf))
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
    read = files.reader.read_key_bytes
    for k, a, b, s0 in zip(ks, lo.tolist(), hi.tolist(), starts.tolist(), strict=True):
        read(
            table.file(k),
            table.key(k),
            (a - s0) * row,
            (b - a) * row,
            dst[(a - offsets[0]) * row : (b - offsets[0]) * row],
        )
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
            # Read from the tables' columns: (tensor, file, key, xxh3, ranges) of each hashed slice.
            checked: list[tuple[str, str, str, str | None, Any]] = []
            for src, ks in needed.items():
                table = reader.tensors[src].table
                for k in ks:
                    h, rng = table.xxh3(k), table.ranges(k)
                    if h is not None or rng is not None:
                        checked.append((src, table.file(k), table.key(k), h, rng))

            def check(item: tuple[str, str, str, str | None, Any]) -> None:
                src, file, key, h, rng = item
                failures.extend(slice_failures(src, file, key, h, rng, reader.iter_key(file, key)))

            # On a URL, the slices to hash are fetched a window at a time, coalesced, and kept
            # for the reads below (each byte fetched once) when they fit URL_VERIFY_HOLD.
            held = each_slice(reader, checked, check, keep=True)
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
    one host copy of this rank's share of the state (for device targets leased from the pool,
    exact sizes, handed back once copied); the copy is the device step of every other load."""
    err: BaseException | None = None
    # (target box, the tree it is built through or None, stored name, stored box, its bytes)
    staged: list[tuple[LocalSlice, Node | None, str, tuple[int, ...], tuple[int, ...], torch.Tensor]] = []
    files = _Files(reader)
    device = DeviceLoader()
    try:
        try:
            maybe_fail("load.read")
            jobs = [(reader.tensors[src], b) for _, src, boxes in plan for b in boxes]
            batch = ReadBatch()

            def one(job: tuple[TensorEntry, LocalSlice]) -> torch.Tensor:
                entry, b = job
                out = device.stage(b.tensor, tuple(b.shape), torch_dtype(entry.dtype))
                if located and add_row_box(located, entry, b.offsets, b.shape, out, batch):
                    return out
                return read_box(files, entry, b.offsets, b.shape, out=out, batch=batch)

            datas = each_block(reader, jobs, one, held, batch)
            staged = [(b, None, "", (), (), data) for (_, b), data in zip(jobs, datas, strict=True)]
            for _, node, boxes in mapped or []:
                stored = torch_dtype(node.dtype)
                for b in boxes:
                    for src, off, shp in node.leaves(tuple(b.offsets), tuple(b.shape)):
                        out = device.stage(b.tensor, shp, stored)
                        staged.append(
                            (b, node, src, off, shp, read_box(files, reader.tensors[src], off, shp, out))
                        )
        except Exception as e:  # safetensors raises its own error types; every rank must hear of it
            err = _read_error(e, where)
        finally:
            files.close()
        _dist.agree(err, f"reading {what} from {where}", group)
        with torch.no_grad():
            wholes: dict[int, tuple[LocalSlice, torch.Tensor]] = {}  # boxes no view of the target fits
            for b, tree, src, off, shp, data in staged:
                if tree is None:
                    device.send(b.tensor.detach(), data, None)
                    continue
                view = _box_view(b.tensor, b.shape)
                if view is None:
                    view = wholes.setdefault(id(b), (b, torch.empty(b.shape, dtype=data.dtype)))[1]
                for region, part in _pieces_in(tree, b, src, off, shp, data):
                    if id(b) in wholes:
                        view[region].copy_(part)
                    else:
                        device.send(view[region], part, None)
            for b, whole in wholes.values():
                device.send(b.tensor.detach(), whole, None)
    finally:
        device.close()


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
    """Read each block straight into its tensor (CPU, same dtype) or through the load's two
    host buffers (``DeviceLoader``): memory stays at two chunks over the state. A read error
    mid-way leaves the state partly loaded; every rank raises, saying so."""
    err: BaseException | None = None
    files = _Files(reader)
    # Blocks read straight into their tensors are located first and read at the end (of each
    # window on a store that fetches ahead), coalesced per file (locally one preadv per run of
    # adjacent slices).
    batch = ReadBatch()
    device = DeviceLoader()
    try:

        def one(job: tuple[TensorEntry, LocalSlice]) -> None:
            entry, b = job
            stored = torch_dtype(entry.dtype)
            direct = _direct_target(b, stored)
            with torch.no_grad():
                if direct is None:  # through the host buffers, then the device step
                    device.load(
                        b.tensor, b.offsets, b.shape, stored, functools.partial(read_box, files, entry)
                    )
                elif not (located and add_row_box(located, entry, b.offsets, b.shape, direct, batch)):
                    read_box(files, entry, b.offsets, b.shape, out=direct, batch=batch)
            maybe_fail("load.read")

        each_block(
            reader, [(reader.tensors[src], b) for _, src, boxes in plan for b in boxes], one, held, batch
        )

        def reads(name: str) -> Reader:
            return functools.partial(read_box, files, reader.tensors[name])

        with torch.no_grad():
            for _, node, boxes in mapped or []:
                for b in boxes:
                    device.load_mapped(b, node, reads)
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
        table = entry.table  # the slices the box meets, found and read from the table's columns
        if len(b.shape) == 0:
            _, off, n = reader.key_location(table.file(0), table.key(0))  # its one slice
            wanted.setdefault(table.file(0), []).append((off, n))
            continue
        for j in table.overlapping(b.offsets, b.shape):
            s_offsets, s_shape = table.box(j)
            inter = intersect(b.offsets, b.shape, s_offsets, s_shape)
            if inter is None:
                continue
            ioff, ishp = inter
            src_off = tuple(a - o for a, o in zip(ioff, s_offsets, strict=True))
            file = table.file(j)
            _, off, _ = reader.key_location(file, table.key(j))
            wanted.setdefault(file, []).extend(
                (off + a * isz, k * isz) for a, k in runs(s_shape, src_off, ishp)
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
    opened: Storage | Exception
    try:
        opened = open_storage(where, storage_options)[0]
    except Exception as e:  # raised where the store is used, below: agreed by every rank
        opened = e
    err: BaseException | None = None
    if not alone and isinstance(opened, Storage) and opened.fetch_ahead:
        try:
            if args is not None and args.check is not None:
                args.check()
            if _dist.rank(group) == 0:
                located = reader_mod.locate(opened, where, kind, fetch=True)
        except BaseException as e:
            err = e
        _dist.agree(err, f"opening {where}", group, args)
        args = None  # checked
        located = _dist.broadcast_object(located, 0, group)
    reader: CheckpointReader | None = None
    try:
        if args is not None and args.check is not None:
            args.check()
        maybe_fail("open")
        if isinstance(opened, Exception):
            raise opened
        if located is not None:
            reader = open_located(opened, located, kind)
        else:
            reader = open_in(opened, where, kind, pin=alone)
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
    items: list[tuple[str, str, str, str | None, Any]],
    fn: Callable[[tuple[str, str, str, str | None, Any]], None],
    keep: bool = False,
) -> bool:
    """``fn((tensor name, file, key, xxh3, ranges))`` for each stored slice; on a store that
    fetches ahead, the whole slices of about ``URL_WINDOW`` bytes at a time are fetched first (coalesced, in flight together), so hashing
    them (``verify=True``) costs a few large requests, not one round trip per slice.

    ``keep``: there, when the slices total at most ``URL_VERIFY_HOLD`` bytes, the fetched
    bytes stay in the reader for the load's reads (``each_block(held=True)``), so a verified load
    fetches each byte once. Returns whether they were kept (the caller must then read with
    ``held=True``, which drops them, or call ``reader.drop_prefetched()``)."""
    if not reader.storage.fetch_ahead:
        for item in items:
            fn(item)
        return False
    keep = keep and sum(reader.key_location(it[1], it[2])[2] for it in items) <= URL_VERIFY_HOLD
    start = 0
    while start < len(items):
        stop, size = start, 0
        while stop < len(items) and (stop == start or size < URL_WINDOW):
            size += reader.key_location(items[stop][1], items[stop][2])[2]
            stop += 1
        wanted: dict[str, list[tuple[int, int]]] = {}
        for _, file, key, _, _ in items[start:stop]:
            _, off, n = reader.key_location(file, key)
            wanted.setdefault(file, []).append((off, n))
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
