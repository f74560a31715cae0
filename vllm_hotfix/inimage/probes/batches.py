"""Fixed batches: every concurrency level's requests through vLLM's engine in this process, stepped by hand.

    python3 batches.py SPEC.json

Over HTTP a level's batches depend on when each request reaches the engine,
so above concurrency 1 a reply is a function of the timing as well as of
the image, and the oracle could only bound it by the noise. Here the engine
core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, no async
scheduling) and nothing else feeds it: at level ``c`` the first ``c``
requests are added, each step runs, and each request that finished is
replaced by the next in order before the following step. Every step's batch
(which requests, how many prefill and decode tokens, which chunk of a long
prompt) is then a function of the prompts, the level and the engine's
settings alone, so the replies at a level are the image's, bit for bit, and
a trusted image's replies at the same level are the answer to compare with.

This probe only measures: it prints no verdict. The host compares what it
wrote with the reference answers, which never enter the image.

SPEC: ``model`` (the served folder), ``engine_args`` (``vllm serve``'s engine
arguments, as the server gets them), ``env`` (added before vLLM is imported),
``levels``, ``requests`` (per level), ``prompts`` (request ``i`` asks prompt
``i mod len``), ``max_tokens``, ``top_logprobs``, ``passes`` (the whole
schedule this many times on one engine), ``out`` (a file: one JSON line per
finished pass and level, written as each ends so a crash keeps what came
before; ``{"error": ...}`` when the engine raised; ``{"done": true}`` last).
Tokens are written as ``token_id:N``, as the server names them.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any

# Engine arguments of `vllm serve` that only the HTTP server knows; dropped, with the rest passed to vLLM's parser.
SERVER_ONLY = ("--port", "--host", "--served-model-name", "--api-key", "--uvicorn-log-level", "--root-path")


def engine_argv(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in SERVER_ONLY:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def token(tid: int) -> str:
    return f"token_id:{tid}"


def reply_of(index: int, prompt: int, output: Any) -> dict[str, Any]:
    done = output.outputs[0]
    ids = [int(t) for t in done.token_ids]
    chosen, top = [], []
    for pos, tid in enumerate(ids):
        entry = done.logprobs[pos] if done.logprobs is not None and pos < len(done.logprobs) else None
        entry = entry or {}
        lp = entry.get(tid)
        chosen.append(None if lp is None else float(lp.logprob))
        top.append({token(int(k)): float(v.logprob) for k, v in entry.items()})
    return {"request": index, "prompt": prompt, "prompt_tokens": len(output.prompt_token_ids or ()),
            "tokens": [token(t) for t in ids], "logprobs": chosen, "top_logprobs": top,
            "finish_reason": str(done.finish_reason)}


def run_level(engine: Any, params: Any, prompts: list[str], level: int, n: int, tag: str) -> list[dict[str, Any]]:
    """``n`` requests with at most ``level`` in the engine, refilled in order as each finishes."""
    replies: dict[int, dict[str, Any]] = {}
    ids: dict[str, int] = {}
    nxt = 0

    def add() -> None:
        nonlocal nxt
        ids[f"{tag}-{nxt}"] = nxt
        engine.add_request(f"{tag}-{nxt}", prompts[nxt % len(prompts)], params)
        nxt += 1

    while nxt < min(level, n):
        add()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                i = ids[str(out.request_id)]
                replies[i] = reply_of(i, i % len(prompts), out)
                if nxt < n:
                    add()
    return [replies[i] for i in sorted(replies)]


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: batches.py SPEC.json", file=sys.stderr)
        return 2
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    os.environ.update({str(k): str(v) for k, v in (spec.get("env") or {}).items()})
    # The engine core in this process, stepped by this loop alone; request IDs as given (no random suffix).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"
    out = open(spec["out"], "w", encoding="utf-8")  # noqa: SIM115 - open for the whole run, a line per level

    def write(line: dict[str, Any]) -> None:
        out.write(json.dumps(line) + "\n")
        out.flush()

    start = time.monotonic()
    try:
        from vllm import SamplingParams
        from vllm.engine.arg_utils import EngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.llm_engine import LLMEngine

        imported = round(time.monotonic() - start, 2)
        parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
        ns, unknown = parser.parse_known_args(["--model", str(spec["model"]), *engine_argv(list(spec["engine_args"]))])
        args = EngineArgs.from_cli_args(ns)
        levels = [int(c) for c in spec["levels"]]
        # Fixed here, not left to vLLM's defaults (which follow the GPU's memory): they shape every step.
        args.max_num_seqs = args.max_num_seqs or max(levels)
        args.max_num_batched_tokens = args.max_num_batched_tokens or int(spec.get("max_batched_tokens", 8192))
        args.async_scheduling = False
        args.disable_log_stats = True
        engine = LLMEngine.from_engine_args(args, usage_context=UsageContext.ENGINE_CONTEXT)
        write({"ready": round(time.monotonic() - start, 2), "imported": imported, "ignored_args": unknown,
               "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens})
        params = SamplingParams(temperature=0.0, max_tokens=int(spec["max_tokens"]),
                                logprobs=int(spec["top_logprobs"]))
        prompts = [str(p) for p in spec["prompts"]]
        for p in range(int(spec.get("passes", 1))):
            for c in levels:
                t0 = time.monotonic()
                replies = run_level(engine, params, prompts, c, int(spec["requests"]), f"p{p}c{c}")
                write({"pass": p, "level": c, "seconds": round(time.monotonic() - t0, 3), "replies": replies})
    except BaseException as exc:  # noqa: BLE001 - whatever ended the engine is the evidence
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        write({"error": last[:2000]})
        traceback.print_exc()
        return 1
    write({"done": True, "seconds": round(time.monotonic() - start, 2)})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
