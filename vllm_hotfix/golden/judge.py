"""The ``golden`` check: served replies against the golden forward, where the golden is sure. Pure.

The golden (:mod:`.forward`) scores each served reply teacher-forced: at every
generated position, given the prompt and the tokens the server sent before
it, which token the golden ranks first, by how many nats it leads the
runner-up (its *margin*), and its log-probabilities of the tokens the server
named. The golden computes at the serving dtype (the engine's numerics), the
engine with kernels of its own, so the two never agree bit for bit; how far
a right computation may lie from the model's definition is measured on the
golden alone, never on a served image:

- the **envelope** (:mod:`.envelope`, measured when a reference is recorded,
  kept in the reference's ``golden`` section and signed with it): per
  prompt class, how far one more rounding of the golden (one that is none of
  the worlds a reply is scored in) falls below the worlds' smallest margin
  on the golden's own replies, and its largest value, the *excess*. A
  class's *threshold* is :data:`MARGIN_MULTIPLE` times that largest excess:
  the engine is one more right computation, and 1.5 allows it to stray
  further than the one rounding measured. The envelope also keeps the margin
  error between the golden at the serving dtype and at float32 (the model's
  definition), which the recording's refusal reads.
- a position is **judged** where the golden's margin exceeds its prompt
  class's threshold and it is not *ambiguous* (:mod:`.scoring`: where one of
  the golden's other roundings ranks another token first; elsewhere the
  margin is the smallest). At a judged position the served token must be the golden's. The
  check fails at the first judged position where it is not, naming the reply
  (the HTTP sweep or the fixed batches at a level), the request, the
  position, both tokens and the margin.
- the **coverage** (:mod:`.coverage`): judged positions per level and per
  prompt class; under its floors the check is incomplete, never a pass.

A recording is refused (nothing is kept) where its replies lie outside the
envelope: a judged position that disagrees, or, in a prompt class, the
served replies' median margin error (against the golden, vLLM's two best
tokens) above the envelope's 90th percentile: a trusted image that far from
the model's definition is not trusted. A judged run is held to the envelope's
thresholds, never to anything the recording image's replies measured.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..verdicts import Check, Status
from . import coverage

CHECK = "golden"
MARGIN_MULTIPLE = 1.5  # judged: golden margin > this x the envelope's largest margin error (see the docstring)
SERVED_QUANTILE = 0.9  # a recording whose median margin error exceeds the envelope's quantile here is refused


@dataclass(frozen=True, slots=True)
class Position:
    """One generated position of a served reply, as the golden scored it (teacher-forced)."""

    golden: int  # the token the golden ranks first
    margin: float  # nats the golden's first token leads its second
    served: int  # the token the server sent
    served_logprob: float  # the golden's log-probability of the served token
    margin_error: float | None  # vLLM's and the golden's lead of vLLM's first token over its second, apart
    # (nats; None where the server sent no top-2 here)
    ambiguous: bool = False  # the golden's two block-choice worlds rank another token first here (scoring.py)


@dataclass(frozen=True, slots=True)
class Scored:
    """One served reply scored by the golden; ``problem`` says why it could not be (its positions are empty)."""

    source: str  # "http" (the HTTP sweep) or "fixed" (the fixed-batch probe)
    level: int
    request: int
    prompt: int
    positions: tuple[Position, ...] = ()
    problem: str = ""
    klass: str = "short"  # the prompt's class (coverage.CLASSES)

    @property
    def name(self) -> str:
        where = "HTTP sweep" if self.source == "http" else "fixed batches"
        return f"{where} at concurrency {self.level}, request {self.request} (prompt {self.prompt})"


@dataclass(frozen=True, slots=True)
class Disagreement:
    """The first judged position where a served token is not the golden's."""

    reply: str
    source: str
    level: int
    request: int
    prompt: int
    position: int
    golden: int
    served: int
    margin: float

    def describe(self) -> str:
        return (f"{self.reply}: at position {self.position} the golden's token_id:{self.golden} leads by "
                f"{self.margin:.3g} nats, the server sent token_id:{self.served}")


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The margin a position's golden must exceed to be judged, per prompt class (the envelope's); a class the
    envelope did not measure is not judged."""

    by_class: Mapping[str, float] = field(default_factory=dict)

    def of(self, klass: str) -> float | None:
        return self.by_class.get(klass)

    def to_dict(self) -> dict[str, Any]:
        return {"by_class": dict(sorted(self.by_class.items()))}


@dataclass(frozen=True, slots=True)
class Judgement:
    """Every scored reply against the golden at its prompt class's threshold."""

    thresholds: Thresholds
    replies: int
    positions: int
    confident: int  # judged: over the threshold and unambiguous
    agreeing: int
    first: Disagreement | None
    unscored: tuple[str, ...] = ()
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)
    ambiguous: int = 0
    coverage: dict[str, Any] = field(default_factory=dict)
    by_margin: dict[str, list[list[float]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.first is None and not self.unscored and self.confident > 0

    def to_dict(self) -> dict[str, Any]:
        first = None
        if self.first is not None:
            d = self.first
            first = {"reply": d.reply, "source": d.source, "level": d.level, "request": d.request,
                     "prompt": d.prompt, "position": d.position, "golden": f"token_id:{d.golden}",
                     "served": f"token_id:{d.served}", "margin_nats": round(d.margin, 4)}
        return {"thresholds_nats": self.thresholds.to_dict(), "replies": self.replies, "positions": self.positions,
                "confident": self.confident, "agreeing": self.agreeing, "ambiguous": self.ambiguous,
                "first_disagreement": first, "unscored": list(self.unscored[:10]), "by_source": self.by_source,
                "coverage": self.coverage, "by_margin": self.by_margin}


CURVE_NATS = (0.25, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0)  # the margins the record's curve is counted at


def curve(scored: Sequence[Scored]) -> dict[str, list[list[float]]]:
    """Per prompt class, at each margin of :data:`CURVE_NATS`: ``[margin, positions over it, of them the ones
    whose served token is not the golden's]``, over the unambiguous positions. A measurement for the record (how
    much a threshold would judge, and what it would find), never a judgement."""
    out: dict[str, list[list[float]]] = {}
    for reply in scored:
        if reply.problem:
            continue
        rows = out.setdefault(reply.klass, [[t, 0, 0] for t in CURVE_NATS])
        for p in reply.positions:
            if p.ambiguous:
                continue
            for row in rows:
                if p.margin > row[0]:
                    row[1] += 1
                    row[2] += p.served != p.golden
    return dict(sorted(out.items()))


def served(scored: Sequence[Scored]) -> dict[str, list[list[int]]]:
    """Per prompt (its index, as a string), every distinct reply the golden scored, as token IDs: what was judged,
    kept with the check so that the same replies can be scored again later (another golden, another envelope)
    without the image."""
    out: dict[str, set[tuple[int, ...]]] = {}
    for reply in scored:
        if not reply.problem:
            out.setdefault(str(reply.prompt), set()).add(tuple(p.served for p in reply.positions))
    return {k: [list(ids) for ids in sorted(v)] for k, v in sorted(out.items(), key=lambda kv: int(kv[0]))}


def judge(scored: Sequence[Scored], thresholds: Thresholds | float) -> Judgement:
    """Each reply's positions that are unambiguous and where the golden's margin exceeds its prompt class's
    threshold: the served token must be the golden's. Replies that could not be scored are named (they fail the
    check: nothing judged them). A bare number is every class's threshold."""
    if not isinstance(thresholds, Thresholds):
        thresholds = Thresholds({k: float(thresholds) for k in coverage.CLASSES})
    positions = confident = agreeing = ambiguous = 0
    first: Disagreement | None = None
    unscored = []
    by_source: dict[str, dict[str, int]] = {}
    levels: dict[int, list[int]] = {}
    classes: dict[str, list[int]] = {}
    for reply in scored:
        if reply.problem:
            unscored.append(f"{reply.name}: {reply.problem}")
            continue
        tally = by_source.setdefault(f"{reply.source}:{reply.level}", {"positions": 0, "confident": 0,
                                                                      "agreeing": 0})
        level, klass = levels.setdefault(reply.level, [0, 0]), classes.setdefault(reply.klass, [0, 0])
        threshold = thresholds.of(reply.klass)
        for j, p in enumerate(reply.positions):
            positions += 1
            tally["positions"] += 1
            level[1] += 1
            klass[1] += 1
            if p.ambiguous:
                ambiguous += 1
                continue
            if threshold is None or not p.margin > threshold:
                continue
            confident += 1
            tally["confident"] += 1
            level[0] += 1
            klass[0] += 1
            if p.served == p.golden:
                agreeing += 1
                tally["agreeing"] += 1
            elif first is None:
                first = Disagreement(reply.name, reply.source, reply.level, reply.request, reply.prompt, j,
                                     p.golden, p.served, p.margin)
    # A level or class that asked no position is absent (coverage.py's format).
    cover = {"levels": {str(c): coverage.tally(*v) for c, v in sorted(levels.items()) if v[1]},
             "classes": {k: coverage.tally(*v) for k, v in sorted(classes.items()) if v[1]}}
    return Judgement(thresholds, len(scored), positions, confident, agreeing, first, tuple(unscored), by_source,
                     ambiguous, cover, curve(scored))


def quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def noise(scored: Sequence[Scored]) -> dict[str, Any]:
    """The served replies' margin errors against the golden (``|(vLLM a - vLLM b) - (golden a - golden b)|``, a
    and b vLLM's two best tokens), over their unambiguous positions: the distribution, per prompt class and per
    prompt. A measurement of the image, for the record and for the envelope's refusal; never a threshold."""
    per: dict[int, list[float]] = {}
    by_class: dict[str, list[float]] = {}
    for r in scored:
        if r.problem:
            continue
        found = [p.margin_error for p in r.positions
                 if not p.ambiguous and p.margin_error is not None and math.isfinite(p.margin_error)]
        per.setdefault(r.prompt, []).extend(found)
        by_class.setdefault(r.klass, []).extend(found)
    per = {k: v for k, v in per.items() if v}
    deltas = [d for v in per.values() for d in v]
    if not deltas:
        raise ValueError("no position of the replies carried vLLM's log-probabilities to compare")

    def stats(values: Sequence[float]) -> dict[str, Any]:
        return {"positions": len(values), "median_nats": round(statistics.median(values), 6),
                "p90_nats": round(quantile(values, 0.9), 6), "max_nats": round(max(values), 6)}

    return {"measure": "per unambiguous position, |(vLLM a - vLLM b) - (golden a - golden b)| in log-probability, "
                       "a and b vLLM's two best tokens; teacher-forced on the served replies",
            **stats(deltas), "replies": sum(not r.problem for r in scored),
            "p99_nats": round(quantile(deltas, 0.99), 6),
            "by_class": {k: stats(v) for k, v in sorted(by_class.items()) if v},
            "by_prompt_max_nats": {str(k): round(max(v), 6) for k, v in sorted(per.items())}}


def thresholds(section: Mapping[str, Any] | None) -> Thresholds | None:
    """The margin thresholds per prompt class that a reference's ``golden`` section's envelope names (None: it
    has no envelope, or a malformed one)."""
    envelope = (section or {}).get("envelope")
    classes = envelope.get("classes") if isinstance(envelope, Mapping) else None
    if not isinstance(classes, Mapping) or not classes:
        return None
    out = {}
    for k, entry in classes.items():
        if k not in coverage.CLASSES or not isinstance(entry, Mapping):
            return None
        value = entry.get("threshold_nats")
        if value is None and not entry.get("measured"):
            continue  # a class whose every position was ambiguous: measured nothing, judges nothing
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
                and value >= 0):
            return None
        out[str(k)] = float(value)
    return Thresholds(out) if out else None


def outside(served: Mapping[str, Any], envelope: Mapping[str, Any]) -> str | None:
    """Why served margin errors (:func:`noise`) lie outside the ``envelope``, in one phrase; None where they do
    not: in a class, the served median above the envelope's :data:`SERVED_QUANTILE` quantile."""
    for klass, got in sorted(dict(served.get("by_class") or {}).items()):
        limit = dict(dict(envelope.get("classes") or {}).get(klass) or {}).get("p90_nats")
        if not isinstance(limit, (int, float)):
            return f"the envelope measured no {klass} prompt, which the replies hold"
        if got["median_nats"] > limit:
            return (f"on {klass} prompts the replies lie a median {got['median_nats']:.3g} nats from the golden, "
                    f"beyond the golden's own envelope at the serving dtype (90% of its margin errors within "
                    f"{limit:.3g} nats)")
    return None


def describe(j: Judgement) -> str:
    values = sorted(j.thresholds.by_class.items())
    span = ", ".join(f"{k} {v:.3g}" for k, v in values) or "-"
    share = (f"{j.confident} of {j.positions} positions judged (golden margin over the envelope's {span} nats; "
             f"{j.ambiguous} left out as ambiguous)")
    return f"{j.agreeing} of {j.confident} judged positions agree with the golden; {share}, {j.replies} replies"


def check(j: Judgement, data: Mapping[str, Any] | None = None, levels: tuple[int, ...] = ()) -> Check:
    """The ``golden`` check of a judged run: a fail at the first judged disagreement or an unscored reply,
    incomplete where the coverage falls short of its floors (``levels``: the schedule's, each of which must be
    covered), else a pass."""
    body = {**j.to_dict(), **dict(data or {})}
    if j.first is not None:
        return Check(CHECK, Status.FAIL, f"a served token is not the golden's where the golden is sure: "
                                         f"{j.first.describe()} ({describe(j)})", data=body)
    if j.unscored:
        return Check(CHECK, Status.FAIL, f"{len(j.unscored)} repl{'y' if len(j.unscored) == 1 else 'ies'} could "
                                         f"not be scored by the golden, e.g. {j.unscored[0]}", data=body)
    if j.confident == 0:
        return Check(CHECK, Status.INCOMPLETE, f"no position where the golden is sure ({describe(j)}): the "
                                               "golden judged nothing", data=body)
    short = coverage.shortfall(j.coverage, levels=levels)
    if short is not None:
        return Check(CHECK, Status.INCOMPLETE, f"{short}: too little judged to pass ({describe(j)})", data=body)
    return Check(CHECK, Status.PASS, describe(j), data=body)


def recorded(scored: Sequence[Scored], envelope: Mapping[str, Any], data: Mapping[str, Any] | None = None,
             levels: tuple[int, ...] = ()) -> tuple[Check, dict[str, Any] | None]:
    """A recording's ``golden`` check and the reference's ``golden`` section (None: nothing to keep): the
    trusted image's replies judged at the ``envelope``'s thresholds (measured on the golden alone) and their
    margin errors held to it."""
    body = {"envelope": dict(envelope), **dict(data or {})}
    limits = thresholds({"envelope": envelope})
    if limits is None:
        return Check(CHECK, Status.FAIL, "the golden's envelope measured no position (every one ambiguous, or no "
                                         "prompt): nothing recorded", data=body), None
    j = judge(scored, limits)
    try:
        measured = noise(scored)
    except ValueError as exc:
        return Check(CHECK, Status.FAIL, f"cannot hold the trusted image's replies to the golden's envelope: {exc}; "
                                         "nothing recorded", data={**j.to_dict(), **body}), None
    body["noise"] = measured
    got = check(j, body, levels)
    if got.status is Status.FAIL:
        return Check(CHECK, Status.FAIL, f"{got.detail}; nothing recorded", data=got.data), None
    far = outside(measured, envelope)
    if far is not None:
        return Check(CHECK, Status.FAIL, f"{far}: the image or the golden is not the model's definition; nothing "
                                         "recorded", data={**j.to_dict(), **body}), None
    if got.status is not Status.PASS:
        return Check(CHECK, got.status, f"{got.detail}; nothing recorded", data=got.data), None
    section = {"envelope": dict(envelope), "noise": measured,
               "recorded": {k: v for k, v in j.to_dict().items() if k != "first_disagreement"},
               **{k: v for k, v in dict(data or {}).items() if k in ("timing", "model")}}
    return Check(CHECK, Status.PASS, f"within the golden's envelope (served median "
                                     f"{measured['median_nats']:.3g} nats, max {measured['max_nats']:.3g}); "
                                     f"{describe(j)}", data={**j.to_dict(), **body}), section


def unanswered(gone: Sequence[Scored], *, recording: bool) -> Check:
    """The ``golden`` check of a run where scheduled requests got no reply (``gone``: each with ``problem``
    saying how it ended): a fail. The golden answers every prompt of the schedule; a request the image could
    not answer (its engine died, its server answered with an error or not at all) is a reply that is not the
    golden's, whatever the replies that did come back say. A recording with one keeps nothing."""
    by_source: dict[str, int] = {}
    for reply in gone:
        key = f"{reply.source}:{reply.level}"
        by_source[key] = by_source.get(key, 0) + 1
    where = ", ".join(f"{'HTTP sweep' if k.startswith('http') else 'fixed batches'} at concurrency "
                      f"{k.partition(':')[2]} ({n})" for k, n in by_source.items())
    first = gone[0]
    detail = (f"the image gave no reply to {len(gone)} scheduled request{'' if len(gone) == 1 else 's'}, each of "
              f"which the golden answers ({where}): e.g. {first.name}: {first.problem}")
    return Check(CHECK, Status.FAIL, detail[:1500] + ("; nothing recorded" if recording else ""),
                 data={"unanswered": len(gone), "by_source": by_source,
                       "first": [f"{r.name}: {r.problem}"[:300] for r in gone[:10]]})


def skipped(why: str) -> Check:
    """The ``golden`` check where it cannot run on this host or for this run: a skip that says why."""
    return Check(CHECK, Status.SKIP, f"not run: {why}")
