"""The concurrency sweep against an OpenAI-compatible endpoint.

The bug this project was born from crashed vLLM at concurrency >= 2 while
single requests worked, so each level sends N chat completions at that
concurrency and any failed request, or a server that died, fails the sweep
naming the level.

The requests of a level differ in length, as production traffic does: the
bug needed sequences with different numbers of KV blocks in one batch (one
sequence's top-k block indices read for another's), which a run of identical
short prompts never produces.

A server can also survive such a bug and answer wrongly: a sequence whose
attention read garbage turns to NaN and stops at once. With ``min_tokens`` set
(for a model that cannot stop early, such as a test model whose end-of-text
logit is never the largest), a reply with fewer completion tokens fails its
request too. Each level reports its replies' shortest length and finish reasons
either way.
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

from .errors import ShortReply, SmokeError, UsageError

DEFAULT_LEVELS = (1, 2, 4, 8, 16)
MAX_TOKENS = 32  # completion tokens each request asks for
PROMPT = "Count from one to ten in words, separated by commas."
# Request i of a level carries the prompt's context repeated PROMPT_REPEATS[i % len]
# times: a few dozen to a few thousand tokens, whatever the tokenizer.
PROMPT_REPEATS = (1, 40, 8, 80)
CONTEXT = "The quick brown fox jumps over the lazy dog while the band plays on. "


def prompt(i: int) -> str:
    """The i-th request's message: the same question after a context of varying length."""
    return CONTEXT * (PROMPT_REPEATS[i % len(PROMPT_REPEATS)] - 1) + PROMPT



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


@dataclass
class SweepResult:
    url: str
    model: str
    levels: list[Level]
    failed_level: int | None = None
    server_log: str = ""
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
            logs = condense(watch.logs()) if watch is not None else ""
            raise SmokeError(f"{url}/health did not answer within {deadline_s:.0f} s\n{logs}".rstrip())
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


def _one(session: requests.Session, url: str, model: str, timeout: float, max_tokens: int,
         i: int = 0) -> tuple[float, int, str]:
    start = time.monotonic()
    resp = session.post(
        f"{url}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": prompt(i)}],
            "max_tokens": max_tokens,
            "temperature": 0,
        },
        timeout=timeout,
    )
    elapsed = time.monotonic() - start
    if resp.status_code != 200:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    body = resp.json()
    if not body.get("choices"):
        raise RuntimeError("response has no choices")
    finish = str(body["choices"][0].get("finish_reason"))
    return elapsed, int((body.get("usage") or {}).get("completion_tokens", 0)), finish


def run_level(url: str, model: str, concurrency: int, n: int, timeout: float, max_tokens: int,
              min_tokens: int | None = None) -> Level:
    level = Level(concurrency, n)
    latencies: list[float] = []
    tokens = 0
    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=concurrency) as pool, requests.Session() as session:
        # A pool of `concurrency` workers keeps that many requests in flight;
        # the session keeps one connection per worker alive between requests.
        adapter = requests.adapters.HTTPAdapter(pool_connections=1, pool_maxsize=concurrency)
        session.mount("http://", adapter)
        session.mount("https://", adapter)
        futures = [pool.submit(_one, session, url, model, timeout, max_tokens, i) for i in range(n)]
        for fut in futures:
            try:
                elapsed, toks, finish = fut.result()
                level.finish_reasons[finish] = level.finish_reasons.get(finish, 0) + 1
                if level.shortest_reply_tokens is None or toks < level.shortest_reply_tokens:
                    level.shortest_reply_tokens = toks
                if min_tokens is not None and toks < min_tokens:
                    raise ShortReply(f"reply of {toks} completion token(s), every reply must have "
                                     f"at least {min_tokens} (finish_reason {finish})")
                latencies.append(elapsed)
                tokens += toks
                level.successes += 1
            except Exception as exc:  # any failure of a request fails the level
                level.failures += 1
                if len(level.errors) < 3:
                    level.errors.append(" ".join(str(exc).split())[:200])
    level.wall_s = round(time.monotonic() - start, 4)
    if latencies:
        level.p50_s = round(percentile(latencies, 50), 4)
        level.p95_s = round(percentile(latencies, 95), 4)
        level.output_tokens_per_s = round(tokens / level.wall_s, 2) if level.wall_s > 0 else None
    return level


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
) -> SweepResult:
    """Run every level in order; stop at the first failing one.

    ``min_tokens``: every reply must carry at least this many completion tokens.
    """
    check_min_tokens(min_tokens, max_tokens)
    url = url.rstrip("/")
    model = model or first_model(url)
    result = SweepResult(url, model, [])
    for c in levels:
        level = run_level(url, model, c, n, timeout, max_tokens, min_tokens)
        result.levels.append(level)
        alive = watch.running() if watch is not None else True
        if progress is not None:
            progress(format_level(level) + ("" if alive else "  (server died)"))
        if level.failures or not alive:
            result.failed_level = c
            result.server_died = not alive
            if not alive and not level.errors:
                level.errors.append("server process exited")
            break
    if watch is not None:
        result.server_log = condense(watch.logs())
    return result


def format_level(level: Level) -> str:
    def ms(v: float | None) -> str:
        return f"{v * 1000:7.1f}" if v is not None else "      -"

    tps = f"{level.output_tokens_per_s:8.1f}" if level.output_tokens_per_s is not None else "       -"
    shortest = "-" if level.shortest_reply_tokens is None else str(level.shortest_reply_tokens)
    return (
        f"    concurrency {level.concurrency:>3}: {level.successes:>4}/{level.requests:<4} ok  "
        f"p50 {ms(level.p50_s)} ms  p95 {ms(level.p95_s)} ms  {tps} tok/s  shortest reply {shortest} tok"
    )


def failure_message(result: SweepResult) -> str:
    level = next(lv for lv in result.levels if lv.concurrency == result.failed_level)
    why = level.errors[0] if level.errors else "unknown error"
    server = cause(result.server_log)
    if result.server_died:
        return (f"server {result.url} died during the sweep (at concurrency {result.failed_level}, "
                f"{level.successes}/{level.requests} requests ok): it no longer answers"
                + (f"; server: {server}" if server else f" ({why})"))
    return (
        f"serve sweep failed at concurrency {result.failed_level}: "
        f"{level.failures}/{level.requests} requests failed ({why})" + (f"; server: {server}" if server else "")
    )
