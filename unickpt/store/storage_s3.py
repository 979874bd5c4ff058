"""Streamed writes to S3 with several parts in flight (the write side of ``store/storage.py``).

s3fs's own file object buffers a whole block (50 MiB by default), then uploads it as one part
while the writer waits, one part at a time. :class:`S3Upload` cuts the stream into parts of
``part_size`` bytes and hands each to a thread as soon as it is full, ``in_flight`` at a time,
so the writer (and the hashing beside it) keeps producing while earlier parts travel. A file
of up to one part plus 5 MiB is a single PUT. ``close`` completes the multipart upload (the object
appears whole, at once); ``discard`` aborts it (nothing appears). No torch here.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from unickpt.errors import IncompleteCheckpointError

__all__ = [
    "S3Upload",
    "PART_SIZE",
    "IN_FLIGHT",
    "write_if",
    "delete_if",
    "read_version",
    "precondition_failed",
]

#: Bytes per uploaded part (S3 wants at least 5 MiB for every part but the last).
PART_SIZE = 16 << 20
#: Parts uploaded at once per file.
IN_FLIGHT = 4
_MIN_PART = 5 << 20


class S3Upload:
    """A write-only file object uploading to ``bucket/key`` (see the module docstring)."""

    def __init__(self, fs: Any, path: str, part_size: int = PART_SIZE, in_flight: int = IN_FLIGHT) -> None:
        self.fs = fs
        self.path = path
        self.name = path
        self.bucket, self.key, _ = fs.split_path(path)
        self.part_size = max(part_size, _MIN_PART)
        self.closed = False
        self._buf = bytearray()
        self._upload_id: str | None = None
        self._parts: list[Future[dict[str, Any]]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._slots = threading.Semaphore(in_flight)
        self._in_flight = in_flight
        self._pos = 0

    # -- file protocol
    def writable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")
        n = mv.nbytes
        self._pos += n
        at = 0
        # A part leaves once a whole part plus a minimum part are buffered, so that a file of
        # up to part_size + 5 MiB is one PUT at close (no create / complete requests), and the
        # last part is never under S3's 5 MiB minimum unless it is the only one.
        hold = self.part_size + _MIN_PART
        while at < n:
            take = min(hold - len(self._buf), n - at)
            self._buf += mv[at : at + take]
            at += take
            if len(self._buf) >= hold:
                self._send(bytes(self._buf[: self.part_size]))
                del self._buf[: self.part_size]
        return n

    def flush(self) -> None:
        pass

    def __enter__(self) -> S3Upload:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:
            self.discard()

    # -- parts
    def _send(self, body: bytes) -> None:
        if self._upload_id is None:
            out = self.fs.call_s3("create_multipart_upload", Bucket=self.bucket, Key=self.key)
            self._upload_id = str(out["UploadId"])
            self._pool = ThreadPoolExecutor(max_workers=self._in_flight, thread_name_prefix="unickpt-upload")
        number = len(self._parts) + 1
        self._slots.acquire()  # at most `in_flight` parts held in memory and on the wire
        pool = self._pool
        if pool is None:  # never: the upload and its pool are created above
            raise RuntimeError(f"{self.key}: no upload pool after the upload was created")
        self._parts.append(pool.submit(self._put_part, number, body))

    def _put_part(self, number: int, body: bytes) -> dict[str, Any]:
        try:
            out = self.fs.call_s3(
                "upload_part",
                Bucket=self.bucket,
                Key=self.key,
                UploadId=self._upload_id,
                PartNumber=number,
                Body=body,
            )
            return {"PartNumber": number, "ETag": out["ETag"]}
        finally:
            self._slots.release()

    def close(self) -> None:
        """Upload what is left and complete: the object becomes visible whole."""
        if self.closed:
            return
        try:
            if self._upload_id is None:
                self.fs.call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=bytes(self._buf))
            else:
                if self._buf:
                    self._send(bytes(self._buf))
                parts = [f.result() for f in self._parts]
                self.fs.call_s3(
                    "complete_multipart_upload",
                    Bucket=self.bucket,
                    Key=self.key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},
                )
        except BaseException:
            self.discard()
            raise
        finally:
            self._buf = bytearray()
            self._shutdown()
        self.closed = True
        self.fs.invalidate_cache(self.path)

    def discard(self) -> None:
        """Abort: nothing of this file becomes visible."""
        self._buf = bytearray()
        for f in self._parts:
            f.cancel()
        self._shutdown()
        if self._upload_id is not None and not self.closed:
            upload_id, self._upload_id = self._upload_id, None
            with contextlib.suppress(Exception):
                self.fs.call_s3(
                    "abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=upload_id
                )
        self.closed = True

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


# -- conditional requests (``Storage.write_if`` / ``delete_if`` / ``read_version`` on S3)
def precondition_failed(e: OSError) -> bool:
    """True for S3's 412 (s3fs words it as "... pre-conditions ... did not hold") or a 409
    conflict of two conditional writes at once."""
    said = f"{e} {e.__cause__!r}"
    return any(
        w in said for w in ("PreconditionFailed", "pre-conditions", "412", "ConditionalRequestConflict")
    )


def write_if(fs: Any, path: str, data: bytes, etag: str | None) -> tuple[bool, str | None]:
    """One PUT with ``If-Match: etag`` (``If-None-Match: *`` for None): (written, new ETag)."""
    bucket, key, _ = fs.split_path(path)
    cond = {"IfMatch": etag} if etag is not None else {"IfNoneMatch": "*"}
    try:
        out = fs.call_s3("put_object", Bucket=bucket, Key=key, Body=data, **cond)
    except FileNotFoundError:
        return False, None
    except OSError as e:
        if precondition_failed(e):
            return False, None
        raise
    finally:
        fs.invalidate_cache(path)
    got = out.get("ETag") if isinstance(out, dict) else None
    return True, (str(got) if got else None)


def delete_if(fs: Any, path: str, etag: str) -> bool:
    """One DELETE with ``If-Match: etag``: True when deleted, False when changed or missing."""
    bucket, key, _ = fs.split_path(path)
    try:
        fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=etag)
    except FileNotFoundError:
        return False
    except OSError as e:
        if precondition_failed(e):
            return False
        raise
    finally:
        fs.invalidate_cache(path)
    return True


def read_version(fs: Any, path: str, limit: int) -> tuple[bytes, str | None] | None:
    """The bytes and ETag of one version of a small object (one GET); None when missing."""
    from fsspec.asyn import sync

    bucket, key, _ = fs.split_path(path)

    async def get() -> tuple[bytes, str | None] | None:
        try:
            out = await fs._call_s3("get_object", Bucket=bucket, Key=key)
        except FileNotFoundError:
            return None
        body = out["Body"]
        try:
            if int(out.get("ContentLength") or 0) > limit:
                raise IncompleteCheckpointError(f"s3://{path}: larger than the {limit} bytes expected")
            data = await body.read()
        finally:
            body.close()
        got = out.get("ETag")
        return bytes(data), (str(got) if got else None)

    result: tuple[bytes, str | None] | None = sync(fs.loop, get)
    return result
