"""Which signed verdict answers a policy, and whether it meets it: the scope and time rule.

The rule, in the order it is applied to every verdict that verifies with one
of the keys and names the image (and, for the journal gate, to every verdict
the journal keeps of it, :func:`journal_found`):

1. Each verdict must say when it was signed; one dated further ahead of this
   host's clock than the policy's skew allows is named and left out (a host
   whose clock runs a day ahead does not win outright), unless it is a fail
   of a check the policy counts, which refuses.
2. A signed verdict's time is when its run ended (``run_at`` plus its
   seconds; its signed time where it names no run): a run that started first
   and failed last is the newer. A time that cannot be placed (a year past
   9999) refuses. The journal's verdicts are ordered by the journal's own
   sequence, never by the clocks of the runs.
3. Only verdicts that cover the policy count: that ran every check the policy
   requires to a pass or a fail (skipped or absent does not cover), against the
   reference the policy names. Of those, the newest decides; two of the same
   time cannot be told apart, and nothing is decided.
4. The newest covering verdict must meet every requirement of the policy.
5. Any newer verdict that failed a check the policy counts or that the
   accepted run covered blocks it, whatever else it ran: a narrower run's
   fail is still a fail of the image; one that ended at the same instant
   cannot be ordered against it. An older fail of such a check blocks it too
   until a later run that ran at least every check the failing run ran passed
   the failed checks: a narrower pass (the sweep skipped) never clears a
   wider fail. A fail judged against another definition than the one the
   policy names does not count.

Nothing here trusts the image: the facts come from the host's signed
predicate, and only its host-proved fields (never ``claimed``).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import AttestationMismatch, AttestationTampered, CannotCheck, Malformed
from ..verdicts import EARLIER_FORMAT, Status, Verdict
from . import signing
from .policy import GPU_BOUND, Facts, Failure, Passed, Policy, Result

log = logging.getLogger(__name__)
_EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)


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
        format=verdict.format if "format" in predicate else EARLIER_FORMAT,
        # Only a predicate that keeps the labels apart says this as the host's own: before, it was the label's.
        judged_definition=str(predicate.get("definition") or "") if proved else "",
    )


def _sha256(value: object) -> str:
    text = str(value or "")
    return text if not text or text.startswith("sha256:") else f"sha256:{text}"


@dataclass(frozen=True, slots=True)
class Found:
    """A verdict about the image, where it came from, and its times: one that verified with one of the keys
    (``attested``), or one the journal keeps (``attested`` None, ``rank`` its sequence)."""

    where: str
    attested: signing.Attested | None
    facts: Facts
    signed: dt.datetime
    ended: dt.datetime
    rank: int  # the order: a signed verdict's end in microseconds since the epoch, a journal entry's sequence

    @property
    def status(self) -> Status:
        return self.facts.verdict.status

    def summary(self, policy: Policy) -> dict[str, Any]:
        return {"source": self.where, "status": self.status.value, "ended": self.ended.isoformat(),
                "signed_at": self.signed.isoformat(), "covers": policy.covers(self.facts) or "yes",
                "ran": sorted(_ran(self))}


def found(where: str, attested: signing.Attested) -> Found:
    """``attested`` with its times; CannotCheck where it does not say when it was signed, AttestationMismatch
    where its run's end lies past any date (a year 9999 start, a run of 1e12 seconds)."""
    predicate = attested.predicate
    signed = signing.signed_time(predicate)
    if signed is None:
        raise CannotCheck(f"{where}: the signed verdict carries no signed time (made before verdicts were dated), "
                          "so it cannot be placed among the others", hint="smoke the image again with --sign-key")
    typed = facts(predicate, where)
    ended = signed
    try:
        if typed.run_at is not None:
            ended = typed.run_at + dt.timedelta(seconds=max(typed.verdict.seconds, 0.0))
        rank = (ended - _EPOCH) // dt.timedelta(microseconds=1)
    except (OverflowError, ValueError):
        raise AttestationMismatch(f"{where}: its run (started {typed.run_at.isoformat() if typed.run_at else '?'}, "
                                  f"lasting {typed.verdict.seconds:g} s) ends past any date this host can place; "
                                  "refused", hint="check the signing host's clock, then smoke again") from None
    return Found(where, attested, typed, signed, ended, rank)


def journal_found(where: str, seq: int, created: str, verdict: Verdict) -> Found:
    """A verdict the journal keeps, as :func:`decide` reads a signed one: the facts the host recorded (what its
    layer-identity check proved, never the labels), placed by the journal's sequence ``seq``."""
    report = verdict.to_dict()
    predicate = {**report, **signing.proved(report), "scope": signing.scope(report), "claimed": {}}
    typed = facts(predicate, where)
    when = signing.signed_time({"t": created}, "t") or _EPOCH
    ended = when
    try:
        if typed.run_at is None and verdict.started:
            started = signing.signed_time({"t": verdict.started}, "t")
            ended = started + dt.timedelta(seconds=max(verdict.seconds, 0.0)) if started else when
    except (OverflowError, ValueError):
        ended = when
    return Found(where, None, typed, when, ended, seq)


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
    counted = set(policy.checks)
    candidates = [f for f in candidates if _judged_here(f, policy)]
    dated: list[Found] = []
    for f in candidates:
        ahead = max(f.signed, f.ended) - now
        if f.attested is None or ahead <= policy.max_skew:
            dated.append(f)
            continue
        if _failed(f, counted):
            raise AttestationMismatch(f"{f.where}: a fail dated {max(f.signed, f.ended).isoformat()}, {ahead} ahead "
                                      f"of this host's clock (more than the {policy.max_skew} allowed); refused",
                                      hint="check the signing host's clock (and this one's), then smoke again")
        # Not a fail: it cannot let the image through, and it must not keep every other verdict from deciding.
        log.warning("%s: its %s verdict is dated %s, %s ahead of this host's clock (more than the %s allowed); "
                    "left out", f.where, f.status.value, max(f.signed, f.ended).isoformat(), ahead, policy.max_skew)
    candidates = dated
    covering = [f for f in candidates if policy.covers(f.facts) is None]
    if not covering:
        fails = [f for f in candidates if _failed(f, counted)]
        if fails:
            # A fail of a check the policy requires refuses the image, whatever else its run left out.
            f = max(fails, key=lambda x: x.rank)
            raise AttestationMismatch(f"{f.where}: the smoke verdict of {image} is {_not_a_pass(f)} (its run "
                                      f"ended {f.ended.isoformat()}); no verdict covers the policy",
                                      hint="smoke the image again")
        if not candidates:
            raise AttestationMismatch(f"{image}: no verdict left to decide (those dated ahead of this host's clock, "
                                      "and fails judged against another definition, are left out)",
                                      hint="check the signing host's clock, then smoke again")
        latest3 = sorted(candidates, key=lambda f: f.rank, reverse=True)[:3]
        # One line, of the newest alone: the whole scope and three verdicts' places made it 847 characters; the
        # others and everything required are in --json.
        newest = latest3[0]
        hint = "smoke it with everything the policy requires (on a GPU host, with --serve-model and --reference)"
        if not policy.allow_gpu_unverified and all(
                set(policy.scope) - _ran(f) <= GPU_BOUND for f in latest3):
            hint += ", or accept a run on a host without a GPU with --allow-gpu-unverified"
        raise AttestationMismatch(f"{image}: none of its {len(candidates)} verdict(s) covers what the policy "
                                  f"requires: the newest, {newest.where} ({newest.status.value}), left out "
                                  f"{policy.covers(newest.facts)}", hint=hint + " (verify --json lists what each "
                                  "verdict left out)")
    latest = max(f.rank for f in covering)
    top = [f for f in covering if f.rank == latest]
    if len(top) > 1:
        raise CannotCheck(f"{image}: {len(top)} verdicts end at the same instant ({top[0].ended.isoformat()}): "
                          f"{' and '.join(f.where for f in top)}; neither is the newest",
                          hint="smoke it again with --sign-key")
    newest = top[0]
    results = tuple(requirements.check(newest.facts, now))
    failures = [r for r in results if isinstance(r, Failure)]
    if failures:
        message = (f"{newest.where}: the smoke verdict of {image} does not meet {policy.source}: "
                   f"{'; '.join(r.reason for r in failures)}")
        older = [f for f in covering if f is not newest and f.status is Status.PASS]
        if newest.status is not Status.PASS and older:
            w = max(older, key=lambda f: f.rank)
            message += (f" (the newest, its run ended {newest.ended.isoformat()}); the older {_kind(w)}pass {w.where} "
                        f"(ended {w.ended.isoformat()}) does not count")
        hint = failures[0].hint or "smoke the image again; the newest verdict that covers the policy decides"
        narrower = [f for f in candidates if f.rank > newest.rank and f.status is Status.PASS]
        if newest.status is not Status.PASS and narrower:
            # A narrower pass since (the sweep skipped) is the re-smoke that must not clear a wider fail.
            n = max(narrower, key=lambda f: f.rank)
            message += (f"; the newer pass {n.where} left out {policy.covers(n.facts)} and does not clear it")
            hint = (f"smoke it again with every check the failing run ran ({_scope_text(newest)}), on a GPU host "
                    "with --serve-model and --reference")
        refusal = AttestationMismatch(message, hint=hint)
        refusal.evidence = Decision(newest, results, policy, tuple(candidates)).to_dict()
        raise refusal
    counted |= {c.name for c in newest.facts.verdict.checks}
    for f in sorted(candidates, key=lambda f: f.rank, reverse=True):
        if f is newest or not _failed(f, counted):
            continue
        if f.rank > newest.rank:
            raise AttestationMismatch(f"{f.where}: the smoke verdict of {image} is {_not_a_pass(f)}, a newer "
                                      f"fail (its run ended {f.ended.isoformat()}); the older {_kind(newest)}pass "
                                      f"{newest.where} (ended {newest.ended.isoformat()}) does not count",
                                      hint="smoke the image again; a newer fail of a check the pass ran blocks it")
        if f.rank == newest.rank:
            raise CannotCheck(f"{image}: the pass {newest.where} and the fail {f.where} of "
                              f"{', '.join(_failed(f, counted))} end at the same instant "
                              f"({f.ended.isoformat()}); neither is the newer", hint="smoke it again with --sign-key")
        clearing = [later for later in candidates if later.rank > f.rank and _ran(f) <= _ran(later)
                    and not set(_failed(f, counted)) - _passed(later)]
        if not clearing:
            failed = _failed(f, counted)
            raise AttestationMismatch(
                f"{f.where}: an older {_not_a_pass(f)} (its run ended {f.ended.isoformat()}) is not cleared: no "
                f"later run that ran at least its checks passed {', '.join(failed)}; the pass {newest.where} ran "
                f"{_scope_text(newest)}",
                hint=f"smoke it again with every check the failing run ran ({_scope_text(f)}), on a GPU host with "
                     "--serve-model and --reference where it ran the sweep")
    return Decision(newest, results, policy, tuple(candidates))


def _judged_here(found: Found, policy: Policy) -> bool:
    """Whether ``found`` is about what the policy asks of: a fail judged against another definition than the one
    the policy names says nothing about this one (where the predicate names what it was judged against)."""
    said = found.facts.judged_definition
    return not (policy.definition and said and said != policy.definition and found.status is Status.FAIL)


def _kind(found: Found) -> str:
    """"signed " for a signed verdict, nothing for one of the journal's."""
    return "signed " if found.attested is not None else ""


def _passed(found: Found) -> set[str]:
    return {c.name for c in found.facts.verdict.checks if c.status is Status.PASS}


def _scope_text(found: Found) -> str:
    ran = sorted(_ran(found))
    return f"{len(ran)} check(s): {', '.join(ran)}" if ran else "no check"


def _ran(found: Found) -> set[str]:
    """The checks ``found``'s run ran to a pass or a fail."""
    return {c.name for c in found.facts.verdict.checks if c.status in (Status.PASS, Status.FAIL)}


def _failed(found: Found, counted: set[str]) -> list[str]:
    """The checks among ``counted`` that ``found``'s run failed."""
    return [c.name for c in found.facts.verdict.checks if c.status is Status.FAIL and c.name in counted]


def _not_a_pass(found: Found) -> str:
    result = Passed().check(found.facts, dt.datetime.now(dt.UTC))
    if isinstance(result, Failure):
        return result.reason
    # Its status says pass and a check says fail (an edited entry): the check is what counts.
    failed = [c.name for c in found.facts.verdict.checks if c.status is Status.FAIL]
    return f"marked a pass with {', '.join(failed)} failed"
