"""The concurrency sweep's sender: the prompts at every level against an OpenAI-compatible endpoint.

Each level sends N completions at that concurrency (concurrency 1 too: with
four index heads on one GPU the unpatched MiniMax-M3 fails there). The
requests are the fixed prompt set of :mod:`vllm_hotfix.inimage.reference`, of
mixed lengths as production traffic, at temperature 0 with the top-k
logprobs. Every request leaves its evidence (status, latency, lengths,
finish reason, the reply's sha256), and ``replies`` keeps each reply as it
came for the judge.

This module only asks and measures: the runner carries it into the image,
where it sends every reply back to the host. Who judges the replies is the
caller's :class:`Judge` (the host's, :mod:`vllm_hotfix.judges.sweep`: the
oracle, ``--min-tokens``, the levels' summaries and the ``serve-sweep``
check). Without one the sweep stops where its stop rule says (a request
that got no reply, a reply shorter than ``min_tokens``, the server gone),
which decides how far it asks, never whether anything passed.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import requests
import requests.adapters

from ..errors import SmokeError, SmokeIncomplete, UsageError
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


def _ask_one(session: requests.Session, url: str, model: str, timeout: float, max_tokens: int, level: int,
             i: int, prompts: Sequence[str], replies: dict[str, dict[str, Any]] | None = None
             ) -> tuple[RequestEvidence, answers.Reply | None]:
    """Send request ``i`` of a level; never raises for the server's faults. ``replies``: each reply as it came,
    kept under ``LEVEL:I`` for the judge (the host judges what a runner sent back)."""
    k = i % len(prompts)
    ev = RequestEvidence(level, i, k, None, 0.0)
    reply = ask(session, url, model, prompts[k], max_tokens, timeout, ev)
    if reply is not None and replies is not None:
        replies[f"{level}:{i}"] = asdict(reply)
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


Asked = Sequence[tuple[RequestEvidence, answers.Reply | None]]  # a level's requests: evidence, and the reply or None


def ask_level(url: str, model: str, concurrency: int, n: int, timeout: float, max_tokens: int,
              prompts: Sequence[str], replies: dict[str, dict[str, Any]] | None = None) -> tuple[Level, Asked]:
    """One level's ``n`` requests at ``concurrency``: the level with each request's evidence and its wall time
    (nothing judged), and every request's reply (None where none came back)."""
    level = Level(concurrency, n)
    start = time.monotonic()
    done: Asked = pool(concurrency, n, lambda session, i: _ask_one(session, url, model, timeout, max_tokens,
                                                                    concurrency, i, prompts, replies))
    level.wall_s = round(time.monotonic() - start, 4)
    level.per_request = [ev for ev, _ in done]
    return level, done


class Judge(Protocol):
    """Who judges a level's replies as they come back (the host's, :class:`vllm_hotfix.judges.sweep.Judged`)."""

    def level(self, level: Level, asked: Asked) -> None:
        """Judge every request of ``level`` into its evidence and fill in the level's summary."""

    def line(self, level: Level) -> str:
        """The progress line of a judged level."""


def _stops(asked: Asked, min_tokens: int | None) -> bool:
    """The stop rule of a sweep nobody judges where it runs: a request got no reply, or (``min_tokens``) a reply
    shorter than that. It decides how far the sweep asks; the judge decides what passed."""
    return any(reply is None or (min_tokens is not None and reply.completion_tokens < min_tokens)
               for _, reply in asked)


def measured_line(level: Level) -> str:
    """The progress line of a level nobody judged here: how many replies came back, and the level's wall time."""
    back = sum(ev.http_status == 200 and ev.reply_tokens is not None for ev in level.per_request)
    return (f"    concurrency {level.concurrency:>3}: {back:>4}/{level.requests:<4} replied in {level.wall_s:.2f} s "
            "(judged by the host)")


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
    progress: Callable[[str], None] | None = None,
    keep_going: bool = False,
    prompts: Sequence[str] | None = None,
    replies: dict[str, dict[str, Any]] | None = None,
    judge: Judge | None = None,
) -> SweepResult:
    """Ask every level in order; stop at the first failing one (``keep_going``: ask the rest while the server
    lives; ``failed_level`` stays the first that failed).

    ``prompts`` (default the fixed set) are asked, ``max_tokens`` tokens each.
    With ``judge`` every level is judged as it comes back and a level fails
    where a request failed its judgement; without one nothing is judged here,
    a level "fails" only by the stop rule (a request got no reply, a reply
    shorter than ``min_tokens``, the server gone), and ``replies`` keeps every
    reply as it came for a judge elsewhere (:mod:`vllm_hotfix.judges.replies`:
    the host judges what a runner sent).
    """
    check_min_tokens(min_tokens, max_tokens)
    url = url.rstrip("/")
    model = model or first_model(url)
    asked = tuple(prompts or PROMPTS)
    result = SweepResult(url, model, [], max_tokens=max_tokens, min_tokens=min_tokens, prompts=len(asked))
    for c in levels:
        level, done = ask_level(url, model, c, n, timeout, max_tokens, asked, replies)
        if judge is not None:
            judge.level(level, done)
        stopped = level.failures > 0 if judge is not None else _stops(done, min_tokens)
        result.levels.append(level)
        alive = watch.running() if watch is not None else True
        if progress is not None:
            line = judge.line(level) if judge is not None else measured_line(level)
            progress(line + ("" if alive else "  (server died)"))
        if stopped or not alive:
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
