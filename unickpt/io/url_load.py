"""Loads from checkpoints on URLs: opening with the index fetched once, and reading in windows.

``open_for_load`` is how every ``CheckpointIO`` opens a checkpoint (a local path or a URL); on a
URL in a distributed load, rank 0 alone fetches the index and broadcasts its bytes.
``each_block`` runs the load engine's per-block reads (``load.read_box``) so that on a URL each
window's byte ranges are fetched first, coalesced and in flight together
(``CheckpointReader.prefetch``), and the blocks are then copied from memory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from unickpt import _dist
from unickpt._faults import maybe_fail
from unickpt.format.boxes import intersect, runs
from unickpt.format.dtypes import itemsize
from unickpt.format.index import TensorEntry
from unickpt.format.reader import CheckpointReader, Located, locate, open_checkpoint, open_located
from unickpt.format.storage import is_url
from unickpt.io.tensors import LocalSlice

__all__ = [
    "each_slice",
    "open_for_load",
    "each_block",
    "wanted_ranges",
    "URL_WINDOW",
    "URL_READ_THREADS",
    "URL_VERIFY_HOLD",
]

#: On a URL, the blocks of a load are read in windows of about this many bytes: each window's
#: ranges are fetched first (coalesced, in flight together, ``URL_READ_THREADS`` files at once),
#: then copied, so a load holds at most one window of fetched bytes beyond its state.
URL_WINDOW = 128 << 20
URL_READ_THREADS = 8
#: A verified load on a URL keeps the slices it fetched to hash for its reads (each byte fetched
#: once) when they total at most this many bytes per rank; beyond, the reads fetch again.
URL_VERIFY_HOLD = 4 << 30


def each_block(
    reader: CheckpointReader,
    jobs: list[tuple[TensorEntry, LocalSlice]],
    fn: Callable[[Any], Any],
    held: bool = False,
) -> list[Any]:
    """``[fn(job) for job in jobs]``. On a URL, jobs go in windows of about ``URL_WINDOW`` bytes:
    every byte range a window's blocks need is fetched first (``reader.prefetch``: coalesced
    requests, all in flight, files in parallel), then the blocks are copied from memory.

    ``held``: the reader still holds the whole slices ``each_slice(keep=True)`` fetched to hash
    them; ranges they cover are not fetched again, and they are dropped when this returns."""
    if reader.storage is None:
        return [fn(job) for job in jobs]
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

    On a URL in a distributed load, rank 0 alone finds the checkpoint and fetches its index, one
    broadcast hands the bytes to every rank, and each rank parses them: the store serves the
    index once, not once per rank. A single process opens (pins) every data file at once, so a
    save committed while the checkpoint is opened is retried once here, before anything is loaded.
    """
    where = os.fspath(checkpoint)
    alone = _dist.world_size(group) == 1
    located: Located | None = None
    if is_url(where) and not alone:
        err: BaseException | None = None
        try:
            if args is not None and args.check is not None:
                args.check()
            if _dist.rank(group) == 0:
                located = locate(where, kind, storage_options)
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
    """``fn((tensor name, stored slice))`` for each item; on a URL, the whole slices of about
    ``URL_WINDOW`` bytes at a time are fetched first (coalesced, in flight together), so hashing
    them (``verify=True``) costs a few large requests, not one round trip per slice.

    ``keep``: on a URL, when the slices total at most ``URL_VERIFY_HOLD`` bytes, the fetched
    bytes stay in the reader for the load's reads (``each_block(held=True)``), so a verified load
    fetches each byte once. Returns whether they were kept (the caller must then read with
    ``held=True``, which drops them, or call ``reader.drop_prefetched()``)."""
    if reader.storage is None:
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
