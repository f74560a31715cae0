"""The builds and verdicts of one image repository, read from its registry: what every build host pushed.

The journal (:mod:`vllm_hotfix.journal.records`) is one host's memory; the
registry holds what the whole team pushed. Which images a repository holds is
read from its tags: the tags people use, and the tags a registry without the
referrers API keeps beside every image a signed verdict was attached to
(``sha256-<image manifest>``, :mod:`vllm_hotfix.trust.referrers`), so an image
whose tag has since moved on is still found; the pushes this host's journal
recorded add their digests. Each image's config is read by its digest (its
image ID, its creation time, its labels) and its signed verdicts from its
referrers.

A verdict counts only when it verifies with one of the keys given: without
keys, the verdicts found are counted and shown as not checked. What the
image's labels say (its definition) is shown as its claim; nothing here runs
the image or trusts it further. An image's place in the history is when its
oldest verified verdict was signed (a reproducible build's config carries a
fixed creation time), else its config's creation time.

``rollback`` in the registry moves a tag to an earlier image of the same
definition and platform whose newest verified verdict is a pass (earlier by
that order), by putting
that image's manifest (the same bytes, so the same digest) under the tag.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine import Engine
from ..engine import labels as L
from ..errors import AttestationError, NothingToRollBack, PushError, Refused
from ..journal import records
from ..registry import client as registry
from ..registry import refs
from ..registry.write import Repo, Writer
from ..trust import referrers, signing

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Verdict:
    status: str  # pass, fail, incomplete
    gpu_verified: bool
    signed_at: str
    key_id: str
    artifact: str


@dataclass(frozen=True, slots=True)
class RemoteBuild:
    """One image of the repository, as its registry describes it."""

    digest: str  # the image manifest's
    image_id: str  # its config's digest
    created: str
    platform: str
    definition: str  # the image's label: its claim
    tags: tuple[str, ...]
    media_type: str
    verdicts_found: int
    verdict: Verdict | None  # the newest that verified with a given key
    refused: tuple[str, ...] = field(default_factory=tuple)  # why found verdicts did not count
    first_judged: str = ""  # when its oldest verified verdict was signed

    @property
    def when(self) -> str:
        """Its place in the repository's history: when it was first judged under a key given, else its config's
        creation time (a reproducible build's is fixed, so the verdicts tell its order better)."""
        return self.first_judged or self.created

    def as_dict(self) -> dict[str, Any]:
        return {"digest": self.digest, "image_id": self.image_id, "created": self.created, "platform": self.platform,
                "definition": self.definition, "tags": list(self.tags), "verdicts_found": self.verdicts_found,
                "verdict": self.verdict.status if self.verdict else None,
                "gpu_verified": bool(self.verdict and self.verdict.gpu_verified),
                "signed_at": self.verdict.signed_at if self.verdict else None,
                "key_id": self.verdict.key_id if self.verdict else None, "refused": list(self.refused),
                "first_judged": self.first_judged or None}


def _config(client: registry.Client, path: str, manifest: registry.Manifest) -> dict[str, Any]:
    digest = str((manifest.json().get("config") or {}).get("digest") or "")
    res = client.request("GET", f"/v2/{path}/blobs/{digest}", f"repository:{path}:pull")
    if res.status_code != 200:
        raise PushError(f"registry {client.host} answered {res.status_code} for the config {path}@{digest}")
    if registry.sha256(res.content) != digest:
        raise PushError(f"registry {client.host} sent the config {path}@{digest} with other bytes")
    try:
        found = json.loads(res.content)
    except ValueError:
        raise PushError(f"registry {client.host}: the config {path}@{digest} is not JSON") from None
    return found if isinstance(found, dict) else {}


def _judged(client: registry.Client, path: str, digest: str, image_id: str,
            keys: Sequence[signing.PublicKey]) -> tuple[int, Verdict | None, tuple[str, ...], str]:
    """How many signed verdicts refer to the image, the newest that verifies with ``keys`` and names it, why the
    others did not count, and when the oldest that verifies was signed."""
    found = referrers.envelopes(client, path, digest)
    if not keys:
        return len(found), None, (), ""
    good: list[tuple[str, signing.Attested]] = []
    refused: list[str] = []
    for artifact, data in found:
        where = f"{path}@{artifact[:19]}"
        try:
            attested = signing.open_with_any(data, keys, where)
            signing.require_subject(attested, {image_id, digest}, path, where)
        except AttestationError as exc:
            refused.append(str(exc))
            continue
        good.append((artifact, attested))
    if not good:
        return len(found), None, tuple(refused), ""

    def ran(g: tuple[str, signing.Attested]) -> str:
        return str(g[1].predicate.get("run_at") or g[1].predicate.get("signed_at") or "")

    artifact, newest = max(good, key=ran)
    pred = newest.predicate
    return len(found), Verdict(str(pred.get("status") or ""), bool(pred.get("gpu_verified")),
                               str(pred.get("signed_at") or ""), newest.key_id, artifact), tuple(refused), \
        ran(min(good, key=ran))


def _candidates(client: registry.Client, path: str, repo: str, root: Path) -> dict[str, list[str]]:
    """Manifest digest -> the tags naming it (empty for one found by a verdict's fallback tag or the journal)."""
    found: dict[str, list[str]] = {}
    for tag in referrers.tags(client, path):
        if tag.startswith("sha256-"):
            subject = "sha256:" + tag.removeprefix("sha256-").partition(".")[0]
            found.setdefault(subject, [])
            continue
        manifest = client.manifest(path, tag)
        if manifest is None:
            continue
        if manifest.is_index:
            for child in registry.children(manifest):
                found.setdefault(child.digest, [])
        found.setdefault(manifest.digest, []).append(tag)
    for entry in records.load(root, "push"):
        for pushed in [entry.data, *[c for c in entry.data.get("children") or [] if isinstance(c, dict)]]:
            ref, digest = str(pushed.get("ref") or ""), str(pushed.get("digest") or "")
            if ref.rpartition(":")[0] == repo and digest.startswith("sha256:"):
                found.setdefault(digest, [])
    return found


def _require_repository(client: registry.Client, path: str, repo: str) -> None:
    """PushError where the registry has no repository ``path`` (its tag list unknown): a folder above
    repositories (HOST/PATH without the image's name) or a typo, said as such, not as an empty repository."""
    res = client.request("GET", f"/v2/{path}/tags/list", f"repository:{path}:pull", params={"n": 1})
    if res.status_code != 404:
        return
    below = _repositories_below(client, path)
    hint = (f"--registry names one image repository, HOST[:PORT]/PATH/NAME; under {repo} the registry has "
            + ", ".join(f"{repo}/{name}" for name in below[:5]) + (" ..." if len(below) > 5 else "")
            if below else "--registry names one image repository, HOST[:PORT]/PATH/NAME, as push printed it")
    raise PushError(f"{repo}: the registry {client.host} has no repository {path}", hint=hint)


def _repositories_below(client: registry.Client, path: str) -> list[str]:
    """The names of the repositories under ``path/`` that the registry's catalog lists (none where it lists none
    or refuses to: the catalog is optional)."""
    res = client.request("GET", "/v2/_catalog", "registry:catalog:*", params={"n": 1000})
    if res.status_code != 200:
        return []
    try:
        body = res.json()
        names = body.get("repositories") or [] if isinstance(body, dict) else []
    except ValueError:
        return []
    return [str(n).removeprefix(path + "/") for n in names if str(n).startswith(path + "/")]


def builds(engine: Engine, root: Path, repo: str, keys: Sequence[signing.PublicKey] = (),
           progress: Callable[[str], None] = lambda _l: None) -> list[RemoteBuild]:
    """Every image of ``repo`` its registry holds (and this host pushed there), newest first."""
    refs.check_repository(repo, "--registry")
    host, path = registry.split_repo(repo)
    client = registry.client_for(engine, host)
    progress(f"==> reading {repo} from its registry (tags, configs, signed verdicts)")
    candidates = _candidates(client, path, repo, root)
    if not candidates:
        _require_repository(client, path, repo)
    out = []
    for digest, tags in candidates.items():
        manifest = client.manifest(path, digest)
        if manifest is None or manifest.is_index or "config" not in manifest.json():
            continue
        if (manifest.json().get("config") or {}).get("mediaType", "").endswith("in-toto+json"):
            continue  # a signed verdict's own artifact
        config = _config(client, path, manifest)
        image_id = str(manifest.json()["config"]["digest"])
        labels = (config.get("config") or {}).get("Labels") or {}
        count, verdict, refused, first = _judged(client, path, manifest.digest, image_id, keys)
        plat = "/".join(p for p in (config.get("os"), config.get("architecture"), config.get("variant")) if p)
        out.append(RemoteBuild(manifest.digest, image_id, str(config.get("created") or ""), plat,
                               str(labels.get(L.DEFINITION) or ""), tuple(sorted(tags)), manifest.media_type,
                               count, verdict, refused, first))
    return sorted(out, key=lambda b: b.when, reverse=True)


@dataclass(frozen=True, slots=True)
class Moved:
    ref: str
    to: RemoteBuild
    was: str  # the digest the tag named before ("" when it named none)
    direction: str  # back, forward, unchanged


def rollback(engine: Engine, root: Path, repo: str, definition: str, tag: str, keys: Sequence[signing.PublicKey],
             to_image: str | None = None, progress: Callable[[str], None] = lambda _l: None) -> Moved:
    """Point ``repo:tag`` at the image before the one it names (or ``to_image``): of ``definition``, the same
    platform, its newest verified verdict a pass."""
    if not keys:
        raise Refused("rollback --registry needs --key: only a verdict that verifies with one of the team's keys "
                      "says an image may be served again", hint="give the public key(s) the verdicts are signed with")
    made = [b for b in builds(engine, root, repo, keys, progress) if b.definition == definition]
    if not made:
        raise NothingToRollBack(f"{repo} holds no image of definition {definition} (by their labels)",
                                hint=f"python build.py list --registry {repo} shows what it holds")
    ref = f"{repo}:{tag}"
    current = next((b for b in made if tag in b.tags), None)
    if to_image is not None:
        wanted = [b for b in made if b.image_id == to_image or b.image_id.removeprefix("sha256:").startswith(
            to_image.removeprefix("sha256:"))]
        if len(wanted) != 1:
            raise Refused(f"--to {to_image}: {'no' if not wanted else 'more than one'} image of {definition} in "
                          f"{repo} has that ID")
        target = wanted[0]
    else:
        if current is None:
            raise NothingToRollBack(f"{ref} names no image of {definition}: nothing to roll back from",
                                    hint="name the image with --to ID")
        older = [b for b in made if b.when < current.when and b.platform == current.platform]
        passing = [b for b in older if b.verdict is not None and b.verdict.status == "pass"]
        if not passing:
            raise NothingToRollBack(f"{ref}: no earlier image of {definition} ({current.platform}) in {repo} has a "
                                    "passing verdict signed with the keys given")
        target = passing[0]
    if target.verdict is None or target.verdict.status != "pass":
        why = "; ".join(target.refused) or ("no signed verdict" if not target.verdicts_found else "")
        raise Refused(f"{repo}@{target.digest[:19]} ({target.image_id[:19]}) has no passing verdict signed with the "
                      f"keys given{': ' + why if why else ''}; refusing to point {ref} at it")
    if current is not None and current.platform != target.platform:
        raise Refused(f"{ref} is {current.platform}; {target.image_id[:19]} is {target.platform}")
    if current is not None and current.digest == target.digest:
        return Moved(ref, target, current.digest, "unchanged")
    host, path = registry.split_repo(repo)
    client = registry.client_for(engine, host)
    manifest = client.manifest(path, target.digest)
    if manifest is None:
        raise PushError(f"registry {host} no longer holds {path}@{target.digest}")
    records.append(root, "tag", {"ref": ref, "image_id": target.image_id, "why": "rollback --registry",
                                 "registry_digest": target.digest,
                                 **({"from": current.image_id} if current is not None else {})})
    put = Writer(Repo(client, path)).put_manifest(tag, manifest.media_type, manifest.body, f"the tag {ref}")
    if put != target.digest:
        raise PushError(f"registry {host} stored {ref} as {put}, not {target.digest}")
    direction = "back" if current is None or target.when < current.when else "forward"
    return Moved(ref, target, current.digest if current is not None else "", direction)
