"""Signed reference answers: the site's key vouches for the answers a run is judged against.

A reference file carries the sha256 of its own content, which shows a file
changed by accident, not one replaced on purpose: anyone can record answers
from a wrong image and write a file that checks. So ``smoke
--record-reference FILE --sign-key KEY`` signs, here on the host that
recorded it, an in-toto statement whose subject is the file's content
digest and whose predicate names the image it was recorded from (its config
digest, the host's fact) and the settings it was recorded under, in a DSSE
envelope beside the file (:func:`envelope_path`), with the same key and
machinery as smoke verdicts (:mod:`.signing`; a separate predicate type, so
neither is ever taken for the other). ``smoke --reference FILE --sign-key
KEY`` checks it before anything runs (:func:`check`): an envelope missing or
made with another key is refused unless the run accepts it explicitly (and
the verdict then says so); one that does not verify, or vouches for other
content, is always refused.

Answers are only as good as the run that recorded them: a reference is
written and signed only from a recording whose verdict passed, with its
``golden`` check passed (the golden forward judged the trusted image's
replies, not skipped) and its GPU checks, the patch set's among them,
verified (:func:`unfit`). The signed reference names that verdict's signed
envelope by its sha256 (``recording_verdict``), and a copy of it is kept
beside the reference (:func:`verdict_path`) as in the journal; ``smoke
--reference`` finds it there or in this host's journal, checks it with the
same key, and refuses a reference whose recording verdict it cannot find
(unless accepted, as a missing signature is) or that did not pass (always).

Nothing here reads the reference itself: callers pass its path, its
content digest and what the predicate names, so this module stays below the
checking code that loads references.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.hazmat.primitives.asymmetric import ec

from ..errors import (
    AttestationError,
    AttestationMismatch,
    AttestationMissing,
    AttestationTampered,
    AttestationWrongKey,
    Malformed,
    NotRegular,
)
from ..journal.atomic import opened_regular, write_atomic
from ..verdicts import Status, Verdict
from . import signing

# A signed reference is a small statement (the answers stay in their own file); a file far larger is not one.
MAX_ENVELOPE = 1024 * 1024


def envelope_path(reference: Path) -> Path:
    """Where the signed envelope of the reference at ``reference`` lives: beside it, ``NAME.dsse.json``."""
    return reference.with_name(f"{reference.stem}.dsse.json")


def verdict_path(reference: Path) -> Path:
    """Where the recording run's signed verdict is kept beside the reference at ``reference``:
    ``NAME.verdict.dsse.json`` (the same bytes as the journal's copy, so the pair travels to another host)."""
    return reference.with_name(f"{reference.stem}.verdict.dsse.json")


GOLDEN = "golden"  # the golden forward's check (vllm_hotfix.golden.judge.CHECK), which a recording must pass


def unfit(verdict: Verdict) -> str | None:
    """Why the answers of the recording run ``verdict`` judged may not become a reference (None: they may): its
    verdict must be a pass, its ``golden`` check passed (not skipped: the golden forward judged the trusted
    image's replies) and its GPU checks, the patch set's among them, verified. A recording that failed, or that
    no GPU and no golden vouched for, would judge every later image by answers nobody checked."""
    if verdict.status is not Status.PASS:
        why = ", ".join(verdict.failed) if verdict.status is Status.FAIL else "; ".join(verdict.incomplete)
        return f"the recording run is a {verdict.status.value}" + (f" ({why})" if why else "")
    golden = next((c for c in verdict.checks if c.name == GOLDEN), None)
    if golden is None or golden.status is not Status.PASS:
        said = f"{golden.status.value}: {' '.join(golden.detail.split())[:200]}" if golden is not None else \
            "not run"
        return f"its golden check did not pass ({said}); answers are kept only where the golden judged them"
    if not verdict.gpu_verified:
        why = str(verdict.gpu.get("why_unverified") or "")
        return "the recording run is not GPU-verified" + (f" ({why[:200]})" if why else "") + \
            "; answers are kept only from a run whose GPU checks, the patch set's among them, passed"
    return None


@dataclass(frozen=True, slots=True)
class Signature:
    """What the host found of a reference's signature: ``state`` is ``signed`` (verified with the site key),
    ``accepted`` (none, or another key's, let through by ``--accept-unsigned-reference``: ``why`` says which)
    or ``unchecked`` (no key was given to check it with)."""

    state: str
    key_id: str = ""
    envelope: str = ""
    why: str = ""
    recording: str = ""  # sha256:... of the passing recording run's signed verdict the signature names

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "key_id": self.key_id, "envelope": self.envelope, "why": self.why,
                **({"recording_verdict": self.recording} if self.recording else {})}

    def words(self) -> str:
        """The signature as the verdict says it."""
        if self.state == "signed":
            made = f", recorded by a passing run (its signed verdict {self.recording[:19]})" if self.recording else ""
            return f"signed with the site key {self.key_id[:12]} ({self.envelope}){made}"
        if self.state == "accepted":
            return f"{self.why}: accepted by --accept-unsigned-reference"
        return "its signature not checked (no --sign-key)"


UNCHECKED = Signature("unchecked")


def planned(reference: Path, key_source: str) -> Signature:
    """The signature :func:`sign` will make of the reference at ``reference`` with the key at ``key_source``, as
    the recording run's verdict names it before that verdict is signed (the signed reference names the verdict)."""
    return Signature("signed", signing.key_id(signing.load_private_key(key_source).public_key()),
                     str(envelope_path(reference)))


def sign(reference: Path, sha256: str, predicate: Mapping[str, Any], key_source: str,
         recording: bytes | None = None) -> Signature:
    """Sign the reference at ``reference`` (content digest ``sha256``) with the key at ``key_source``, now; the
    envelope is written beside it. ``predicate``: what the host knows of the recording (image, settings);
    ``recording``: the recording run's signed verdict (its envelope), named by its sha256 in the predicate and
    kept beside the reference (:func:`verdict_path`)."""
    key = signing.load_private_key(key_source)
    named = {"recording_verdict": f"sha256:{hashlib.sha256(recording).hexdigest()}"} if recording is not None else {}
    statement = {
        "_type": signing.STATEMENT_TYPE,
        "subject": [{"name": reference.name, "digest": {"sha256": sha256}}],
        "predicateType": signing.REFERENCE_PREDICATE_TYPE,
        "predicate": {**dict(predicate), **named, "signed_at": signing.now()},
    }
    if recording is not None:
        write_atomic(verdict_path(reference), recording, error=AttestationError)
    out = envelope_path(reference)
    write_atomic(out, signing.sign(statement, key), error=AttestationError)
    return Signature("signed", signing.key_id(key.public_key()), str(out), recording=named.get("recording_verdict", ""))


def _read(path: Path) -> bytes | None:
    """The envelope's bytes; None where there is no file."""
    try:
        with opened_regular(path) as (fh, st):
            if st.st_size > MAX_ENVELOPE:
                raise AttestationError(f"the signed reference {path} is {st.st_size} bytes, too large for one")
            data: bytes = fh.read(MAX_ENVELOPE + 1)
            return data
    except FileNotFoundError:
        return None
    except NotRegular:
        raise AttestationError(f"the signed reference {path} is not a regular file (a FIFO, device or socket)") \
            from None
    except OSError as exc:
        raise AttestationError(f"cannot read the signed reference {path}: {exc.strerror or exc}") from None


def check(reference: Path, sha256: str, key_source: str, *, accept_unsigned: bool = False,
          journal: Sequence[Path] = ()) -> Signature:
    """The reference's signature checked with the public half of the key at ``key_source``, and the recording
    run's verdict it names (:func:`recording`; ``journal``: folders of this host's journal where it may be kept,
    as ``<sha256>.dsse.json``).

    No envelope beside it: AttestationMissing; one made with another key:
    AttestationWrongKey; a recording verdict named that cannot be found (or
    none named: signed by an earlier version): AttestationMissing; each one is
    a :class:`Signature` ``accepted`` instead where ``accept_unsigned``. One
    that does not verify (AttestationTampered), vouches for other content or
    names a recording run that did not pass (AttestationMismatch) is refused
    whatever the flag: that is no missing signature but a wrong one.
    """
    key = signing.load_private_key(key_source).public_key()
    where = envelope_path(reference)
    data = _read(where)
    if data is None:
        if accept_unsigned:
            return Signature("accepted", envelope=str(where), why=f"not signed (no {where.name} beside it)")
        raise AttestationMissing(f"--reference {reference}: not signed with the site key (no {where} beside it)",
                                 hint="record it with --record-reference FILE --sign-key KEY, or accept it "
                                      "unsigned with --accept-unsigned-reference (the verdict says so)")
    try:
        found = signing.open_envelope(data, key, str(where), signing.REFERENCE_PREDICATE_TYPE)
    except AttestationWrongKey as exc:
        if accept_unsigned:
            return Signature("accepted", envelope=str(where), why=f"signed with another key than the site's ({exc})")
        raise AttestationWrongKey(f"--reference {reference}: {exc}",
                                  hint="sign references with the site key, or accept this one with "
                                       "--accept-unsigned-reference (the verdict says so)") from None
    if f"sha256:{sha256}" not in found.digests:
        raise AttestationMismatch(f"--reference {reference}: {where} vouches for other content "
                                  f"({', '.join(sorted(found.digests)) or 'none'}), not this file's sha256:{sha256}")
    try:
        made = recording(reference, sha256, found, key, journal)
    except AttestationMissing as exc:
        if accept_unsigned:
            why = str(exc).removeprefix(f"--reference {reference}: ")
            return Signature("accepted", found.key_id, str(where), why=why)
        raise
    return Signature("signed", found.key_id, str(where), recording=made)


def recording(reference: Path, sha256: str, found: signing.Attested, key: ec.EllipticCurvePublicKey,
              journal: Sequence[Path]) -> str:
    """The digest of the recording run's signed verdict the signed reference ``found`` names, once found (beside
    the reference, else in ``journal``), verified with ``key`` and judged a passing recording (:func:`unfit`) of
    the image the reference names and of these answers. AttestationMissing where it names none or it cannot be
    found; AttestationMismatch where it did not pass or is about other answers."""
    where = f"--reference {reference}"
    named = found.predicate.get("recording_verdict")
    if not isinstance(named, str) or not named.startswith("sha256:") or len(named) != 71:
        raise AttestationMissing(f"{where}: its signature names no recording verdict (signed by an earlier "
                                 "version), so nothing shows the run that recorded it passed",
                                 hint="record it again with smoke --record-reference FILE --sign-key KEY on a GPU "
                                      "host, or accept it with --accept-unsigned-reference (the verdict says so)")
    places = [verdict_path(reference), *(folder / f"{named.removeprefix('sha256:')}.dsse.json" for folder in journal)]
    data = next((d for d in (_read(p) for p in places) if d is not None and
                 f"sha256:{hashlib.sha256(d).hexdigest()}" == named), None)
    if data is None:
        raise AttestationMissing(f"{where}: the verdict of the run that recorded it ({named[:19]}) is neither "
                                 f"beside it ({verdict_path(reference).name}) nor in this host's journal",
                                 hint=f"copy {verdict_path(reference).name} from the recording host beside it, or "
                                      "accept it with --accept-unsigned-reference (the verdict says so)")
    opened = signing.open_envelope(data, key, f"{where}: its recording verdict {named[:19]}")
    try:
        verdict = Verdict.from_dict(opened.predicate)
    except Malformed as exc:
        raise AttestationTampered(f"{where}: its recording verdict {named[:19]} is malformed: {exc}") from None
    recorded = (verdict.sweep or {}).get("recorded")
    said = found.predicate.get("image_id")
    if not isinstance(recorded, Mapping) or recorded.get("sha256") != sha256 or verdict.image_id != said:
        raise AttestationMismatch(f"{where}: its recording verdict {named[:19]} is of another recording (image "
                                  f"{verdict.image_id[:19]}, answers "
                                  f"{str(recorded.get('sha256') if isinstance(recorded, Mapping) else 'none')[:12]})")
    why = unfit(verdict)
    if why is not None:
        raise AttestationMismatch(f"{where}: recorded by a run that did not pass ({named[:19]}): {why}",
                                  hint="record the reference again from a trusted image on a GPU host, with the "
                                       "golden: only a passing recording gives answers to judge by")
    return named
