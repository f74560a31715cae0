"""Recording reference answers from a trusted server, and what the oracle needs measured on it.

:func:`record` asks the prompt set once at concurrency 1 (the answers), once
more (every reply must repeat bit for bit, or the exact oracle cannot hold on
this server and its settings), then :data:`~vllm_hotfix.inimage.oracle.NOISE_ROUNDS`
times at :data:`~vllm_hotfix.inimage.oracle.NOISE_CONCURRENCY` against those answers:
how far those replies moved is measured and kept (``noise``), whatever it is
(a model's sensitivity to its batch is its own, and a right image may serve
there tokens its concurrency-1 answer had outside its top-k); only a reply
whose form is wrong (a NaN, a finish reason other than stop or length, a
length that does not add up) ends the recording. It also measures whether the
model reads its prompt (distinct replies, the median gap between the first
token's two best candidates). It speaks HTTP through
:mod:`vllm_hotfix.inimage.sweep`; the runner carries both into the image.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import requests

from .. import __version__
from ..errors import SmokeError
from . import oracle
from . import reference as answers
from .sweep import MAX_TOKENS, PROMPTS, RequestEvidence, ask, first_model, pool


def _record_round(url: str, model: str, prompts: Sequence[str], max_tokens: int, timeout: float,
                  concurrency: int, n: int) -> list[tuple[int, answers.Reply]]:
    """``n`` requests over the prompt set at ``concurrency``; any failed one ends the recording."""

    def job(session: requests.Session, i: int) -> tuple[int, answers.Reply]:
        k = i % len(prompts)
        ev = RequestEvidence(concurrency, i, k, None, 0.0)
        reply = ask(session, url, model, prompts[k], max_tokens, timeout, ev)
        if reply is None:
            raise SmokeError(f"cannot record reference answers from {url}: prompt {k} at concurrency {concurrency}: "
                             f"{' '.join(str(ev.error).split())[:240]}")
        if reply.tokens is None or len(reply.top) < len(reply.tokens):
            raise SmokeError(f"cannot record reference answers from {url}: prompt {k}: the reply carries no top "
                             "logprobs per token (a server that does not speak vLLM's completions API?)")
        return k, reply

    return pool(concurrency, n, job)


def record(url: str, model: str | None = None, *, prompts: Sequence[str] = PROMPTS, max_tokens: int = MAX_TOKENS,
           timeout: float = 120, recorded_from: str | None = None,
           progress: Callable[[str], None] | None = None) -> answers.Reference:
    """Reference answers from the server at ``url``, with what the oracle needs measured on the same server.

    The prompt set once at concurrency 1, temperature 0 (the answers); once
    more (``repeat``: every reply must be bitwise the first, or the oracle
    cannot hold); then :data:`oracle.NOISE_ROUNDS` times at
    :data:`oracle.NOISE_CONCURRENCY` against those answers (``noise``: how far
    they moved, measured, never judged). Only a trusted server may be
    recorded: any failed request, a reply that does not repeat, or a reply at
    concurrency 16 whose form is wrong ends the recording.
    """
    url = url.rstrip("/")
    model = model or first_model(url)
    say = progress or (lambda _line: None)
    first = _record_round(url, model, prompts, max_tokens, timeout, 1, len(prompts))
    got = [answers.answer_of(prompts[k], reply) for k, reply in first]
    again = _record_round(url, model, prompts, max_tokens, timeout, 1, len(prompts))
    for k, reply in again:
        dev = oracle.compare(got[k], reply)
        if not dev.identical:
            raise SmokeError(f"cannot record reference answers from {url}: prompt {k} asked again at concurrency 1 "
                             f"differs ({dev.detail}): the server is not repeatable bit for bit (run it with "
                             f"{' '.join(oracle.SERVE_ARGS)} and "
                             f"{' '.join(f'{k}={v}' for k, v in oracle.SERVE_ENV.items())})")
    say(f"    asked the {len(prompts)} prompts again at concurrency 1: every reply bitwise equal")
    loud = _record_round(url, model, prompts, max_tokens, timeout, oracle.NOISE_CONCURRENCY,
                         oracle.NOISE_ROUNDS * len(prompts))
    for k, reply in loud:
        # Only a malformed reply ends the recording here; how far a whole one moved is measured below.
        fault = oracle.form_fault(reply, reply.completion_tokens, max_tokens)
        if fault is not None:
            raise SmokeError(f"cannot record reference answers from {url}: prompt {k} at concurrency "
                             f"{oracle.NOISE_CONCURRENCY}: malformed reply: {fault}")
    noise = oracle.noise([oracle.compare(got[k], reply) for k, reply in loud])
    sensitivity = oracle.prompt_sensitivity(got, [a.sha256 for a in got])
    say(f"    recorded {len(got)} reference answers of {model} from {recorded_from or url}; at concurrency "
        f"{noise['concurrency']}: {oracle.describe_movement(noise)}; {sensitivity['distinct_replies']} distinct "
        f"replies, median first-token gap {sensitivity['median_first_token_gap_nats']} nats")
    served = first[0][1].model if first else ""
    return answers.Reference(model, served or model, max_tokens, answers.TOP_LOGPROBS, tuple(got), __version__,
                             time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), recorded_from or url,
                             noise=noise, repeat={"concurrency": 1, "requests": len(again), "identical": len(again)},
                             prompt_sensitivity=sensitivity)

