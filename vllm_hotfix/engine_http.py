"""The engine's plain HTTP transport: requests over its local unix socket, and loads opened early.

Part of the one seam to the engine (:mod:`engine` speaks through it when the
engine is local). It imports nothing but ``os`` and ``socket``, so that the
entry script can open an assembled build's load before the rest of the tool
is even imported (:mod:`early_load`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from typing import Any

from .errors import EngineError, EngineLost, PipelineError


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


class PendingLoad:
    """A ``POST /images/load`` whose archive is sent in two parts: ``lead`` now, the rest later.

    The body goes chunked, so its length need not be known when it opens.
    """

    def __init__(self, http: UnixHttp, lead: bytes, nothing: bytes) -> None:
        self._http, self.lead, self._nothing = http, lead, nothing

    @classmethod
    def try_open(cls, path: str, timeout: float, lead: bytes, nothing: bytes) -> PendingLoad | None:
        """:meth:`open`, or None where the engine does not take it: only a head start, the run's
        own calls then report an engine that is not there."""
        try:
            return cls.open(path, timeout, lead, nothing)
        except PipelineError:
            return None

    @classmethod
    def open(cls, path: str, timeout: float, lead: bytes, nothing: bytes) -> PendingLoad:
        http = UnixHttp(path, timeout)
        http._open("POST /images/load")
        head = ("POST /images/load?quiet=1 HTTP/1.1\r\nHost: docker\r\nContent-Type: application/x-tar\r\n"
                "Transfer-Encoding: chunked\r\n\r\n").encode("latin-1")
        try:
            http._sock.sendall(head + chunk(lead))
        except OSError as exc:
            http.close()
            raise lost("POST /images/load", exc) from exc
        return cls(http, lead, nothing)

    def finish(self, rest: bytes) -> tuple[int, bytes]:
        """Send the rest of the archive and read the engine's answer."""
        try:
            self._http._sock.sendall(chunk(rest) + chunk(b""))
            return self._http._response("POST")
        except (OSError, ValueError, Closed) as exc:
            raise lost("POST /images/load", exc) from exc
        finally:
            self._http.close()

    def cancel(self) -> None:
        """Complete the archive so that it loads nothing; the answer is not waited for."""
        try:
            self._http._sock.sendall(chunk(self._nothing) + chunk(b""))
        except OSError:
            pass  # the engine went away: it has nothing of ours either
        finally:
            self._http.close()


# Loads opened before the run's Engine existed (open_load_early), by socket
# path: the first Engine.start_load on that socket with the same lead takes
# its one over; close_early_loads completes any left.
opened_early: dict[str, PendingLoad] = {}


def local_socket(base_url: str | None = None) -> str | None:
    """The engine's unix socket path when it is spoken to directly (no TLS), else None."""
    host = base_url or os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    if host.startswith("unix://") and not os.environ.get("DOCKER_TLS_VERIFY"):
        return host.removeprefix("unix://")
    return None


def open_load_early(lead: bytes, nothing: bytes, timeout: float = 120) -> None:
    """:meth:`Engine.start_load` before any Engine exists: the tool's own start overlaps the engine's."""
    path = local_socket()
    if path is None or path in opened_early:
        return
    pending = PendingLoad.try_open(path, timeout, lead, nothing)
    if pending is not None:
        opened_early[path] = pending


def close_early_loads() -> None:
    """Complete every early load no Engine took over, so that it loads nothing."""
    while opened_early:
        opened_early.popitem()[1].cancel()


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked HTTP body (the empty one ends the body)."""
    return b"%x\r\n" % len(data) + data + b"\r\n"
