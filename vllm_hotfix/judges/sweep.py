"""The host's judge of a concurrency sweep: each reply, each level's summary, and the ``serve-sweep`` check.

A server can survive a bug and answer wrongly with HTTP 200, so each request
is judged by the strictest check given: with a reference by the oracle
(:mod:`.oracle`: at concurrency 1 bit for bit against the reference; above
it by its form, HTTP status, length, finish reason and no NaN, with how far
it moved from the same image's concurrency-1 reply measured, never judged:
over HTTP a reply's batch is the timing's, and how far a batch moves a
model's numerics is the model's); with ``min_tokens`` a shorter reply fails;
else the HTTP status alone. Every request keeps its evidence beside each
level's summary (:func:`summarise`), and each level above 1 its measured
movement (:func:`vllm_hotfix.inimage.oracle.movement`).

The replies come from the sender (:mod:`vllm_hotfix.inimage.sweep`): here on
the host when ``serve-check`` asks a running server (:func:`sweep`, judging
each level as it comes back), or sent back by the runner in the image and
judged again from what it sent (:mod:`.replies`). The image never judges.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from ..inimage import oracle as measures
from ..inimage import reference as answers
from ..inimage.sweep import (
    DEFAULT_LEVELS,
    MAX_TOKENS,
    Asked,
    Level,
    RequestEvidence,
    SweepResult,
    Watcher,
    cause,
)
from ..inimage.sweep import sweep as send
from . import oracle

log = logging.getLogger(__name__)


def judge(ev: RequestEvidence, k: int, reply: answers.Reply, ref: answers.Reference,
          basis: dict[int, answers.Reply], exact: bool) -> None:
    """The oracle's verdict on one reply into ``ev``: at concurrency 1 (``exact``) bit for bit against the
    reference; above it by its form, with its movement from the same image's concurrency-1 reply to prompt ``k``
    (the reference's answer where there is none) measured."""
    answer = ref.answers[k]
    if answer.prompt_tokens is not None and reply.prompt_tokens is not None \
            and reply.prompt_tokens != answer.prompt_tokens:
        ev.judged_by = "exact" if exact else "form"
        ev.error = (f"prompt {k}: the prompt was {reply.prompt_tokens} tokens, in the reference "
                    f"{answer.prompt_tokens}: another model or tokenizer than the reference's")
        return
    if exact:
        ev.judged_by, ev.basis = "exact", "reference"
        verdict = oracle.exact(answer, reply)
    else:
        own = basis.get(k)
        ev.judged_by, ev.basis = "form", "concurrency-1" if own is not None else "reference"
        verdict = oracle.moved(own if own is not None else answer, reply, reply.completion_tokens, ref.max_tokens)
    dev = verdict.deviation
    ev.divergence, ev.token_divergence = dev.first_difference, dev.token_divergence
    # Not rounded: one bit of difference at concurrency 1 must show in the evidence.
    ev.max_logprob_diff, ev.gap_nats = dev.max_logprob_diff, dev.gap
    ev.deviation_nats = None if dev.size == float("inf") else dev.size
    ev.passed = verdict.ok
    if not verdict.ok:
        ev.error = f"prompt {k}: {verdict.detail}"


def short(ev: RequestEvidence, reply: answers.Reply, min_tokens: int) -> bool:
    """``--min-tokens``: a reply with fewer completion tokens fails, its evidence saying so."""
    if reply.completion_tokens >= min_tokens:
        return False
    ev.judged_by, ev.passed = "min-tokens", False
    ev.error = (f"reply of {reply.completion_tokens} completion token(s), every reply must have "
                f"at least {min_tokens} (finish_reason {reply.finish_reason})")
    return True


def judge_reply(ev: RequestEvidence, k: int, reply: answers.Reply, ref: answers.Reference | None,
                basis: dict[int, answers.Reply], exact: bool, min_tokens: int | None) -> None:
    """One reply that came back, judged into ``ev`` by the strictest check given: the reference's oracle, then
    ``min_tokens`` (a reply the reference passed can still be too short: a test model that cannot stop early),
    else its HTTP status alone."""
    if ref is not None:
        judge(ev, k, reply, ref, basis, exact)
        if not ev.passed:
            return
    if min_tokens is not None:
        if ref is None:
            ev.judged_by = "min-tokens"
        if short(ev, reply, min_tokens):
            return
    ev.passed = True


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


def _deviation(ev: RequestEvidence) -> measures.Deviation:
    """A judged reply's deviation from its basis, as its evidence keeps it."""
    return measures.Deviation(ev.divergence is None, ev.divergence, ev.token_divergence, ev.max_logprob_diff or 0.0,
                              ev.gap_nats, comparable=ev.deviation_nats is not None)


def summarise(level: Level) -> None:
    """A level's summary, from its requests' evidence alone."""
    replies = [ev for ev in level.per_request if ev.http_status == 200 and ev.reply_tokens is not None]
    for ev in replies:
        reason = str(ev.finish_reason)
        level.finish_reasons[reason] = level.finish_reasons.get(reason, 0) + 1
    level.shortest_reply_tokens = min((ev.reply_tokens or 0 for ev in replies), default=None)
    passed = [ev for ev in level.per_request if ev.passed]
    level.successes = len(passed)
    level.failures = len(level.per_request) - len(passed)
    level.errors = [" ".join(str(ev.error).split())[:300] for ev in level.per_request if not ev.passed][:3]
    judged = [ev for ev in replies if ev.judged_by in ("exact", "form")]
    level.wrong_answers = sum(not ev.passed for ev in judged)
    level.identical = sum(ev.passed and ev.divergence is None for ev in judged)
    level.deviated = sum(ev.passed and ev.divergence is not None for ev in judged)
    level.widest_deviation_nats = max((ev.deviation_nats for ev in judged if ev.deviation_nats is not None),
                                      default=None)
    formed = [ev for ev in judged if ev.judged_by == "form"]
    level.movement = measures.movement([_deviation(ev) for ev in formed]) if formed else None
    if passed:
        latencies = [ev.latency_s for ev in passed]
        level.p50_s = round(percentile(latencies, 50), 4)
        level.p95_s = round(percentile(latencies, 95), 4)
        tokens = sum(ev.reply_tokens or 0 for ev in passed)
        level.output_tokens_per_s = round(tokens / level.wall_s, 2) if level.wall_s > 0 else None


def format_level(level: Level) -> str:
    def ms(v: float | None) -> str:
        return f"{v * 1000:7.1f}" if v is not None else "      -"

    tps = f"{level.output_tokens_per_s:8.1f}" if level.output_tokens_per_s is not None else "       -"
    shortest = "-" if level.shortest_reply_tokens is None else str(level.shortest_reply_tokens)
    judged = any(ev.judged_by in ("exact", "form") for ev in level.per_request)
    widest = "-" if level.widest_deviation_nats is None else f"{level.widest_deviation_nats:.3g}"
    beyond = f", {level.movement['beyond_top_k']} beyond top-k" if level.movement else ""
    answers_note = (f"  wrong answers {level.wrong_answers}, identical {level.identical}, moved "
                    f"{level.deviated} (widest {widest} nats{beyond})" if judged else "")
    return (
        f"    concurrency {level.concurrency:>3}: {level.successes:>4}/{level.requests:<4} ok  "
        f"p50 {ms(level.p50_s)} ms  p95 {ms(level.p95_s)} ms  {tps} tok/s  shortest reply {shortest} tok"
        + answers_note
    )


class Judged:
    """The sender's judge (:class:`vllm_hotfix.inimage.sweep.Judge`) where the host asks a server itself:
    every reply as its level comes back, at concurrency 1 the passing replies kept as the basis above it."""

    def __init__(self, reference: answers.Reference | None, min_tokens: int | None) -> None:
        self.reference, self.min_tokens = reference, min_tokens
        self.basis: dict[int, answers.Reply] = {}

    def level(self, level: Level, asked: Asked) -> None:
        exact = self.reference is not None and level.concurrency == 1
        for ev, reply in asked:
            if reply is not None:
                judge_reply(ev, ev.prompt, reply, self.reference, self.basis, exact, self.min_tokens)
        if exact:
            for ev, reply in asked:
                # Only a reply the oracle passed: under --keep-going a wrong one must not become the basis above.
                if reply is not None and reply.tokens is not None and ev.passed:
                    self.basis.setdefault(ev.prompt, reply)
        summarise(level)

    def line(self, level: Level) -> str:
        return format_level(level)


def sweep(url: str, model: str | None = None, levels: Sequence[int] = DEFAULT_LEVELS, n: int = 32, *,
          watch: Watcher | None = None, timeout: float = 120, max_tokens: int = MAX_TOKENS,
          min_tokens: int | None = None, reference: answers.Reference | None = None,
          progress: Callable[[str], None] | None = None, keep_going: bool = False) -> SweepResult:
    """A sweep asked from here and judged as it goes: ``reference``: every reply by the oracle (bit for bit at
    concurrency 1; above it by its form, its movement from the same image's concurrency-1 reply measured), its
    prompts and max_tokens asked; ``min_tokens``: every reply must carry at least this many completion tokens."""
    if reference is not None:
        max_tokens = reference.max_tokens
    result = send(url, model, levels, n, watch=watch, timeout=timeout, max_tokens=max_tokens, min_tokens=min_tokens,
                  progress=progress, keep_going=keep_going,
                  prompts=reference.prompts if reference is not None else None,
                  judge=Judged(reference, min_tokens))
    if reference is not None:
        result.reference = reference.summary()
    return result


def failure_message(result: SweepResult) -> str:
    level = next(lv for lv in result.levels if lv.concurrency == result.failed_level)
    why = level.errors[0] if level.errors else "unknown error"
    server = cause(result.server_log)
    if result.server_died:
        return (f"server {result.url} died during the sweep (at concurrency {result.failed_level}, "
                f"{level.successes}/{level.requests} requests ok): it no longer answers"
                + (f"; server: {server}" if server else f" ({why})"))
    later = [lv.concurrency for lv in result.levels if lv.failures and lv.concurrency != result.failed_level]
    also = f"; also failed at concurrency {','.join(map(str, later))}" if later else ""
    return (
        f"serve sweep failed at concurrency {result.failed_level}{also}: "
        f"{level.failures}/{level.requests} requests failed ({why})" + (f"; server: {server}" if server else "")
    )


def as_check(result: SweepResult, levels: Sequence[int], min_tokens: int | None) -> dict[str, Any]:
    """The serve-sweep check a judged sweep makes (serve-check's, and the runner's sweep judged on the host)."""
    if not result.ok:
        tail = result.server_log.strip().splitlines()[-12:]
        return {"name": "serve-sweep", "status": "fail", "detail": failure_message(result),
                "data": {"server_log": tail}}
    detail = f"levels {','.join(map(str, levels))}: every request succeeded"
    if min_tokens is not None:
        detail += f", every reply at least {min_tokens} token(s)"
    if result.reference is not None:
        moved = [f"{lv.deviated} of {lv.requests} at {lv.concurrency}" for lv in result.levels if lv.concurrency != 1]
        detail += (f", every reply at concurrency 1 bitwise the reference answer ({result.reference['file']}) and "
                   f"every reply above it whole (status, length, finish reason, no NaN); moved from the same "
                   f"image's concurrency-1 reply, measured and not judged: "
                   f"{', '.join(moved) or 'no level above 1'}")
    return {"name": "serve-sweep", "status": "pass", "detail": detail}
