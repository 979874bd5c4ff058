"""A real S3 API for the tests: moto's server on a free local port, with a byte counter.

Every response's body bytes are counted per request method and per client (the
``user_agent_extra`` a client sets, e.g. ``rank-3``), so tests assert how much each load
fetched. Clients reach it with s3fs through ``storage_options`` or the standard
``AWS_ENDPOINT_URL`` environment (subprocesses inherit :meth:`S3Server.env`).
"""

from __future__ import annotations

import re
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

LOCK_NAME = ".unickpt.lock"  # unickpt.store.lock.LOCK_NAME
_AGENT = re.compile(r"unickpt-client/(\S+)")


def client_options(endpoint: str, client: str | None = None) -> dict[str, Any]:
    """s3fs options for a server at ``endpoint``; ``client`` names the requests (the counters' key)."""
    opts: dict[str, Any] = {
        "endpoint_url": endpoint,
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"region_name": "us-east-1"},
    }
    if client is not None:
        opts["config_kwargs"] = {"user_agent_extra": f"unickpt-client/{client}"}
    return opts


class _Counting:
    """WSGI middleware counting the body bytes of every response."""

    def __init__(self, app: Any, server: S3Server) -> None:
        self.app, self.server = app, server

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        method = environ.get("REQUEST_METHOD", "")
        m = _AGENT.search(environ.get("HTTP_USER_AGENT", ""))
        client = m.group(1) if m else "other"
        self.server.count_request(method, client)
        if not environ.get("PATH_INFO", "").endswith(LOCK_NAME):  # a save's lock object is not its data
            self.server.count_in(method, client, int(environ.get("CONTENT_LENGTH") or 0))
        watcher = self.server.watcher
        if watcher is not None and method in ("PUT", "POST", "DELETE"):
            # A watched write runs alone and is reported once complete (tests/crashstore.py).
            with self.server.write_lock:
                body = list(self.app(environ, start_response))
                watcher(method, environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", ""))
        else:
            body = self.app(environ, start_response)
        for chunk in body:
            self.server.count(method, client, len(chunk), environ.get("HTTP_RANGE") is not None)
            yield chunk


class S3Server:
    def __init__(self) -> None:
        from moto.moto_server.threaded_moto_server import ThreadedMotoServer

        self._lock = threading.Lock()
        self.bytes_out: Counter[tuple[str, str]] = Counter()
        self.requests: Counter[tuple[str, str]] = Counter()
        self.bytes_in: Counter[tuple[str, str]] = Counter()
        self.ranged_gets = 0
        # Called (method, path, query) after each PUT/POST/DELETE completes, writes serialised.
        self.watcher: Callable[[str, str, str], None] | None = None
        self.write_lock = threading.Lock()
        self._moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self._wrap()
        self._moto.start()
        host, port = self._moto.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"

    def _wrap(self) -> None:
        # ThreadedMotoServer builds its WSGI app in its thread; wrap make_server's app argument.
        import moto.moto_server.threaded_moto_server as tms

        real = tms.make_server
        server = self

        def make_server(host: str, port: int, app: Any, *a: Any, **k: Any) -> Any:
            return real(host, port, _Counting(app, server), *a, **k)

        self._moto_make_server = real
        tms.make_server = make_server  # type: ignore[assignment]

    def count(self, method: str, client: str, n: int, ranged: bool) -> None:
        with self._lock:
            self.bytes_out[(method, client)] += n

    def count_in(self, method: str, client: str, n: int) -> None:
        with self._lock:
            self.bytes_in[(method, client)] += n

    def received(self, method: str = "PUT", client: str | None = None) -> int:
        """Request body bytes the server received (uploads: PUT parts and objects)."""
        with self._lock:
            return sum(n for (m, c), n in self.bytes_in.items() if m == method and client in (None, c))

    def count_request(self, method: str, client: str) -> None:
        with self._lock:
            self.requests[(method, client)] += 1

    def reset(self) -> None:
        with self._lock:
            self.bytes_out.clear()
            self.requests.clear()
            self.bytes_in.clear()

    def served(self, method: str = "GET", client: str | None = None) -> int:
        with self._lock:
            return sum(n for (m, c), n in self.bytes_out.items() if m == method and client in (None, c))

    def env(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def storage_options(self, client: str | None = None) -> dict[str, Any]:
        return {**client_options(self.endpoint, client), "skip_instance_cache": True}

    def new_bucket(self) -> str:
        import boto3

        name = f"b-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
            region_name="us-east-1",
        ).create_bucket(Bucket=name)
        return name

    def fs(self) -> Any:
        """An s3fs client of its own (a "tester"), not counted as the code under test."""
        import s3fs

        return s3fs.S3FileSystem(**self.storage_options("tester"))

    def objects(self, url: str) -> dict[str, bytes]:
        """Every object under ``url`` (``s3://bucket/prefix``), by its name below the prefix."""
        fs = self.fs()
        root = url.removeprefix("s3://")
        return {p[len(root) + 1 :]: fs.cat_file(p) for p in fs.find(root)}

    def open_uploads(self, bucket: str) -> list[Any]:
        """The multipart uploads of ``bucket`` neither completed nor aborted."""
        out = self.fs().call_s3("list_multipart_uploads", Bucket=bucket)
        return list(out.get("Uploads", []) or [])

    def stop(self) -> None:
        import moto.moto_server.threaded_moto_server as tms

        self._moto.stop()
        tms.make_server = self._moto_make_server  # type: ignore[assignment]
