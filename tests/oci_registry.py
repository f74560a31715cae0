"""A small in-memory OCI registry for tests, with the referrers API (OCI distribution 1.1) or without it.

Debian's docker-registry 2.8 has no referrers API, so the branch of
:mod:`vllm_hotfix.trust.referrers` that uses it is tried against this one. It
speaks what that module and the registry client use, no more: ``/v2/``,
blobs (``HEAD``/``GET``, a monolithic upload by ``POST`` then ``PUT
?digest=``), manifests (``PUT``/``GET``/``HEAD`` by tag or digest; a manifest
with a ``subject`` is answered with ``OCI-Subject`` when the API is on), and
``GET /v2/<name>/referrers/<digest>`` with the ``artifactType`` filter. No
authentication. Every request is logged as (method, path, status).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
_NAME = r"(?P<name>[a-z0-9]+(?:[._/-][a-z0-9]+)*)"
_BLOB = re.compile(rf"^/v2/{_NAME}/blobs/(?P<digest>sha256:[0-9a-f]{{64}})$")
_UPLOADS = re.compile(rf"^/v2/{_NAME}/blobs/uploads/(?P<id>[0-9a-f]*)$")
_MANIFEST = re.compile(rf"^/v2/{_NAME}/manifests/(?P<ref>[A-Za-z0-9_.:-]+)$")
_REFERRERS = re.compile(rf"^/v2/{_NAME}/referrers/(?P<digest>sha256:[0-9a-f]{{64}})$")
_TAGS = re.compile(rf"^/v2/{_NAME}/tags/list$")


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


@dataclass
class Store:
    """What the registry holds, per repository."""

    referrers_api: bool = True
    blobs: dict[tuple[str, str], bytes] = field(default_factory=dict)
    manifests: dict[tuple[str, str], tuple[str, bytes]] = field(default_factory=dict)  # (repo, digest) -> type, body
    tags: dict[tuple[str, str], str] = field(default_factory=dict)  # (repo, tag) -> digest
    log: list[tuple[str, str, int]] = field(default_factory=list)
    # Extra descriptors the referrers API lists for a subject (a registry that lists a stranger).
    extra_referrers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    # Artifacts the referrers API does not list (pushed before the registry indexed subjects).
    unindexed: set[str] = field(default_factory=set)
    referrers_body: bytes | None = None  # the referrers API's answer, when set (a registry answering nonsense)
    page_size: int | None = None  # the referrers API and tag list answer this many per page, the rest behind a Link
    broken_pages: bool = False  # a page after the first is answered 500

    def referrers(self, repo: str, subject: str, artifact_type: str | None) -> list[dict[str, Any]]:
        found = []
        for (where, digest), (media, body) in sorted(self.manifests.items()):
            doc = json.loads(body)
            if where != repo or (doc.get("subject") or {}).get("digest") != subject or digest in self.unindexed:
                continue
            kind = doc.get("artifactType") or (doc.get("config") or {}).get("mediaType")
            found.append({"mediaType": media, "digest": digest, "size": len(body), "artifactType": kind})
        found += self.extra_referrers.get(subject, [])
        return [d for d in found if artifact_type is None or d.get("artifactType") == artifact_type]


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    store: Store  # set on the class made per server

    def log_message(self, *_args: Any) -> None:
        pass

    def _answer(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        url = urlsplit(self.path)
        self.store.log.append((self.command, url.path, status))
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _manifest(self, repo: str, ref: str) -> tuple[str, str, bytes] | None:
        digest = ref if ref.startswith("sha256:") else self.store.tags.get((repo, ref), "")
        found = self.store.manifests.get((repo, digest))
        return (digest, *found) if found is not None else None

    def _page(self, path: str, query: dict[str, list[str]], items: list[Any],
              keep: dict[str, str]) -> tuple[dict[str, str] | None, list[Any]]:
        """The page of ``items`` the query asks for and the Link header to the next (``keep``: query kept); no
        headers (None) for a later page of a registry whose later pages are broken."""
        size = self.store.page_size
        if not size:
            return {}, items
        start = int(query.get("page", ["0"])[0])
        if start and self.store.broken_pages:
            return None, []
        headers = {}
        if start + size < len(items):
            headers["Link"] = f'<{path}?{urlencode({"page": start + size, **keep})}>; rel="next"'
        return headers, items[start:start + size]

    def do_GET(self) -> None:  # noqa: N802 - the handler's spelling
        url = urlsplit(self.path)
        if url.path == "/v2/":
            return self._answer(200, b"{}", {"Content-Type": "application/json"})
        if (m := _BLOB.match(url.path)) is not None:
            data = self.store.blobs.get((m["name"], m["digest"]))
            if data is None:
                return self._answer(404)
            return self._answer(200, data, {"Content-Type": "application/octet-stream",
                                            "Docker-Content-Digest": m["digest"]})
        if (m := _MANIFEST.match(url.path)) is not None:
            found = self._manifest(m["name"], m["ref"])
            if found is None:
                return self._answer(404, b'{"errors": [{"code": "MANIFEST_UNKNOWN"}]}')
            digest, media, body = found
            return self._answer(200, body, {"Content-Type": media, "Docker-Content-Digest": digest})
        if (m := _TAGS.match(url.path)) is not None:
            names = sorted(tag for repo, tag in self.store.tags if repo == m["name"])
            if not names:
                return self._answer(404, b'{"errors": [{"code": "NAME_UNKNOWN"}]}')
            headers, names = self._page(url.path, parse_qs(url.query), names, {})
            if headers is None:
                return self._answer(500)
            return self._answer(200, json.dumps({"name": m["name"], "tags": names}).encode(),
                                {"Content-Type": "application/json", **headers})
        if (m := _REFERRERS.match(url.path)) is not None and self.store.referrers_api:
            query = parse_qs(url.query)
            wanted = query.get("artifactType", [None])[0]
            found = self.store.referrers(m["name"], m["digest"], wanted)
            headers = {"Content-Type": OCI_INDEX, **({"OCI-Filters-Applied": "artifactType"} if wanted else {})}
            paged, found = self._page(url.path, query, found, {"artifactType": wanted} if wanted else {})
            if paged is None:
                return self._answer(500)
            headers.update(paged)
            index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": found}
            return self._answer(200, self.store.referrers_body or json.dumps(index).encode(), headers)
        return self._answer(404)

    do_HEAD = do_GET  # noqa: N815

    def do_POST(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        self._body()
        if (m := _UPLOADS.match(url.path)) is not None and not m["id"]:
            return self._answer(202, headers={"Location": f"/v2/{m['name']}/blobs/uploads/{uuid.uuid4().hex}"})
        return self._answer(404)

    def do_PUT(self) -> None:  # noqa: N802
        url = urlsplit(self.path)
        body = self._body()
        if (m := _UPLOADS.match(url.path)) is not None and m["id"]:
            digest = parse_qs(url.query).get("digest", [""])[0]
            if sha256(body) != digest:
                return self._answer(400, b'{"errors": [{"code": "DIGEST_INVALID"}]}')
            self.store.blobs[(m["name"], digest)] = body
            return self._answer(201, headers={"Docker-Content-Digest": digest})
        if (m := _MANIFEST.match(url.path)) is not None:
            repo, ref, digest = m["name"], m["ref"], sha256(body)
            if ref.startswith("sha256:") and ref != digest:
                return self._answer(400, b'{"errors": [{"code": "DIGEST_INVALID"}]}')
            doc = json.loads(body)
            media = self.headers.get("Content-Type") or doc.get("mediaType") or ""
            self.store.manifests[(repo, digest)] = (media, body)
            if not ref.startswith("sha256:"):
                self.store.tags[(repo, ref)] = digest
            headers = {"Docker-Content-Digest": digest, "Location": f"/v2/{repo}/manifests/{digest}"}
            subject = (doc.get("subject") or {}).get("digest")
            if subject and self.store.referrers_api:
                headers["OCI-Subject"] = subject
            return self._answer(201, headers=headers)
        return self._answer(404)


@contextmanager
def serving(referrers_api: bool = True) -> Iterator[tuple[str, Store]]:
    """A registry on a free loopback port: (``HOST:PORT``, its store), stopped when the block ends."""
    store = Store(referrers_api=referrers_api)
    handler = type("Handler", (_Handler,), {"store": store})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", store
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
