"""The answer oracle: bit for bit at concurrency 1, within recorded noise above it.

Measured on an H200 (the patched image, a tiny MiniMax-M3): with vLLM's
prefix caching on, the same server asked the same prompts twice in a row at
concurrency 1 gave bitwise-equal log-probabilities for only 4 of 24 replies;
with ``--no-enable-prefix-caching`` and ``VLLM_BATCH_INVARIANT=1`` it gave 24
of 24, again after a restart (whether the second setting is needed was not
measured, so both are kept). Under those settings a reply at concurrency 1
is the reference answer exactly, or it is wrong:

- **concurrency 1**: tokens, their log-probabilities and the top-k
  log-probabilities must equal the reference's bit for bit (a float read
  from JSON is the float the server wrote, so ``==`` compares the bits). The
  evidence names the first position that differs and the largest
  log-probability difference over the prefix where the tokens agree.
- **above concurrency 1** the numerics follow the batch (at 16, 3 of 24
  replies were bitwise equal to the concurrency-1 ones in that measurement),
  so each reply is compared with the same image's concurrency-1 reply to the
  same prompt: status, length, finish reason, no NaN, and a deviation (the
  largest log-probability difference over the shared prefix, and where the
  tokens part, how far below the served token the other reply's token lay)
  of at most the tolerance. The tolerance is :data:`NOISE_MULTIPLE` times the
  spread measured when the reference was recorded (the trusted image at
  concurrency :data:`NOISE_CONCURRENCY` against its own concurrency-1
  answers), never a constant.

Pure and stdlib-only: the runner carries it into the image with the sweep.
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
NOISE_MULTIPLE = 4.0  # the default: tolerance above concurrency 1 = this many times the recorded spread
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


@dataclass(frozen=True, slots=True)
class Verdict:
    """A reply judged: passed or not, why, and the deviation that decided it."""

    ok: bool
    deviation: Deviation
    detail: str = ""


def exact(answer: Tokens, reply: Tokens) -> Verdict:
    """Concurrency 1: the reply must be the reference answer, bit for bit."""
    dev = compare(answer, reply)
    if dev.identical:
        return Verdict(True, dev)
    return Verdict(False, dev, f"wrong answer (not bitwise the reference): {dev.detail}; first difference at "
                               f"position {dev.first_difference}, largest logprob difference over the shared "
                               f"prefix {dev.max_logprob_diff:.3g} nats")


def within(basis: Tokens, reply: Tokens, tolerance: float) -> Verdict:
    """Above concurrency 1: the reply lies within ``tolerance`` nats of its basis (see :class:`Deviation`)."""
    dev = compare(basis, reply)
    if dev.identical:
        return Verdict(True, dev)
    if dev.non_finite:
        return Verdict(False, dev, "a NaN or infinite log-probability in the reply")
    if not dev.comparable:
        return Verdict(False, dev, f"wrong answer: {dev.detail}")
    if dev.size <= tolerance:
        return Verdict(True, dev, f"within noise: {dev.detail}; deviation {dev.size:.3g} nats "
                                  f"(tolerance {tolerance:.3g})")
    return Verdict(False, dev, f"wrong answer: {dev.detail}; deviation {dev.size:.3g} nats, over the tolerance "
                               f"{tolerance:.3g} from the recorded noise")


def spread(deviations: Sequence[Deviation]) -> float:
    """The noise a recording measured: the largest deviation; ValueError when one is not noise at all."""
    bad = [d for d in deviations if math.isinf(d.size)]
    if bad:
        raise ValueError(bad[0].detail or "a reply that cannot be compared")
    return max((d.size for d in deviations), default=0.0)


def noise(deviations: Sequence[Deviation], concurrency: int = NOISE_CONCURRENCY) -> dict[str, Any]:
    """What the reference file keeps of the noise measured when it was recorded."""
    return {"concurrency": concurrency, "requests": len(deviations),
            "identical": sum(d.identical for d in deviations),
            "token_divergences": sum(d.token_divergence is not None for d in deviations),
            "spread_nats": spread(deviations)}


def tolerance(noise_record: Mapping[str, Any] | None, multiple: float) -> float:
    """The tolerance above concurrency 1: ``multiple`` times the recorded spread (ValueError without one)."""
    value = (noise_record or {}).get("spread_nats")
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise ValueError("it records no noise (spread_nats) at concurrency "
                         f"{NOISE_CONCURRENCY}: record it again with this version")
    return float(value) * multiple


def prompt_sensitivity(answers: Sequence[Tokens], shas: Sequence[str]) -> dict[str, Any]:
    """Does the model read its prompt: distinct replies, and the median gap between the first token's top two."""
    gaps = []
    for a in answers:
        first = sorted((a.top[0] if a.top else {}).values(), reverse=True)
        if len(first) >= 2:
            gaps.append(first[0] - first[1])
    return {"prompts": len(shas), "distinct_replies": len(set(shas)),
            "median_first_token_gap_nats": round(statistics.median(gaps), 4) if gaps else None}


def settings_difference(recorded: Mapping[str, Any] | None, here: Mapping[str, Any]) -> str | None:
    """The settings of ``here`` that differ from those the reference was recorded under, in words; None: same.

    Only the keys ``here`` gives are compared (a run knows the GPU model after
    it found the GPU, the versions after the image reported them).
    """
    recorded = recorded or {}
    differ = [f"{key} {recorded.get(key)!r} there, {here[key]!r} here" for key in SETTING_KEYS
              if key in here and recorded.get(key) != here[key]]
    return "; ".join(differ) or None


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
