from __future__ import annotations

import hashlib
import os
import random
from dataclasses import dataclass, field
from typing import Any

VOCAB = 320
CHUNK = 64  # prompt tokens a step prefills per sequence


def _tok(*parts: object) -> int:
    return 1 + int.from_bytes(hashlib.sha256(":".join(map(str, parts)).encode()).digest()[:4], "big") % (VOCAB - 1)


@dataclass
class Logprob:
    logprob: float


@dataclass
class _Out:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[_Out]
    finished: bool = False


@dataclass
class _Seq:
    rid: str
    prompt: str
    params: Any
    prefilled: int = 0
    out: _Out = field(default_factory=_Out)


class LLMEngine:
    def __init__(self, args: Any) -> None:
        self.args = args
        self.waiting: list[_Seq] = []
        self.running: list[_Seq] = []
        self.unrepeatable = bool(args.unrepeatable)

    @classmethod
    def from_engine_args(cls, args: Any, usage_context: Any = None) -> LLMEngine:
        if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
            raise RuntimeError("the stand-in engine runs in-process only")
        return cls(args)

    def add_request(self, request_id: str, prompt: str, params: Any) -> str:
        self.waiting.append(_Seq(request_id, prompt, params))
        return request_id

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def step(self) -> list[RequestOutput]:
        while self.waiting and len(self.running) < (self.args.max_num_seqs or 256):
            self.running.append(self.waiting.pop(0))
        width = len(self.running)  # the step's batch: its numerics follow it
        if self.args.die_at_concurrency and width >= self.args.die_at_concurrency:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        done = []
        for seq in list(self.running):
            if seq.prefilled < len(seq.prompt):
                seq.prefilled = min(len(seq.prompt), seq.prefilled + CHUNK)
                if seq.prefilled < len(seq.prompt):
                    continue
            j = len(seq.out.token_ids)
            key = seq.prompt
            if self.args.wrong_at_concurrency and width >= self.args.wrong_at_concurrency and j >= 2:
                key = f"garbage:{seq.prompt}"
            chosen = _tok(key, j, 0)
            wobble = (width % 7) * 1e-6 + (random.random() * 1e-7 if self.unrepeatable else 0.0)
            top = {chosen: Logprob(-0.05 - wobble)}
            m = 1
            while len(top) < max(2, seq.params.logprobs or 0):
                alt = _tok(key, j, m)
                m += 1
                if alt not in top:
                    top[alt] = Logprob(-2.45 - 0.5 * len(top) - wobble)
            seq.out.token_ids.append(chosen)
            seq.out.logprobs.append(top)
            if len(seq.out.token_ids) >= seq.params.max_tokens:
                seq.out.finish_reason = "length"
                self.running.remove(seq)
                done.append(RequestOutput(seq.rid, list(seq.prompt.encode()), [seq.out], True))
        return done
