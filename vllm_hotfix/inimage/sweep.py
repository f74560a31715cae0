"""The concurrency sweep against an OpenAI-compatible endpoint.

Each level sends N completions at that concurrency (concurrency 1 too: with
four index heads on one GPU the unpatched MiniMax-M3 fails there); any failed
request, or a server that died, fails the sweep naming the level. The
requests are the fixed prompt set of :mod:`vllm_hotfix.inimage.reference`, of mixed
lengths as production traffic, at temperature 0 with the top-k logprobs.

A server can survive a bug and answer wrongly with HTTP 200, so each request
is judged by the strictest check given: with ``reference`` by the oracle
(:mod:`vllm_hotfix.inimage.oracle`: at concurrency 1 bit for bit against the
reference; above it by its form, HTTP status, length, finish reason and no
NaN, with how far it moved from the same image's concurrency-1 reply
measured, never judged: over HTTP a reply's batch is the timing's, and how
far a batch moves a model's numerics is the model's); with ``min_tokens`` a
shorter reply fails; else the HTTP status alone. Every request leaves its
evidence in the report beside each level's summary, and each level above 1
its measured movement (:func:`vllm_hotfix.inimage.oracle.movement`).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import requests
import requests.adapters

from ..errors import SmokeError, SmokeIncomplete, UsageError
from . import oracle
from . import reference as answers

DEFAULT_LEVELS = (1, 2, 4, 8, 16)
MAX_TOKENS = 32  # completion tokens each request asks for (a reference brings its own)
PROMPTS = answers.PROMPTS


def prompt(i: int, prompts: Sequence[str] = PROMPTS) -> str:
    """The i-th request's prompt: the prompt set over and over."""
    return prompts[i % len(prompts)]


class Watcher(Protocol):
    """The server process, as whoever started it sees it (None where nobody does)."""

    def running(self) -> bool: ...

    def logs(self) -> str: ...  # its last log lines, asked for only when a report needs them


class HealthWatch:
    """A server nobody here started: it counts as running while its ``/health`` answers at all.

    Without it a server that died mid-sweep reads as "0/8 ok" with connection
    errors; with it the report says the server is gone.
    """

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def running(self) -> bool:
        try:
            requests.get(f"{self.url}/health", timeout=5)
        except requests.RequestException:
            return False
        return True

    def logs(self) -> str:
        return ""


def check_url(url: str) -> str:
    """A server's base URL, http(s)://HOST[:PORT][/PATH]; a UsageError otherwise."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        raise UsageError(f"--url {url!r}: not a URL ({exc})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or not url.isprintable():
        raise UsageError(f"--url {url!r}: expected http(s)://HOST[:PORT], e.g. http://127.0.0.1:8000")
    return url


LOG_LINES = 50  # server log lines a report keeps
# One line per request in the server's access log: left out of reports, where
# hundreds of "500 Internal Server Error" lines would push out the reason.
_ACCESS = re.compile(r'"(?:GET|POST|PUT|DELETE|HEAD) \S+ HTTP/[0-9.]+" \d{3}')
# "torch.AcceleratorError: CUDA error: ...", "RuntimeError: ...", after any "(EngineCore pid=9) " prefix.
_ERROR = re.compile(r"^(?:\([^)]*\)\s*)?((?:[\w.]*(?:Error|Exception)|error): .+)$")


def condense(logs: str, lines: int = LOG_LINES) -> str:
    """The last ``lines`` lines of a server log that are not per-request access lines."""
    kept = [ln for ln in logs.splitlines() if not _ACCESS.search(ln)]
    return "\n".join(kept[-lines:])


def cause(logs: str) -> str | None:
    """The last error line of a server log ("torch.AcceleratorError: CUDA error: ..."), if any."""
    found = None
    for ln in logs.splitlines():
        m = _ERROR.match(ln.strip())
        if m and not _ACCESS.search(ln):
            found = m.group(1).strip()
    return found


@dataclass
class RequestEvidence:
    """One request of a level: what was asked, what came back, and which check judged it."""

    level: int  # its concurrency
    index: int  # its place in the level
    prompt: int  # which prompt of the set
    http_status: int | None  # None: no answer (connection refused or reset, timeout)
    latency_s: float
    prompt_tokens: int | None = None
    reply_tokens: int | None = None
    finish_reason: str | None = None
    reply_sha256: str | None = None  # of the reply's token IDs (its text where the server named no tokens)
    judged_by: str = "status"  # what passed or failed it: status, min-tokens, exact, form or schedule (the host's)
    passed: bool = False
    basis: str | None = None  # what the reply was compared with: reference, or concurrency-1 (the same image's)
    divergence: int | None = None  # the first position (from 0) where a token or a logprob differs from the basis
    token_divergence: int | None = None  # the first position where the tokens differ
    max_logprob_diff: float | None = None  # the largest logprob difference over the positions where tokens agree
    gap_nats: float | None = None  # at the token divergence: how far below the served token the basis's lay
    deviation_nats: float | None = None  # how far it lay from its basis, in nats (None: unmeasurable)
    error: str | None = None


@dataclass
class Level:
    concurrency: int
    requests: int
    successes: int = 0
    failures: int = 0
    p50_s: float | None = None
    p95_s: float | None = None
    output_tokens_per_s: float | None = None
    wall_s: float = 0.0
    shortest_reply_tokens: int | None = None
    finish_reasons: dict[str, int] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    wrong_answers: int = 0  # replies the oracle failed
    identical: int = 0  # replies bitwise equal to their basis
    deviated: int = 0  # above concurrency 1: replies that passed and differ from their basis (moved)
    widest_deviation_nats: float | None = None  # the largest measurable deviation of a judged reply
    movement: dict[str, Any] | None = None  # above concurrency 1, with a reference: oracle.movement of its replies
    per_request: list[RequestEvidence] = field(default_factory=list)


@dataclass
class SweepResult:
    url: str
    model: str
    levels: list[Level]
    failed_level: int | None = None
    server_log: str = ""
    max_tokens: int = MAX_TOKENS
    min_tokens: int | None = None
    reference: dict[str, Any] | None = None  # the reference answers judged against (file, sha256, ...)
    prompts: int = len(PROMPTS)
    server_died: bool = False

    @property
    def ok(self) -> bool:
        return self.failed_level is None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def parse_levels(text: str) -> tuple[int, ...]:
    try:
        levels = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise UsageError(f"--concurrency {text!r}: expected numbers like 1,2,4,8,16") from None
    if not levels or any(n < 1 for n in levels):
        raise UsageError(f"--concurrency {text!r}: levels must be positive")
    return levels


def check_min_tokens(min_tokens: int | None, max_tokens: int = MAX_TOKENS) -> None:
    if min_tokens is not None and not 1 <= min_tokens <= max_tokens:
        raise UsageError(f"--min-tokens {min_tokens}: must be between 1 and the {max_tokens} tokens a request asks for")


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


def wait_healthy(
    url: str, deadline_s: float, watch: Watcher | None = None, progress: Callable[[str], None] | None = None
) -> None:
    """Poll ``/health`` until it answers 200, the server dies, or time runs out."""
    end = time.monotonic() + deadline_s
    last_note = 0.0
    while True:
        try:
            if requests.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except requests.RequestException:
            pass
        if watch is not None and not watch.running():
            logs = watch.logs()
            why = cause(logs)
            raise SmokeError(f"server exited before {url}/health answered{': ' + why if why else ''}; "
                             f"last log lines:\n{condense(logs)}")
        now = time.monotonic()
        if now > end:
            if watch is None:  # serve-check: no server there is the host's state, not a failed check (11)
                raise SmokeIncomplete(f"no server answers at {url}/health (waited {deadline_s:.0f} s)",
                                      hint="start the server, check --url, or wait longer (--wait S)")
            raise SmokeError(f"{url}/health did not answer in {deadline_s:.0f} s\n{condense(watch.logs())}".rstrip())
        if progress is not None and now - last_note > 10:
            progress(f"    waiting for {url}/health ({end - now:.0f} s left)")
            last_note = now
        time.sleep(0.5)


def first_model(url: str) -> str:
    try:
        data = requests.get(f"{url}/v1/models", timeout=10).json()
        return str(data["data"][0]["id"])
    except (requests.RequestException, ValueError, KeyError, IndexError) as exc:
        raise SmokeError(f"cannot list models at {url}/v1/models: {exc}") from exc


def _post(session: requests.Session, url: str, model: str, text: str, max_tokens: int,
          timeout: float) -> tuple[float, requests.Response]:
    start = time.monotonic()
    resp = session.post(
        f"{url}/v1/completions",
        json={
            "model": model,
            "prompt": text,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": answers.TOP_LOGPROBS,
            # vLLM's own field: tokens as "token_id:N", so that replies compare by ID, not by text.
            "return_tokens_as_token_ids": True,
        },
        timeout=timeout,
    )
    return time.monotonic() - start, resp


def ask(session: requests.Session, url: str, model: str, text: str, max_tokens: int, timeout: float,
         ev: RequestEvidence) -> answers.Reply | None:
    """One request; its status, latency and reply facts into ``ev``; the reply, or None (``ev.error`` says why)."""
    start = time.monotonic()
    try:
        ev.latency_s, resp = _post(session, url, model, text, max_tokens, timeout)
    except requests.RequestException as exc:
        ev.latency_s = time.monotonic() - start
        ev.error = f"no answer: {type(exc).__name__}: {exc}"
        return None
    finally:
        ev.latency_s = round(ev.latency_s, 4)
    ev.http_status = resp.status_code
    if resp.status_code != 200:
        ev.error = f"HTTP {resp.status_code}: {resp.text[:200]}"
        return None
    try:
        reply = answers.parse_reply(resp.json())
    except ValueError as exc:
        ev.error = f"HTTP 200 but {exc}"
        return None
    ev.prompt_tokens, ev.reply_tokens = reply.prompt_tokens, reply.completion_tokens
    ev.finish_reason, ev.reply_sha256 = reply.finish_reason, reply.sha256
    return reply


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


def _one(session: requests.Session, url: str, model: str, timeout: float, max_tokens: int, level: int, i: int,
         prompts: Sequence[str], min_tokens: int | None, ref: answers.Reference | None,
         basis: dict[int, answers.Reply], exact: bool,
         replies: dict[str, dict[str, Any]] | None = None) -> tuple[RequestEvidence, answers.Reply | None]:
    """Send request ``i`` of a level and judge its reply; never raises for the server's faults. ``replies``: each
    reply as it came, kept under ``LEVEL:I`` for a judge elsewhere (the host judges a runner's sweep)."""
    k = i % len(prompts)
    ev = RequestEvidence(level, i, k, None, 0.0)
    reply = ask(session, url, model, prompts[k], max_tokens, timeout, ev)
    if reply is None:
        return ev, None
    if replies is not None:
        replies[f"{level}:{i}"] = asdict(reply)
    if ref is not None:
        judge(ev, k, reply, ref, basis, exact)
        if not ev.passed:
            return ev, reply
    if min_tokens is not None:
        # Both given: a reply the reference passed can still be too short (a test model that cannot stop early).
        if ref is None:
            ev.judged_by = "min-tokens"
        if reply.completion_tokens < min_tokens:
            ev.judged_by, ev.passed = "min-tokens", False
            ev.error = (f"reply of {reply.completion_tokens} completion token(s), every reply must have "
                        f"at least {min_tokens} (finish_reason {reply.finish_reason})")
            return ev, reply
    ev.passed = True
    return ev, reply


def pool(concurrency: int, n: int, job: Callable[[requests.Session, int], Any]) -> list[Any]:
    """``job(session, i)`` for i in 0..n-1 with ``concurrency`` in flight; results in request order."""
    with ThreadPoolExecutor(max_workers=concurrency) as pool, requests.Session() as session:
        # A pool of `concurrency` workers keeps that many requests in flight;
        # the session keeps one connection per worker alive between requests.
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=concurrency)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        futures = [pool.submit(job, session, i) for i in range(n)]
        return [fut.result() for fut in futures]


def run_level(url: str, model: str, concurrency: int, n: int, timeout: float, max_tokens: int,
              min_tokens: int | None = None, ref: answers.Reference | None = None,
              basis: dict[int, answers.Reply] | None = None,
              prompts: Sequence[str] | None = None, replies: dict[str, dict[str, Any]] | None = None) -> Level:
    """One level. With ``ref``: at concurrency 1 every reply bit for bit, and each prompt's first reply that
    came back whole is kept in ``basis``; above it, each reply by its form, its movement from ``basis``
    measured."""
    level = Level(concurrency, n)
    prompts = ref.prompts if ref is not None else prompts or PROMPTS
    basis = {} if basis is None else basis
    exact = ref is not None and concurrency == 1
    start = time.monotonic()
    done = pool(concurrency, n, lambda session, i: _one(session, url, model, timeout, max_tokens, concurrency, i,
                                                         prompts, min_tokens, ref, basis, exact, replies))
    level.wall_s = round(time.monotonic() - start, 4)
    level.per_request = [ev for ev, _ in done]
    if exact:
        for ev, reply in done:
            # Only a reply the oracle passed: under --keep-going a wrong one must not become the basis above.
            if reply is not None and reply.tokens is not None and ev.passed:
                basis.setdefault(ev.prompt, reply)
    summarise(level)
    return level


def _deviation(ev: RequestEvidence) -> oracle.Deviation:
    """A judged reply's deviation from its basis, as its evidence keeps it."""
    return oracle.Deviation(ev.divergence is None, ev.divergence, ev.token_divergence, ev.max_logprob_diff or 0.0,
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
    level.movement = oracle.movement([_deviation(ev) for ev in formed]) if formed else None
    if passed:
        latencies = [ev.latency_s for ev in passed]
        level.p50_s = round(percentile(latencies, 50), 4)
        level.p95_s = round(percentile(latencies, 95), 4)
        tokens = sum(ev.reply_tokens or 0 for ev in passed)
        level.output_tokens_per_s = round(tokens / level.wall_s, 2) if level.wall_s > 0 else None


def sweep(
    url: str,
    model: str | None = None,
    levels: Sequence[int] = DEFAULT_LEVELS,
    n: int = 32,
    *,
    watch: Watcher | None = None,
    timeout: float = 120,
    max_tokens: int = MAX_TOKENS,
    min_tokens: int | None = None,
    reference: answers.Reference | None = None,
    progress: Callable[[str], None] | None = None,
    keep_going: bool = False,
    prompts: Sequence[str] | None = None,
    replies: dict[str, dict[str, Any]] | None = None,
) -> SweepResult:
    """Run every level in order; stop at the first failing one (``keep_going``: run the rest while the
    server lives, so a report shows each level's outcome; ``failed_level`` stays the first that failed).

    ``min_tokens``: every reply must carry at least this many completion tokens.
    ``reference``: every reply is judged by the oracle (bit for bit at
    concurrency 1; above it by its form, its movement from the same image's
    concurrency-1 reply measured); the reference's prompts and max_tokens
    are used. Without it, ``prompts`` (default the
    fixed set) are asked, and ``replies`` keeps every reply as it came for a
    judge elsewhere (:mod:`vllm_hotfix.judges.replies`: the host judges what a runner sent).
    """
    if reference is not None:
        max_tokens = reference.max_tokens
    check_min_tokens(min_tokens, max_tokens)
    url = url.rstrip("/")
    model = model or first_model(url)
    asked = reference.prompts if reference is not None else tuple(prompts or PROMPTS)
    result = SweepResult(url, model, [], max_tokens=max_tokens, min_tokens=min_tokens, prompts=len(asked))
    if reference is not None:
        result.reference = reference.summary()
    basis: dict[int, answers.Reply] = {}
    for c in levels:
        level = run_level(url, model, c, n, timeout, max_tokens, min_tokens, reference, basis, asked, replies)
        result.levels.append(level)
        alive = watch.running() if watch is not None else True
        if progress is not None:
            progress(format_level(level) + ("" if alive else "  (server died)"))
        if level.failures or not alive:
            if result.failed_level is None:
                result.failed_level = c
            result.server_died = not alive
            if not alive and not level.errors:
                level.errors.append("server process exited")
            if not alive or not keep_going:
                break
    if watch is not None:
        result.server_log = condense(watch.logs())
    return result


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
    """The serve-sweep check a finished sweep makes (the host's smoke and the runner in the image alike)."""
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
