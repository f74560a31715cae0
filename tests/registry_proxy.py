"""A loopback proxy in front of a real registry, for the faults that registry does not make on its own.

Everything is forwarded to the real registry (Debian's docker-registry) and
its answers come back as they are, upload Locations pointed at the proxy.
Switches make it behave as other registries do:

- ``no_mount``: a cross-repository mount is answered with a plain upload
  session (202), as a registry that does not mount answers;
- ``refuse_blobs``: the PUT that finishes a blob upload is answered with
  this status and a registry error body;
- ``manifest_limit``: a manifest PUT over this many bytes is answered as
  the distribution registry answers one over its own 4 MiB limit;
- ``hold_tags``: a manifest PUT under a tag (not a digest) waits until the
  event is set, then is dropped unforwarded (503): the test kills the
  client meanwhile, which from the registry's side never sent it;
- ``refuse_tags``: a manifest PUT under a tag (not a digest) is answered with
  this status, unforwarded;
- ``cut_blobs``: a blob GET is answered with its whole Content-Length but
  only this many bytes, then the connection is closed (a link that broke);
- ``redirect_blobs``: a blob GET is answered with a 307 to a storage server
  on another port (as the large registries send blob reads to object
  storage), which serves the bytes the proxy read from the registry and
  keeps the ``Authorization`` header of each request it got in
  ``storage_auth`` (None where there was none);
- ``fail_reads``: the next this many GETs and HEADs are answered 500 with
  the body Debian's registry gives while another writer links the same blob
  or tag (it read the half-written link), unforwarded.

``seen`` lists (method, path) of every request, in order.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlencode, urlsplit

import requests

_DIGEST = re.compile(r"/manifests/sha256:[0-9a-f]{64}$")


@dataclass
class Switches:
    no_mount: bool = False
    refuse_blobs: int | None = None
    manifest_limit: int | None = None
    hold_tags: threading.Event | None = None
    cut_blobs: int | None = None
    refuse_tags: int | None = None
    redirect_blobs: bool = False
    fail_reads: int = 0
    storage_auth: list[str | None] = field(default_factory=list)
    holding: threading.Event = field(default_factory=threading.Event)  # set while a tag PUT waits
    seen: list[tuple[str, str]] = field(default_factory=list)


@contextmanager
def serve(upstream: str) -> Iterator[tuple[str, Switches]]:
    """A proxy on a free loopback port in front of ``upstream`` (HOST:PORT); yields its HOST:PORT and switches."""
    switches = Switches()
    session = requests.Session()
    stored: dict[str, bytes] = {}

    class Storage(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - the name http.server calls
            switches.storage_auth.append(self.headers.get("Authorization"))
            data = stored.get(self.path.rsplit("/", 1)[-1])
            self.send_response(200 if data is not None else 404)
            self.send_header("Content-Length", str(len(data or b"")))
            self.end_headers()
            self.wfile.write(data or b"")

    storage = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Storage)
    threading.Thread(target=storage.serve_forever, daemon=True).start()

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *_args: object) -> None:
            pass

        def _forward(self) -> None:
            parts = urlsplit(self.path)
            query = parse_qsl(parts.query, keep_blank_values=True)
            switches.seen.append((self.command, parts.path))
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else b""
            if self.command in ("GET", "HEAD") and switches.fail_reads > 0:
                switches.fail_reads -= 1
                return self._answer(500, json.dumps({"errors": [
                    {"code": "UNKNOWN", "message": "unknown error", "detail": "invalid checksum digest format"}]}
                ).encode(), {})
            if self.command == "POST" and switches.no_mount and any(k == "mount" for k, _ in query):
                query = [(k, v) for k, v in query if k not in ("mount", "from")]
            if (self.command == "PUT" and "/blobs/uploads/" in parts.path and switches.refuse_blobs is not None):
                return self._answer(switches.refuse_blobs, json.dumps({"errors": [
                    {"code": "DENIED", "message": "blob refused by policy"}]}).encode(), {})
            if (self.command == "PUT" and "/manifests/" in parts.path and switches.manifest_limit is not None
                    and len(body) > switches.manifest_limit):
                return self._answer(400, json.dumps({"errors": [{"code": "MANIFEST_INVALID", "message":
                                    "manifest invalid", "detail": "http: request body too large"}]}).encode(), {})
            if (self.command == "PUT" and "/manifests/" in parts.path and not _DIGEST.search(parts.path)
                    and switches.refuse_tags is not None):
                return self._answer(switches.refuse_tags, json.dumps({"errors": [
                    {"code": "UNKNOWN", "message": "tag write failed"}]}).encode(), {})
            if (self.command == "PUT" and "/manifests/" in parts.path and not _DIGEST.search(parts.path)
                    and switches.hold_tags is not None):
                switches.holding.set()
                switches.hold_tags.wait(60)
                return self._answer(503, b"", {})
            headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")}
            url = f"http://{upstream}{parts.path}" + (f"?{urlencode(query)}" if query else "")
            res = session.request(self.command, url, data=body, headers=headers, allow_redirects=False,
                                  stream=True)
            data = res.raw.read(decode_content=False) if self.command != "HEAD" else b""
            if (self.command == "GET" and "/blobs/sha256:" in parts.path and switches.redirect_blobs
                    and res.status_code == 200):
                token = f"{len(stored)}-{parts.path.rsplit(':', 1)[-1][:16]}"
                stored[token] = data
                where = f"http://127.0.0.1:{storage.server_address[1]}/blobs/{token}"
                return self._answer(307, b"", {"Location": where})
            if (self.command == "GET" and "/blobs/sha256:" in parts.path and switches.cut_blobs is not None
                    and res.status_code == 200):
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                try:
                    self.wfile.write(data[:switches.cut_blobs])
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True
                return
            out = {k: v for k, v in res.headers.items()
                   if k.lower() not in ("content-length", "transfer-encoding", "connection")}
            if "Location" in out:
                out["Location"] = out["Location"].replace(f"http://{upstream}", f"http://{self.server_address_text}")
            self._answer(res.status_code, data, out, head_length=res.headers.get("Content-Length"))

        @property
        def server_address_text(self) -> str:
            host, port = self.server.server_address[:2]
            return f"{host}:{port}"

        def _answer(self, status: int, data: bytes, headers: dict[str, str], head_length: str | None = None) -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", head_length if self.command == "HEAD" and head_length else
                             str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                try:
                    self.wfile.write(data)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client is gone (a killed run)

        do_GET = do_HEAD = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", switches
    finally:
        if switches.hold_tags is not None:
            switches.hold_tags.set()
        server.shutdown()
        server.server_close()
        storage.shutdown()
        storage.server_close()
        session.close()
