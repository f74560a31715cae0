"""The loopback HTTP server that hands a patch set's pinned wheels to the build's ``RUN`` step.

Apart from :mod:`pins` so that a build without pins never imports an HTTP
server (and the email and TLS modules under it).
"""

from __future__ import annotations

import html
import http.server
import logging
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .pins import Prepared

log = logging.getLogger(__name__)


class _Handler(http.server.BaseHTTPRequestHandler):
    routes: Mapping[str, Path | bytes] = {}

    def do_GET(self) -> None:  # noqa: N802  (the name http.server calls)
        item = self.routes.get(self.path.split("?", 1)[0])
        if item is None:
            self.send_error(404)
            return
        data = item if isinstance(item, bytes) else None
        size = len(data) if data is not None else item.stat().st_size  # type: ignore[union-attr]
        self.send_response(200)
        self.send_header("Content-Length", str(size))
        self.send_header("Content-Type", "text/html" if self.path.endswith("/") else "application/octet-stream")
        self.end_headers()
        if data is not None:
            self.wfile.write(data)
            return
        with item.open("rb") as fh:  # type: ignore[union-attr]
            while block := fh.read(1 << 20):
                self.wfile.write(block)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("wheel server: " + format, *args)


def routes(prepared: Prepared) -> dict[str, Path | bytes]:
    """What the loopback server answers: an index of the wheels, the wheels, one requirement file per pin."""
    out: dict[str, Path | bytes] = {}
    links = []
    for w in prepared.wheels:
        out[f"/wheels/{w.filename}"] = w.path
        links.append(f'<a href="{html.escape(w.filename)}#sha256={w.sha256}">{html.escape(w.filename)}</a><br>')
    out["/wheels/"] = ("<html><body>\n" + "\n".join(links) + "\n</body></html>\n").encode()
    for entry, pin in zip(prepared.entries(), prepared.pinset.pins, strict=True):
        out[f"/req/{entry['req']}"] = pin.requirement().encode()
    return out


@contextmanager
def serve(prepared: Prepared) -> Iterator[str]:
    """Serve the wheels on 127.0.0.1 for the length of a build; yields the server's base URL."""
    handler = type("WheelHandler", (_Handler,), {"routes": routes(prepared)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="wheel-server", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)
