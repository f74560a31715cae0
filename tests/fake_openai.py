#!/usr/bin/env python3
"""A tiny OpenAI-compatible server for testing the serve sweep.

Usage (the same argv shape as `vllm serve`):
    fake_openai.py serve MODEL --port N [--die-at-concurrency K] [--short-at-concurrency K [--short-length L]]
                         [--wrong-at-concurrency K] [--tie-at-concurrency K [--tie-gap G]]
                         [--jitter-at-concurrency K [--jitter J]] [--nudge-at-concurrency K] [--nan-at-concurrency K]
                         [--finish-at-concurrency K [--finish-reason R]] [--cut-at-concurrency K] [--prompt-log FILE]

It answers the completions API as vLLM does at temperature 0: the reply's
tokens follow from the prompt alone (a hash of it), so the same prompt gets the
same reply every time, and with ``logprobs: k`` every position carries the
chosen token's logprob and the top k (``return_tokens_as_token_ids`` names
tokens "token_id:N"). The chosen token always leads its runner-up by 2.4 nats,
except where a switch below makes it otherwise. Token 0 is the end of text.

The switches act on a request that found K or more requests in flight when it
arrived (K=2: concurrent requests, while single ones are answered right):
--die-at-concurrency K  the process dies, printing the error vLLM 0.25.1 printed
                        for the MiniMax-M3 top-k layout bug.
--short-at-concurrency K  the reply ends at once with token 0 (after L-1 right
                        tokens, --short-length L, default 1), as a model whose
                        attention read garbage does (NaN, then end of text); the
                        right token is 5 nats below the end of text there.
--wrong-at-concurrency K  from position 2 on the reply is another prompt's: the
                        right token is not among the top k there.
--tie-at-concurrency K  at position 1 the runner-up is chosen instead, the right
                        token --tie-gap G nats (default 0.2) below it: the near-tie
                        batching produces on a real GPU; the rest follows the new prefix.
--jitter-at-concurrency K  every logprob of the reply J nats lower (default 0.01): the
                        numerical noise of batching, with the same tokens.
--nudge-at-concurrency K  the chosen token's logprob at position 3 one bit lower (the next
                        float towards minus infinity): a reply that is not bitwise the same.
--nan-at-concurrency K  the chosen token's logprob at position 2 is NaN (sent as the JSON
                        token NaN, as Python writes it).
--finish-at-concurrency K  the reply's finish reason is R (--finish-reason, default "abort", as
                        vLLM says of a request its engine gave up on), its tokens right.
--cut-at-concurrency K  the reply ends after 5 right tokens, yet says finish_reason "length": a
                        length that does not add up.
With --prompt-log FILE it appends each request's prompt length to FILE.
Where VLLM_CACHE_ROOT is set (the smoke run's compile cache), each start
appends a line to fake-openai-starts there, as vLLM writes its own cache,
naming whether prefix caching was on (``--no-enable-prefix-caching``) and
``VLLM_BATCH_INVARIANT``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

IN_FLIGHT = 0
LOCK = threading.Lock()
VOCAB = 320
EOS = 0
CHOSEN_LP = -0.1
RUNNER_UP_GAP = 2.4


def _tok(*parts: object) -> int:
    """A token other than the end of text, from a hash of ``parts``."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return 1 + int.from_bytes(digest[:4], "big") % (VOCAB - 1)


def _position(key: str, j: int, k: int, avoid: int | None = None) -> tuple[int, dict[int, float]]:
    """Position j of the reply keyed ``key``: the chosen token and the top k (never ``avoid``)."""
    chosen = _tok(key, j, 0)
    salt = 0
    while chosen == avoid:
        salt += 1
        chosen = _tok(key, j, 0, salt)
    top = {chosen: CHOSEN_LP}
    m = 1
    while len(top) < k:
        alt = _tok(key, j, m)
        m += 1
        if alt not in top and alt != avoid:
            top[alt] = CHOSEN_LP - RUNNER_UP_GAP - 0.5 * (len(top) - 1)
    return chosen, top


def reply_tokens(prompt: str, n: int, k: int, mode: str,
                 args: argparse.Namespace) -> tuple[list[int], list[dict[int, float]], str]:
    """The reply to ``prompt``: tokens, top-k logprobs per position, finish reason."""
    tokens: list[int] = []
    tops: list[dict[int, float]] = []
    key = prompt
    for j in range(n):
        right, top = _position(key, j, max(k, 2))
        if mode == "short" and j == args.short_length - 1:
            tokens.append(EOS)
            tops.append({EOS: -0.05, right: -5.05})
            return tokens, tops, "stop"
        if mode == "wrong" and j >= 2:
            chosen, top = _position(f"garbage:{prompt}", j, max(k, 2), avoid=right)
            tokens.append(chosen)
            tops.append(top)
            continue
        if mode == "tie" and j == 1:
            runner_up = next(t for t in top if t != right)
            tokens.append(runner_up)
            tops.append({runner_up: -0.6, right: -0.6 - args.tie_gap,
                         **{t: lp for t, lp in top.items() if t not in (right, runner_up)}})
            key = f"after-tie:{prompt}"  # what follows depends on the new prefix
            continue
        tokens.append(right)
        tops.append(top)
    return tokens, tops, "length"


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--die-at-concurrency", type=int, default=0)
    ap.add_argument("--short-at-concurrency", type=int, default=0)
    ap.add_argument("--short-length", type=int, default=1)
    ap.add_argument("--wrong-at-concurrency", type=int, default=0)
    ap.add_argument("--tie-at-concurrency", type=int, default=0)
    ap.add_argument("--tie-gap", type=float, default=0.2)
    ap.add_argument("--jitter-at-concurrency", type=int, default=0)
    ap.add_argument("--jitter", type=float, default=0.01)
    ap.add_argument("--nudge-at-concurrency", type=int, default=0)
    ap.add_argument("--nan-at-concurrency", type=int, default=0)
    ap.add_argument("--finish-at-concurrency", type=int, default=0)
    ap.add_argument("--finish-reason", default="abort")
    ap.add_argument("--cut-at-concurrency", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.05)
    ap.add_argument("--prompt-log", default=None)
    ap.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    # vLLM's own engine arguments that a definition's [smoke] table hands every server (images/v0.25.1.toml's):
    # taken as vLLM takes them, and of no use to a stand-in.
    for name in ("--max-model-len", "--gpu-memory-utilization", "--kv-cache-memory-bytes", "--max-num-seqs"):
        ap.add_argument(name)
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args(argv)
    cache = os.environ.get("VLLM_CACHE_ROOT")
    if cache:
        os.makedirs(cache, exist_ok=True)
        with open(os.path.join(cache, "fake-openai-starts"), "a", encoding="utf-8") as fh:
            fh.write(f"started prefix_caching={args.prefix_caching} "
                     f"VLLM_BATCH_INVARIANT={os.environ.get('VLLM_BATCH_INVARIANT')}\n")
    model_name = args.model

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, fmt: str, *a: object) -> None:
            pass

        def reply(self, code: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self.reply(200, {})
            elif self.path == "/v1/models":
                self.reply(200, {"object": "list", "data": [{"id": model_name, "object": "model"}]})
            else:
                self.reply(404, {"error": "not found"})

        def do_POST(self) -> None:
            global IN_FLIGHT
            if self.path != "/v1/completions":
                self.reply(404, {"error": "not found"})
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            prompt = str(body.get("prompt", ""))
            if args.prompt_log:
                with LOCK, open(args.prompt_log, "a", encoding="utf-8") as fh:
                    fh.write(f"{len(prompt)}\n")
            with LOCK:
                IN_FLIGHT += 1
                now = IN_FLIGHT
            try:
                if args.die_at_concurrency and now >= args.die_at_concurrency:
                    print("torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
                          flush=True)
                    print("vllm.v1.engine.exceptions.EngineDeadError", flush=True)
                    os._exit(1)
                time.sleep(args.delay)
            finally:
                # Done before the reply is sent: a client that gets its answer and
                # sends the next request at once must not find this one still counted.
                with LOCK:
                    IN_FLIGHT -= 1
            mode = "right"
            for name in ("short", "wrong", "tie"):
                at = getattr(args, f"{name}_at_concurrency")
                if at and now >= at:
                    mode = name
            k = body.get("logprobs")
            n = int(body.get("max_tokens", 16))
            tokens, tops, finish = reply_tokens(prompt, n, int(k or 0), mode, args)
            if args.jitter_at_concurrency and now >= args.jitter_at_concurrency:
                tops = [{t: lp - args.jitter for t, lp in top.items()} for top in tops]
            if args.nudge_at_concurrency and now >= args.nudge_at_concurrency and len(tokens) > 3:
                tops[3] = {**tops[3], tokens[3]: math.nextafter(tops[3][tokens[3]], -math.inf)}
            if args.nan_at_concurrency and now >= args.nan_at_concurrency and len(tokens) > 2:
                tops[2] = {**tops[2], tokens[2]: math.nan}
            if args.finish_at_concurrency and now >= args.finish_at_concurrency:
                finish = args.finish_reason
            if args.cut_at_concurrency and now >= args.cut_at_concurrency:
                tokens, tops = tokens[:5], tops[:5]
            as_ids = bool(body.get("return_tokens_as_token_ids"))

            def name(t: int) -> str:
                return f"token_id:{t}" if as_ids else f"w{t}"

            logprobs = None
            if k:
                logprobs = {"tokens": [name(t) for t in tokens],
                            "token_logprobs": [top[t] for t, top in zip(tokens, tops, strict=True)],
                            "top_logprobs": [{name(t): lp for t, lp in list(top.items())[:int(k)]} for top in tops],
                            "text_offset": list(range(len(tokens)))}
            prompt_tokens = len(prompt.split()) + 1
            self.reply(200, {
                "id": "cmpl-test", "object": "text_completion", "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": finish, "logprobs": logprobs,
                             "text": " ".join(f"w{t}" for t in tokens if t != EOS)}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                          "total_tokens": prompt_tokens + len(tokens)},
            })

    # A listen backlog for 16 connections arriving at once (the default 5 can reset some under load).
    ThreadingHTTPServer.request_queue_size = 64
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"fake server for {model_name} on 127.0.0.1:{args.port}", flush=True)
    print("INFO:     Application startup complete.", flush=True)  # the line uvicorn prints when vLLM's server is up
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
