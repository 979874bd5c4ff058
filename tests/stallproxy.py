"""A store that stops answering, for the tests: a TCP forwarder in front of a real server.

:class:`StallProxy` listens on a free local port and forwards every connection to ``target``
(moto's S3 server) byte for byte, until it is stalled (:meth:`stall`, or by itself when the
``stall_at``-th request of a given method starts): from then on it accepts connections and reads
what clients send, but forwards nothing either way and never replies, as a store that hangs
does; connections already open hang too. :meth:`resume` forwards again (new connections).
Nothing in unickpt is mocked: the client talks HTTP to a socket that stops answering.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections import Counter

_METHODS = (b"GET ", b"PUT ", b"POST ", b"HEAD ", b"DELETE ")


class StallProxy:
    def __init__(self, target: str) -> None:
        host, port = target.removeprefix("http://").rsplit(":", 1)
        self.target = (host, int(port))
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.endpoint = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.stalled = threading.Event()
        self.requests: Counter[str] = Counter()  # request lines seen (forwarded or not), by method
        self.stall_at: tuple[str, int] | None = None  # (method, n): stall as the n-th such request starts
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True, name="stallproxy-accept").start()

    def stall(self) -> None:
        self.stalled.set()

    def resume(self) -> None:
        self.stalled.clear()

    def close(self) -> None:
        self._closed = True
        with self._lock:
            socks, self._socks = self._socks, []
        for s in [self.listener, *socks]:
            with contextlib.suppress(OSError):
                s.close()

    # ---------------------------------------------------------------- forwarding
    def _keep(self, s: socket.socket) -> None:
        with self._lock:
            self._socks.append(s)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self._keep(client)
            upstream: socket.socket | None = None
            if not self.stalled.is_set():
                try:
                    upstream = socket.create_connection(self.target)
                    self._keep(upstream)
                except OSError:
                    upstream = None
            threading.Thread(target=self._up, args=(client, upstream), daemon=True).start()
            if upstream is not None:
                threading.Thread(target=self._down, args=(upstream, client), daemon=True).start()

    def _count(self, chunk: bytes) -> None:
        for m in _METHODS:
            if chunk.startswith(m):
                method = m.decode().strip()
                with self._lock:
                    self.requests[method] += 1
                    n = self.requests[method]
                if self.stall_at is not None and self.stall_at == (method, n):
                    self.stalled.set()
                return

    def _up(self, client: socket.socket, upstream: socket.socket | None) -> None:
        """Client to server: forwarded while not stalled; read and dropped once stalled."""
        while True:
            try:
                chunk = client.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                return
            self._count(chunk)
            if self.stalled.is_set() or upstream is None:
                continue
            try:
                upstream.sendall(chunk)
            except OSError:
                return

    def _down(self, upstream: socket.socket, client: socket.socket) -> None:
        """Server to client: forwarded while not stalled; dropped once stalled."""
        while True:
            try:
                chunk = upstream.recv(1 << 16)
            except OSError:
                return
            if not chunk:
                with contextlib.suppress(OSError):
                    client.shutdown(socket.SHUT_WR)
                return
            if self.stalled.is_set():
                continue
            try:
                client.sendall(chunk)
            except OSError:
                return
