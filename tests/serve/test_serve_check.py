"""`serve-check` against tests/fake_openai.py as a host process.

The fake server answers as vLLM's OpenAI server does, healthy, dying at
concurrency 2 as the bug did, or answering concurrent requests with one token.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO, cli, fails, free_port

FAKE = REPO / "tests" / "fake_openai.py"


def _serve(port: int, *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, str(FAKE), "serve", "test-model", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc


def test_serve_check_healthy_server(tmp_path: Path) -> None:
    port = free_port()
    # A healthy server need not take its usual 50 ms per request: nothing here counts overlaps.
    proc = _serve(port, "--prompt-log", str(tmp_path / "prompts.txt"), "--delay", "0.01")
    try:
        r = cli("serve-check", "--url", f"http://127.0.0.1:{port}", "--concurrency", "1,2,4,8,16",
                "--requests", "32", "--report", str(tmp_path / "s.json"))
        assert r.rc == 0, r.err
        data = json.loads((tmp_path / "s.json").read_text())
        assert [lv["concurrency"] for lv in data["levels"]] == [1, 2, 4, 8, 16]
        for lv in data["levels"]:
            assert lv["successes"] == 32 and lv["failures"] == 0
            assert lv["p50_s"] <= lv["p95_s"]
            assert lv["output_tokens_per_s"] > 0
        # Requests of a level differ in length (sequences with different numbers of KV
        # blocks in one batch), from a few hundred characters to a few thousand.
        lengths = [int(x) for x in (tmp_path / "prompts.txt").read_text().split()]
        assert len(lengths) == 5 * 32
        assert len(set(lengths)) >= 4 and min(lengths) < 300 and max(lengths) > 4000
    finally:
        proc.kill()
        proc.wait()


def test_serve_check_server_dying_at_concurrency_2() -> None:
    port = free_port()
    proc = _serve(port, "--die-at-concurrency", "2")
    try:
        r = cli("serve-check", "--url", f"http://127.0.0.1:{port}", "--requests", "8")
        assert r.rc == 7
        # Not "0/8 ok" and a connection error: the server is gone, and the line says so.
        assert "server http://127.0.0.1:" in r.last_error and "died during the sweep" in r.last_error
        assert "at concurrency 2" in r.last_error
        assert "(server died)" in r.err
        assert "concurrency   1:    8/8" in r.err  # single requests worked
    finally:
        proc.kill()
        proc.wait()


def test_serve_check_short_replies_fail_with_min_tokens(tmp_path: Path) -> None:
    """A server that survives the bug but answers concurrent requests with one token."""
    port = free_port()
    proc = _serve(port, "--short-at-concurrency", "2")
    try:
        url = f"http://127.0.0.1:{port}"
        # Without --min-tokens a short reply is still a reply: the sweep passes, and says how short.
        r = cli("serve-check", "--url", url, "--concurrency", "1,2", "--requests", "8",
                "--report", str(tmp_path / "plain.json"))
        assert r.rc == 0, r.err
        levels = json.loads((tmp_path / "plain.json").read_text())["levels"]
        assert levels[0]["shortest_reply_tokens"] == 32 and levels[0]["finish_reasons"] == {"length": 8}
        assert levels[1]["shortest_reply_tokens"] == 1 and levels[1]["finish_reasons"].get("stop", 0) >= 1
        r = cli("serve-check", "--url", url, "--concurrency", "1,2", "--requests", "8", "--min-tokens", "32",
                "--report", str(tmp_path / "strict.json"))
        assert r.rc != 0
        assert "serve sweep failed at concurrency 2" in r.last_error
        assert "reply of 1 completion token(s), every reply must have at least 32 (finish_reason stop)" in r.last_error
        assert "concurrency   1:    8/8" in r.err
        r = cli("serve-check", "--url", url, "--min-tokens", "33")
        fails(r, "--min-tokens 33: must be between 1 and the 32 tokens a request asks for")
    finally:
        proc.kill()
        proc.wait()


def test_serve_check_on_a_refused_port_says_what_it_waits_for() -> None:
    port = free_port()
    start = time.monotonic()
    r = cli("serve-check", "--url", f"http://127.0.0.1:{port}", "--wait", "2")
    fails(r, f"no server answers at http://127.0.0.1:{port}/health (waited 2 s)")
    # The host had nothing to check: incomplete (11), as the docs say, not a failed check (7).
    assert r.rc == 11 and "waiting up to 2 s" in r.err and "hint: start the server" in r.err
    assert time.monotonic() - start < 20
