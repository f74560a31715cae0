"""A loopback HTTP server of fixed routes, for the length of a build.

It hands a patch set's pinned wheels to the build's ``RUN`` step; what it
serves (URL path -> file or bytes) is :meth:`pins.Prepared.routes`, and it
knows nothing of pins. Apart from :mod:`pins` so that a build without pins
never imports an HTTP server (and the email and TLS modules under it).
"""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: Mapping[str, Path | bytes] = {}

    def do_GET(self) -> None:  # noqa: N802  (the name http.server calls)
        item = self.routes.get(self.path.split("?", 1)[0])
        if item is None:
            self.send_error(404)
            return
        size = len(item) if isinstance(item, bytes) else item.stat().st_size
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Content-Type", "text/html" if self.path.endswith("/") else "application/octet-stream")
        self.end_headers()
        if isinstance(item, bytes):
            self.wfile.write(item)
            return
        with item.open("rb") as fh:
            while block := fh.read(1 << 20):
                self.wfile.write(block)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("loopback server: " + format, *args)


@contextmanager
def serve(routes: Mapping[str, Path | bytes]) -> Iterator[str]:
    """Answer GET of each URL path in ``routes`` on 127.0.0.1 until the block ends; yields the base URL."""
    handler = type("RoutesHandler", (_Handler,), {"routes": dict(routes)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheel-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
