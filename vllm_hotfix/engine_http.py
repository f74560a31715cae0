"""The engine's plain HTTP transport: requests over its local unix socket.

Part of the one seam to the engine (:mod:`engine` speaks through it when the
engine is local).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from .errors import EngineError, EngineLost


def lost(what: str, exc: BaseException) -> EngineLost:
    return EngineLost(
        f"{what}: the Docker engine stopped answering ({' '.join(str(exc).split())[:400]})",
        hint="check the engine (docker version); containers and images this run left are removed "
             "by the next run once it answers",
    )


class Closed(Exception):
    """The engine closed a kept-alive connection before answering."""


class UnixHttp:
    """HTTP/1.1 to the engine over its unix socket, one kept-alive connection.

    Written out rather than built on http.client, whose import (the email
    parser with it) costs a noticeable part of an unchanged rebuild. It only
    needs what the engine sends: a status line, headers, and a body sized by
    Content-Length, sent chunked, or ended by closing the connection.
    """

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: Any = None
        self._file: Any = None
        self.answered = False  # whether this engine ever answered: a failure after that is a lost engine

    def _open(self, what: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as exc:
            sock.close()
            if self.answered:
                raise lost(what, exc) from exc
            raise EngineError(
                f"no Docker engine answers (unix://{self.path}: {exc.strerror or exc})",
                hint="start one (make services), or point DOCKER_HOST at a running engine",
            ) from exc
        self._sock, self._file = sock, sock.makefile("rb")

    def close(self) -> None:
        if self._sock is not None:
            self._file.close()
            self._sock.close()
        self._sock = self._file = None

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: Mapping[str, str] | None = None
    ) -> tuple[int, bytes]:
        head = [f"{method} {path} HTTP/1.1", "Host: docker", f"Content-Length: {len(body or b'')}"]
        head += [f"{k}: {v}" for k, v in (headers or {}).items()]
        data = ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body or b"")
        for attempt in (0, 1):
            fresh = self._sock is None
            if fresh:
                self._open(f"{method} {path.split('?', 1)[0]}")
            try:
                self._sock.sendall(data)
                answer = self._response(method)
                self.answered = True
                return answer
            except (OSError, ValueError, Closed) as exc:
                self.close()
                # A kept-alive connection the engine closed meanwhile: one retry on a new one.
                if fresh or attempt == 1:
                    raise lost(f"{method} {path.split('?', 1)[0]}", exc) from exc
        raise AssertionError("unreachable")

    def _response(self, method: str) -> tuple[int, bytes]:
        f = self._file
        status_line = f.readline()
        if not status_line:
            raise Closed("connection closed")
        status = int(status_line.split()[1])
        headers: dict[str, str] = {}
        while (line := f.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        body = bytearray()
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            pass
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            while size := int(f.readline().split(b";")[0].strip() or b"0", 16):
                body += f.read(size)
                f.readline()
            while f.readline() not in (b"\r\n", b"\n", b""):
                pass  # trailers
        elif "content-length" in headers:
            body += f.read(int(headers["content-length"]))
        else:
            body += f.read()
            headers["connection"] = "close"
        if headers.get("connection", "").lower() == "close":
            self.close()
        return status, bytes(body)


def local_socket(base_url: str | None = None) -> str | None:
    """The engine's unix socket path when it is spoken to directly (no TLS), else None."""
    host = base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if host.startswith("unix://") and not os.environ.get("DOCKER_TLS_VERIFY"):
        return host.removeprefix("unix://")
    return None

