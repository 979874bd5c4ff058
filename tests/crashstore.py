"""Crash states of an object store: every prefix of a save's completed write requests.

An S3 store is linearizable: a request takes effect whole at one instant between its start and
its response, and a client that dies loses only the requests not completed yet. So the states a
crashed save may leave are the store after each prefix of its completed PUTs, multipart
completes and DELETEs (in the order they completed), with the multipart uploads begun but not
completed at that point still open (invisible to readers, never completed by anyone).

:class:`StoreRecorder` serialises the write requests of moto's server (``tests/s3server.py``:
``S3Server.watcher``) and snapshots the bucket's objects and open uploads from moto's backend
after each one; :meth:`StoreRecorder.materialise` writes a state into a fresh bucket.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ACCOUNT = "123456789012"  # moto's default account


@dataclass(frozen=True)
class StoreState:
    objects: tuple[tuple[str, bytes], ...]
    uploads: tuple[str, ...]  # keys of multipart uploads begun, neither completed nor aborted
    after: str  # the last request completed


class StoreRecorder:
    def __init__(self, server: Any, bucket: str) -> None:
        self.server, self.bucket = server, bucket
        self.states: list[StoreState] = []
        self.requests: list[str] = []

    def _bucket(self) -> Any:
        from moto.s3.models import s3_backends

        return s3_backends[ACCOUNT]["global"].buckets[self.bucket]

    def snapshot(self, after: str) -> StoreState:
        b = self._bucket()
        objects = tuple(sorted((k, bytes(v.value)) for k, v in b.keys.items()))
        uploads = tuple(sorted(mp.key_name for mp in b.multiparts.values()))
        return StoreState(objects, uploads, after)

    @contextlib.contextmanager
    def recording(self) -> Iterator[StoreRecorder]:
        self.states = [self.snapshot("(start)")]

        def watch(method: str, path: str, query: str) -> None:
            if not path.startswith(f"/{self.bucket}/") and path != f"/{self.bucket}":
                return
            what = f"{method} {path[len(self.bucket) + 2 :]}{'?' + query if query else ''}"
            self.requests.append(what)
            self.states.append(self.snapshot(what))

        self.server.watcher = watch
        try:
            yield self
        finally:
            self.server.watcher = None

    def materialise(self, state: StoreState) -> str:
        """A fresh bucket holding ``state``: its objects, and its open uploads (one part each)."""
        import boto3

        bucket = self.server.new_bucket()
        c = boto3.client(
            "s3",
            endpoint_url=self.server.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        )
        for key, data in state.objects:
            c.put_object(Bucket=bucket, Key=key, Body=data)
        for key in state.uploads:
            up = c.create_multipart_upload(Bucket=bucket, Key=key)
            c.upload_part(Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1, Body=b"\0" * 1024)
        return bucket
