#!/usr/bin/env python3
"""A tiny OpenAI-compatible server for testing the serve sweep.

Usage (the same argv shape as `vllm serve`):
    fake_openai.py serve MODEL --port N [--die-at-concurrency K] [--short-at-concurrency K]
                         [--prompt-log FILE]

With --die-at-concurrency K the process dies the moment K requests are in
flight at once, printing the error vLLM 0.25.1 printed for the MiniMax-M3
top-k layout bug: single requests work, concurrent ones kill the server.
With --short-at-concurrency K it stays up but answers a request that had K or
more in flight with a one-token reply, as a model whose attention read garbage
does (NaN, then end of text at once).
With --prompt-log FILE it appends each request's message length to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

IN_FLIGHT = 0
LOCK = threading.Lock()


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["serve"])
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--die-at-concurrency", type=int, default=0)
    ap.add_argument("--short-at-concurrency", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.05)
    ap.add_argument("--prompt-log", default=None)
    args = ap.parse_args(argv)
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
            if self.path != "/v1/chat/completions":
                self.reply(404, {"error": "not found"})
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if args.prompt_log:
                with LOCK, open(args.prompt_log, "a", encoding="utf-8") as fh:
                    fh.write(f"{sum(len(m.get('content', '')) for m in body.get('messages', []))}\n")
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
            n = int(body.get("max_tokens", 16))
            finish = "length"
            if args.short_at_concurrency and now >= args.short_at_concurrency:
                n, finish = 1, "stop"
            self.reply(200, {
                "id": "cmpl-test", "object": "chat.completion", "model": body.get("model"),
                "choices": [{"index": 0, "finish_reason": finish,
                             "message": {"role": "assistant", "content": "one, two, three"}}],
                "usage": {"prompt_tokens": 12, "completion_tokens": n, "total_tokens": 12 + n},
            })

    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    print(f"fake server for {model_name} on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
