"""The oracle's measures of a reply: how far it lies from a basis, and what is wrong with its form.

:func:`compare` finds where a reply departs from its basis (the reference
answer, or the same image's concurrency-1 reply) and by how much;
:func:`form_fault` says what is wrong with a reply whatever its numerics
(no log-probabilities, a NaN, a finish reason other than stop or length, a
length that does not add up); :func:`movement` and :func:`noise` sum up how
far replies moved. Beside them, the settings under which concurrency 1 is
repeatable bit for bit (:data:`SERVE_ARGS`, :data:`SERVE_ENV`) and the keys a
reference names (:data:`SETTING_KEYS`). The verdict on a reply (bit for bit
at concurrency 1, by its form above it) is the host's
(:mod:`vllm_hotfix.judges.oracle`); a recording in the image uses these
measures only to refuse answers that do not repeat or are malformed.

Pure and stdlib-only: the runner carries it into the image with the sweep's sender.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

# What the sweep's server always runs with, so that concurrency 1 is repeatable bit for bit.
SERVE_ARGS = ("--no-enable-prefix-caching",)
SERVE_ENV = {"VLLM_BATCH_INVARIANT": "1"}
CONTRARY_ARGS = ("--enable-prefix-caching",)
NOISE_CONCURRENCY = 16
NOISE_ROUNDS = 2  # requests at NOISE_CONCURRENCY: the prompt set this many times
# How a completion may end (vLLM also says "abort" and "error": a request the engine gave up on is no answer).
FINISH_REASONS = ("stop", "length")
# The settings a reference names and a judged run must share (what decides the numerics).
SETTING_KEYS = ("serve_args", "env", "gpu", "vllm", "torch", "base_image_id", "model")


class Tokens(Protocol):
    """A reply or a reference answer: tokens, their log-probabilities, the top-k per position."""

    @property
    def tokens(self) -> Sequence[str] | None: ...

    @property
    def logprobs(self) -> Sequence[float | None]: ...

    @property
    def top(self) -> Sequence[Mapping[str, float]]: ...

    @property
    def finish_reason(self) -> str: ...


@dataclass(frozen=True, slots=True)
class Deviation:
    """One reply against a basis (the reference answer, or the same image's concurrency-1 reply)."""

    identical: bool  # tokens, log-probabilities, top-k and finish reason equal, bit for bit
    first_difference: int | None = None  # first position where a token or a log-probability differs
    token_divergence: int | None = None  # first position where the tokens differ
    max_logprob_diff: float = 0.0  # largest |difference| over the positions where the tokens agree
    gap: float | None = None  # at the token divergence: nats the basis's token lay below the served one
    comparable: bool = True  # False: the basis's token is not in the served top-k, or a length differs early
    non_finite: bool = False  # a NaN or infinite log-probability in the reply
    detail: str = ""

    @property
    def size(self) -> float:
        """How far the reply lies from its basis, in nats (infinite where it cannot be measured)."""
        if not self.comparable or self.non_finite:
            return math.inf
        return max(self.max_logprob_diff, self.gap or 0.0)


def _finite(values: Sequence[float | None], tops: Sequence[Mapping[str, float]]) -> bool:
    return all(v is not None and math.isfinite(v) for v in values) and all(
        math.isfinite(v) for t in tops for v in t.values())


def compare(basis: Tokens, reply: Tokens) -> Deviation:
    """Where ``reply`` departs from ``basis``, and by how much (see :class:`Deviation`)."""
    if reply.tokens is None:
        return Deviation(False, 0, 0, comparable=False, detail="the reply carries no logprobs")
    want, got = list(basis.tokens or ()), list(reply.tokens)
    non_finite = not _finite(reply.logprobs, reply.top)
    first = None
    widest = 0.0
    n = 0
    while n < len(want) and n < len(got) and want[n] == got[n]:
        a = basis.logprobs[n] if n < len(basis.logprobs) else None
        b = reply.logprobs[n] if n < len(reply.logprobs) else None
        top_a = basis.top[n] if n < len(basis.top) else {}
        top_b = reply.top[n] if n < len(reply.top) else {}
        if first is None and (a != b or dict(top_a) != dict(top_b)):
            first = n
        pairs = [(a, b)] + [(top_a[k], top_b[k]) for k in top_a.keys() & top_b.keys()]
        for x, y in pairs:
            if x is not None and y is not None and math.isfinite(x) and math.isfinite(y):
                widest = max(widest, abs(x - y))
        n += 1
    widest = float(widest)
    if n == len(want) == len(got):
        same_end = basis.finish_reason == reply.finish_reason
        if first is None and same_end and not non_finite:
            return Deviation(True)
        where = first if first is not None else n
        detail = (f"finish_reason {reply.finish_reason}, the basis's {basis.finish_reason}" if first is None
                  and not same_end else f"log-probabilities differ from position {where} "
                  f"(largest difference {widest:.3g} nats)")
        return Deviation(False, where, None, widest, comparable=same_end, non_finite=non_finite, detail=detail)
    first = n if first is None else first
    if n == len(want) or n == len(got):
        longer = "reply" if n == len(want) else "basis"
        return Deviation(False, first, n, widest, comparable=False, non_finite=non_finite,
                         detail=f"the {'basis' if longer == 'reply' else 'reply'} ends at position {n}, the "
                                f"{longer} goes on with {(got if longer == 'reply' else want)[n]}")
    top = reply.top[n] if n < len(reply.top) else {}
    chosen = reply.logprobs[n] if n < len(reply.logprobs) else None
    chosen = top.get(got[n]) if chosen is None else chosen
    if want[n] not in top or chosen is None:
        return Deviation(False, first, n, widest, comparable=False, non_finite=non_finite,
                         detail=f"served {got[n]} at position {n}; the basis's {want[n]} is not among the served "
                                f"top-{len(top)} there")
    gap = float(chosen - top[want[n]])
    return Deviation(False, first, n, widest, gap, non_finite=non_finite,
                     detail=f"served {got[n]} at position {n}, the basis's {want[n]} {gap:.3g} nats below it")


def form_fault(reply: Tokens, completion_tokens: int, max_tokens: int) -> str | None:
    """What is wrong with a reply's form whatever its numerics (None: nothing): no log-probabilities, a NaN,
    a finish reason other than stop or length, or a length that does not add up (``completion_tokens`` as the
    server counted them, against the tokens it named and the ``max_tokens`` asked for)."""
    tokens = reply.tokens
    if tokens is None:
        return "the reply carries no logprobs"
    if not _finite(reply.logprobs, reply.top):
        return "a NaN or infinite log-probability in the reply"
    if reply.finish_reason not in FINISH_REASONS:
        return f"finish_reason {reply.finish_reason!r}, not {' or '.join(FINISH_REASONS)}"
    n = len(tokens)
    if not 1 <= n <= max_tokens or completion_tokens != n or len(reply.logprobs) != n or len(reply.top) != n:
        return (f"wrong length: {n} token(s) named, {completion_tokens} counted, {len(reply.logprobs)} "
                f"log-probabilities and {len(reply.top)} top-k lists, for at most {max_tokens} asked")
    if reply.finish_reason == "length" and n != max_tokens:
        return f"wrong length: finish_reason length after {n} of the {max_tokens} tokens asked"
    return None


def _median(values: Sequence[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def movement(deviations: Sequence[Deviation]) -> dict[str, Any]:
    """How far replies moved from their basis, as measured: how many are bitwise equal, how many part in
    tokens, how many served a token the basis did not have among its top-k (``beyond_top_k``: no size in nats
    can be given), the deviation in nats (median and max over the replies it could be measured for, the
    identical ones at 0) and the first positions where each reply that is not identical differs."""
    sizes = [d.size for d in deviations if math.isfinite(d.size)]
    positions = sorted(d.first_difference for d in deviations if not d.identical and d.first_difference is not None)
    token_positions = sorted(d.token_divergence for d in deviations if d.token_divergence is not None)
    return {"replies": len(deviations), "identical": sum(d.identical for d in deviations),
            "token_divergences": len(token_positions),
            "beyond_top_k": sum(not d.identical and math.isinf(d.size) for d in deviations),
            "deviation_nats": {"median": _median(sizes), "max": max(sizes, default=None), "measured": len(sizes)},
            "first_difference": {"min": positions[0] if positions else None, "median": _median(positions),
                                 "positions": positions},
            "first_token_divergence": {"min": token_positions[0] if token_positions else None,
                                       "median": _median(token_positions)}}


def noise(deviations: Sequence[Deviation], concurrency: int = NOISE_CONCURRENCY) -> dict[str, Any]:
    """What the reference file keeps of the movement measured when it was recorded: the trusted image at
    ``concurrency`` against its own concurrency-1 answers (a measurement shown beside the runs judged against
    it, never a tolerance)."""
    return {"concurrency": concurrency, "requests": len(deviations), **movement(deviations)}


def describe_movement(measured: Mapping[str, Any]) -> str:
    """One line of :func:`movement`'s numbers."""
    nats, first = (measured.get(k) for k in ("deviation_nats", "first_difference"))
    nats, first = (v if isinstance(v, Mapping) else {} for v in (nats, first))

    def num(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, (int, float)) else "-"

    return (f"{measured.get('identical')}/{measured.get('replies')} replies bitwise equal to the concurrency-1 "
            f"reply, {measured.get('token_divergences')} parting in tokens ({measured.get('beyond_top_k')} beyond its "
            f"top-k), deviation median {num(nats.get('median'))} max {num(nats.get('max'))} nats, first difference "
            f"from position {num(first.get('min'))} (median {num(first.get('median'))})")


def prompt_sensitivity(answers: Sequence[Tokens], shas: Sequence[str]) -> dict[str, Any]:
    """Does the model read its prompt: distinct replies, and the median gap between the first token's top two."""
    gaps = []
    for a in answers:
        first = sorted((a.top[0] if a.top else {}).values(), reverse=True)
        if len(first) >= 2:
            gaps.append(first[0] - first[1])
    return {"prompts": len(shas), "distinct_replies": len(set(shas)),
            "median_first_token_gap_nats": round(statistics.median(gaps), 4) if gaps else None}


def check_serve_args(args: Sequence[str]) -> None:
    """ValueError for a server argument that would undo the oracle's settings."""
    for arg in args:
        if arg.split("=", 1)[0] in CONTRARY_ARGS:
            raise ValueError(f"--serve-arg={arg}: the sweep's server runs with {' '.join(SERVE_ARGS)} (concurrency 1 "
                             "is compared bit for bit, which prefix caching breaks)")


def fingerprint(folder: str) -> str:
    """A model folder's fingerprint: each file's path, size and sha256 (of its first and last MiB only, past
    64 MiB: a served model's weights can be hundreds of GB), hashed together in path order."""
    import hashlib
    import os

    h = hashlib.sha256()
    found = []
    for top, dirs, files in os.walk(folder):
        dirs.sort()
        found += [os.path.join(top, f) for f in files]
    for path in sorted(found):
        size = os.path.getsize(path)
        part = hashlib.sha256()
        with open(path, "rb") as fh:
            if size <= 64 << 20:
                for block in iter(lambda: fh.read(1 << 20), b""):
                    part.update(block)
            else:
                part.update(fh.read(1 << 20))
                fh.seek(size - (1 << 20))
                part.update(fh.read(1 << 20))
        h.update(f"{os.path.relpath(path, folder)}\0{size}\0{part.hexdigest()}\n".encode())
    return h.hexdigest()
