"""The ``golden`` check: served replies against the golden forward, where the golden is confident. Pure.

The golden (:mod:`.forward`) scores each served reply teacher-forced: at every
generated position, given the prompt and the tokens the server sent before
it, which token the golden ranks first, by how many nats it leads the
runner-up (its *margin*), and its log-probabilities of the tokens the server
named. vLLM computes in bfloat16 with kernels of its own, the golden in
float32 with plain PyTorch, so the two never agree bit for bit; the question
is how far apart a right image lies, and that is measured, not assumed:

- **noise**, measured when the reference is recorded on the trusted image
  (``smoke --record-reference``): at every position of every reply it
  recorded (concurrency 1 over HTTP, and every fixed-batch level), take the
  two tokens vLLM ranked first there, ``a`` and ``b``, and compare how far
  ``a`` leads ``b`` in vLLM's log-probabilities with how far it leads in the
  golden's: ``|(vLLM a - vLLM b) - (golden a - golden b)|``, the *margin
  error*. The reference keeps its distribution and, per prompt, its
  maximum: that prompt's noise. Per prompt, because it differs by prompt:
  a prompt longer than ``topk_blocks x block_size`` tokens (2,048 for
  MiniMax-M3) has its attention blocks chosen by the indexer, and a
  bfloat16 computation of the index scores can choose another block than
  the golden's float32 where two scores are close; a shorter prompt reads
  every block and only rounding separates the two (measured on CPU, the tiny
  model served in bfloat16 against the golden: median margin error 0.23-0.31
  nats, largest 1.3-1.8, where every block is read; median 1.3, largest 5-10
  with 16-token blocks and a top-k of 4, where the indexer chooses).
- **confident** positions are those where the golden's margin exceeds
  :data:`MARGIN_MULTIPLE` times their prompt's noise (a prompt the recording
  did not measure: the largest noise of all). vLLM serves its first token
  ``a``; for the golden to rank vLLM's runner-up ``b`` first by a margin
  ``m``, the two must disagree on ``a - b`` by at least ``m``, so on a right
  image a served token differs from the golden's (when the golden's token is
  one of vLLM's two best) only where the margin is at most the noise. The
  multiple 1.5 leaves half as much again for positions the recording did
  not see.
- at a confident position the served token must be the golden's. The check
  fails at the first confident position where it is not, naming the reply
  (HTTP at concurrency 1, or fixed batches at a level), the request, the
  position, both tokens and the margin.

A recording is refused where the median margin error exceeds
:data:`NOISE_CEILING`: a trusted image that far from the model's definition
(or a golden that far from the image) is no basis for a threshold.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..verdicts import Check, Status

CHECK = "golden"
MARGIN_MULTIPLE = 1.5  # confident: golden margin > this x the recorded noise (see the module's docstring)
NOISE_CEILING = 1.0  # nats: a recording whose median golden-vs-vLLM margin error is larger is refused


@dataclass(frozen=True, slots=True)
class Position:
    """One generated position of a served reply, as the golden scored it (teacher-forced)."""

    golden: int  # the token the golden ranks first
    margin: float  # nats the golden's first token leads its second
    served: int  # the token the server sent
    served_logprob: float  # the golden's log-probability of the served token
    margin_error: float | None  # vLLM's and the golden's lead of vLLM's first token over its second, apart
    # (nats; None where the server sent no top-2 here)


@dataclass(frozen=True, slots=True)
class Scored:
    """One served reply scored by the golden; ``problem`` says why it could not be (its positions are empty)."""

    source: str  # "http" (the sweep at concurrency 1) or "fixed" (the fixed-batch probe)
    level: int
    request: int
    prompt: int
    positions: tuple[Position, ...] = ()
    problem: str = ""

    @property
    def name(self) -> str:
        where = "HTTP sweep" if self.source == "http" else "fixed batches"
        return f"{where} at concurrency {self.level}, request {self.request} (prompt {self.prompt})"


@dataclass(frozen=True, slots=True)
class Disagreement:
    """The first confident position where a served token is not the golden's."""

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
class Judgement:
    """Every scored reply against the golden at its prompt's margin threshold."""

    thresholds: Thresholds
    replies: int
    positions: int
    confident: int
    agreeing: int
    first: Disagreement | None
    unscored: tuple[str, ...] = ()
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)

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
                "confident": self.confident, "agreeing": self.agreeing, "first_disagreement": first,
                "unscored": list(self.unscored[:10]), "by_source": self.by_source}


@dataclass(frozen=True, slots=True)
class Thresholds:
    """The margin a position's golden must exceed to be confident: per prompt where the recording measured it
    (each prompt's noise differs: a long prompt's sparse block selection can flip under bfloat16), else
    ``default`` (None: a prompt the recording did not measure is not judged)."""

    by_prompt: Mapping[int, float] = field(default_factory=dict)
    default: float | None = None

    def of(self, prompt: int) -> float | None:
        return self.by_prompt.get(prompt, self.default)

    def to_dict(self) -> dict[str, Any]:
        return {"by_prompt": {str(k): v for k, v in sorted(self.by_prompt.items())}, "default": self.default}


def judge(scored: Sequence[Scored], thresholds: Thresholds | float) -> Judgement:
    """Each reply's positions where the golden's margin exceeds its prompt's threshold: the served token must be
    the golden's. Replies that could not be scored are named (they fail the check: nothing judged them)."""
    if not isinstance(thresholds, Thresholds):
        thresholds = Thresholds(default=float(thresholds))
    positions = confident = agreeing = 0
    first: Disagreement | None = None
    unscored = []
    by_source: dict[str, dict[str, int]] = {}
    for reply in scored:
        if reply.problem:
            unscored.append(f"{reply.name}: {reply.problem}")
            continue
        tally = by_source.setdefault(f"{reply.source}:{reply.level}", {"positions": 0, "confident": 0,
                                                                      "agreeing": 0})
        threshold = thresholds.of(reply.prompt)
        for j, p in enumerate(reply.positions):
            positions += 1
            tally["positions"] += 1
            if threshold is None or not p.margin > threshold:
                continue
            confident += 1
            tally["confident"] += 1
            if p.served == p.golden:
                agreeing += 1
                tally["agreeing"] += 1
            elif first is None:
                first = Disagreement(reply.name, reply.source, reply.level, reply.request, reply.prompt, j,
                                     p.golden, p.served, p.margin)
    return Judgement(thresholds, len(scored), positions, confident, agreeing, first, tuple(unscored), by_source)


def _quantile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def noise(scored: Sequence[Scored]) -> dict[str, Any]:
    """What the reference keeps of the golden-vs-vLLM noise measured on the trusted image's replies: the
    distribution of the per-position margin errors, each prompt's largest (its noise) and its threshold, and the
    largest of all (the threshold of a prompt not measured)."""
    per: dict[int, list[float]] = {}
    for r in scored:
        if r.problem:
            continue
        per.setdefault(r.prompt, []).extend(p.margin_error for p in r.positions
                                           if p.margin_error is not None and math.isfinite(p.margin_error))
    per = {k: v for k, v in per.items() if v}
    deltas = [d for v in per.values() for d in v]
    if not deltas:
        raise ValueError("no position of the trusted image's replies carried vLLM's log-probabilities to compare")
    top = max(deltas)
    return {"measure": "per position, |(vLLM a - vLLM b) - (golden a - golden b)| in log-probability, a and b "
                       "vLLM's two best tokens; teacher-forced on the trusted image's replies",
            "positions": len(deltas), "replies": sum(not r.problem for r in scored),
            "median_nats": round(statistics.median(deltas), 6), "p90_nats": round(_quantile(deltas, 0.9), 6),
            "p99_nats": round(_quantile(deltas, 0.99), 6), "max_nats": round(top, 6),
            "by_prompt_max_nats": {str(k): round(max(v), 6) for k, v in sorted(per.items())},
            "margin_multiple": MARGIN_MULTIPLE,
            "threshold_by_prompt_nats": {str(k): round(MARGIN_MULTIPLE * max(v), 6) for k, v in sorted(per.items())},
            "threshold_nats": round(MARGIN_MULTIPLE * top, 6)}


def thresholds(section: Mapping[str, Any] | None) -> Thresholds | None:
    """The margin thresholds a reference's ``golden`` section names (None: it has none, or a malformed one)."""
    measured = (section or {}).get("noise") or {}
    default = measured.get("threshold_nats")
    if not (isinstance(default, (int, float)) and math.isfinite(default) and default >= 0):
        return None
    per = {}
    for k, v in dict(measured.get("threshold_by_prompt_nats") or {}).items():
        if not (str(k).isdigit() and isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            return None
        per[int(k)] = float(v)
    return Thresholds(per, float(default))


def describe(j: Judgement) -> str:
    values = [*j.thresholds.by_prompt.values()] or ([j.thresholds.default] if j.thresholds.default is not None else [])
    span = (f"{min(values):.3g}-{max(values):.3g}" if len(set(values)) > 1 else f"{values[0]:.3g}") if values else "-"
    share = f"{j.confident} of {j.positions} positions confident (golden margin over {span} nats, by prompt)"
    return f"{j.agreeing} of {j.confident} confident positions agree with the golden; {share}, {j.replies} replies"


def check(j: Judgement, data: Mapping[str, Any] | None = None) -> Check:
    """The ``golden`` check of a judged run."""
    body = {**j.to_dict(), **dict(data or {})}
    if j.first is not None:
        return Check(CHECK, Status.FAIL, f"a served token is not the golden's where the golden is confident: "
                                         f"{j.first.describe()} ({describe(j)})", data=body)
    if j.unscored:
        return Check(CHECK, Status.FAIL, f"{len(j.unscored)} repl{'y' if len(j.unscored) == 1 else 'ies'} could "
                                         f"not be scored by the golden, e.g. {j.unscored[0]}", data=body)
    if j.confident == 0:
        return Check(CHECK, Status.INCOMPLETE, f"no position where the golden is confident ({describe(j)}): the "
                                               "golden judged nothing", data=body)
    return Check(CHECK, Status.PASS, describe(j), data=body)


def recorded(scored: Sequence[Scored], data: Mapping[str, Any] | None = None
             ) -> tuple[Check, dict[str, Any] | None]:
    """A recording's ``golden`` check and the reference's ``golden`` section (None: nothing to keep): the noise
    measured on the trusted image's replies, and those replies judged at the threshold it gives."""
    try:
        measured = noise(scored)
    except ValueError as exc:
        return Check(CHECK, Status.FAIL, f"cannot measure the golden's noise: {exc}", data=dict(data or {})), None
    found = thresholds({"noise": measured})
    assert found is not None
    j = judge(scored, found)
    body = {"noise": measured, **dict(data or {})}
    if measured["median_nats"] > NOISE_CEILING:
        return Check(CHECK, Status.FAIL, f"the trusted image's replies lie a median {measured['median_nats']:.3g} nats "
                                         f"from the golden (more than {NOISE_CEILING:g}): the image or the golden is "
                                         "not the model's definition; nothing recorded",
                     data={**j.to_dict(), **body}), None
    got = check(j, body)
    if got.status is not Status.PASS:
        return got, None
    section = {**body, "recorded": {k: v for k, v in j.to_dict().items() if k != "first_disagreement"}}
    return Check(CHECK, Status.PASS, f"noise {measured['max_nats']:.3g} nats (median {measured['median_nats']:.3g}) "
                                     f"over {measured['positions']} positions; {describe(j)}",
                 data={**j.to_dict(), **body}), section


def skipped(why: str) -> Check:
    """The ``golden`` check where it cannot run on this host or for this run: a skip that says why."""
    return Check(CHECK, Status.SKIP, f"not run: {why}")
