"""Signed verdicts travel with the image: read from every copy of it, attached beside the pushed one.

A verdict is attached beside the registry copy it was signed for; a push
that promotes the image to another registry must carry it, or a fail
attached beside the staging copy stays behind and the promoted copy says
nothing (what ``cosign copy`` does for signatures). So a push reads the
signed verdicts of its source, every registry copy of the image this host
knows (:func:`registry_copies`: the engine's repo digests, the journal's
pushes and in-registry builds) and the copy in the registry the pushed
reference names (:func:`source_copy`: the staging copy a promotion pulled
from), keeps those that name the image, and
attaches every one, pass and fail, beside the target, with the journal's
own. Nothing here judges them: :func:`vllm_hotfix.trust.attest.judge` does,
over the same set.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine import Engine, split_reference
from ..errors import AttestationError, PipelineError
from ..journal import records
from ..registry import client as registry
from . import attest, referrers

log = logging.getLogger(__name__)


def registry_copies(root: Path, image_id: str, repo_digests: Sequence[str] = ()) -> list[str]:
    """Every registry copy of ``image_id`` this host knows, as NAME@sha256:... (the engine's repo digests, the
    journal's pushes and in-registry builds)."""
    places = [str(d) for d in repo_digests if "@sha256:" in str(d)]
    for entry in records.pushes(root, image_id):
        # An index push names each platform's image among its children: the verdict goes beside that image.
        mine: list[Mapping[str, Any]] = [c for c in entry.data.get("children") or [] if isinstance(c, dict)
                                         and c.get("image_id") == image_id] or [entry.data]
        for pushed in mine:
            ref, digest = str(pushed.get("ref") or ""), str(pushed.get("digest") or "")
            if ref and digest.startswith("sha256:"):
                places.append(f"{split_reference(ref)[0]}@{digest}")
    for entry in records.builds_of_image(root, image_id):
        where = entry.data.get("registry")
        if isinstance(where, dict) and str(where.get("digest", "")).startswith("sha256:") and where.get("repository"):
            places.append(f"{where['repository']}@{where['digest']}")
    return list(dict.fromkeys(places))


def source_copy(engine: Engine, image_ref: str, image_id: str) -> str | None:
    """``image_ref``'s copy in the registry it names, as NAME@sha256:..., where that tag holds ``image_id`` (an
    index: its child that does); None where the reference names no registry or the tag holds another image.
    Raises PipelineError where the registry cannot be read."""
    first, slash, _rest = image_ref.partition("/")
    if not slash or not ("." in first or ":" in first or first == "localhost"):
        return None
    client, path, manifest = registry.look_up(engine, image_ref)
    if manifest is None:
        return None
    found = [manifest] if not manifest.is_index else [
        m for m in (client.manifest(path, c.digest) for c in registry.children(manifest)) if m is not None]
    for one in found:
        if (one.json().get("config") or {}).get("digest") == image_id:
            return f"{client.host}/{path}@{one.digest}"
    return None


@dataclass(frozen=True, slots=True)
class Carried:
    """The signed verdicts found beside the image's registry copies, and the copies that could not be read."""

    envelopes: list[tuple[str, bytes]] = field(default_factory=list)  # (where it was found, the envelope)
    unread: list[str] = field(default_factory=list)  # "NAME@sha256:...: why"


def read(engine: Engine, image_id: str, places: Sequence[str]) -> Carried:
    """The signed verdicts beside each of ``places`` that name ``image_id`` (unverified: verifying is the judge's)."""
    out = Carried()
    for place in places:
        name, _, digest = place.partition("@")
        try:
            host, path = registry.split_repo(name)
            found = attest.registry_candidates(registry.client_for(engine, host), path, digest)
        except PipelineError as exc:
            out.unread.append(f"{place}: {str(exc).splitlines()[0]}")
            continue
        out.envelopes.extend((where, data) for where, data in found
                             if image_id in (attest.named_images(data) or set()))
    return out


def unique(envelopes: Sequence[tuple[str, bytes]]) -> list[tuple[str, bytes]]:
    """``envelopes`` once each, by their bytes, the first place each was found naming it: what :func:`attach`
    attaches, and what a dry run says it would (the journal's copy of a verdict and the same one beside a
    registry copy are one)."""
    once: dict[str, tuple[str, bytes]] = {}
    for where, data in envelopes:
        once.setdefault(hashlib.sha256(data).hexdigest(), (where, data))
    return list(once.values())


def attach(engine: Engine, target: str, digest: str, envelopes: Sequence[tuple[str, bytes]],
           say: Callable[[str], None] = lambda _l: None) -> list[str]:
    """Attach each of ``envelopes`` (once each, by its bytes: :func:`unique`) beside ``target``'s pushed manifest
    ``digest``; the artifacts' digests."""
    going = unique(envelopes)
    if not going:
        return []
    client, path, manifest = registry.look_up(engine, target, digest)
    if manifest is None:
        raise AttestationError(f"registry {client.host} has no {path}@{digest} to attach the signed verdicts to")
    subject = referrers.Subject(manifest.digest, manifest.media_type, manifest.size)
    out = []
    for where, data in going:
        out.append(referrers.attach(client, path, subject, data))
        say(f"    attached the signed verdict from {where} as {out[-1][:19]}")
    return out
