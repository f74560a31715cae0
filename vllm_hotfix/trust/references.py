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

Nothing here reads the reference itself: callers pass its path, its
content digest and what the predicate names, so this module stays below the
checking code that loads references.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import (
    AttestationError,
    AttestationMismatch,
    AttestationMissing,
    AttestationWrongKey,
    NotRegular,
)
from ..journal.atomic import opened_regular, write_atomic
from . import signing

# A signed reference is a small statement (the answers stay in their own file); a file far larger is not one.
MAX_ENVELOPE = 1024 * 1024


def envelope_path(reference: Path) -> Path:
    """Where the signed envelope of the reference at ``reference`` lives: beside it, ``NAME.dsse.json``."""
    return reference.with_name(f"{reference.stem}.dsse.json")


@dataclass(frozen=True, slots=True)
class Signature:
    """What the host found of a reference's signature: ``state`` is ``signed`` (verified with the site key),
    ``accepted`` (none, or another key's, let through by ``--accept-unsigned-reference``: ``why`` says which)
    or ``unchecked`` (no key was given to check it with)."""

    state: str
    key_id: str = ""
    envelope: str = ""
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"state": self.state, "key_id": self.key_id, "envelope": self.envelope, "why": self.why}

    def words(self) -> str:
        """The signature as the verdict says it."""
        if self.state == "signed":
            return f"signed with the site key {self.key_id[:12]} ({self.envelope})"
        if self.state == "accepted":
            return f"{self.why}: accepted by --accept-unsigned-reference"
        return "its signature not checked (no --sign-key)"


UNCHECKED = Signature("unchecked")


def sign(reference: Path, sha256: str, predicate: Mapping[str, Any], key_source: str) -> Signature:
    """Sign the reference at ``reference`` (content digest ``sha256``) with the key at ``key_source``, now; the
    envelope is written beside it. ``predicate``: what the host knows of the recording (image, settings)."""
    key = signing.load_private_key(key_source)
    statement = {
        "_type": signing.STATEMENT_TYPE,
        "subject": [{"name": reference.name, "digest": {"sha256": sha256}}],
        "predicateType": signing.REFERENCE_PREDICATE_TYPE,
        "predicate": {**dict(predicate), "signed_at": signing.now()},
    }
    out = envelope_path(reference)
    write_atomic(out, signing.sign(statement, key), error=AttestationError)
    return Signature("signed", signing.key_id(key.public_key()), str(out))


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


def check(reference: Path, sha256: str, key_source: str, *, accept_unsigned: bool = False) -> Signature:
    """The reference's signature checked with the public half of the key at ``key_source``.

    No envelope beside it: AttestationMissing; one made with another key:
    AttestationWrongKey; either one is a :class:`Signature` ``accepted``
    instead where ``accept_unsigned``. One that does not verify
    (AttestationTampered) or vouches for other content (AttestationMismatch)
    is refused whatever the flag: that is no missing signature but a wrong one.
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
    return Signature("signed", found.key_id, str(where))
