"""Signed verdicts: made where smoke ran, kept beside the image, checked wherever it is pulled.

``smoke --sign-key`` signs the run's report (:mod:`signing`) and keeps the
envelope in the journal folder, named by its own hash. ``push`` attaches
every envelope kept for the image to the pushed manifest (:mod:`referrers`),
and ``push --require-attestation`` lets the image through on a verified
envelope instead of the local journal's verdict, so the GPU host that ran
smoke and the host that pushes need share no files. ``verify`` reads the
envelopes back from the registry.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import __version__
from ..engine import Engine, ImageInfo, split_reference
from ..engine import labels as L
from ..errors import (
    AttestationError,
    AttestationMismatch,
    AttestationMissing,
    AttestationTampered,
    PipelineError,
)
from ..journal.atomic import write_atomic
from ..journal.records import records_dir
from ..registry import client as registry
from ..verdicts import Verdict
from . import referrers, signing

log = logging.getLogger(__name__)


def folder(root: Path, image_id: str) -> Path:
    return records_dir(root) / "attestations" / image_id.removeprefix("sha256:")


def predicate(verdict: Verdict, info: ImageInfo) -> dict[str, Any]:
    """The smoke report plus what the image says it was made from (checked by the report's landed check)."""
    labels = dict(info.labels)
    try:
        patches = json.loads(labels.get(L.PATCHES, "{}"))
    except ValueError:
        patches = {}
    return {
        **verdict.to_dict(),
        "tool_version": __version__,
        "definition": labels.get(L.DEFINITION, ""),
        "patches": patches if isinstance(patches, dict) else {},
        "base": {"id": labels.get(L.BASE_ID, ""), "name": labels.get(L.OCI_BASE_NAME, ""),
                 "digest": labels.get(L.OCI_BASE_DIGEST, "")},
    }


def subjects(image_ref: str, info: ImageInfo) -> dict[str, str]:
    """The image by config digest (its ID), and by manifest digest wherever a registry gave it one."""
    found = {image_ref: info.id}
    for repo_digest in info.repo_digests:
        name, _, digest = repo_digest.partition("@")
        if digest.startswith("sha256:"):
            found[name] = digest
    return found


def sign(root: Path, verdict: Verdict, info: ImageInfo, image_ref: str, key_source: str,
         copy_to: Path | None = None) -> Path:
    """Sign ``verdict`` and keep the envelope in the journal folder (and at ``copy_to``); return its path."""
    key = signing.load_private_key(key_source)
    envelope = signing.sign(signing.statement(subjects(image_ref, info), predicate(verdict, info)), key)
    path = folder(root, info.id) / f"{hashlib.sha256(envelope).hexdigest()}.dsse.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, envelope, error=AttestationError)
    if copy_to is not None:
        write_atomic(copy_to, envelope, error=AttestationError)
    return path


def kept(root: Path, image_id: str) -> list[Path]:
    where = folder(root, image_id)
    return sorted(where.glob("*.dsse.json")) if where.is_dir() else []


@dataclass(frozen=True, slots=True)
class Accepted:
    """A signed verdict that let an image through, and where it came from."""

    source: str
    key_id: str
    report: dict[str, Any]

    @property
    def gpu_verified(self) -> bool:
        return self.report.get("gpu_verified") is True


def judge(candidates: Sequence[tuple[str, bytes]], digests: set[str], image: str, key_source: str, *,
          gpu_verified: bool = True, gpu_products: Sequence[str] = ()) -> Accepted:
    """The first envelope that verifies with the key, names the image and passes; else the closest refusal.

    ``candidates``: (where it came from, envelope bytes). With none: AttestationMissing.
    Refusals rank by how far an envelope got: a pass about this image signed
    by this key wins; else the error of the envelope that got furthest.
    """
    public = signing.load_public_key(key_source)
    if not candidates:
        raise AttestationMissing(f"{image}: no signed verdict found", hint="smoke it with --sign-key, then push it")
    best: tuple[int, PipelineError] | None = None
    for where, data in candidates:
        stage = 0
        try:
            found = signing.open_envelope(data, public, where)
            stage = 1
            signing.require_subject(found, digests, image, where)
            stage = 2
            signing.require_verdict(found, image, where, gpu_verified=gpu_verified, gpu_products=gpu_products)
            return Accepted(where, found.key_id, found.predicate)
        except AttestationError as exc:
            if best is None or stage > best[0]:
                best = (stage, exc)
    assert best is not None
    raise best[1]


# A DSSE envelope of a smoke report is tens of kilobytes; a file far larger is not one.
MAX_ENVELOPE = 16 * 1024 * 1024


def read_envelope(path: Path) -> bytes:
    """The bytes of the signed verdict at ``path``: a regular file, read without waiting on it.

    A FIFO (or a device) given as --attestation would block the read until
    someone writes to it: it is refused instead, as is a file too large to be
    an envelope.
    """
    import os
    import stat

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise AttestationError(f"cannot read the signed verdict {path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise AttestationError(f"the signed verdict {path} is not a regular file (a FIFO, device or socket); "
                                   "give the envelope's file")
        if st.st_size > MAX_ENVELOPE:
            raise AttestationError(f"the signed verdict {path} is {st.st_size} bytes, too large for an envelope")
        with os.fdopen(os.dup(fd), "rb") as fh:
            return fh.read(MAX_ENVELOPE + 1)
    except OSError as exc:
        raise AttestationError(f"cannot read the signed verdict {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def named_images(data: bytes) -> set[str] | None:
    """The image IDs an envelope's statement names as its subjects (unverified); None if it is no envelope."""
    try:
        envelope = json.loads(data)
        doc = json.loads(base64.b64decode(envelope["payload"]))
        return {f"sha256:{s['digest']['sha256']}" for s in doc["subject"]}
    except (ValueError, KeyError, TypeError):
        return None


def names(path: Path, image_id: str) -> bool:
    """Whether the envelope at ``path`` says it is about ``image_id`` (unverified: only to route it)."""
    try:
        return image_id in (named_images(read_envelope(path)) or set())
    except AttestationError:
        return False


def require_about(path: Path, image_ids: Sequence[str], what: str) -> None:
    """Refuse ``--attestation path`` unless its envelope names one of ``image_ids`` (before anything is pushed).

    Attached beside another image it would vouch for nothing; skipped without
    a word, the push looked as if it carried it.
    """
    named = named_images(read_envelope(path))
    if named is None:
        raise AttestationTampered(f"--attestation {path}: not a signed verdict (a DSSE envelope of a statement)")
    if not named & set(image_ids):
        raise AttestationMismatch(f"--attestation {path} is a signed verdict about another image "
                                  f"({', '.join(i[:19] for i in sorted(named))}), not {what} "
                                  f"({', '.join(i[:19] for i in image_ids)})",
                                  hint="give the envelope smoke wrote for this image")


def local_candidates(root: Path, image_id: str, given: Path | None) -> list[tuple[str, bytes]]:
    """The envelope given on the command line, else every one the journal keeps for the image."""
    paths = [given] if given is not None else kept(root, image_id)
    out = []
    for path in paths:
        try:
            out.append((str(path), path.read_bytes() if given is None else read_envelope(path)))
        except OSError as exc:
            raise AttestationError(f"cannot read the signed verdict {path}: {exc.strerror or exc}") from None
    return out


def attach(engine: Engine, root: Path, image_id: str, target: str, digest: str,
           extra: Sequence[Path] = (), say: Callable[[str], None] = lambda _l: None) -> list[str]:
    """Attach every envelope kept for ``image_id`` (and ``extra``) to ``target``'s pushed manifest."""
    paths = list(dict.fromkeys([*kept(root, image_id), *extra]))
    if not paths:
        return []
    repo, _tag = split_reference(target)
    host, path = registry.split_repo(repo)
    client = registry.client_for(engine, host)
    manifest = client.manifest(path, digest)
    if manifest is None:
        raise AttestationError(f"registry {host} has no {path}@{digest} to attach the signed verdict to")
    subject = referrers.Subject(manifest.digest, manifest.media_type, manifest.size)
    out = []
    for envelope in paths:
        out.append(referrers.attach(client, path, subject, read_envelope(envelope)))
        say(f"    attached signed verdict {envelope.name} as {out[-1][:19]}")
    return out


def verify(engine: Engine, ref: str, key_source: str, *, gpu_verified: bool = True,
           gpu_products: Sequence[str] = ()) -> tuple[str, Accepted]:
    """Read the signed verdicts of ``ref`` from its registry and judge them; return (manifest digest, accepted)."""
    repo, tag = split_reference(ref)
    host, path = registry.split_repo(repo)
    client = registry.client_for(engine, host)
    manifest = client.manifest(path, tag)
    if manifest is None:
        raise AttestationMissing(f"registry {host} has no {path}:{tag}")
    images = [manifest]
    if manifest.is_index:
        images = []
        for child in registry.children(manifest):
            found = client.manifest(path, child.digest)
            if found is not None:
                images.append(found)
    accepted: Accepted | None = None
    for image in images:
        digests = {image.digest}
        config = (image.json().get("config") or {}).get("digest")
        if isinstance(config, str):
            digests.add(config)
        where = f"{path}@{image.digest}"
        candidates = [(f"{where} (signed verdict {d[:19]})", data)
                      for d, data in referrers.envelopes(client, path, image.digest)]
        accepted = judge(candidates, digests, f"{ref} ({image.digest[:19]})", key_source,
                         gpu_verified=gpu_verified, gpu_products=gpu_products)
    assert accepted is not None
    return manifest.digest, accepted
