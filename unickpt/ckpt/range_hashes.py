"""Checking a slice's byte ranges (``SliceEntry.ranges``, docs/format.md 5.1) while it is read (no torch).

A gathered save written by several ranks records, instead of one xxh3-64 of a tensor's bytes
(which no rank could compute alone), the xxh3-64 of each range of bytes one rank wrote.
:class:`RangeChecker` takes the slice's bytes in order, in chunks of any size, and names every
range whose bytes do not hash to the recorded value, so a damaged range is pinpointed.
"""

from __future__ import annotations

from collections.abc import Iterable

import xxhash

from unickpt.errors import IntegrityFailure
from unickpt.spec.index_models import SliceEntry

__all__ = ["RangeChecker", "RangeFailure", "check_ranges", "has_hashes", "slice_failures"]


class RangeFailure(IntegrityFailure):
    """One byte range of a slice whose bytes do not hash to the recorded value."""

    __slots__ = ("end", "start")

    def __init__(
        self, tensor: str, file: str, key: str, start: int, end: int, expected: str, found: str
    ) -> None:
        super().__init__(tensor, file, key, expected, found)
        self.start = start
        self.end = end

    def __str__(self) -> str:
        return (
            f"tensor {self.tensor!r} in file {self.file!r} (stored as {self.key!r}): bytes "
            f"[{self.start}, {self.end}) of the tensor: expected xxh3-64 {self.expected}, found {self.found}"
        )


def has_hashes(s: SliceEntry) -> bool:
    """Whether a slice records any hash of its bytes (``xxh3`` or ``ranges``)."""
    return s.xxh3 is not None or s.ranges is not None


class RangeChecker:
    """Feed a slice's bytes in order (``update``); ``failures()`` names each range that differs."""

    def __init__(self, tensor: str, s: SliceEntry) -> None:
        self.tensor, self.slice = tensor, s
        self._ranges = list(s.ranges or [])
        self._i = 0
        self._pos = 0
        self._h = xxhash.xxh3_64()
        self._bad: list[RangeFailure] = []

    def update(self, data: bytes | memoryview) -> None:
        mv = memoryview(data).cast("B")
        while mv.nbytes and self._i < len(self._ranges):
            r = self._ranges[self._i]
            take = min(mv.nbytes, r.end - self._pos)
            self._h.update(mv[:take])
            self._pos += take
            mv = mv[take:]
            if self._pos == r.end:
                self._close(r.start, r.end, r.xxh3, self._h.hexdigest())
                self._h = xxhash.xxh3_64()
                self._i += 1

    def _close(self, start: int, end: int, expected: str, found: str) -> None:
        if found != expected:
            s = self.slice
            self._bad.append(RangeFailure(self.tensor, s.file, s.key, start, end, expected, found))

    def failures(self, unreadable: str | None = None) -> list[RangeFailure]:
        """The ranges that differ; with ``unreadable`` (why reading stopped), every range not fully read."""
        if unreadable is not None or self._pos < (self._ranges[-1].end if self._ranges else 0):
            why = unreadable or "unreadable (the slice ended early)"
            for r in self._ranges[self._i :]:
                self._bad.append(
                    RangeFailure(self.tensor, self.slice.file, self.slice.key, r.start, r.end, r.xxh3, why)
                )
            self._i = len(self._ranges)
        return list(self._bad)


def check_ranges(tensor: str, s: SliceEntry, chunks: Iterable[bytes | memoryview]) -> list[RangeFailure]:
    """Every range of ``s`` whose bytes (``chunks``, the whole slice in order) differ from the record."""
    c = RangeChecker(tensor, s)
    for data in chunks:
        c.update(data)
    return c.failures()


def slice_failures(
    tensor: str, s: SliceEntry, chunks: Iterable[bytes | memoryview]
) -> list[IntegrityFailure]:
    """Rehash a slice's bytes (``chunks``, the whole slice in order) against its ``xxh3`` and each of
    its ``ranges``; the failures (empty when every recorded hash matches)."""
    h = xxhash.xxh3_64() if s.xxh3 is not None else None
    c = RangeChecker(tensor, s) if s.ranges is not None else None
    for data in chunks:
        if h is not None:
            h.update(data)
        if c is not None:
            c.update(data)
    out: list[IntegrityFailure] = list(c.failures()) if c is not None else []
    if h is not None and s.xxh3 is not None and h.hexdigest() != s.xxh3:
        out.append(IntegrityFailure(tensor, s.file, s.key, s.xxh3, h.hexdigest()))
    return out
