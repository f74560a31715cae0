"""Writing an image into a registry without an engine: blobs, manifests, tags, in an order that never
tags a part.

A base layer the target repository lacks is mounted from the base's
repository when both live on one registry (``POST
/v2/<target>/blobs/uploads/?mount=<digest>&from=<base>``; 201: mounted); a
registry that will not mount answers with an upload session instead (202),
and a base on another registry has nothing to mount from: then the blob is
copied, streamed from the base's registry into the upload, its digest
checked as it passes. New blobs (the hotfix layer, the config) are put whole.
Manifests are put by digest, so nothing names them until the tag, put last,
once every blob and manifest it reaches is in.

Every write to a registry goes through :class:`Writer` (the in-registry
builder's, a push's index, a signed verdict and its referrers index).
Registries refuse manifests over a size limit (4 MiB for the distribution
registry, and for Docker Hub; containerd will not read bigger ones): a
manifest over it is refused here before anything is written.

The distribution registry on its filesystem driver rewrites a repository's
link to a blob each time a writer finishes uploading that blob, emptying the
file before writing it again. A manifest put in that instant names a blob the
registry cannot read (400: DIGEST_INVALID and MANIFEST_BLOB_UNKNOWN): two hosts
attaching verdicts to one image at once both upload its one empty config and
meet it. Such a refusal, of blobs the registry shows when asked next, is put
again (:meth:`Writer.store_manifest`).
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3

from ..engine import Engine
from ..engine.dockerconfig import split_reference
from ..errors import PushError
from . import client as registry

log = logging.getLogger(__name__)

MANIFEST_LIMIT = 4 * 1024 * 1024
CHUNK = 1 << 20
# A manifest refused for blobs the registry then shows: put again this many times (another writer linking them).
RELINK_RETRIES = 3


@dataclass(frozen=True, slots=True)
class Repo:
    """One repository on one registry, with the client (and login) for its host."""

    client: registry.Client
    path: str

    @property
    def name(self) -> str:
        return f"{self.client.host}/{self.path}"

    @property
    def pull(self) -> str:
        return f"repository:{self.path}:pull"

    @property
    def push(self) -> str:
        return f"repository:{self.path}:pull,push"


def _detail(res: requests.Response) -> str:
    try:
        errors = res.json().get("errors") or []
        return "; ".join(f"{e.get('code')}: {e.get('message')}" + (f" ({e['detail']})" if isinstance(
            e.get("detail"), str) else "") for e in errors)[:300]
    except (ValueError, AttributeError):
        return res.text.strip()[:200]


def _unknown_references(res: requests.Response) -> list[str]:
    """The digests a manifest's refusal says the registry does not know (MANIFEST_BLOB_UNKNOWN), in its order."""
    try:
        errors = res.json().get("errors") or []
    except (ValueError, AttributeError):
        return []
    return [str(e.get("detail")) for e in errors
            if isinstance(e, dict) and e.get("code") == "MANIFEST_BLOB_UNKNOWN" and isinstance(e.get("detail"), str)]


def _refused(res: requests.Response, what: str, host: str) -> PushError:
    detail = _detail(res)
    return PushError(f"registry {host} refused {what} ({res.status_code}{': ' + detail if detail else ''})")


class _Body:
    """A source blob's bytes streamed into an upload: a known length, hashed and counted as they pass."""

    def __init__(self, res: requests.Response, digest: str, size: int, where: str) -> None:
        self._raw = res.raw
        self._digest = digest
        self._size = size
        self._where = where
        self._hash = hashlib.sha256()
        self.seen = 0

    def __len__(self) -> int:
        return self._size

    def read(self, n: int = -1) -> bytes:
        try:
            data = self._raw.read(CHUNK if n is None or n < 0 else n, decode_content=False)
        except (OSError, requests.RequestException, urllib3.exceptions.HTTPError) as exc:
            raise PushError(f"{self._where}: the download broke off ({type(exc).__name__})") from None
        self.seen += len(data)
        if self.seen > self._size:
            raise PushError(f"{self._where}: the registry sent more than the {self._size} bytes its manifest gives")
        self._hash.update(data)
        if self.seen == self._size and "sha256:" + self._hash.hexdigest() != self._digest:
            raise PushError(f"{self._where}: its bytes do not hash to {self._digest}")
        return data


@dataclass(frozen=True, slots=True)
class Stored:
    """A manifest the registry took: its digest, and the subject digest the registry says it indexed it under
    (its OCI-Subject answer; "" where it indexes no referrers itself)."""

    digest: str
    subject: str = ""


class Writer:
    """Puts blobs, manifests and tags into one target repository: the one way this tool writes to a registry."""

    def __init__(self, target: Repo, say: Any = lambda _l: None) -> None:
        self.target = target
        self.say = say

    # -- blobs ------------------------------------------------------------------

    def has_blob(self, digest: str) -> bool:
        return self._has("blob", digest)

    def _has(self, kind: str, digest: str) -> bool:
        """Whether the target holds the ``kind`` ("blob" or "manifest") ``digest``; a refusal to say is an error."""
        t = self.target
        headers = {"Accept": registry.ACCEPT} if kind == "manifest" else {}
        res = t.client.request("HEAD", f"/v2/{t.path}/{kind}s/{digest}", t.push, headers=headers)
        res.close()
        if res.status_code == 404:
            return False
        if not res.ok:
            raise _refused(res, f"a look at {kind} {digest[:19]} of {t.path}", t.client.host)
        return True

    def _location(self, res: requests.Response, what: str) -> str:
        where = res.headers.get("Location", "")
        if not where:
            raise PushError(f"registry {self.target.client.host} opened no upload for {what} (no Location)")
        host = urlsplit(where).netloc
        if host and host != self.target.client.host:
            raise PushError(f"registry {self.target.client.host} sends the upload of {what} to another host "
                            f"({host}), which this tool does not follow")
        return where

    def _start(self, what: str, mount: tuple[str, Repo] | None = None) -> tuple[bool, str]:
        """(mounted, upload location): a mount the registry made, or an upload session to fill."""
        t = self.target
        if mount is not None:
            digest, source = mount
            res = t.client.request("POST", f"/v2/{t.path}/blobs/uploads/", f"{t.push} {source.pull}",
                                   params={"mount": digest, "from": source.path})
        else:
            res = t.client.request("POST", f"/v2/{t.path}/blobs/uploads/", t.push)
        res.close()
        if res.status_code == 201 and mount is not None:
            return True, ""
        if res.status_code != 202:
            raise _refused(res, f"an upload of {what} to {t.path}", t.client.host)
        return False, self._location(res, what)

    def _finish(self, location: str, digest: str, what: str, body: Any) -> None:
        t = self.target
        sep = "&" if "?" in location else "?"
        res = t.client.request("PUT", f"{location}{sep}digest={digest}", t.push, data=body,
                               headers={"Content-Type": "application/octet-stream"})
        res.close()
        if res.status_code not in (201, 204):
            raise _refused(res, f"{what} for {t.path}", t.client.host)

    def put_blob(self, data: bytes, what: str) -> str:
        """A new blob (the hotfix layer, a config), put whole; its digest."""
        digest = registry.sha256(data)
        if self.has_blob(digest):
            return digest
        _mounted, location = self._start(what)
        self._finish(location, digest, f"{what} {digest[:19]}", data)
        return digest

    def bring(self, descriptor: dict[str, Any], source: Repo) -> str:
        """A base layer into the target: already there, mounted, or copied; which one."""
        digest, size = str(descriptor["digest"]), int(descriptor["size"])
        if descriptor.get("urls"):
            return "foreign"  # a layer fetched from its own URLs (non-distributable): never pushed
        if self.has_blob(digest):
            return "present"
        same = source.client.host == self.target.client.host
        mounted, location = self._start(f"layer {digest[:19]}", (digest, source) if same else None)
        if mounted:
            return "mounted"
        why = "the registry would not mount it" if same else "another registry"
        self.say(f"    copying layer {digest[:19]} ({size} bytes) from {source.name}: {why}")
        res = source.client.request("GET", f"/v2/{source.path}/blobs/{digest}", source.pull, stream=True)
        try:
            if not res.ok:
                raise _refused(res, f"a read of layer {digest[:19]} of {source.path}", source.client.host)
            body = _Body(res, digest, size, f"layer {digest[:19]} of {source.name}")
            self._finish(location, digest, f"layer {digest[:19]}", body)
        finally:
            res.close()
        return "copied"

    # -- manifests and tags -------------------------------------------------------

    def put_manifest(self, reference: str, media_type: str, body: bytes, what: str = "") -> str:
        """A manifest or index under ``reference`` (its digest, or a tag); its digest, as confirmed."""
        return self.store_manifest(reference, media_type, body, what).digest

    def store_manifest(self, reference: str, media_type: str, body: bytes, what: str = "") -> Stored:
        """:meth:`put_manifest`, with what the registry said of a manifest's subject (OCI-Subject: it indexes
        referrers itself). ``what``: the manifest in words, for a refusal (default: ``the manifest NAME``)."""
        t = self.target
        digest = registry.sha256(body)
        check_size(body, f"{t.name}@{digest}")
        for attempt in range(RELINK_RETRIES + 1):
            res = t.client.request("PUT", f"/v2/{t.path}/manifests/{reference}", t.push, data=body,
                                   headers={"Content-Type": media_type})
            res.close()
            if res.status_code == 413 or (res.status_code == 400 and "too large" in _detail(res).lower()):
                raise PushError(f"registry {t.client.host} refused the manifest {t.path}@{digest}: {len(body)} "
                                f"bytes is over its size limit ({_detail(res) or res.status_code})")
            if res.ok:
                break
            unknown = _unknown_references(res) if res.status_code == 400 else []
            # Only blobs the registry shows now were being linked: one it lacks is a refusal, said at once.
            if not unknown or attempt == RELINK_RETRIES or not all(self._shows(d, media_type) for d in unknown):
                raise _refused(res, what or f"the manifest {t.path}:{reference}", t.client.host)
            log.info("registry %s refused %s:%s for %s, which it shows: another writer was linking it; putting it "
                     "again", t.client.host, t.path, reference, ", ".join(d[:19] for d in unknown))
        said = res.headers.get("Docker-Content-Digest")
        if said and said != digest:
            raise PushError(f"registry {t.client.host} stored {t.path}:{reference} as {said}, not {digest}")
        return Stored(digest, res.headers.get("OCI-Subject", ""))

    def _shows(self, digest: str, media_type: str) -> bool:
        """Whether the target has ``digest`` as what a manifest of ``media_type`` names: an index its manifests,
        a manifest its blobs. The look reads the registry's link whole, so a writer rewriting it has finished."""
        return self._has("manifest" if media_type in registry.INDEX_TYPES else "blob", digest)

    def resolve(self, tag: str) -> str | None:
        """The digest the target's ``tag`` resolves to now (None: no such tag)."""
        found = self.target.client.manifest(self.target.path, tag)
        return found.digest if found is not None else None


def check_size(body: bytes, name: str) -> None:
    if len(body) > MANIFEST_LIMIT:
        raise PushError(f"the manifest of {name} would be {len(body)} bytes, over the {MANIFEST_LIMIT} bytes "
                        "registries accept (the distribution registry, Docker Hub, containerd)",
                        hint="its base has too many layers or annotations to extend in a registry; "
                             "build from the engine (image without --in-registry)")


def put_index(engine: Engine, index_ref: str, entries: list[tuple[str, str, str, str]]
              ) -> tuple[str, registry.Manifest]:
    """Put one index under ``index_ref`` over already pushed images.

    ``entries``: (os, architecture, variant, child reference by digest, ``repo@sha256:...``) of each
    platform's image in the same repository. Each child's manifest is read back (its media type and size
    go into the index, and reading it proves it landed). Returns the index digest and the index.
    """
    repo, tag = split_reference(index_ref)
    host, path = registry.split_repo(repo)
    client = registry.client_for(engine, host)
    kids: list[registry.Child] = []
    for os_name, arch, variant, child in entries:
        digest = child.split("@", 1)[1]
        found = client.manifest(path, digest)
        if found is None:
            raise PushError(f"registry {host} has no {path}@{digest}, which the index {index_ref} must name")
        if found.is_index:
            raise PushError(f"{path}@{digest} is itself an index; an index names one image per platform")
        kids.append(registry.Child(digest, found.media_type, found.size, os_name, arch, variant))
    media, body = registry.index_body(kids)
    digest = Writer(Repo(client, path)).put_manifest(tag, media, body, f"the index {path}:{tag}")
    return digest, registry.Manifest(media, digest, body)
