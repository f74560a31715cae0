"""The push gate: what lets an image be pushed, and the signed verdicts that travel with it.

One rule at every door (:func:`vllm_hotfix.trust.decide.decide`): of the
verdicts about the image, the newest that covers the verification policy must
meet it, and a fail of a check it counts blocks it, newer, or older and not
cleared by a later run of equal or wider scope. Without
``--require-attestation`` the journal's verdicts of this exact image ID are
judged, ordered by the journal's sequence (no unreadable entry that may be
about the image is skipped), against the default policy (the definition's
full smoke; :func:`gate`), GPU-bound checks loosened only under
``--allow-gpu-unverified``. With it, signed verdicts are judged
(:class:`Gate`): those given, those the journal keeps, those beside every
registry copy of the image this host knows and those already beside the
target; of those that verify with one of the keys
(:func:`vllm_hotfix.trust.attest.judge`; by default the same policy). Whichever let it through, every signed
verdict found for the image, pass and fail, is attached beside the pushed copy
(:mod:`vllm_hotfix.trust.travel`). The re-check of the image's files right
before the push answers here in the gate's words (:func:`landed_refusal`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..checking.launchers import facts
from ..engine import Engine, ImageInfo, registry_of
from ..errors import AttestationError, AttestationMismatch, CannotCheck, PipelineError, PushError
from ..journal import records
from ..registry import client as registry
from ..trust import attest, decide, policy_file, signing, travel
from ..trust.policy import Policy

log = logging.getLogger(__name__)


def gate(root: Path, image_id: str, image_ref: str, allow_gpu_unverified: bool) -> records.VerdictEntry:
    """The journal's verdict that lets this exact image ID through under the default policy, if one does.

    Ordered by the journal's own sequence, never by the clocks of the runs.
    A journal entry of any kind that may be about this image and cannot be
    read stops the gate with a RecordError naming the file: skipping it could
    let an older pass stand in for a newer fail.
    """
    records.require_readable(root, image_id, ("build", "tag", "push"))
    entries = records.verdicts(root, image_id)  # the verdict folder: checked the same way, read once
    judged = [e for e in entries if e.verdict.judged]
    if not judged:
        why = f" (its only smoke runs were incomplete: {entries[0].verdict.incomplete})" if entries else ""
        raise PushError(
            f"{image_ref} ({image_id[:19]}) has no passing smoke verdict{why}; refusing to push an untested image",
            hint=f"run: python build.py smoke {image_ref}",
        )
    rules = policy_file.build(flags=policy_file.Flags(allow_gpu_unverified=allow_gpu_unverified))
    by_name = {str(e.path): e for e in judged}
    found = [decide.journal_found(str(e.path), e.seq, e.created, e.verdict) for e in judged]
    what = f"{image_ref} ({image_id[:19]})"
    try:
        decision = decide.decide(found, rules, what)
    except (AttestationMismatch, CannotCheck) as exc:
        newest = judged[0]
        if not newest.verdict.passed:
            lead = f"{what} failed its newest smoke run ({newest.created}); refusing to push"
        elif not newest.verdict.gpu_verified and not allow_gpu_unverified:
            lead = f"{what} passed its newest smoke without GPU checks (GPU-unverified); refusing to push"
        else:
            lead = "refusing to push" if what in str(exc) else f"refusing to push {what}"
        hint = exc.hint or f"see {newest.path}"
        if not allow_gpu_unverified and "--allow-gpu-unverified" in hint:
            hint = "smoke-test it on a GPU host (with --serve-model and --reference), or pass --allow-gpu-unverified"
        raise PushError(f"{lead}: {exc}", hint=hint) from None
    not_run = attest.not_run(decision)
    if not_run:
        log.warning("%s: let through by %s, in which %s did not run", image_ref,
                    Path(decision.accepted.where).name, ", ".join(not_run))
    return by_name[decision.accepted.where]


@dataclass(frozen=True, slots=True)
class Clearance:
    """What let an image through: a journal verdict, or a signed verdict checked with the given key."""

    source: str  # the journal entry's or the signed verdict's file name
    gpu_verified: bool


@dataclass(frozen=True, slots=True)
class Gate:
    """How the push gate judges: the local journal, or signed verdicts and the public keys they may be made with."""

    allow_gpu_unverified: bool = False
    require_attestation: tuple[str, ...] = ()  # public keys: files, folders of PEM files, or env:NAME
    attestations: tuple[Path, ...] = ()  # signed verdicts given on the command line
    policy: Policy | None = None  # what the signed verdict must show (None: the definition's full smoke)

    def given_are_about(self, image_ids: list[str], what: str) -> None:
        """Each signed verdict given on the command line must name one of the images pushed (checked first)."""
        for path in self.attestations:
            attest.require_about(path, image_ids, what)

    def carried(self, engine: Engine, root: Path, info: ImageInfo, image_ref: str, say: Callable[[str], None]
                ) -> list[tuple[str, bytes]]:
        """The signed verdicts beside every registry copy of the image this host knows (:mod:`..trust.travel`),
        read before the gate: they are judged with the rest, and travel with the image, pass and fail alike.
        A copy in the registry ``image_ref`` names (the source promoted from) that cannot be read refuses a push
        judged on signed verdicts: a fail there could decide. Any other copy that cannot be read (a registry
        the engine once pulled from and that is gone) is named, and left behind."""
        places = travel.registry_copies(root, info.id, info.repo_digests)
        try:
            source_copy = travel.source_copy(engine, image_ref, info.id)
        except PipelineError as exc:
            if self.require_attestation:
                raise PushError(f"cannot read {image_ref} in its registry: {str(exc).splitlines()[0]}; a "
                                "fail beside it would decide, so nothing is pushed",
                                hint="push again once that registry answers") from exc
            say(f"    {image_ref} could not be read in its registry ({str(exc).splitlines()[0]}); the signed "
                "verdicts beside it do not travel with this push")
            source_copy = None
        found = travel.read(engine, info.id, [*places, *([source_copy] if source_copy else [])])
        first, slash, _rest = image_ref.partition("/")
        named = slash and ("." in first or ":" in first or first == "localhost")  # the ref names its registry
        source = registry_of(image_ref) if named else ""
        for why in found.unread:
            if self.require_attestation and source and registry_of(why.partition("@")[0]) == source:
                raise PushError(f"cannot read the signed verdicts beside the source {why}: a fail there "
                                "would decide, so nothing is pushed",
                                hint="push again once that registry answers")
            say(f"    the signed verdicts beside {why} were not read; they do not travel with this push")
        return found.envelopes

    def clear(self, engine: Engine, root: Path, info: ImageInfo, image_ref: str, target: str,
              carried: list[tuple[str, bytes]] | None = None) -> Clearance:
        if self.require_attestation:
            keys = signing.load_public_keys(self.require_attestation)
            attest.require_given_verify(self.attestations, keys)
            rules = self.policy or policy_file.build(
                flags=policy_file.Flags(allow_gpu_unverified=self.allow_gpu_unverified))
            try:
                pushed = _pushed_candidates(engine, target, info.id)
            except PushError as exc:
                # A fail already beside the target may be there: nothing is judged without it (8, the registry's
                # fault, never the policy's refusal).
                raise PushError(f"{image_ref}: cannot read the signed verdicts beside {target}: {exc}",
                                hint=exc.hint) from exc
            found = attest.local_candidates(root, info.id, self.attestations) + list(carried or []) + pushed
            accepted = attest.judge(found, {info.id}, f"{image_ref} ({info.id[:19]})", keys, rules)
            if not accepted.gpu_verified:
                log.warning("%s: its signed pass is GPU-unverified (%s not run), accepted under "
                            "--allow-gpu-unverified", image_ref, ", ".join(accepted.not_run) or "every check ran")
            elif accepted.not_run:
                log.warning("%s: let through by its signed pass, in which %s did not run", image_ref,
                            ", ".join(accepted.not_run))
            return Clearance(Path(accepted.source).name, accepted.gpu_verified)
        entry = gate(root, info.id, image_ref, self.allow_gpu_unverified)
        return Clearance(entry.path.name, entry.verdict.gpu_verified)

    def would_attach(self, root: Path, info: ImageInfo) -> list[Path]:
        """The signed verdicts :meth:`attach` puts beside the image: those given and those kept for it (the given
        first: a verdict given whose bytes the journal also keeps is named by the file the user gave)."""
        extra = [path for path in self.attestations if attest.names(path, info.id)]
        return list(dict.fromkeys([*extra, *attest.kept(root, info.id)]))

    def attach(self, engine: Engine, root: Path, info: ImageInfo, target: str, digest: str,
               say: Callable[[str], None], carried: list[tuple[str, bytes]] | None = None) -> list[str]:
        """Put the image's signed verdicts beside it in the registry: the journal's, those given, and those
        ``carried`` from its other registry copies (every one, pass or fail)."""
        try:
            local = [(path.name, attest.read_envelope(path))
                     for path in self.would_attach(root, info)]
            return travel.attach(engine, target, digest, [*local, *(carried or [])], say)
        except PushError as exc:  # the registry's fault, coded as every registry fault is
            raise PushError(f"{target} landed in the registry as {digest}, but its signed verdicts could not be "
                            f"attached: {exc}", hint="push it again to attach them") from exc
        except PipelineError as exc:
            raise AttestationError(f"{target} landed in the registry as {digest}, but its signed verdicts could "
                                   f"not be attached: {exc}", hint="push it again to attach them") from exc


def _pushed_candidates(engine: Engine, target: str, image_id: str) -> list[tuple[str, bytes]]:
    """The signed verdicts already beside ``target`` in its registry, when it holds this very image."""
    client, path, manifest = registry.look_up(engine, target)
    if manifest is None or manifest.is_index or (manifest.json().get("config") or {}).get("digest") != image_id:
        return []
    return attest.registry_candidates(client, path, manifest.digest)


def landed_refusal(what: str, problem: facts.LandedProblem) -> PushError:
    """The push gate's answer to a re-check of the files that did not pass; both are the gate's refusal (8).

    A difference is the image's: its verdict does not match its files, and
    only a rebuild mends that. A host fault (a base this host could not find
    or read, a pins.txt or definition it cannot use) says nothing against the
    image: the user is told its files could not be re-checked here, and what
    to make readable, never to rebuild an image that may be sound. Both keep
    the code every refusal of the gate has: nothing is pushed either way, and
    the push never judged the image good.
    """
    if problem.host_fault:
        return PushError(f"refusing to push {what}: its files could not be re-checked on this host: {problem}",
                         hint="nothing is known against the image; make what is named readable here (pull its "
                              "base, mend the project's files) and push again")
    return PushError(f"refusing to push {what}: {problem}",
                     hint="its verdict does not match its files; rebuild and smoke-test it")
