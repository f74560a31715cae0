"""Signed verdicts stored beside the image they speak of, in the registry.

An envelope is stored as an OCI 1.1 artifact: a manifest whose
``artifactType`` is an in-toto statement, whose one layer is the DSSE
envelope, and whose ``subject`` is the image's manifest. A registry with the
referrers API indexes it by its subject; for one without, the OCI fallback
applies: an index under the tag ``sha256-<subject hex>`` lists the
artifacts, and whoever adds one rewrites that index. Readers try the API
first and the fallback tag second, so both kinds of registry work.
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import PushError
from ..registry.client import OCI_INDEX, OCI_MANIFEST, Client, sha256
from ..registry.write import Repo, Writer
from .signing import ENVELOPE_MEDIA_TYPE, PAYLOAD_TYPE

if TYPE_CHECKING:
    import requests

log = logging.getLogger(__name__)

EMPTY_MEDIA_TYPE = "application/vnd.oci.empty.v1+json"
EMPTY = b"{}"


@dataclass(frozen=True, slots=True)
class Subject:
    """The image an artifact speaks of, as its manifest's descriptor."""

    digest: str
    media_type: str
    size: int

    def descriptor(self) -> dict[str, Any]:
        return {"mediaType": self.media_type, "digest": self.digest, "size": self.size}


def fallback_tag(digest: str) -> str:
    return digest.replace(":", "-")


def verdict_tag(subject: str, artifact: str) -> str:
    """The tag one signed verdict stands under by itself: the fallback tag, a dot, the artifact's hash (part)."""
    return f"{fallback_tag(subject)}.{artifact.partition(':')[2][:32]}"


INDEX_RETRIES = 5  # times the fallback index is written again when a concurrent writer replaced it


def _writer(client: Client, repo: str) -> Writer:
    return Writer(Repo(client, repo))


def attach(client: Client, repo: str, subject: Subject, envelope: bytes) -> str:
    """Store ``envelope`` as an artifact referring to ``subject``; return the artifact's digest."""
    writer = _writer(client, repo)
    writer.put_blob(EMPTY, "the empty config")
    layer = writer.put_blob(envelope, "the signed verdict's envelope")
    manifest = {
        "schemaVersion": 2,
        "mediaType": OCI_MANIFEST,
        "artifactType": PAYLOAD_TYPE,
        "config": {"mediaType": EMPTY_MEDIA_TYPE, "digest": sha256(EMPTY), "size": len(EMPTY)},
        "layers": [{"mediaType": ENVELOPE_MEDIA_TYPE, "digest": layer, "size": len(envelope)}],
        "subject": subject.descriptor(),
    }
    body = json.dumps(manifest, indent=2).encode()
    stored = writer.store_manifest(sha256(body), OCI_MANIFEST, body,
                                   f"the signed verdict for {repo}@{subject.digest}")
    digest = stored.digest
    # Its own tag: no other writer ever writes it, so no concurrent attach can drop it.
    writer.put_manifest(verdict_tag(subject.digest, digest), OCI_MANIFEST, body)
    if stored.subject == subject.digest:
        log.info("registry %s indexes referrers itself", client.host)
        return digest
    _add_to_fallback(client, repo, subject, {"mediaType": OCI_MANIFEST, "digest": digest, "size": len(body),
                                             "artifactType": PAYLOAD_TYPE})
    return digest


def _index_entries(client: Client, repo: str, tag: str) -> list[dict[str, Any]] | None:
    """The fallback index's entries (None: no index there)."""
    found = client.manifest(repo, tag)
    if found is None:
        return None
    if found.media_type != OCI_INDEX:
        raise PushError(f"registry {client.host}: {repo}:{tag} exists and is not a referrers index; "
                        f"not overwriting it")
    return [e for e in found.json().get("manifests") or [] if isinstance(e, dict)]


def _add_to_fallback(client: Client, repo: str, subject: Subject, entry: dict[str, Any]) -> None:
    """Add ``entry`` to the fallback index, with every verdict the per-verdict tags hold; read it back and write
    the union again while a concurrent writer's index replaced this one."""
    tag = fallback_tag(subject.digest)
    for attempt in range(INDEX_RETRIES):
        try:
            entries = _index_entries(client, repo, tag) or []
            known = {e.get("digest") for e in entries}
            mine = {e["digest"]: e for e in [entry, *tagged(client, repo, subject.digest)]}
            wanted = [e for d, e in mine.items() if d not in known]
            if not wanted:
                return
            index = {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": [*entries, *wanted]}
            _writer(client, repo).put_manifest(tag, OCI_INDEX, json.dumps(index, indent=2).encode(),
                                               f"the referrers index {repo}:{tag}")
        except PushError as exc:
            if "is not a referrers index" in str(exc):
                raise
            # Writers racing on one tag: some registries answer 500 to a read or write of it meanwhile. The
            # verdict stands under its own tag already; the index is tried again, after a pause that differs
            # between writers.
            log.info("registry %s: the fallback index %s:%s: %s; trying again", client.host, repo, tag, exc)
            time.sleep(0.05 * (attempt + 1) + random.random() * 0.1)
    log.warning("registry %s: the fallback index %s:%s kept changing under this writer; the verdict stands under "
                "its own tag", client.host, repo, tag)


def tagged(client: Client, repo: str, digest: str) -> list[dict[str, Any]]:
    """Descriptors of the signed verdicts tagged by themselves beside ``repo@digest`` (:func:`verdict_tag`)."""
    prefix = fallback_tag(digest) + "."
    out = []
    for tag in tags(client, repo):
        if not tag.startswith(prefix):
            continue
        found = client.manifest(repo, tag)
        if found is None or found.media_type != OCI_MANIFEST:
            continue
        body = found.json()
        if body.get("artifactType") != PAYLOAD_TYPE:
            continue
        out.append({"mediaType": OCI_MANIFEST, "digest": found.digest, "size": found.size,
                    "artifactType": PAYLOAD_TYPE})
    return out


def tags(client: Client, repo: str) -> list[str]:
    """Every tag of ``repo`` (the tag list, read page by page as its ``Link`` header names them)."""
    res = client.request("GET", f"/v2/{repo}/tags/list", f"repository:{repo}:pull", params={"n": 1000})
    if res.status_code != 200:
        return []
    return [str(t) for page in _pages(client, res, repo, "tags", f"the tag list of {repo}", "a tag list")
            for t in page]


MAX_PAGES = 1000  # pages of the referrers API read at most (a registry looping its Link would hold the run)
_LINK_NEXT = re.compile(r'<([^>]+)>\s*;\s*rel="?next"?')


def _next_page(link: str) -> str | None:
    """The next page a ``Link`` header names (a path on the registry, or a whole URL), if any."""
    found = _LINK_NEXT.search(link)
    return found.group(1) if found else None


def _pages(client: Client, res: requests.Response, repo: str, key: str, what: str, shape: str,
           headers: dict[str, str] | None = None) -> Iterator[list[Any]]:
    """The ``key`` list of ``res`` and of every later page its ``Link`` header names (at most MAX_PAGES), page by
    page; a later page the registry does not answer with 200 is an error, so what it lists is never taken for
    absent."""
    pages = 0
    while True:
        try:
            items = res.json().get(key) or []
        except (ValueError, AttributeError):
            raise PushError(f"registry {client.host} answered {what} with something that is not {shape}") from None
        yield list(items)
        nxt = _next_page(res.headers.get("Link", ""))
        pages += 1
        if nxt is None or pages >= MAX_PAGES:
            return
        res = client.request("GET", nxt, f"repository:{repo}:pull", headers=dict(headers or {}))
        if res.status_code != 200:
            raise PushError(f"registry {client.host} answered {res.status_code} for a later page of {what}")


def listed(client: Client, repo: str, digest: str) -> list[dict[str, Any]]:
    """Descriptors of the signed verdicts referring to ``repo@digest``: the union of the referrers API, the
    fallback index and the verdicts' own tags, each once.

    All three are read whatever the registry answers: a verdict attached while
    the registry had no referrers API (or by a writer that could not use it)
    stands under the fallback tag and its own, which a registry that gained
    the API later need not list; one dropped from the fallback index still
    stands under its own tag, and is named.
    """
    res = client.request("GET", f"/v2/{repo}/referrers/{digest}", f"repository:{repo}:pull",
                         params={"artifactType": PAYLOAD_TYPE}, headers={"Accept": OCI_INDEX})
    entries: list[Any] = []
    if res.status_code == 200 and res.headers.get("Content-Type", "").startswith(OCI_INDEX):
        # The API pages its answer (a Link header naming the next page): every page is read, so a verdict
        # listed on a later one still counts.
        for page in _pages(client, res, repo, "manifests", f"the referrers of {repo}@{digest}", "an index",
                           headers={"Accept": OCI_INDEX}):
            entries += page
    found = client.manifest(repo, fallback_tag(digest))
    indexed: set[Any] = set()
    if found is not None and found.media_type == OCI_INDEX:
        fallback = [e for e in found.json().get("manifests") or [] if isinstance(e, dict)]
        indexed = {e.get("digest") for e in fallback}
        entries += fallback
    for e in tagged(client, repo, digest):
        if found is not None and e["digest"] not in indexed:
            # Every verdict also stands under its own tag: one the index lacks was dropped from it.
            log.warning("registry %s: the signed verdict %s stands under its own tag beside %s@%s, but the "
                        "fallback index %s lacks it (the index was rewritten); it is read all the same",
                        client.host, e["digest"][:19], repo, digest[:19], fallback_tag(digest))
        entries.append(e)
    unique: dict[str, dict[str, Any]] = {}
    for e in entries:
        if isinstance(e, dict) and e.get("artifactType") == PAYLOAD_TYPE:
            unique.setdefault(str(e.get("digest")), e)
    return list(unique.values())


def envelopes(client: Client, repo: str, digest: str) -> list[tuple[str, bytes]]:
    """(artifact digest, envelope bytes) of every signed verdict referring to ``repo@digest``.

    Each artifact and blob is checked against its digest; one that does not
    name ``digest`` as its subject is left out (a fallback index anyone can
    write may list strangers).
    """
    out: list[tuple[str, bytes]] = []
    for entry in listed(client, repo, str(digest)):
        artifact = client.manifest(repo, str(entry.get("digest")))
        if artifact is None:
            continue
        body = artifact.json()
        if (body.get("subject") or {}).get("digest") != digest:
            log.warning("%s@%s is listed as a referrer of %s but names another subject", repo, artifact.digest,
                        digest)
            continue
        for layer in body.get("layers") or []:
            if layer.get("mediaType") != ENVELOPE_MEDIA_TYPE:
                continue
            res = client.request("GET", f"/v2/{repo}/blobs/{layer.get('digest')}", f"repository:{repo}:pull")
            if res.status_code != 200:
                raise PushError(f"registry {client.host} answered {res.status_code} for the signed verdict "
                                f"{repo}@{layer.get('digest')}")
            if sha256(res.content) != layer.get("digest"):
                raise PushError(f"registry {client.host} sent {repo}@{layer.get('digest')} with other bytes")
            out.append((artifact.digest, res.content))
    return out
