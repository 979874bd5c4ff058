"""``verify`` of many small slices in local files: one read per run of adjacent slices (no torch).

A sliced save's data file holds one slice of every tensor its rank saved, back to back. Rehashing
them one ``pread`` at a time costs a system call and its bookkeeping per slice; here the slices
to rehash (every hashed slice of the tensors whose fingerprint is not recomputed and that carry
no byte-range hashes) are located from the tables in bulk, sorted per file, and each run of
adjacent slices (up to ``RUN_BYTES``) is read with one ``pread`` and hashed slice by slice over
memoryviews of that buffer. A run that cannot be read whole (a file truncated or changed under
the reader) is read again slice by slice, so each of its slices fails or passes exactly as the
one-slice path (``verify._verify_tensor``) would say.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
import xxhash

from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, IntegrityFailure
from unickpt.format.index import TensorEntry
from unickpt.format.read_batch import table_spans
from unickpt.format.reader import CheckpointReader
from unickpt.format.slice_spans import FileNumbers, recorded_hashes

if TYPE_CHECKING:
    from unickpt.tools.verify import VerifyReport

__all__ = ["RUN_BYTES", "bulk_verifiable", "verify_bulk"]

#: Bytes read at a time: a run of adjacent slices is cut here; a larger slice takes the per-slice path.
RUN_BYTES = 16 << 20


def bulk_verifiable(r: CheckpointReader, t: TensorEntry, fp: bool) -> bool:
    """Whether the tensor's slices can be rehashed here: local files, no fingerprint to
    recompute, no byte-range hashes."""
    return r.storage is None and not fp and t.table.ranges_count() == 0


def verify_bulk(
    r: CheckpointReader,
    tensors: list[tuple[str, TensorEntry]],
    report: VerifyReport,
    tick: Callable[[int], object],
) -> list[tuple[str, TensorEntry]]:
    """Rehash the small hashed slices of ``tensors``, run by run; failures go to ``report`` (in
    tensor and slice order). Returns the tensors left to the per-slice path (a slice larger than
    ``RUN_BYTES``, or a key its header lacks)."""
    numbers = FileNumbers()
    cols: list[tuple[np.ndarray, ...]] = []
    rest: list[tuple[str, TensorEntry]] = []
    for ti, (name, t) in enumerate(tensors):
        table = t.table
        ks, wants = recorded_hashes(table)
        spans = r.spans.get(name)  # located when the structure was validated
        if spans is not None:
            offs, lens = spans[0][ks], spans[1][ks]
        else:
            try:
                _, o, n = table_spans(r.header, table, ks.tolist())
            except (IncompleteCheckpointError, CheckpointFormatError):
                rest.append((name, t))  # the per-slice path reports it slice by slice
                continue
            offs, lens = np.asarray(o, dtype=np.int64), np.asarray(n, dtype=np.int64)
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
            _check_run(r, r._fd(file), file, run, tensors, failed, report, tick)
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
    fd: int,
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
        buf = memoryview(os.pread(fd, total, start))
    except OSError:
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
            got = r.hash_slice(t.table.entry(k))
        except (IncompleteCheckpointError, CheckpointFormatError, OSError) as e:
            got = f"unreadable ({e})"
        tick(int(size[i]))
        if got != f"{int(want[i]):016x}":
            failed.append((int(tis[i]), k, _failure(name, file, t, k, got)))


def _failure(name: str, file: str, t: TensorEntry, k: int, found: str) -> IntegrityFailure:
    return IntegrityFailure(name, file, t.table.key(k), t.table.xxh3(k) or "-", found)
