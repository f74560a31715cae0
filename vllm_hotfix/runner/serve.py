"""The serve sweep from inside the image: start the server, wait for it, send requests at each level.

Standard library only (``urllib`` and threads): the image guarantees no
``requests``. The host-side sweep (:mod:`vllm_hotfix.sweep`) judges replies
against reference answers too; this one checks that every request succeeds
and, when asked, that every reply is long enough.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

MAX_TOKENS = 32
LOG_LINES = 40


def _get(url: str, timeout: float) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return json.loads(reply.read() or b"null")


def _post(url: str, body: dict[str, Any], timeout: float) -> Any:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as reply:
        return json.loads(reply.read())


def _one(base: str, model: str, i: int, timeout: float, min_tokens: int | None) -> tuple[bool, float, str]:
    start = time.monotonic()
    try:
        body = _post(f"{base}/v1/completions", {"model": model, "prompt": f"Count from {i} onwards:",
                                                 "max_tokens": MAX_TOKENS, "temperature": 0}, timeout)
        text = body["choices"][0]["text"]
        tokens = int((body.get("usage") or {}).get("completion_tokens", 0))
    except (OSError, ValueError, KeyError, IndexError, TypeError, urllib.error.URLError) as exc:
        return False, time.monotonic() - start, f"request {i}: {exc}"
    if min_tokens is not None and tokens < min_tokens:
        return False, time.monotonic() - start, f"request {i}: {tokens} completion token(s) < {min_tokens}"
    return isinstance(text, str), time.monotonic() - start, ""


def run(argv: Sequence[str], port: int, levels: Sequence[int], requests: int, *, timeout: float,
        min_tokens: int | None, say: Callable[[str], None]) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the serve-sweep check, the sweep's facts) for a server started with ``argv`` listening on ``port``."""
    log: deque[str] = deque(maxlen=LOG_LINES)
    base = f"http://127.0.0.1:{port}"
    try:
        server = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  errors="replace")
    except OSError as exc:
        return {"name": "serve-sweep", "status": "fail", "detail": f"cannot start {argv[0]}: {exc}"}, None
    import threading

    assert server.stdout is not None
    def read() -> None:
        for line in server.stdout or ():
            log.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + timeout
        while True:
            if server.poll() is not None:
                return _failed(f"the server exited ({server.returncode}) before it was healthy", log), None
            try:
                urllib.request.urlopen(f"{base}/health", timeout=5).close()
                break
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                return _failed(f"the server was not healthy within {timeout:.0f} s", log), None
            time.sleep(2)
        model = str(_get(f"{base}/v1/models", 30)["data"][0]["id"])
        say(f"    serving {model} on port {port}")
        facts: dict[str, Any] = {"model": model, "levels": []}
        problems: list[str] = []
        for level in levels:
            with ThreadPoolExecutor(max_workers=level) as pool:
                results = list(pool.map(lambda i: _one(base, model, i, 300, min_tokens), range(requests)))
            failed = [why for ok, _, why in results if not ok]
            latency = [took for _, took, _ in results]
            facts["levels"].append({"concurrency": level, "requests": requests, "failed": len(failed),
                                    "p50_s": round(statistics.median(latency), 3)})
            say(f"    level {level}: {requests - len(failed)}/{requests} ok")
            problems += failed[:3]
        if problems:
            return _failed(f"{len(problems)} request(s) failed: {problems[0]}", log), facts
        detail = f"levels {','.join(map(str, levels))}: every request succeeded"
        if min_tokens is not None:
            detail += f", every reply at least {min_tokens} token(s)"
        return {"name": "serve-sweep", "status": "pass", "detail": detail}, facts
    except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
        return _failed(f"the server answered wrongly: {exc}", log), None
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def _failed(detail: str, log: deque[str]) -> dict[str, Any]:
    return {"name": "serve-sweep", "status": "fail", "detail": detail, "data": {"server_log": list(log)[-12:]}}
