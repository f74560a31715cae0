"""Signed verdicts: signed by the host that ran smoke, kept beside the image, checked wherever it is pulled.

``smoke --sign-key`` signs the report the host judged (:mod:`signing` builds
what is signed) and keeps the envelope in the journal folder, named by its
own hash. ``push`` attaches every envelope kept for the image to the pushed
manifest (:mod:`referrers`), and ``push --require-attestation`` lets the
image through on signed verdicts instead of the local journal's, so the GPU
host that ran smoke and the host that pushes need share no files. ``verify``
reads the envelopes back from the registry.

One rule wherever signed verdicts are judged (:func:`judge`): of every
envelope found for the image that verifies with one of the given keys, the
verification policy (:mod:`.policy`) is asked of the newest that covers it,
by when its run ended, and a newer fail of a check it counts blocks it
(:mod:`.decide`). An older pass never stands in for a newer fail.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import Engine, split_reference
from ..errors import (
    AttestationError,
    AttestationMismatch,
    AttestationMissing,
    AttestationTampered,
    NotRegular,
    PipelineError,
    PushError,
    UsageError,
)
from ..journal.atomic import opened_regular, write_atomic
from ..journal.records import records_dir
from ..registry import client as registry
from ..verdicts import Verdict
from . import decide, policy, referrers, signing

log = logging.getLogger(__name__)


def folder(root: Path, image_id: str) -> Path:
    return records_dir(root) / "attestations" / image_id.removeprefix("sha256:")


def keep(root: Path, image_id: str, envelope: bytes, copy_to: Path | None = None) -> Path:
    """Keep a signed envelope in the journal folder (and at ``copy_to``); push attaches what is kept."""
    path = folder(root, image_id) / f"{hashlib.sha256(envelope).hexdigest()}.dsse.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, envelope, error=AttestationError)
    if copy_to is not None:
        write_atomic(copy_to, envelope, error=AttestationError)
    return path


def sign(root: Path, verdict: Verdict, labels: Mapping[str, str], subjects: Mapping[str, str], key_source: str,
         copy_to: Path | None = None) -> tuple[Path, bytes]:
    """Sign the host's ``verdict`` now and keep the envelope; return where it is kept, and its bytes. The run's
    time (``run_at``) is the verdict's start as the host recorded it."""
    key = signing.load_private_key(key_source)
    doc = signing.statement(subjects, signing.predicate(verdict.to_dict(), labels, signing.now(),
                                                        verdict.started or None))
    envelope = signing.sign(doc, key)
    return keep(root, verdict.image_id, envelope, copy_to), envelope


def kept(root: Path, image_id: str) -> list[Path]:
    where = folder(root, image_id)
    return sorted(where.glob("*.dsse.json")) if where.is_dir() else []


@dataclass(frozen=True, slots=True)
class Accepted:
    """The signed verdict that let an image through, where it came from, and the policy's decision."""

    source: str
    key_id: str
    key_name: str
    report: dict[str, Any]
    decision: decide.Decision

    @property
    def gpu_verified(self) -> bool:
        return self.report.get("gpu_verified") is True

    @property
    def signed_at(self) -> str:
        return str(self.report.get("signed_at", ""))

    @property
    def not_run(self) -> list[str]:
        """The checks the policy counts that the accepted run skipped or never ran, whatever its GPU said."""
        return not_run(self.decision)


def not_run(decision: decide.Decision) -> list[str]:
    """The checks ``decision``'s policy counts that its accepted run skipped or never ran."""
    statuses = decision.accepted.facts.statuses
    return [name for name in sorted(decision.policy.checks) if statuses.get(name, "skip") == "skip"]


def require_given_verify(paths: Sequence[Path], keys: Sequence[signing.PublicKey]) -> None:
    """Every signed verdict given on the command line must verify with one of ``keys``: one that does not is an
    error naming it (tampered: 23; signed with another key: 22), never skipped for the journal's own passes
    and never attached."""
    for path in paths:
        signing.open_with_any(read_envelope(path), keys, str(path))


def judge(candidates: Sequence[tuple[str, bytes]], digests: set[str], image: str, keys: Sequence[signing.PublicKey],
          rules: policy.Policy, now: dt.datetime | None = None) -> Accepted:
    """The signed verdict about the image that answers ``rules`` (:func:`.decide.decide`), if it meets them.

    ``candidates``: (where it came from, envelope bytes), every one found.
    With none: AttestationMissing. When none verifies with the keys and
    names the image, the refusal of the one that got furthest. The same
    statement found twice (in the registry and given as a file) counts once.
    """
    rules.requirements()  # an empty policy is refused before anything is read
    if not candidates:
        raise AttestationMissing(f"{image}: no signed verdict found", hint="smoke it with --sign-key, then push it")
    refusal: tuple[int, PipelineError] | None = None
    about: dict[str, tuple[str, signing.Attested]] = {}
    for where, data in candidates:
        stage = 0
        try:
            found = signing.open_with_any(data, keys, where)
            stage = 1
            signing.require_subject(found, digests, image, where)
        except AttestationError as exc:
            if refusal is None or stage > refusal[0]:
                refusal = (stage, exc)
            continue
        about.setdefault(json.dumps(found.statement, sort_keys=True), (where, found))
    if not about:
        assert refusal is not None
        raise refusal[1]
    decision = decide.decide([decide.found(where, f) for where, f in about.values()], rules, image, now)
    chosen = decision.accepted
    assert chosen.attested is not None  # every candidate here verified with a key
    return Accepted(chosen.where, chosen.attested.key_id, chosen.attested.key_name, chosen.attested.predicate,
                    decision)


# A DSSE envelope of a smoke report is tens of kilobytes; a file far larger is not one.
MAX_ENVELOPE = 16 * 1024 * 1024


def read_envelope(path: Path) -> bytes:
    """The bytes of the signed verdict at ``path``: a regular file, read without waiting on it.

    A FIFO (or a device) given as --attestation would block the read until
    someone writes to it: it is refused instead, as is a file too large to be
    an envelope.
    """
    try:
        with opened_regular(path) as (fh, st):
            if st.st_size > MAX_ENVELOPE:
                raise AttestationError(f"the signed verdict {path} is {st.st_size} bytes, too large for an envelope")
            return fh.read(MAX_ENVELOPE + 1)
    except NotRegular:
        raise AttestationError(f"the signed verdict {path} is not a regular file (a FIFO, device or socket); "
                               "give the envelope's file") from None
    except OSError as exc:
        raise AttestationError(f"cannot read the signed verdict {path}: {exc.strerror or exc}") from None


def named_images(data: bytes) -> set[str] | None:
    """The image IDs an envelope's statement names as its subjects (unverified); None if it is no envelope."""
    try:
        envelope = json.loads(data)
        doc = json.loads(base64.b64decode(envelope["payload"]))
        return {f"sha256:{s['digest']['sha256']}" for s in doc["subject"]}
    except (ValueError, KeyError, TypeError):
        return None


def claimed_status(data: bytes) -> str | None:
    """The status an envelope's verdict says (``pass``, ``fail``...), unverified; None if it says none.

    Only to ask the user before something is replaced, never to let anything through.
    """
    try:
        envelope = json.loads(data)
        doc = json.loads(base64.b64decode(envelope["payload"]))
        status = doc["predicate"]["status"]
    except (ValueError, KeyError, TypeError):
        return None
    return status if isinstance(status, str) else None


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


def files(paths: Iterable[Path]) -> list[tuple[str, bytes]]:
    """Signed verdict files as candidates; AttestationError naming one that cannot be read (or is no file)."""
    return [(str(path), read_envelope(path)) for path in paths]


def local_candidates(root: Path, image_id: str, given: Sequence[Path] = ()) -> list[tuple[str, bytes]]:
    """The envelopes given on the command line and every one the journal keeps for the image."""
    return files(dict.fromkeys([*given, *kept(root, image_id)]))


def attach_and_read_back(engine: Engine, image: str, envelope: bytes) -> bytes:
    """Attach ``envelope`` to ``image`` (NAME@sha256:...) in its registry, and return it as read back from there."""
    client, path, manifest = registry.look_up(engine, image)
    host, digest = client.host, image.partition("@")[2]
    if manifest is None:
        raise AttestationMissing(f"registry {host} has no {path}@{digest} to attach the signed verdict to")
    subject = referrers.Subject(manifest.digest, manifest.media_type, manifest.size)
    artifact = referrers.attach(client, path, subject, envelope)
    for found, data in referrers.envelopes(client, path, manifest.digest):
        if found == artifact:
            return data
    raise AttestationMissing(f"registry {host}: the signed verdict {artifact[:19]} attached to {path}@{digest} "
                             "is not listed among its referrers")


def registry_candidates(client: registry.Client, path: str, digest: str) -> list[tuple[str, bytes]]:
    """Every signed verdict the registry keeps beside ``path@digest``, named for messages."""
    where = f"{path}@{digest}"
    return [(f"{where} (signed verdict {d[:19]})", data) for d, data in referrers.envelopes(client, path, digest)]


def _missing_tag_hint(client: registry.Client, path: str) -> str:
    """What to verify instead of a tag the registry lacks: the repository's tags, or that it has none."""
    where = f"{client.host}/{path}"
    tags = sorted(t for t in referrers.tags(client, path) if not t.startswith("sha256-"))  # not verdicts' own
    if not tags:
        return (f"the registry has no image under {where}: give the reference push printed "
                "(HOST[:PORT]/PATH/NAME:TAG)")
    shown = ", ".join(tags[:5]) + (f" and {len(tags) - 5} more" if len(tags) > 5 else "")
    return f"{where} has the tags {shown} (`python build.py list --registry {where}` shows their builds)"


def verify(engine: Engine, ref: str, keys: Sequence[signing.PublicKey], rules: policy.Policy, *,
           given: Sequence[Path] = ()) -> tuple[str, Accepted]:
    """Judge every signed verdict of ``ref`` (its registry's, and ``given``); return (manifest digest, accepted).

    An index is judged per platform: each platform's image must pass.
    """
    client, path, manifest = registry.look_up(engine, ref)
    host, tag = client.host, split_reference(ref)[1]
    if manifest is None:
        raise AttestationMissing(f"registry {host} has no {path}:{tag}", hint=_missing_tag_hint(client, path))
    images = [manifest]
    if manifest.is_index:
        images = []
        for child in registry.children(manifest):
            found = client.manifest(path, child.digest)
            if found is None:
                # Each platform's image must pass: one the registry lacks cannot, and is never skipped.
                raise AttestationMissing(f"{ref} is an index whose {child.os}/{child.architecture} image "
                                         f"{child.digest[:19]} its registry {host} does not hold")
            images.append(found)
        if not images:
            raise AttestationMissing(f"{ref} is an index over no image")
    require_given_verify(given, keys)
    extra = files(given)
    accepted: Accepted | None = None
    for image in images:
        digests = {image.digest}
        config = (image.json().get("config") or {}).get("digest")
        if isinstance(config, str):
            digests.add(config)
        accepted = judge(registry_candidates(client, path, image.digest) + extra, digests,
                         f"{ref} ({image.digest[:19]})", keys, rules)
    if accepted is None:
        raise AttestationMissing(f"{ref}: no image to judge")
    return manifest.digest, accepted


def check(engine: Callable[[], Engine], ref: str, key_sources: Sequence[str], rules: policy.Policy,
          given: Sequence[Path] = ()) -> tuple[str, Accepted]:
    """What ``verify`` does: (the digest judged, the accepted verdict) of ``ref``, an image in a registry (its
    verdicts there and ``given``), or an image ID with ``given`` alone. A registry that cannot be read is a
    PushError (the registry's fault): nothing was judged, so nothing was refused."""
    import re

    public = signing.load_public_keys(key_sources)
    if re.fullmatch(r"sha256:[0-9a-f]{64}", ref):
        if not given:
            raise UsageError(f"verify {ref}: an image ID has no registry to read from; give --attestation FILE")
        require_given_verify(given, public)
        return ref, judge(files(given), {ref}, ref, public, rules)
    if ref.startswith("sha256:") or not _in_a_registry(ref):
        raise UsageError(f"verify {ref!r}: REF must be HOST[:PORT]/PATH:TAG in a registry, or with --attestation "
                         "the image's ID (sha256:<64 hex>)")
    try:
        return verify(engine(), ref, public, rules, given=given)
    except PushError as exc:
        # The registry could not be read (down, no login, an error answered): a registry's fault, 8 as for push;
        # nothing was judged, so never the policy's refusal (24).
        raise PushError(f"verify {ref}: cannot read its signed verdicts: {exc}", hint=exc.hint) from exc


def _in_a_registry(ref: str) -> bool:
    try:
        registry.split_repo(split_reference(ref)[0])
    except PushError:
        return False
    return True
