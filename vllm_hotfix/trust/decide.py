"""Which signed verdict answers a policy, and whether it meets it: the scope and time rule.

The rule, in the order it is applied to every verdict that verifies with one
of the keys and names the image:

1. Each verdict must say when it was signed; one dated further ahead of this
   host's clock than the policy's skew allows is refused (a host whose clock
   runs a day ahead does not win outright).
2. A verdict's time is when its run ended (``run_at`` plus its seconds; its
   signed time where it names no run): a run that started first and failed
   last is the newer.
3. Only verdicts that cover the policy count: that ran every check the policy
   requires to a pass or a fail (skipped or absent does not cover), against the
   reference the policy names. Of those, the newest decides; two of the same
   time cannot be told apart, and nothing is decided.
4. The newest covering verdict must meet every requirement of the policy.
5. Any newer verdict that failed a check the policy requires or that the
   accepted run covered blocks it, whatever else it ran: a narrower run's
   fail is still a fail of the image.

Nothing here trusts the image: the facts come from the host's signed
predicate, and only its host-proved fields (never ``claimed``).
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AttestationMismatch, AttestationTampered, CannotCheck, Malformed
from ..verdicts import Status, Verdict
from . import signing
from .policy import GPU_BOUND, Facts, Failure, Passed, Policy, Result


def facts(predicate: Mapping[str, Any], where: str) -> Facts:
    """The typed facts of a signed predicate; AttestationTampered (malformed) where they do not read.

    The definition, patch set and base count only in a predicate that keeps
    the labels apart under ``claimed``: one signed before did not, and took
    them from the image's labels."""
    try:
        verdict = Verdict.from_dict(predicate)
    except Malformed as exc:
        raise AttestationTampered(f"{where}: the signed verdict is malformed: {exc}") from None
    proved = "claimed" in predicate
    patch_set = predicate.get("patch_set") if proved else None
    base = predicate.get("base") if proved else None
    base = base if isinstance(base, Mapping) else {}
    scope = predicate.get("scope")
    sweep = verdict.sweep or {}
    judged_against = sweep.get("reference")
    reference: Mapping[str, Any] = judged_against if isinstance(judged_against, Mapping) else {}
    said = scope.get("reference") if isinstance(scope, Mapping) else None
    return Facts(
        verdict=verdict,
        definition=str(predicate.get("definition") or "") if proved else "",
        patch_set_digest=str(patch_set.get("digest") or "") if isinstance(patch_set, Mapping) else "",
        base_id=str(base.get("id") or ""),
        base_digests=tuple(str(d) for d in base.get("digests") or [] if isinstance(d, str)),
        reference=_sha256(said or reference.get("sha256") or ""),
        tool_version=str(predicate.get("tool_version") or ""),
        run_at=signing.signed_time(predicate, "run_at"),
    )


def _sha256(value: object) -> str:
    text = str(value or "")
    return text if not text or text.startswith("sha256:") else f"sha256:{text}"


@dataclass(frozen=True, slots=True)
class Found:
    """A verdict that verified with one of the keys and names the image, where it came from, and its times."""

    where: str
    attested: signing.Attested
    facts: Facts
    signed: dt.datetime
    ended: dt.datetime

    @property
    def status(self) -> Status:
        return self.facts.verdict.status

    def summary(self, policy: Policy) -> dict[str, Any]:
        return {"source": self.where, "status": self.status.value, "ended": self.ended.isoformat(),
                "signed_at": self.signed.isoformat(), "covers": policy.covers(self.facts) or "yes",
                "ran": sorted(c.name for c in self.facts.verdict.checks if c.status in (Status.PASS, Status.FAIL))}


def found(where: str, attested: signing.Attested) -> Found:
    """``attested`` with its times; CannotCheck where it does not say when it was signed."""
    predicate = attested.predicate
    signed = signing.signed_time(predicate)
    if signed is None:
        raise CannotCheck(f"{where}: the signed verdict carries no signed time (made before verdicts were dated), "
                          "so it cannot be placed among the others", hint="smoke the image again with --sign-key")
    typed = facts(predicate, where)
    ended = signed
    if typed.run_at is not None:
        ended = typed.run_at + dt.timedelta(seconds=max(typed.verdict.seconds, 0.0))
    return Found(where, attested, typed, signed, ended)


@dataclass(frozen=True, slots=True)
class Decision:
    """The verdict that met the policy, what the policy required and found, and every verdict considered."""

    accepted: Found
    results: tuple[Result, ...]
    policy: Policy
    considered: tuple[Found, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"policy": self.policy.to_dict(),
                "found": [{"requirement": r.requirement, "found": r.found, "met": not isinstance(r, Failure)}
                          for r in self.results],
                "verdicts": [f.summary(self.policy) for f in self.considered]}


def decide(candidates: Sequence[Found], policy: Policy, image: str, now: dt.datetime | None = None) -> Decision:
    """The decision of ``policy`` over ``candidates`` (every verified verdict about the image; see the module).

    A refusal (AttestationMismatch) or a verdict set that cannot be ordered (CannotCheck) carries its
    ``evidence``: the policy, what was found where it got that far, and every verdict considered."""
    try:
        return _decide(candidates, policy, image, now or dt.datetime.now(dt.UTC))
    except (AttestationMismatch, CannotCheck) as exc:
        if exc.evidence is None:
            exc.evidence = {"policy": policy.to_dict(), "found": [],
                            "verdicts": [f.summary(policy) for f in candidates]}
        raise


def _decide(candidates: Sequence[Found], policy: Policy, image: str, now: dt.datetime) -> Decision:
    requirements = policy.requirements()  # an empty policy is refused before any verdict is read
    for f in candidates:
        ahead = max(f.signed, f.ended) - now
        if ahead > policy.max_skew:
            raise AttestationMismatch(f"{f.where}: dated {max(f.signed, f.ended).isoformat()}, {ahead} ahead of "
                                      f"this host's clock (more than the {policy.max_skew} allowed); refused",
                                      hint="check the signing host's clock (and this one's), then smoke again")
    counted = set(policy.checks)
    covering = [f for f in candidates if policy.covers(f.facts) is None]
    if not covering:
        fails = [f for f in candidates if _failed(f, counted)]
        if fails:
            # A fail of a check the policy requires refuses the image, whatever else its run left out.
            f = max(fails, key=lambda x: x.ended)
            raise AttestationMismatch(f"{f.where}: the signed smoke verdict of {image} is {_not_a_pass(f)} (its run "
                                      f"ended {f.ended.isoformat()}); no signed verdict covers the policy",
                                      hint="smoke the image again")
        latest3 = sorted(candidates, key=lambda f: f.ended, reverse=True)[:3]
        # One line, of the newest alone: the whole scope and three verdicts' places made it 847 characters; the
        # others and everything required are in --json.
        newest = latest3[0]
        hint = "smoke it with everything the policy requires (on a GPU host, with --serve-model and --reference)"
        if not policy.allow_gpu_unverified and all(
                set(policy.scope) - _ran(f) <= GPU_BOUND for f in latest3):
            hint += ", or accept a run on a host without a GPU with --allow-gpu-unverified"
        raise AttestationMismatch(f"{image}: none of its {len(candidates)} signed verdict(s) covers what the policy "
                                  f"requires: the newest, {newest.where} ({newest.status.value}), left out "
                                  f"{policy.covers(newest.facts)}", hint=hint + " (verify --json lists what each "
                                  "verdict left out)")
    latest = max(f.ended for f in covering)
    top = [f for f in covering if f.ended == latest]
    if len(top) > 1:
        raise CannotCheck(f"{image}: {len(top)} signed verdicts end at the same instant ({latest.isoformat()}): "
                          f"{' and '.join(f.where for f in top)}; neither is the newest",
                          hint="smoke it again with --sign-key")
    newest = top[0]
    results = tuple(requirements.check(newest.facts, now))
    failures = [r for r in results if isinstance(r, Failure)]
    if failures:
        message = (f"{newest.where}: the signed smoke verdict of {image} does not meet {policy.source}: "
                   f"{'; '.join(r.reason for r in failures)}")
        older = [f for f in covering if f is not newest and f.status is Status.PASS]
        if newest.status is not Status.PASS and older:
            w = max(older, key=lambda f: f.ended)
            message += (f" (the newest, its run ended {newest.ended.isoformat()}); the older signed pass {w.where} "
                        f"(ended {w.ended.isoformat()}) does not count")
        refusal = AttestationMismatch(message, hint=failures[0].hint or "smoke the image again; the newest signed "
                                                                        "verdict that covers the policy decides")
        refusal.evidence = Decision(newest, results, policy, tuple(candidates)).to_dict()
        raise refusal
    counted |= {c.name for c in newest.facts.verdict.checks}
    for f in sorted(candidates, key=lambda f: f.ended, reverse=True):
        if f.ended > newest.ended and _failed(f, counted):
            raise AttestationMismatch(f"{f.where}: the signed smoke verdict of {image} is {_not_a_pass(f)}, a newer "
                                      f"fail (its run ended {f.ended.isoformat()}); the older signed pass "
                                      f"{newest.where} (ended {newest.ended.isoformat()}) does not count",
                                      hint="smoke the image again; a newer fail of a check the pass ran blocks it")
    return Decision(newest, results, policy, tuple(candidates))


def _ran(found: Found) -> set[str]:
    """The checks ``found``'s run ran to a pass or a fail."""
    return {c.name for c in found.facts.verdict.checks if c.status in (Status.PASS, Status.FAIL)}


def _failed(found: Found, counted: set[str]) -> list[str]:
    """The checks among ``counted`` that ``found``'s run failed."""
    return [c.name for c in found.facts.verdict.checks if c.status is Status.FAIL and c.name in counted]


def _not_a_pass(found: Found) -> str:
    result = Passed().check(found.facts, dt.datetime.now(dt.UTC))
    return result.reason if isinstance(result, Failure) else "a pass"
