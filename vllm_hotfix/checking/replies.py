"""The host's judgement of the replies a runner's sweep sent back: the reference never enters the image.

The runner in the image asks the image's server the reference's prompts at
every level and sends back each reply as it came (tokens, log-probabilities,
top-k; :func:`vllm_hotfix.checking.sweep.sweep` with ``replies``), after a
mark of its own. It never has the reference answers, so it cannot echo them;
whatever it says of its replies' correctness is not read. Here, on the host,
every reply is judged by the oracle exactly as :mod:`.sweep` judges a server
the host asks itself: at concurrency 1 bit for bit against the reference,
above it within the tolerance of the same image's concurrency-1 reply (the
reference's where the image gave none that passed), and ``--min-tokens``.
A request whose reply did not come back, or came back unreadable, fails.
The levels' summaries, the first failing level and the ``serve-sweep``
check are made again from these judgements alone; what the runner measured
of time (latency, wall time) is kept as its measurement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import Malformed
from . import oracle
from . import reference as answers
from .sweep import Level, RequestEvidence, SweepResult, as_check, judge, summarise

_EVIDENCE = {f.name for f in dataclasses.fields(RequestEvidence)}
_LEVEL = {f.name for f in dataclasses.fields(Level)} - {"per_request"}
# What the runner measured and may say; every judgement field is the host's.
_MEASURED = ("level", "index", "prompt", "http_status", "latency_s", "error")


def reply_of(raw: object) -> answers.Reply:
    """A reply as the runner sent it, checked field by field; Malformed when it is not one."""
    if not isinstance(raw, Mapping):
        raise Malformed("not an object")
    try:
        tokens = raw.get("tokens")
        return answers.Reply(
            text=str(raw["text"]), finish_reason=str(raw["finish_reason"]),
            prompt_tokens=None if raw.get("prompt_tokens") is None else int(raw["prompt_tokens"]),
            completion_tokens=int(raw["completion_tokens"]),
            tokens=None if tokens is None else tuple(str(t) for t in tokens),
            logprobs=tuple(None if v is None else float(v) for v in raw.get("logprobs") or ()),
            top=tuple({str(k): float(v) for k, v in dict(t).items()} for t in raw.get("top") or ()),
            model=str(raw.get("model") or ""))
    except (KeyError, TypeError, ValueError) as exc:
        raise Malformed(f"unreadable reply ({exc})") from None


def _fresh(said: Mapping[str, Any]) -> RequestEvidence:
    """A request's evidence with only what the runner measured kept: nothing it judged."""
    kept = {k: said.get(k) for k in _MEASURED}
    ev = RequestEvidence(int(kept["level"] or 0), int(kept["index"] or 0), int(kept["prompt"] or 0),
                         None if kept["http_status"] is None else int(kept["http_status"]),
                         float(kept["latency_s"] or 0.0))
    ev.error = None if kept["error"] is None else str(kept["error"])
    return ev


def rejudge(sweep: Mapping[str, Any], raw: Mapping[str, Any], reference: answers.Reference | None,
            levels: Sequence[int], requests: int, *, min_tokens: int | None = None,
            noise_multiple: float = oracle.NOISE_MULTIPLE, keep_going: bool = False
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the serve-sweep check, the sweep's report) as the host judges the runner's ``raw`` replies.

    ``sweep``: the runner's report of its sweep (which requests it sent, what
    it measured); ``raw``: its replies under ``LEVEL:I``. Without
    ``keep_going`` the levels after the first failing one are left out, as a
    sweep judged where it runs stops there.
    """
    tolerance = answers.tolerance(reference, noise_multiple) if reference is not None else None
    basis: dict[int, answers.Reply] = {}
    result = SweepResult(str(sweep.get("url", "")), str(sweep.get("model", "")), [],
                         max_tokens=int(sweep.get("max_tokens") or 0), min_tokens=min_tokens,
                         prompts=int(sweep.get("prompts") or 0), server_log=str(sweep.get("server_log") or ""),
                         server_died=bool(sweep.get("server_died")))
    if reference is not None:
        result.reference = {**reference.summary(), "noise_multiple": noise_multiple, "tolerance_nats": tolerance}
    for said_level in sweep.get("levels") or []:
        level = Level(**{k: v for k, v in dict(said_level).items() if k in _LEVEL and k in ("concurrency",
                                                                                           "requests", "wall_s")})
        exact = reference is not None and level.concurrency == 1
        level.tolerance_nats = 0.0 if exact else tolerance
        for said in said_level.get("per_request") or []:
            ev = _fresh(said)
            reply = None
            got = raw.get(f"{ev.level}:{ev.index}")
            if got is not None:
                try:
                    reply = reply_of(got)
                except Malformed as exc:
                    ev.error = f"the runner's reply is {exc}"
            if reply is None:
                ev.error = ev.error or "no reply came back from the runner"
                level.per_request.append(ev)
                continue
            ev.error = None
            ev.prompt_tokens, ev.reply_tokens = reply.prompt_tokens, reply.completion_tokens
            ev.finish_reason, ev.reply_sha256 = reply.finish_reason, reply.sha256
            # Passed by status alone without a reference; with one, only where the oracle passes it.
            ev.judged_by, ev.passed = "status", reference is None
            if reference is not None:
                if not 0 <= ev.prompt < len(reference.answers):
                    ev.passed, ev.error = False, f"prompt {ev.prompt} is not one of the reference's"
                else:
                    judge(ev, ev.prompt, reply, reference, basis, None if exact else tolerance)
                if exact and ev.passed and reply.tokens is not None:
                    basis.setdefault(ev.prompt, reply)
            if ev.passed and min_tokens is not None and reply.completion_tokens < min_tokens:
                ev.judged_by, ev.passed = "min-tokens", False
                ev.error = (f"reply of {reply.completion_tokens} completion token(s), every reply must have "
                            f"at least {min_tokens} (finish_reason {reply.finish_reason})")
            level.per_request.append(ev)
        summarise(level)
        result.levels.append(level)
        if (level.failures or level.successes < level.requests) and result.failed_level is None:
            result.failed_level = level.concurrency
            if not keep_going:
                break
    if result.server_died and result.failed_level is None:
        result.failed_level = result.levels[-1].concurrency if result.levels else None
    missing = [c for c in levels if c not in {lv.concurrency for lv in result.levels}]
    if missing and result.failed_level is None:
        # A level the runner skipped before anything failed: nothing of it can pass.
        level = Level(missing[0], requests, failures=requests, errors=["the runner sent no reply at this level"])
        result.levels.append(level)
        result.failed_level = missing[0]
    check = as_check(result, levels, min_tokens)
    return {**check, "data": {**dict(check.get("data") or {}), "judged_on": "host"}}, result.to_dict()
