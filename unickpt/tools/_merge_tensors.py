"""How merge writes each tensor into its output file: copied in the kernel, streamed in chunks, or
rebuilt band by band in memory (column splits, 2-D meshes, dtype casts), hashing on the way.

An output file is a file a store opened for writes at offsets (``Storage.open_range``, on a store
with ``range_write``), or a file streamed to an object store (``store.publish.StoreFile``);
a tensor is copied in the kernel only into a file of a store with ``kernel_copy``.

**Runs, and merge's structure check.** The slices of each tensor as contiguous runs of its flat range.
Most layouts store every slice of a tensor as one contiguous run of the flattened tensor (row
slices of FSDP/TP ``Shard(0)``, ZeRO flat ranges, whole tensors): merge then copies bytes
straight from source to output, and coverage is shown in O(slices) instead of the general sweep.

**Small row-sliced tensors, in bulk: runs copied, not slices.**
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
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import xxhash

from unickpt.ckpt.reader import CheckpointReader, check_keys_referenced
from unickpt.ckpt.stored_slices import ReadBatch, all_referenced, locate_all, recorded_hashes
from unickpt.errors import IndexFileError, IntegrityError, IntegrityFailure, UnsupportedError
from unickpt.spec.boxes import contiguous_start, coverage_problem
from unickpt.spec.dtypes import itemsize, word_dtype
from unickpt.spec.hashing import (
    SliceHasher,
    combine_partials,
    finalize_fingerprint,
    fingerprint_partial,
)
from unickpt.spec.index import TensorEntry
from unickpt.spec.naming import shown
from unickpt.store.publish import StoreFile
from unickpt.store.storage import RangeFile, Storage
from unickpt.tools._bands import bands, is_sparse, next_data, pieces

__all__ = [
    "GROUP_BYTES",
    "SMALL",
    "row_order",
    "merge_rows",
    "groups",
    "Stored",
    "stored",
    "Run",
    "RunsOf",
    "flat_runs",
    "validate_runs",
    "CASTABLE",
    "CHUNK",
    "RangeOutput",
    "TensorMerger",
]


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
        spans = r.spans[name]  # every slice located by the structure check (``validate_runs``)
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


class Stored(NamedTuple):
    """One stored slice as merge reads it, from its tensor's slice table."""

    file: str
    key: str
    xxh3: str | None
    offsets: list[int]
    shape: list[int]


def stored(t: TensorEntry) -> list[Stored]:
    """The slices of ``t`` in table order, read from the table's columns."""
    return list(map(Stored._make, t.table.rows()))


@dataclass(frozen=True)
class Run:
    """One contiguous run of the flattened tensor stored as one slice."""

    slice: Stored
    flat_start: int  # in elements


def flat_runs(t: TensorEntry, slices: list[Stored] | None = None) -> list[Run] | None:
    """The slices (``slices``: ``stored(t)``, when already read) as contiguous runs in flat order,
    or None when some slice is not contiguous."""
    runs = []
    for s in stored(t) if slices is None else slices:
        if math.prod(s.shape) == 0:
            continue
        start = contiguous_start(t.shape, s.offsets, s.shape)
        if start is None:
            return None
        runs.append(Run(s, start))
    runs.sort(key=lambda r: r.flat_start)
    return runs


def _tiles(t: TensorEntry, runs: list[Run] | None) -> bool:
    """True when ``runs`` lie inside the tensor and tile its flat range exactly once.

    O(slices) with no numpy: the common layouts (row splits, ZeRO flat ranges, whole tensors)
    need nothing more, and ``coverage_problem`` would find nothing to report for them. False
    means "not shown here", not "broken": the general check then decides.
    """
    if runs is None:
        return False
    end = 0
    for r in runs:
        s = r.slice
        inside = all(o >= 0 and o + n <= g for o, n, g in zip(s.offsets, s.shape, t.shape, strict=True))
        if r.flat_start != end or not inside:
            return False
        end += math.prod(s.shape)
    return end == math.prod(t.shape)


class RunsOf(dict[str, "list[Run] | None"]):
    """Tensor name -> its flat runs (``flat_runs``); for a tensor whose slices are row blocks the
    runs are built only when asked (``rows`` holds their order, which the bulk merge uses)."""

    def __init__(self, tensors: dict[str, TensorEntry]) -> None:
        super().__init__()
        self.tensors = tensors
        self.rows: dict[str, np.ndarray] = {}

    def __missing__(self, name: str) -> list[Run] | None:
        runs = self[name] = flat_runs(self.tensors[name])
        return runs


def validate_runs(r: CheckpointReader) -> RunsOf:
    """``r.validate_structure()`` with the same checks, order and errors; returns each tensor's
    flat runs (``flat_runs``) for the copy.

    Coverage is shown from the slice table for tensors of row blocks (``row_order``), in O(slices)
    for other tensors whose slices are contiguous runs (``_tiles``); only the others go through
    ``coverage_problem``'s general sweep.
    """
    r.open_files(r.files)  # each header bounds the slices in its file before they are built
    runs_of = RunsOf(r.block.tensors)
    for name, t in r.block.tensors.items():
        rows = row_order(t)
        if rows is not None:
            runs_of.rows[name] = rows
            continue
        nd = len(t.shape)
        slices = stored(t)
        same_dims = all(len(s.offsets) == nd and len(s.shape) == nd for s in slices)
        runs = flat_runs(t, slices) if same_dims else None
        runs_of[name] = runs
        if not _tiles(t, runs):
            problem = coverage_problem(t.shape, t.table.boxes())
            if problem:
                raise IndexFileError(f"{r.index_path or r.directory}: tensor {shown(name)}: {problem}")
    matched = locate_all(r)  # every slice at once (spans kept for the copy); raises naming the first bad one
    if r.has_unickpt_block and not all_referenced(r.header, r.files, matched):
        check_keys_referenced(r.block, r.files, r.header)
    return runs_of


CASTABLE = {"F16", "BF16", "F32", "F64"}
# Copy in chunks of this size: large enough for disk speed (the kernel reads ahead of it anyway),
# small enough to keep memory flat. 4 MiB measured as fast as 16 MiB for merges of 128 to 512 MiB.
CHUNK = 4 << 20
# Start writeback of an output file every this many bytes written (the final fsync waits for less).
_WRITEBACK = 8 << 20
# Tensors rebuilt in memory (column splits, 2-D meshes, casts) are rebuilt a band of at most this
# many bytes at a time (``_bands``): peak memory is about two bands, whatever the tensor's size.
_BAND_BYTES = 16 << 20
_EMPTY_HASH = SliceHasher().hexdigest()


class RangeOutput:
    """An output file of ``store`` written front to back (``f``: ``Storage.open_range``), with
    writeback started every ``_WRITEBACK`` bytes so the final fsync does not wait for the whole file."""

    def __init__(self, f: RangeFile, store: Storage) -> None:
        self.f, self.store = f, store
        self._hinted = 0

    def wrote(self, end: int) -> None:
        """The file now holds bytes up to ``end``."""
        if end - self._hinted >= _WRITEBACK:
            self.f.writeback(self._hinted, end - self._hinted)
            self._hinted = end

    def write(self, data: memoryview, pos: int) -> None:
        self.f.pwrite(data, pos)
        self.wrote(pos + data.nbytes)

    def write_pieces(self, data: memoryview, pos: int) -> None:
        """``write`` of a large buffer, ``_WRITEBACK`` bytes at a time (a writeback hint each)."""
        step = _WRITEBACK
        for at in range(0, data.nbytes, step):
            self.write(data[at : at + step], pos + at)


class TensorMerger:
    """Writes the tensors of one source checkpoint into output files, checking slice hashes on the way."""

    def __init__(
        self,
        reader: CheckpointReader,
        *,
        verify: bool,
        out_dtype: str | None,
        progress: Callable[[int], object],
        src: str,
        buf: memoryview,
        runs_of: dict[str, list[Run] | None],
    ) -> None:
        self.r = reader
        self._runs_of = runs_of
        self._rows: dict[str, np.ndarray] = getattr(runs_of, "rows", {})
        self._any_sparse: bool | None = None
        self.verify = verify
        self.out_dtype = out_dtype
        self.progress = progress
        self.src = src
        self._buf = buf
        self._sparse_files: dict[str, bool] = {}

    def target_dtype(self, t: TensorEntry) -> str:
        if self.out_dtype is not None and t.dtype in CASTABLE:
            return self.out_dtype
        return t.dtype

    # -------------------------------------------------------------- checking
    def _check(self, name: str, s: Stored, found: str) -> None:
        if self.verify and s.xxh3 is not None and found != s.xxh3:
            raise IntegrityError([IntegrityFailure(name, s.file, s.key, s.xxh3, found)], checkpoint=self.src)

    # -------------------------------------------------------------- planning
    def _route(self, name: str, t: TensorEntry) -> tuple[str, list[Run]]:
        """How a tensor is written: "kernel" (copy_file_range of one stored slice), "stream"
        (contiguous runs read in pieces, hashed, written) or "assemble" (rebuilt in memory)."""
        runs = self._runs_of[name] if self.target_dtype(t) == t.dtype else None
        if runs is None:
            return "assemble", []
        # copy_file_range would write a sparse source's holes out as zeros: stream those.
        if (
            len(runs) == 1
            and runs[0].slice.xxh3 is not None
            and not self.verify
            and self.r.read_handle(runs[0].slice.file).descriptor() is not None  # else nothing to copy from
            and not self._sparse(runs[0].slice.file)
        ):
            return "kernel", runs
        return "stream", runs

    # -------------------------------------------------------------- writing
    def write_file(
        self, tensors: list[tuple[str, TensorEntry, int]], out: RangeOutput | StoreFile
    ) -> dict[str, tuple[str | None, str | None]]:
        """Write each (name, entry, position) into ``out`` (a file written at offsets:
        :class:`RangeOutput`, or a file streamed to an object store), in order; return
        name -> (xxh3, fingerprint)."""
        results: dict[str, tuple[str | None, str | None]] = {}
        for bulk, items in groups(tensors, self._bulk):
            if bulk:  # small row-sliced tensors: read in runs per file, written together
                results.update(
                    merge_rows(
                        self.r,
                        items,
                        self._rows.__getitem__,
                        out.write_pieces,
                        verify=self.verify,
                        src=self.src,
                        progress=self.progress,
                    )
                )
            else:
                results.update(self._write_one(items[0], out))
        return results

    def _bulk(self, name: str, t: TensorEntry) -> bool:
        """Whether a tensor goes through the bulk merge of row-sliced tensors (``merge_rows``)."""
        if name not in self._rows or self.target_dtype(t) != t.dtype:
            return False
        if t.table.ranges_count() or len(self._rows[name]) == 1:  # one slice: copied whole (kernel copy)
            return False
        if self._any_sparse is None:
            self._any_sparse = any(self._sparse(f) for f in self.r.files)
        return not self._any_sparse

    def _write_one(
        self, item: tuple[str, TensorEntry, int], out: RangeOutput | StoreFile
    ) -> dict[str, tuple[str | None, str | None]]:
        results: dict[str, tuple[str | None, str | None]] = {}
        for name, t, pos in [item]:
            how, runs = self._route(name, t)
            if how == "assemble":
                results[name] = self._assemble(name, t, self.target_dtype(t), out, pos)
                continue
            self._check_empty(name, stored(t))
            if how == "kernel" and isinstance(out, RangeOutput) and out.store.kernel_copy:  # else: stream
                results[name] = (self._copy_one(runs[0].slice, out, pos), t.fingerprint)
            else:
                results[name] = (self._stream_runs(name, t, runs, out, pos), t.fingerprint)
        return results

    def _check_empty(self, name: str, slices: list[Stored]) -> None:
        # Empty slices hold no bytes but still carry a hash: check it.
        for s in slices:
            if math.prod(s.shape) == 0:
                self._check(name, s, _EMPTY_HASH)

    def _copy_one(self, s: Stored, out: RangeOutput, pos: int) -> str | None:
        """The output bytes are exactly the stored slice: copy in the kernel, its hash is the output's."""
        _, off, n = self.r.key_location(s.file, s.key)
        self._copy_file_range(out.store, self._fd(s.file), off, out.f, pos, n)
        out.wrote(pos + n)
        self.progress(n)
        return s.xxh3

    def _stream_runs(
        self, name: str, t: TensorEntry, runs: list[Run], out: RangeOutput | StoreFile, pos: int
    ) -> str:
        isz = itemsize(t.dtype)
        out_hash = SliceHasher()
        for run in runs:
            s = run.slice
            n = math.prod(s.shape) * isz
            dst = pos + run.flat_start * isz
            h = None
            if self.verify and s.xxh3 is not None:
                # A tensor stored whole: the slice's bytes are the output's, one hash serves both.
                h = out_hash if len(runs) == 1 else SliceHasher()
            done = 0
            hole_end = self._hole_end(s, 0, n)
            while done < n:
                k = min(CHUNK, n - done)
                if done + k <= hole_end:
                    # Inside a hole of a sparse source: zeros, neither read nor written.
                    chunk = self._zeros[:k]
                else:
                    chunk = self.r.read_key_bytes(s.file, s.key, done, k, self._buf[:k])
                    out.write(chunk, dst + done)
                if h is not None and h is not out_hash:
                    h.update(chunk)
                out_hash.update(chunk)
                done += k
                self.progress(k)
                if done >= hole_end:
                    hole_end = self._hole_end(s, done, n)
            if h is not None:
                self._check(name, s, h.hexdigest())
        return out_hash.hexdigest()

    def _hole_end(self, s: Stored, rel: int, n: int, unit: int = CHUNK) -> int:
        """Where the hole at ``rel`` bytes into slice ``s`` ends (``rel`` itself when ``rel`` holds
        data), as bytes into the slice, rounded down to whole ``unit``s; ``n`` when the hole runs
        to byte ``n``. Only sparse files are asked."""
        if not self._sparse(s.file):
            return rel
        _, off, _n = self.r.key_location(s.file, s.key)
        data = next_data(self._fd(s.file), off + rel, off + n) - off
        return rel + (data - rel) // unit * unit if data < n else n

    @property
    def _zeros(self) -> memoryview:
        z = getattr(self, "_zero_chunk", None)
        if z is None:
            z = self._zero_chunk = memoryview(bytes(CHUNK))
        return z

    @staticmethod
    def _copy_file_range(
        store: Storage, src_fd: int, src_off: int, dst: RangeFile, dst_off: int, n: int
    ) -> None:
        """The kernel's copy into ``dst`` (``Storage.copy_range``: read and written where it cannot)."""
        store.copy_range(src_fd, src_off, dst, dst_off, n)

    def _fd(self, file: str) -> int:
        """The OS descriptor of a source data file (asked only of files that have one)."""
        fd = self.r.read_handle(file).descriptor()
        if fd is None:  # never: kernel copies and holes are asked of files with descriptors
            raise UnsupportedError(f"{self.r.file_path(file)} has no OS descriptor to copy from")
        return fd

    def _sparse(self, file: str) -> bool:
        got = self._sparse_files.get(file)
        if got is None:
            fd = self.r.read_handle(file).descriptor()
            got = self._sparse_files[file] = fd is not None and is_sparse(fd)
        return got

    def _assemble(
        self, name: str, t: TensorEntry, out_dtype: str, out: RangeOutput | StoreFile, pos: int
    ) -> tuple[str, str | None]:
        """Rebuild the tensor band by band (``_bands``): memory stays about two bands, whatever its size."""
        isz = itemsize(t.dtype)
        wdt = word_dtype(t.dtype)
        nd = len(t.shape)
        slices = stored(t)
        self._check_empty(name, slices)
        live = [s for s in slices if math.prod(s.shape)]
        hashers = {i: SliceHasher() for i, s in enumerate(live) if self.verify and s.xxh3 is not None}
        done = [0] * len(live)
        sparse = any(self._sparse(s.file) for s in live)
        cast = out_dtype != t.dtype
        partials: list[int] = []
        out_hash = SliceHasher()
        at = pos
        for band in bands(t.shape, isz, _BAND_BYTES):
            buf = np.empty(math.prod(band.shape) * isz, dtype=np.uint8)
            dense = buf.view(wdt).reshape(band.shape or (1,))
            for i, s in enumerate(live):
                pc = pieces(band, s.offsets, s.shape)
                if pc is None:
                    continue
                if pc.first != done[i]:  # pragma: no cover - bands visit each slice in its own order
                    raise RuntimeError(
                        f"internal: merge read {shown(name)} slice {shown(s.key)} out of order"
                    )
                if (
                    self._hole_end(s, pc.first * isz, (pc.first + pc.count) * isz, 1)
                    >= (pc.first + pc.count) * isz
                ):
                    tmp = np.zeros(pc.count * isz, dtype=np.uint8)  # a hole of a sparse source: not read
                else:
                    tmp = np.empty(pc.count * isz, dtype=np.uint8)
                    self.r.read_key_bytes(s.file, s.key, pc.first * isz, pc.count * isz, tmp.data)
                h = hashers.get(i)
                if h is not None:
                    h.update(tmp.data)
                done[i] += pc.count
                if h is not None and done[i] == math.prod(s.shape):
                    self._check(name, s, h.hexdigest())
                dense[(slice(pc.lo, pc.hi), *pc.inner)] = tmp.view(wdt).reshape(
                    (pc.hi - pc.lo, *s.shape[band.dim + 1 :])
                )
                self.progress(pc.count * isz)
                del tmp
            if cast:
                offs, box = (band.offsets(nd), band.box_shape()) if nd else ([], [])
                buf = _cast(buf, t.dtype, out_dtype, box)
                partials.append(fingerprint_partial(buf.view(word_dtype(out_dtype)), t.shape, offs, box))
            out_hash.update(buf.data)
            if not (sparse and not buf.any()):  # a zero band of a sparse source stays a hole
                out.write(buf.data, at)
            at += buf.nbytes
        fingerprint = t.fingerprint
        if cast:
            fingerprint = finalize_fingerprint(name, out_dtype, t.shape, combine_partials(partials))
        return out_hash.hexdigest(), fingerprint


def _cast(buf: np.ndarray, src: str, dst: str, shape: list[int]) -> np.ndarray:
    from unickpt.tools._torch import from_bytes, tensor_bytes, torch_of

    return tensor_bytes(from_bytes(buf, src, shape).to(torch_of(dst)))
