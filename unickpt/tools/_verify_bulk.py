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

import xxhash

from unickpt.errors import CheckpointFormatError, IncompleteCheckpointError, IntegrityFailure
from unickpt.format.index import TensorEntry
from unickpt.format.read_batch import table_spans
from unickpt.format.reader import CheckpointReader

if TYPE_CHECKING:
    from unickpt.tools.verify import VerifyReport

__all__ = ["RUN_BYTES", "bulk_verifiable", "verify_bulk"]

#: Bytes read at a time: a run of adjacent slices is cut here; a larger slice takes the per-slice path.
RUN_BYTES = 16 << 20

# (absolute offset, byte length, recorded xxh3, tensor number, slice position)
_Item = tuple[int, int, str, int, int]


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
    per_file: dict[str, list[_Item]] = {}
    rest: list[tuple[str, TensorEntry]] = []
    for ti, (name, t) in enumerate(tensors):
        table = t.table
        hashes = table.hash_list()
        ks = [k for k, h in enumerate(hashes) if h is not None]
        wants = [h for h in hashes if h is not None]
        try:
            files, offs, lens = table_spans(r.header, table, ks)
        except (IncompleteCheckpointError, CheckpointFormatError):
            rest.append((name, t))  # the per-slice path reports it slice by slice
            continue
        if lens and max(lens) > RUN_BYTES:
            rest.append((name, t))
            continue
        for file, off, n, k, h in zip(files, offs, lens, ks, wants, strict=True):
            per_file.setdefault(file, []).append((off, n, h, ti, k))
    failed: list[tuple[int, int, IntegrityFailure]] = []
    for file, items in per_file.items():
        items.sort()
        fd = r._fd(file)
        for run in _runs(items):
            _check_run(r, fd, file, run, tensors, failed, report, tick)
    failed.sort(key=lambda x: (x[0], x[1]))
    report.extend(f for _, _, f in failed)
    return rest


def _runs(items: list[_Item]) -> list[list[_Item]]:
    out: list[list[_Item]] = []
    cur: list[_Item] = []
    end = size = -1
    for it in items:
        off, n = it[0], it[1]
        if off != end or size + n > RUN_BYTES:
            if cur:
                out.append(cur)
            cur, size = [], 0
        cur.append(it)
        end = off + n
        size += n
    if cur:
        out.append(cur)
    return out


def _check_run(
    r: CheckpointReader,
    fd: int,
    file: str,
    run: list[_Item],
    tensors: list[tuple[str, TensorEntry]],
    failed: list[tuple[int, int, IntegrityFailure]],
    report: VerifyReport,
    tick: Callable[[int], object],
) -> None:
    start = run[0][0]
    total = run[-1][0] + run[-1][1] - start
    try:
        buf = memoryview(os.pread(fd, total, start))
    except OSError:
        buf = memoryview(b"")
    whole = len(buf) == total
    for off, n, want, ti, k in run:
        name, t = tensors[ti]
        report.hashed += 1
        if whole:
            found = xxhash.xxh3_64_hexdigest(buf[off - start : off - start + n])
        else:  # read this slice alone, as the per-slice path does, to say what is wrong with it
            try:
                found = r.hash_slice(t.table.entry(k))
            except (IncompleteCheckpointError, CheckpointFormatError, OSError) as e:
                found = f"unreadable ({e})"
        tick(n)
        if found != want:
            failed.append((ti, k, IntegrityFailure(name, file, t.table.key(k), want, found)))
