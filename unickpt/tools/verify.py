"""``unickpt verify``: check every claim of a checkpoint against its files. No torch.

1. Structure (raises, since the input is then not a usable checkpoint): the index schema and
   safe file names; the index's parts agree (no slice named twice, ``weight_map`` and the
   unickpt block describe the same tensors in the same files, optimizer tensor names);
   exact coverage of every tensor; every slice present in its file with the recorded dtype
   and shape; every key of every data file referenced by a slice; the files' format tags;
   ``metadata.total_size``.
2. Data (returned as failures): every stored slice rehashed (xxh3-64) and every recorded
   fingerprint recomputed from the data, in one streamed pass of bounded memory. Small slices
   of local files with no fingerprint to recompute are read a run of adjacent slices at a time
   (:func:`verify_bulk`), each failing or passing exactly as when read alone.

The result says exactly what was checked: how many slices were rehashed, how many carry no
hash (their bytes cannot be checked), how many fingerprints were recomputed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import xxhash

from unickpt._logging import get_logger
from unickpt.ckpt.reader import CheckpointReader, RangeChecker
from unickpt.ckpt.stored_slices import FileNumbers, recorded_hashes
from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, IndexFileError, IntegrityFailure
from unickpt.spec.boxes import flat_range_to_boxes
from unickpt.spec.dtypes import itemsize
from unickpt.spec.hashing import (
    SliceHasher,
    combine_partials,
    finalize_fingerprint,
    fingerprint_partial,
)
from unickpt.spec.index import TensorEntry
from unickpt.spec.naming import shown
from unickpt.store.storage import ReadHandle
from unickpt.tools._common import open_auto
from unickpt.tools._progress import progress_bar

__all__ = ["verify_checkpoint", "VerifyReport", "FingerprintFailure", "MissingHash"]

logger = get_logger(__name__)

# Bytes read (and hashed) at a time: memory stays bounded whatever the tensor's size.
_CHUNK = 16 << 20


class FingerprintFailure(IntegrityFailure):
    """A tensor whose data does not give the fingerprint its index records."""

    __slots__ = ()

    def __str__(self) -> str:
        return (
            f"tensor {shown(self.tensor)} (in {self.file}): recorded fingerprint {self.expected}, "
            f"the data gives {self.found}"
        )


class MissingHash(IntegrityFailure):
    """A stored slice without a recorded hash, reported under ``require_hashes``."""

    __slots__ = ()

    def __str__(self) -> str:
        return (
            f"tensor {shown(self.tensor)} in file {shown(self.file)} (stored as {shown(self.key)}): no xxh3-64 recorded, "
            "so its bytes cannot be checked"
        )


class VerifyReport(list[IntegrityFailure]):
    """The failures found (a list, empty when all is well) and what was checked.

    ``slices``: stored slices; ``hashed``: slices rehashed; ``unhashed``: slices without a
    recorded hash (not checked); ``fingerprints``: fingerprints recomputed; ``unfingerprinted``:
    tensors without one; ``unickpt_block``: False for a plain Hugging Face / safetensors
    checkpoint.
    """

    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path
        self.tensors = 0
        self.slices = 0
        self.files = 0
        self.hashed = 0
        self.unhashed = 0
        self.fingerprints = 0
        self.unfingerprinted = 0
        self.unickpt_block = True
        self.require_hashes = False

    def to_dict(self) -> dict[str, Any]:
        """Plain data for ``unickpt verify --json``: what was checked and every failure."""
        return {
            "path": self.path,
            "ok": not self,
            "unickpt_block": self.unickpt_block,
            "tensors": self.tensors,
            "slices": self.slices,
            "files": self.files,
            "hashed": self.hashed,
            "unhashed": self.unhashed,
            "fingerprints": self.fingerprints,
            "unfingerprinted": self.unfingerprinted,
            "require_hashes": self.require_hashes,
            "failures": [
                {
                    "what": {FingerprintFailure: "fingerprint", MissingHash: "missing_hash"}.get(
                        type(f), "hash"
                    ),
                    "tensor": f.tensor,
                    "file": f.file,
                    "key": f.key,
                    "expected": f.expected,
                    "found": f.found,
                    "message": str(f),
                }
                for f in self
            ],
            "summary": self.summary(),
        }

    def summary(self) -> str:
        """One paragraph saying what was checked (and what could not be)."""
        what = (
            "index, weight_map against the unickpt block, coverage, headers, every stored key accounted for"
            if self.unickpt_block
            else "weight_map and headers"
        )
        files = f"{self.files} file" + ("" if self.files == 1 else "s")
        parts = [f"structure valid ({self.tensors} tensors, {self.slices} slices in {files}: {what})"]
        if self.hashed:
            parts.append(f"{self.hashed} of {self.slices} slices rehashed")
        if self.fingerprints:
            parts.append(f"{self.fingerprints} of {self.tensors} fingerprints recomputed from the data")
        if self.unhashed:
            plain = "a plain Hugging Face / safetensors checkpoint, " if not self.unickpt_block else ""
            then = (
                "each is a failure under --require-hashes"
                if self.require_hashes
                else ("--require-hashes makes this a failure")
            )
            parts.append(
                f"{self.unhashed} slice(s) carry no hash ({plain}their bytes were not checked; {then})"
            )
        if not self.hashed and not self.fingerprints and self.slices:
            parts.append("structure only: no stored byte was checked")
        return "; ".join(parts)


def verify_checkpoint(
    path: str | os.PathLike[str],
    *,
    kind: str | None = None,
    progress: bool = False,
    require_hashes: bool = False,
    fingerprints: bool = True,
) -> VerifyReport:
    """Check the checkpoint at ``path``; return a :class:`VerifyReport` (a list of failures).

    Structural problems raise (``IndexFileError``, ``HeaderError``, ``IncompleteCheckpointError``
    ...). Then every stored slice is rehashed and (``fingerprints``) every recorded fingerprint
    recomputed; each mismatch is returned, naming the tensor and the file. With
    ``require_hashes`` every slice without a recorded hash is a failure too (``MissingHash``).
    An empty report means every check made passed: read ``report.summary()`` for which.
    ``progress`` shows a tqdm bar on stderr.
    """
    with open_auto(path, kind) as r:
        report = VerifyReport(os.fspath(path))
        r.validate_structure()
        check_claims(r)
        b = r.block
        report.unickpt_block = r.has_unickpt_block
        report.require_hashes = require_hashes
        report.tensors = len(b.tensors)
        report.files = len(r.files)
        todo: list[tuple[str, TensorEntry, bool]] = []
        total = 0
        for name, t in b.tensors.items():
            fp = fingerprints and t.fingerprint is not None
            table = t.table  # counted from the slice table: no per-slice object
            report.slices += len(table)
            hashed = table.hashed_count()
            report.unhashed += len(table) - hashed
            if t.fingerprint is None:
                report.unfingerprinted += 1
            if hashed or fp:
                todo.append((name, t, fp))
                vol = table.volumes()
                if not fp and hashed < len(table):
                    vol = vol[table.hashed_mask()]
                total += int(vol.sum()) * itemsize(t.dtype)
            if require_hashes and hashed < len(table):
                report.extend(
                    MissingHash(name, table.file(k), table.key(k), "-", "-")
                    for k, has in enumerate(table.hashed_mask())
                    if not has
                )
        with progress_bar(total, "verify", progress) as tick:
            # Local files, no fingerprint to recompute: slices rehashed a run of adjacent ones at a time.
            bulk = [(name, t) for name, t, fp in todo if bulk_verifiable(r, t, fp)]
            left = {name for name, _ in verify_bulk(r, bulk, report, tick)} if bulk else set()
            done = {name for name, _ in bulk} - left
            for name, t, fp in todo:
                if name not in done:
                    _verify_tensor(r, name, t, fp, report, tick)
        for f in report:
            logger.info("integrity failure: %s", f)
        return report


def _verify_tensor(
    r: CheckpointReader,
    name: str,
    t: TensorEntry,
    fp: bool,
    report: VerifyReport,
    tick: Callable[[int], object],
) -> None:
    """Rehash the tensor's slices and recompute its fingerprint, reading each slice once, in chunks."""
    isz = itemsize(t.dtype)
    partials: list[int] = []
    bad = False  # a slice failed its hash or could not be read: that failure says it all
    table = t.table  # the slices read from its columns, taken whole: no per-slice object
    columns = table.rows()
    for k, (file, key, xxh3, offsets, shape) in enumerate(columns):
        rng = table.ranges(k)
        if not fp and xxh3 is None and rng is None:
            continue
        h = SliceHasher()
        ranges = RangeChecker(name, file, key, rng) if rng is not None else None
        try:
            for start, data in _ChunkIter(r, file, key, shape, isz):
                h.update(data)
                if ranges is not None:
                    ranges.update(data)
                if fp:
                    partials.extend(_partials(t, offsets, shape, data, start, isz))
                tick(len(data))
            found = h.hexdigest()
        except (IncompleteCheckpointError, CheckpointFormatError, OSError) as e:
            found = f"unreadable ({e})"
            bad = True
        if ranges is not None:  # a gathered save written by several ranks: each range
            report.hashed += xxh3 is None
            failed = ranges.failures(found if found.startswith("unreadable") else None)
            report.extend(failed)
            bad = bad or bool(failed)
            if xxh3 is None:
                continue
        if xxh3 is not None:
            report.hashed += 1
            if found != xxh3:
                report.append(IntegrityFailure(name, file, key, xxh3, found))
                bad = True
        elif found.startswith("unreadable"):
            report.append(IntegrityFailure(name, file, key, "-", found))
    if fp and t.fingerprint is not None and not bad:
        report.fingerprints += 1
        got = finalize_fingerprint(name, t.dtype, t.shape, combine_partials(partials))
        if got != t.fingerprint:
            files = ", ".join(sorted(table.file_counts()))
            report.append(FingerprintFailure(name, files, "", t.fingerprint, got))


class _ChunkIter:
    """(first element index within the slice, bytes) of a slice, at most ``_CHUNK`` bytes at a time."""

    def __init__(self, r: CheckpointReader, file: str, key: str, shape: list[int], isz: int) -> None:
        self.r, self.file, self.key, self.shape, self.isz = r, file, key, shape, isz

    def __iter__(self) -> _ChunkIter:
        self.n = math.prod(self.shape)
        self.step = max(1, _CHUNK // self.isz)
        self.pos = 0
        self.r.key_location(
            self.file, self.key
        )  # a key absent from the file raises here, even for an empty slice
        return self

    def __next__(self) -> tuple[int, memoryview]:
        if self.pos >= self.n:
            raise StopIteration
        start = self.pos
        count = min(self.step, self.n - start)
        data = self.r.read_key_bytes(self.file, self.key, start * self.isz, count * self.isz)
        self.pos += count
        return start, data


def _partials(
    t: TensorEntry, offsets: list[int], shape: list[int], data: memoryview, start: int, isz: int
) -> list[int]:
    """Fingerprint partial sums of the flat element range [start, start + len) of a slice."""
    words = np.frombuffer(data, dtype=f"<u{isz}")
    out = []
    for (off, shp), flat in flat_range_to_boxes(shape, start, start + len(words)):
        glob = [a + b for a, b in zip(offsets, off, strict=True)]
        k = flat - start
        out.append(fingerprint_partial(words[k : k + math.prod(shp)], t.shape, glob, shp))
    return out


def check_claims(r: CheckpointReader) -> None:
    """The index's remaining claims a reader may rely on: total_size and the files' format tags."""
    where = r.index_path or r.directory
    if not r.has_unickpt_block:
        return  # a plain Hugging Face index: only weight_map matters, and it was read
    if r.index is not None:
        want = sum(t.nbytes for t in r.block.tensors.values())
        if r.index.metadata.total_size != want:
            raise IndexFileError(
                f"{where}: metadata.total_size says {r.index.metadata.total_size} bytes, the tensors of the "
                f"index hold {want}"
            )
    sliced = not r.block.layout.gathered
    want_tag = "unickpt-sliced" if sliced else "pt"
    for file in r.files:
        h = r.header(file)
        tag = h.metadata.get("format")
        if tag != want_tag:
            raise IndexFileError(
                f"{h.path}: format tag {shown(tag)} in a {'sliced' if sliced else 'gathered'} checkpoint, "
                f"expected {shown(want_tag)} (a sliced file tagged 'pt' would be loaded by Hugging Face as whole "
                "tensors)"
            )


# Many small slices in files read where they lie (not fetched ahead): one read per run of adjacent slices.
#
# A sliced save's data file holds one slice of every tensor its rank saved, back to back.
# Rehashing them one ``pread`` at a time costs a system call and its bookkeeping per slice; here
# the slices to rehash (every hashed slice of the tensors whose fingerprint is not recomputed and
# that carry no byte-range hashes) are located from the tables in bulk, sorted per file, and each
# run of adjacent slices (up to ``RUN_BYTES``) is read with one ``pread`` and hashed slice by
# slice over memoryviews of that buffer. A run that cannot be read whole (a file truncated or
# changed under the reader) is read again slice by slice, so each of its slices fails or passes
# exactly as the one-slice path (:func:`_verify_tensor`) would say.

#: Bytes read at a time: a run of adjacent slices is cut here; a larger slice takes the per-slice path.
RUN_BYTES = 16 << 20


def bulk_verifiable(r: CheckpointReader, t: TensorEntry, fp: bool) -> bool:
    """Whether the tensor's slices can be rehashed here: files read where they lie (an object
    store's are fetched ahead in windows by the per-slice path), no fingerprint to recompute, no
    byte-range hashes."""
    return not r.storage.fetch_ahead and not fp and t.table.ranges_count() == 0


def verify_bulk(
    r: CheckpointReader,
    tensors: list[tuple[str, TensorEntry]],
    report: VerifyReport,
    tick: Callable[[int], object],
) -> list[tuple[str, TensorEntry]]:
    """Rehash the small hashed slices of ``tensors``, run by run; failures go to ``report`` (in
    tensor and slice order). Returns the tensors left to the per-slice path (a slice larger than
    ``RUN_BYTES``). Their spans are the reader's, located when the structure was validated."""
    numbers = FileNumbers()
    cols: list[tuple[np.ndarray, ...]] = []
    rest: list[tuple[str, TensorEntry]] = []
    for ti, (name, t) in enumerate(tensors):
        table = t.table
        ks, wants = recorded_hashes(table)
        spans = r.spans[name]  # every slice located when the structure was validated
        offs, lens = spans[0][ks], spans[1][ks]
        if len(lens) and int(lens.max()) > RUN_BYTES:
            rest.append((name, t))
            continue
        cols.append((numbers.of(table, ks), offs, lens, wants, np.full(len(ks), ti, dtype=np.int64), ks))
    failed: list[tuple[int, int, IntegrityFailure]] = []
    if cols:
        f, off, size, want, tis, kss = (np.concatenate([c[i] for c in cols]) for i in range(6))
        order = np.lexsort((off, f))
        f, off, size, want, tis, kss = (a[order] for a in (f, off, size, want, tis, kss))
        names = numbers.names
        for a, b in _runs(f, off, size):
            file = names[int(f[a])]
            run = (off[a:b], size[a:b], want[a:b], tis[a:b], kss[a:b])
            _check_run(r, r.read_handle(file), file, run, tensors, failed, report, tick)
    failed.sort(key=lambda x: (x[0], x[1]))
    report.extend(fl for _, _, fl in failed)
    return rest


def _runs(f: np.ndarray, off: np.ndarray, size: np.ndarray) -> list[tuple[int, int]]:
    """Runs ``a:b`` of adjacent slices in one file (sorted by file and offset) of at most
    ``RUN_BYTES`` (each slice is at most that)."""
    adj = (f[1:] == f[:-1]) & (off[1:] == off[:-1] + size[:-1])
    starts = np.concatenate(([0], np.flatnonzero(~adj) + 1)).tolist()
    stops = [*starts[1:], len(f)]
    out: list[tuple[int, int]] = []
    sizes = size.tolist()
    for a, b in zip(starts, stops, strict=True):
        if int(off[b - 1]) + sizes[b - 1] - int(off[a]) <= RUN_BYTES:
            out.append((a, b))
            continue
        i, total = a, 0
        for j in range(a, b):
            if total + sizes[j] > RUN_BYTES:
                out.append((i, j))
                i, total = j, 0
            total += sizes[j]
        out.append((i, b))
    return out


def _check_run(
    r: CheckpointReader,
    handle: ReadHandle,
    file: str,
    run: tuple[np.ndarray, ...],
    tensors: list[tuple[str, TensorEntry]],
    failed: list[tuple[int, int, IntegrityFailure]],
    report: VerifyReport,
    tick: Callable[[int], object],
) -> None:
    """Hash every slice of one run from one read of it; a run not read whole, slice by slice."""
    off, size, want, tis, kss = run
    start = int(off[0])
    total = int(off[-1] + size[-1]) - start
    try:
        buf = memoryview(handle.pread(start, total))
    except (OSError, IncompleteCheckpointError):
        buf = memoryview(b"")
    report.hashed += len(off)
    if len(buf) == total:
        rel = off - start
        found = np.fromiter(
            map(
                xxhash.xxh3_64_intdigest,
                map(buf.__getitem__, map(slice, rel.tolist(), (rel + size).tolist())),
            ),
            np.uint64,
            len(rel),
        )
        tick(total)
        for i in np.flatnonzero(found != want).tolist():
            name, t = tensors[int(tis[i])]
            failed.append(
                (int(tis[i]), int(kss[i]), _failure(name, file, t, int(kss[i]), f"{int(found[i]):016x}"))
            )
        return
    for i in range(len(off)):  # read each slice alone, as the per-slice path does, to say what is wrong
        name, t = tensors[int(tis[i])]
        k = int(kss[i])
        try:
            got = r.hash_key(file, t.table.key(k))
        except (IncompleteCheckpointError, CheckpointFormatError, OSError) as e:
            got = f"unreadable ({e})"
        tick(int(size[i]))
        if got != f"{int(want[i]):016x}":
            failed.append((int(tis[i]), k, _failure(name, file, t, k, got)))


def _failure(name: str, file: str, t: TensorEntry, k: int, found: str) -> IntegrityFailure:
    return IntegrityFailure(name, file, t.table.key(k), t.table.xxh3(k) or "-", found)
