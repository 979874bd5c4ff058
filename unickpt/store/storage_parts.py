"""Multipart uploads shared by ranks: the parts of one object uploaded by different processes.

An object store has no ``pwrite``, but S3's multipart upload comes close: an upload is created
once (an ``UploadId``), its parts (numbered 1..10000, each but the last at least 5 MiB) may be
uploaded by any client holding the id, in any order, and the object appears whole when the
upload is completed with the ordered list of (part number, ETag); aborted, nothing appears.
A gathered save on S3 (``io/parts_save.py``) uses this so that every rank uploads its share of
the Hugging Face files instead of funnelling every byte through rank 0.

This module is the arithmetic and the S3 calls, no torch:

- :func:`part_size_for` picks the part size of a file (``PART_SIZE``, raised when the file
  would need more than ``MAX_PARTS`` parts);
- :func:`plan_parts` cuts a file into fixed parts and gives each part one **owner**, the rank
  holding most of its bytes unless that would take it past its share of the save by more than
  half a part (then the next holder, or the least loaded rank), ties to the least loaded; with
  the byte runs each rank contributes to it;
- :class:`SharedUpload` creates, uploads a part of, completes and aborts an upload by id
  (a file of one part is one PUT instead);
- :func:`supports_shared_parts` says whether a storage offers it: S3 (``s3fs``) does; GCS,
  Azure, ``memory://`` and local file systems through fsspec do not (their gathered saves keep
  the rank-0 funnel, ``io/funnel_save.py``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

from unickpt.store.storage import FsspecStorage, Storage

__all__ = [
    "MAX_PARTS",
    "MIN_PART",
    "PART_SIZE",
    "Part",
    "SharedUpload",
    "part_size_for",
    "plan_parts",
    "supports_shared_parts",
]

#: S3's limits: at most this many parts, each but the last at least ``MIN_PART`` bytes.
MAX_PARTS = 10000
MIN_PART = 5 << 20
#: Bytes per part of a shared upload (raised for files of more than ``MAX_PARTS`` parts).
PART_SIZE = 8 << 20

# (start, end, rank): a byte run of a file and the rank holding it.
Run = tuple[int, int, int]


@dataclass(frozen=True)
class Part:
    """Part ``number`` (1-based) of a file: bytes ``[start, end)``, uploaded by ``owner``."""

    number: int
    start: int
    end: int
    owner: int
    runs: tuple[Run, ...]  # the part's bytes by holder, in file order (clipped to the part)


def supports_shared_parts(storage: Storage | None) -> TypeGuard[FsspecStorage]:
    """Whether several processes can upload parts of one object (S3's multipart uploads)."""
    return (
        isinstance(storage, FsspecStorage)
        and storage.protocol in ("s3", "s3a")
        and callable(getattr(storage.fs, "call_s3", None))
    )


def part_size_for(size: int, base: int = PART_SIZE) -> int:
    """The part size of a ``size``-byte file: ``base`` (at least ``MIN_PART``), raised to a
    whole MiB when the file would otherwise need more than ``MAX_PARTS`` parts."""
    p = max(base, MIN_PART)
    if math.ceil(size / p) > MAX_PARTS:
        p = math.ceil(size / MAX_PARTS / (1 << 20)) << 20
    return p


def plan_parts(
    size: int,
    runs: Sequence[Run],
    part_size: int,
    load: list[int],
    *,
    cap: int | None = None,
    first_owner: int | None = None,
) -> list[Part]:
    """The parts of a ``size``-byte file whose bytes are ``runs`` (sorted, tiling ``[0, size)``).

    ``load[r]`` is the number of bytes rank ``r`` owns so far (updated). A part goes to the
    holder of most of its bytes whose load stays within ``cap`` (ties: the least loaded, so that
    equal shares, e.g. column slices, spread evenly); when every holder would exceed ``cap``, to
    the least loaded rank of all (it receives the whole part). ``first_owner`` forces the owner
    of part 1 (the rank that writes the header last). Every rank computes the same parts from
    the same arguments.
    """
    starts = [b for b, _, _ in runs]
    parts: list[Part] = []
    n = max(1, math.ceil(size / part_size))
    if n > MAX_PARTS:
        raise ValueError(f"internal: {size} bytes in parts of {part_size} need {n} > {MAX_PARTS} parts")
    for j in range(n):
        a, b = j * part_size, min(size, (j + 1) * part_size)
        i = max(0, bisect.bisect_right(starts, a) - 1)
        clipped: list[Run] = []
        held: dict[int, int] = {}
        while i < len(runs) and runs[i][0] < b:
            s, e, r = runs[i]
            s, e = max(s, a), min(e, b)
            if s < e:
                clipped.append((s, e, r))
                held[r] = held.get(r, 0) + e - s
            i += 1
        if sum(e - s for s, e, _ in clipped) != b - a:
            raise ValueError(f"internal: the runs do not cover bytes [{a}, {b}) of a {size}-byte file")
        if j == 0 and first_owner is not None:
            owner = first_owner
        else:
            fits = [r for r in held if cap is None or load[r] + b - a <= cap]
            if fits:
                owner = min(fits, key=lambda r: (-held[r], load[r], r))
            else:
                owner = min(range(len(load)), key=lambda r: (load[r], r))
        load[owner] += b - a
        parts.append(Part(j + 1, a, b, owner, tuple(clipped)))
    return parts


class SharedUpload:
    """One multipart upload of ``path`` on S3, addressed by its id from any process.

    Rank 0 calls :meth:`create`, passes ``upload_id`` to the other ranks, each of which makes
    its own ``SharedUpload(fs, path, upload_id)`` to :meth:`upload_part`; rank 0 then
    :meth:`complete`s it with every part's ETag, or :meth:`abort`s it.
    """

    def __init__(self, fs: Any, path: str, upload_id: str | None = None) -> None:
        self.fs = fs
        self.path = path
        self.bucket, self.key, _ = fs.split_path(path)
        self.upload_id = upload_id

    def create(self) -> str:
        out = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
        self.upload_id = str(out["UploadId"])
        return self.upload_id

    def upload_part(self, number: int, body: bytes | bytearray | memoryview) -> str:
        """Upload part ``number``; returns its ETag."""
        out = self.fs.call_s3(
            "upload_part",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            PartNumber=number,
            Body=bytes(body),  # botocore streams bytes; a bytearray goes to aiohttp raw
        )
        return str(out["ETag"])

    def put(self, body: bytes | bytearray | memoryview, when: dict[str, str] | None = None) -> None:
        """A file of one part needs no multipart upload: one PUT, visible at once. ``when``: the
        request's conditions (``IfMatch`` / ``IfNoneMatch``, ``store.publish.commit_condition``)."""
        self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=bytes(body), **(when or {}))
        self.fs.invalidate_cache(self.path)

    def complete(self, etags: Sequence[tuple[int, str]], when: dict[str, str] | None = None) -> None:
        """Complete with (part number, ETag) for every part: the object appears whole (``when``:
        as for :meth:`put`)."""
        parts = [{"PartNumber": n, "ETag": e} for n, e in sorted(etags)]
        self.fs.call_s3(
            "complete_multipart_upload",
            Bucket=self.bucket,
            Key=self.key,
            UploadId=self.upload_id,
            MultipartUpload={"Parts": parts},
            **(when or {}),
        )
        self.fs.invalidate_cache(self.path)

    def abort(self) -> None:
        """Abort: the parts uploaded so far are dropped and nothing appears."""
        self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=self.upload_id)
