"""How merge writes each tensor into its output file: copied in the kernel, streamed in chunks, or
rebuilt band by band in memory (column splits, 2-D meshes, dtype casts), hashing on the way.

An output file is a file a store opened for writes at offsets (``Storage.open_range``, on a store
with ``range_write``), or a file streamed to an object store (``store.publish.StoreFile``);
a tensor is copied in the kernel only into a file of a store with ``kernel_copy``."""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from unickpt.ckpt.reader import CheckpointReader
from unickpt.errors import IntegrityError, IntegrityFailure, UnsupportedError
from unickpt.spec.dtypes import itemsize, word_dtype
from unickpt.spec.hashing import (
    SliceHasher,
    combine_partials,
    finalize_fingerprint,
    fingerprint_partial,
)
from unickpt.spec.index import SliceEntry, TensorEntry
from unickpt.store.publish import StoreFile
from unickpt.store.storage import RangeFile, Storage
from unickpt.tools._bands import bands, is_sparse, next_data, pieces
from unickpt.tools._merge_bulk import groups, merge_rows
from unickpt.tools._merge_runs import Run

__all__ = ["CASTABLE", "CHUNK", "RangeOutput", "TensorMerger"]

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
    def _check(self, name: str, s: SliceEntry, found: str) -> None:
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
        """Whether a tensor goes through the bulk merge of row-sliced tensors (``_merge_bulk``)."""
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
            self._check_empty(name, t)
            if how == "kernel" and isinstance(out, RangeOutput) and out.store.kernel_copy:  # else: stream
                results[name] = (self._copy_one(runs[0].slice, out, pos), t.fingerprint)
            else:
                results[name] = (self._stream_runs(name, t, runs, out, pos), t.fingerprint)
        return results

    def _check_empty(self, name: str, t: TensorEntry) -> None:
        # Empty slices hold no bytes but still carry a hash: check it.
        for s in t.slices:
            if math.prod(s.shape) == 0:
                self._check(name, s, _EMPTY_HASH)

    def _copy_one(self, s: SliceEntry, out: RangeOutput, pos: int) -> str | None:
        """The output bytes are exactly the stored slice: copy in the kernel, its hash is the output's."""
        _, off, n = self.r.slice_location(s)
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
                    chunk = self.r.read_bytes(s, done, k, self._buf[:k])
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

    def _hole_end(self, s: SliceEntry, rel: int, n: int, unit: int = CHUNK) -> int:
        """Where the hole at ``rel`` bytes into slice ``s`` ends (``rel`` itself when ``rel`` holds
        data), as bytes into the slice, rounded down to whole ``unit``s; ``n`` when the hole runs
        to byte ``n``. Only sparse files are asked."""
        if not self._sparse(s.file):
            return rel
        _, off, _n = self.r.slice_location(s)
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
        self._check_empty(name, t)
        live = [s for s in t.slices if math.prod(s.shape)]
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
                    raise RuntimeError(f"internal: merge read {name!r} slice {s.key!r} out of order")
                if (
                    self._hole_end(s, pc.first * isz, (pc.first + pc.count) * isz, 1)
                    >= (pc.first + pc.count) * isz
                ):
                    tmp = np.zeros(pc.count * isz, dtype=np.uint8)  # a hole of a sparse source: not read
                else:
                    tmp = np.empty(pc.count * isz, dtype=np.uint8)
                    self.r.read_bytes(s, pc.first * isz, pc.count * isz, tmp.data)
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
