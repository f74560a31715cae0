"""Plain HTTP to a local engine over its unix socket.

What docker-py's own transport does (``UnixHTTPConnection``): an
``http.client.HTTPConnection`` whose ``connect`` opens an AF_UNIX socket. The
calls an unchanged rebuild or an assembled build makes (ping, inspect,
history, tag, load, info) go this way, so those runs never import the SDK.
Every socket operation has a deadline: a frozen engine ends the call with a
timeout, which :mod:`.mapping` reports as an engine that stopped answering.
"""

from __future__ import annotations

import http.client
import os
import socket
from collections.abc import Mapping
from typing import BinaryIO

DEFAULT_HOST = "unix:///var/run/docker.sock"


class UnixHTTPConnection(http.client.HTTPConnection):
    """An HTTP/1.1 connection to a unix socket (the host name is only what the Host header says)."""

    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


# A kept-alive connection the engine closed between two requests fails so on
# the next one; that request is sent again on a new connection, once.
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError)


class UnixTransport:
    """One kept-alive connection to the engine's socket; raw errors (OSError, HTTPException) reach the caller."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._conn: UnixHTTPConnection | None = None

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def request(self, method: str, url: str, body: bytes | BinaryIO | None = None,
                headers: Mapping[str, str] | None = None, timeout: float | None = None) -> tuple[int, bytes]:
        """Send one request; return the status and the whole body.

        ``timeout``: this request's deadline per socket operation (default: the transport's).
        """
        head = dict(headers or {})
        wait = self.timeout if timeout is None else timeout
        if body is not None and not isinstance(body, bytes):
            head.setdefault("Content-Length", str(os.fstat(body.fileno()).st_size - body.tell()))
        for attempt in (0, 1):
            reused = self._conn is not None
            if self._conn is None:
                self._conn = UnixHTTPConnection(self.path, wait)
            # A kept-alive connection keeps the deadline it was made with: give it this one's.
            self._conn.timeout = wait
            if self._conn.sock is not None:
                self._conn.sock.settimeout(wait)
            try:
                self._conn.request(method, url, body=body, headers=head)
                response = self._conn.getresponse()
                data = response.read()
            except _STALE:
                self.close()
                if not reused or attempt == 1 or not (body is None or isinstance(body, bytes)):
                    raise
                continue
            except BaseException:
                self.close()
                raise
            if response.will_close:
                self.close()
            return response.status, data
        raise AssertionError("unreachable")


def local_socket(base_url: str | None = None) -> str | None:
    """The engine's unix socket path when it is spoken to directly (no TLS), else None."""
    host = base_url or os.environ.get("DOCKER_HOST") or DEFAULT_HOST
    if host.startswith("unix://") and not os.environ.get("DOCKER_TLS_VERIFY"):
        return host.removeprefix("unix://")
    return None
