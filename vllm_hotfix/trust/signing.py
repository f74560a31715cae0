"""Signed verdicts: an in-toto Statement about an image, in a DSSE envelope.

The one place that builds what is signed: the predicate (the smoke report as
the host judged it, what the image says it was made from, and the time it
was signed), the subjects, the statement and DSSE's pre-authentication
encoding. A smoke run's report becomes the predicate of an in-toto Statement
v1 whose subject is the image (its config digest, which is the engine's image
ID, and its manifest digest where a registry gave it one). The statement is
signed with an ECDSA P-256 key (the key type cosign makes) in a DSSE
envelope, so that any DSSE implementation can check it, not only this one.

Only the host that started the runner signs, after judging its report:
nothing here runs inside the image under test. Keys come from a PEM file (a
private one readable by its owner alone, as ssh demands) or from an
environment variable (``env:NAME``), and never appear in messages or logs.
Public keys may be several: files, or folders of PEM files.
"""

from __future__ import annotations

import base64
import datetime as dt
import hashlib
import json
import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from .. import __version__
from ..engine import labels as L
from ..errors import AttestationError, AttestationMismatch, AttestationTampered, AttestationWrongKey, NotRegular
from ..journal.atomic import opened_regular
from ..verdicts import IDENTITY

PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "urn:vllm-hotfix:smoke-report:v1"
# Reference answers a site recorded from a trusted image (:mod:`.references`): signed by the same key, never
# taken for a smoke verdict (nor a verdict for them), since each is opened only as its own predicate type.
REFERENCE_PREDICATE_TYPE = "urn:vllm-hotfix:reference-answers:v1"
ENVELOPE_MEDIA_TYPE = "application/vnd.dsse.envelope.v1+json"
# The password of an encrypted PEM private key, when it has one.
PASSWORD_ENV = "VLLM_HOTFIX_SIGN_KEY_PASSWORD"


def _read_pem(source: str, what: str) -> tuple[bytes, str]:
    """The PEM bytes behind ``source`` (a path, or ``env:NAME``) and a name for messages."""
    if source.startswith("env:"):
        name = source.removeprefix("env:")
        value = os.environ.get(name)
        if not value:
            raise AttestationError(f"{what} ${name}: the variable is not set or empty")
        return value.encode(), f"${name}"
    try:
        with opened_regular(source) as (fh, _st):
            return fh.read(), source
    except NotRegular:
        # A FIFO or a device would be read until its writer closes it: never, for a key.
        raise AttestationError(f"{what} {source}: not a regular file") from None
    except OSError as exc:
        raise AttestationError(f"{what} {source}: cannot read it ({exc.strerror or exc})") from None


def _private_enough(source: str) -> None:
    """AttestationError when the key file may be read by others than its owner (as ssh refuses such a key)."""
    if source.startswith("env:"):
        return
    try:
        st = os.stat(source)
    except OSError:
        return  # _read_pem names why it cannot be read
    mode = stat.S_IMODE(st.st_mode)
    if stat.S_ISREG(st.st_mode) and st.st_uid != os.getuid():
        # As ssh and gpg: a key another user owns is theirs to change, whatever its mode.
        raise AttestationError(f"signing key {source}: owned by user {st.st_uid}, not by this user "
                               f"({os.getuid()}); a private key must be its user's own",
                               hint="copy it to a file of your own with mode 600")
    if mode & 0o077:
        raise AttestationError(f"signing key {source}: others may read it (mode {mode:04o}); a private key "
                               f"must be readable by its owner alone", hint=f"chmod 600 {source}")


def _not_public(source: str, data: bytes | None = None) -> None:
    """AttestationError when ``source``, given as a signing key, holds a public key."""
    if data is None:
        try:
            data, _name = _read_pem(source, "signing key")
        except AttestationError:
            return
    try:
        serialization.load_pem_public_key(data)
    except ValueError:
        return
    raise AttestationError(f"signing key {source}: it is a public key; signing takes the private key",
                           hint="give the private key (mode 600) here; the public key is for verify --key")


def load_private_key(source: str) -> ec.EllipticCurvePrivateKey:
    """An ECDSA P-256 private key from a PEM file (mode 0600 or stricter) or ``env:NAME``."""
    try:
        _private_enough(source)
    except AttestationError:
        # A public key's mode is as it should be for a public key: said as the mode's refusal, its chmod would
        # send the user the wrong way.
        _not_public(source)
        raise
    data, name = _read_pem(source, "signing key")
    _not_public(name, data)
    password = os.environ.get(PASSWORD_ENV)
    try:
        key = serialization.load_pem_private_key(data, password.encode() if password else None)
    except TypeError:
        raise AttestationError(f"signing key {name}: it is encrypted; put its password in ${PASSWORD_ENV}") \
            from None
    except ValueError:
        raise AttestationError(f"signing key {name}: not a PEM private key (or a wrong password)") from None
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise AttestationError(f"signing key {name}: not an ECDSA P-256 key")
    return key


def load_public_key(source: str) -> ec.EllipticCurvePublicKey:
    """An ECDSA P-256 public key from a PEM file or ``env:NAME``."""
    data, name = _read_pem(source, "public key")
    try:
        key = serialization.load_pem_public_key(data)
    except ValueError:
        raise AttestationError(f"public key {name}: not a PEM public key") from None
    if not isinstance(key, ec.EllipticCurvePublicKey) or not isinstance(key.curve, ec.SECP256R1):
        raise AttestationError(f"public key {name}: not an ECDSA P-256 key")
    return key


@dataclass(frozen=True, slots=True)
class PublicKey:
    """A public key a signed verdict may be made with, and the file (or variable) it came from."""

    name: str
    key: ec.EllipticCurvePublicKey

    @property
    def id(self) -> str:
        return key_id(self.key)


PUBLIC_KEY_SUFFIXES = (".pem", ".pub")


def load_public_keys(sources: Sequence[str]) -> list[PublicKey]:
    """Every public key of ``sources``: PEM files, ``env:NAME``, or folders of ``*.pem``/``*.pub`` files."""
    found: list[PublicKey] = []
    for source in sources:
        folder = Path(source)
        if not source.startswith("env:") and folder.is_dir():
            files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in PUBLIC_KEY_SUFFIXES)
            if not files:
                raise AttestationError(f"public keys {source}: the folder holds no *.pem or *.pub file")
            found += [PublicKey(str(p), load_public_key(str(p))) for p in files]
        else:
            found.append(PublicKey(source, load_public_key(source)))
    if not found:
        raise AttestationError("no public key given")
    return found


def key_id(public: ec.EllipticCurvePublicKey) -> str:
    """The SHA-256 of the key's DER SubjectPublicKeyInfo: names the key without showing it."""
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def pae(payload_type: str, payload: bytes) -> bytes:
    """DSSE's pre-authentication encoding: what the signature covers."""
    kind = payload_type.encode()
    return b"DSSEv1 %d %b %d %b" % (len(kind), kind, len(payload), payload)


def now() -> str:
    """The signing time as the predicate carries it: UTC, to the microsecond (so that two runs rarely tie)."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def signed_time(predicate: Mapping[str, Any], key: str = "signed_at") -> dt.datetime | None:
    """When a statement says it was signed (``signed_at``, or another ``key``: ``run_at``); None when it does not
    say, or says it badly."""
    text = predicate.get(key)
    if not isinstance(text, str):
        return None
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        return None
    return when if when.tzinfo is not None else None


def _identity(report: Mapping[str, Any]) -> tuple[object, Mapping[str, Any]]:
    """The status and data of the host's layer-identity check in ``report`` (None and empty where it has none)."""
    identity = next((c for c in report.get("checks") or [] if isinstance(c, Mapping) and c.get("name") == IDENTITY),
                    None)
    data = identity.get("data") if identity is not None else None
    return (identity.get("status") if identity is not None else None), (data if isinstance(data, Mapping) else {})


def proved(report: Mapping[str, Any]) -> dict[str, Any]:
    """What the host proved about the image, from its own layer-identity check of ``report``.

    The patch set and its patches only where the check passed (the image is
    that definition's product on that base); the base wherever the host found
    one. Nothing here comes from the image's labels. The definition is
    :func:`judged_against`'s, named for a fail too.
    """
    status, data = _identity(report)
    digests = [str(d) for d in data.get("base_digests") or [] if isinstance(d, str)]
    base = {"id": str(data.get("base_id") or ""), "name": str(data.get("base_ref") or ""), "digests": digests}
    if status not in ("pass", "skip"):
        return {"patch_set": {}, "patches": {}, "base": base}
    patches = data.get("patches")
    patch_set = {"name": str(data.get("patch_set") or ""), "digest": str(data.get("patch_set_digest") or "")} \
        if status == "pass" else {}
    return {"patch_set": patch_set, "patches": dict(patches) if isinstance(patches, Mapping) else {}, "base": base}


def judged_against(report: Mapping[str, Any]) -> dict[str, str]:
    """What the run judged the image against, whatever it concluded (a fail too): the definition and its patch
    set's digest as the host's own layer-identity check of ``report`` named them ("" where it found none, as
    where no definition was named). A fail of one definition then says which, so that it is never taken for a
    fail of another; that the image IS that definition's product is proved only where the check passed."""
    _status, data = _identity(report)
    return {"definition": str(data.get("definition") or ""),
            "patch_set_digest": str(data.get("patch_set_digest") or "")}


def scope(report: Mapping[str, Any]) -> dict[str, Any]:
    """What a run covered: the checks that ran to a pass or a fail, those skipped, the reference its answers
    were judged against (its sha256), and whether its GPU checks verified the image."""
    checks = [c for c in report.get("checks") or [] if isinstance(c, Mapping)]
    sweep = report.get("sweep")
    reference = sweep.get("reference") if isinstance(sweep, Mapping) else None
    return {"ran": sorted({str(c.get("name")) for c in checks if c.get("status") in ("pass", "fail")}),
            "skipped": sorted({str(c.get("name")) for c in checks if c.get("status") == "skip"}),
            "reference": str(reference.get("sha256") or "") if isinstance(reference, Mapping) else "",
            "gpu_verified": report.get("gpu_verified") is True}


def claimed(labels: Mapping[str, str]) -> dict[str, Any]:
    """What the image's labels say it was made from: kept apart, under ``claimed``, for a person to read; no
    policy reads it (a label is data the image chose)."""
    try:
        patches = json.loads(labels.get(L.PATCHES, "{}"))
    except ValueError:
        patches = {}
    return {"definition": labels.get(L.DEFINITION, ""), "patches": patches if isinstance(patches, dict) else {},
            "base": {"id": labels.get(L.BASE_ID, ""), "name": labels.get(L.OCI_BASE_NAME, ""),
                     "digest": labels.get(L.OCI_BASE_DIGEST, "")},
            "tool_version": labels.get(L.TOOL_VERSION, "")}


def predicate(report: Mapping[str, Any], labels: Mapping[str, str], signed_at: str,
              run_at: str | None = None) -> dict[str, Any]:
    """The host's judged smoke report, what the host proved the image to be (:func:`proved`), what it judged the
    image against (:func:`judged_against`: ``definition`` and ``patch_set_digest``, a fail's too), what the run
    covered (:func:`scope`), when it was signed and when the run it judged was made (``run_at``: a Job's
    emission, collected later, is that run's time); the image's labels only under ``claimed``."""
    return {
        **report,
        "tool_version": __version__,
        **proved(report),
        **judged_against(report),
        "scope": scope(report),
        "claimed": claimed(labels),
        "signed_at": signed_at,
        **({"run_at": run_at} if run_at else {}),
    }


def subjects(image_ref: str, image_id: str, repo_digests: Iterable[str] = ()) -> dict[str, str]:
    """The image by config digest (its ID), and by manifest digest wherever a registry gave it one."""
    found = {image_ref: image_id}
    for repo_digest in repo_digests:
        name, _, digest = repo_digest.partition("@")
        if digest.startswith("sha256:"):
            found[name] = digest
    return found


def statement(subjects: Mapping[str, str], predicate: Mapping[str, Any]) -> dict[str, Any]:
    """An in-toto Statement v1: ``subjects`` maps a name (an image reference) to a ``sha256:`` digest."""
    return {
        "_type": STATEMENT_TYPE,
        "subject": [{"name": name, "digest": {"sha256": digest.removeprefix("sha256:")}}
                    for name, digest in subjects.items()],
        "predicateType": PREDICATE_TYPE,
        "predicate": dict(predicate),
    }


def sign(doc: Mapping[str, Any], key: ec.EllipticCurvePrivateKey) -> bytes:
    """The DSSE envelope (JSON bytes) of ``doc`` signed with ``key``."""
    payload = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    signature = key.sign(pae(PAYLOAD_TYPE, payload), ec.ECDSA(hashes.SHA256()))
    envelope = {
        "payloadType": PAYLOAD_TYPE,
        "payload": base64.b64encode(payload).decode(),
        "signatures": [{"keyid": key_id(key.public_key()), "sig": base64.b64encode(signature).decode()}],
    }
    return json.dumps(envelope, indent=2).encode() + b"\n"


@dataclass(frozen=True, slots=True)
class Attested:
    """A statement whose envelope verified with the given key (``key_name``: where that key came from)."""

    statement: dict[str, Any]
    key_id: str
    key_name: str = ""

    @property
    def digests(self) -> set[str]:
        return {f"sha256:{s.get('digest', {}).get('sha256', '')}" for s in self.statement.get("subject") or []
                if isinstance(s, dict)}

    @property
    def predicate(self) -> dict[str, Any]:
        found = self.statement.get("predicate")
        return found if isinstance(found, dict) else {}


class _NoMatch(AttestationTampered):
    """A signature that claims the key (or names none) and does not verify with it."""


# What to do about a verdict signed with a key not given.
WRONG_KEY_HINT = ("give the public key of the key that signed it (--key again, or put it in the keys folder), or "
                  "smoke the image again with --sign-key of a key given here")


def open_envelope(data: bytes, public: ec.EllipticCurvePublicKey, where: str,
                  predicate_type: str = PREDICATE_TYPE) -> Attested:
    """Verify a DSSE envelope with ``public`` and return its statement (of ``predicate_type``).

    AttestationWrongKey: no signature was made with this key;
    AttestationTampered: one claims this key but does not verify, or the
    envelope or statement is malformed. ``where`` names it in messages.
    """
    try:
        envelope = json.loads(data)
        payload_type = envelope["payloadType"]
        payload = base64.b64decode(envelope["payload"], validate=True)
        signatures = [(s.get("keyid", ""), base64.b64decode(s["sig"], validate=True))
                      for s in envelope["signatures"]]
    except (ValueError, KeyError, TypeError, AttributeError):
        raise AttestationTampered(f"{where}: not a DSSE envelope") from None
    if payload_type != PAYLOAD_TYPE:
        raise AttestationTampered(f"{where}: payload type {payload_type!r}, not an in-toto statement")
    ours = key_id(public)
    tried = [sig for kid, sig in signatures if kid in ("", ours)]
    if not tried:
        raise AttestationWrongKey(f"{where}: signed with another key (key IDs "
                                  f"{', '.join(k[:12] for k, _ in signatures) or 'none'}; this key is {ours[:12]})",
                                  hint=WRONG_KEY_HINT)
    for sig in tried:
        try:
            public.verify(sig, pae(payload_type, payload), ec.ECDSA(hashes.SHA256()))
            break
        except InvalidSignature:
            continue
    else:
        raise _NoMatch(f"{where}: the signature does not match its content (tampered, or signed with another key)")
    try:
        doc = json.loads(payload)
    except ValueError:
        raise AttestationTampered(f"{where}: the signed payload is not JSON") from None
    if not isinstance(doc, dict) or doc.get("_type") != STATEMENT_TYPE or doc.get("predicateType") != predicate_type:
        what = "reference-answers" if predicate_type == REFERENCE_PREDICATE_TYPE else "smoke-report"
        raise AttestationTampered(f"{where}: not a {what} statement")
    return Attested(doc, ours)


def open_with_any(data: bytes, keys: Sequence[PublicKey], where: str,
                  predicate_type: str = PREDICATE_TYPE) -> Attested:
    """Verify a DSSE envelope with whichever of ``keys`` signed it; else the closest refusal.

    A signature that claims one of the keys but does not verify with it
    (tampered) outranks "signed with another key"; a malformed envelope is
    refused whatever the key.
    """
    refusal: AttestationError | None = None
    for public in keys:
        try:
            found = open_envelope(data, public.key, where, predicate_type)
        except _NoMatch as exc:
            refusal = exc
            continue
        except AttestationWrongKey as exc:
            refusal = refusal or exc
            continue
        return Attested(found.statement, found.key_id, public.name)
    if isinstance(refusal, AttestationWrongKey) and len(keys) > 1:
        try:
            ids = [str(sig.get("keyid", ""))[:12] for sig in json.loads(data)["signatures"]]
        except (ValueError, KeyError, TypeError, AttributeError):
            ids = []
        raise AttestationWrongKey(f"{where}: signed with another key (key IDs {', '.join(ids) or 'none'}; the "
                                  f"{len(keys)} keys given are {', '.join(k.id[:12] for k in keys)})",
                                  hint=WRONG_KEY_HINT)
    if refusal is None:
        raise AttestationError("no public key given")
    raise refusal


def require_subject(found: Attested, digests: Iterable[str], image: str, where: str) -> None:
    """AttestationMismatch unless the statement names one of ``digests`` (the image's)."""
    wanted = set(digests)
    if not found.digests & wanted:
        raise AttestationMismatch(f"{where}: its subject ({', '.join(sorted(found.digests)) or 'none'}) is "
                                  f"another image than {image} ({', '.join(sorted(wanted))})",
                                  hint="a verdict holds for the exact image it names: smoke this image with "
                                       "--sign-key (or give the verdict that names it)")

