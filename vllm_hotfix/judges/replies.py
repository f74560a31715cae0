"""The host's judgement of the replies a runner's sweep sent back: the reference never enters the image.

The runner in the image asks the image's server the reference's prompts at
every level and sends back each reply as it came (tokens, log-probabilities,
top-k; :func:`vllm_hotfix.inimage.sweep.sweep` with ``replies``), after a
mark of its own. It never has the reference answers, so it cannot echo them,
and it judges nothing. Here, on the host, every reply is judged by the
oracle exactly as :mod:`.sweep` judges a server the host asks itself: at
concurrency 1 bit for bit against the reference, above it by its form (status, length, finish reason, no NaN) with its
movement from the same image's concurrency-1 reply (the reference's where
the image gave none that passed) measured, and ``--min-tokens``.
A request whose reply did not come back, or came back unreadable, fails.
Which requests there were is the host's too: the levels, the requests of
each and the prompt each asked come from the job it sent, and a level the
runner reports with any other set (fewer, more, repeated, other prompts)
fails, as does a level the job did not ask for. The levels' summaries, the first failing level and the ``serve-sweep``
check are made again from these judgements alone; what the runner measured
of time (latency, wall time) is kept as its measurement.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import Malformed
from ..inimage import reference as answers
from ..inimage.sweep import Level, RequestEvidence, SweepResult
from .sweep import as_check, judge, short, summarise

# What the runner measured and may say; every judgement field, and the schedule, is the host's.
_MEASURED = ("http_status", "latency_s", "error")


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


def _fresh(said: Mapping[str, Any], level: int, index: int, prompt: int) -> RequestEvidence:
    """Request ``index`` of ``level`` as the host scheduled it (asking ``prompt``), with only what the runner
    measured of it kept: nothing it judged, and neither its place nor its prompt."""
    kept = {k: said.get(k) for k in _MEASURED}
    try:
        status = None if kept["http_status"] is None else int(kept["http_status"])
        latency = float(kept["latency_s"] or 0.0)
    except (TypeError, ValueError):
        status, latency = None, 0.0
    ev = RequestEvidence(level, index, prompt, status, latency)
    ev.error = None if kept["error"] is None else str(kept["error"])
    return ev


def _number(value: object) -> int | None:
    """A whole number the runner wrote, or None where it wrote something else."""
    if isinstance(value, bool):
        return None
    try:
        return int(value) if isinstance(value, (int, str)) else None
    except ValueError:
        return None


def off_schedule(said_levels: Sequence[Mapping[str, Any]], concurrency: int, requests: int,
                 prompts: int) -> str | None:
    """How the runner's report of level ``concurrency`` departs from the schedule the host sent (requests 0 to
    ``requests``-1, request i asking prompt i mod ``prompts``), or None where it keeps to it. The host counts
    and places every request itself: a report of fewer, other or repeated requests cannot make a level pass."""
    if len(said_levels) > 1:
        return f"the runner reported concurrency {concurrency} {len(said_levels)} times"
    entries = [dict(r) if isinstance(r, Mapping) else {} for r in said_levels[0].get("per_request") or []]
    indices = [_number(r.get("index")) for r in entries]
    if sorted(i for i in indices if i is not None) != list(range(requests)) or None in indices:
        shown = ",".join("?" if i is None else str(i) for i in indices[:12]) + ("..." if len(indices) > 12 else "")
        return (f"the runner reported requests [{shown}] at concurrency {concurrency}, the host sent "
                f"{requests} (0 to {requests - 1})")
    for entry, index in zip(entries, indices, strict=True):
        assert index is not None
        if _number(entry.get("level")) != concurrency:
            return (f"the runner reported request {index} of concurrency {concurrency} under level "
                    f"{entry.get('level')!r}")
        if _number(entry.get("prompt")) != index % prompts:
            return (f"the runner reported request {index} of concurrency {concurrency} as prompt "
                    f"{entry.get('prompt')!r}, the host sent prompt {index % prompts}")
    return None


def said_levels(sweep: Mapping[str, Any]) -> dict[int | None, list[Mapping[str, Any]]]:
    """The runner's levels by the concurrency it named (None: one it named unreadably): what it says it asked,
    read for its measurements only (the serve-sweep check's, the golden's unanswered requests)."""
    out: dict[int | None, list[Mapping[str, Any]]] = {}
    for said in sweep.get("levels") or []:
        said = said if isinstance(said, Mapping) else {}
        out.setdefault(_number(said.get("concurrency")), []).append(said)
    return out


def rejudge(sweep: Mapping[str, Any], raw: Mapping[str, Any], reference: answers.Reference | None,
            levels: Sequence[int], requests: int, *, prompts: int, min_tokens: int | None = None,
            keep_going: bool = False
            ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the serve-sweep check, the sweep's report) as the host judges the runner's ``raw`` replies.

    The schedule is the host's, from the job it sent: ``levels`` in that
    order, ``requests`` per level, request i asking prompt i mod ``prompts``.
    ``sweep``: the runner's report of its sweep, read only for what it
    measured (status, latency, errors, wall time); a level it reports with
    any other set of requests, or one the host did not ask for, fails.
    ``raw``: its replies under ``LEVEL:I``. Without ``keep_going`` the levels
    after the first failing one are left out, as a sweep judged where it
    runs stops there.
    """
    basis: dict[int, answers.Reply] = {}
    result = SweepResult(str(sweep.get("url", "")), str(sweep.get("model", "")), [],
                         max_tokens=int(sweep.get("max_tokens") or 0), min_tokens=min_tokens,
                         prompts=prompts, server_log=str(sweep.get("server_log") or ""),
                         server_died=bool(sweep.get("server_died")))
    if reference is not None:
        result.reference = reference.summary()
    by_level = said_levels(sweep)
    foreign = sorted((c for c in by_level if c not in levels), key=lambda c: (c is None, c or 0))
    if foreign:
        # A level the host never asked for: the runner's sweep is not the one it was sent.
        named = foreign[0]
        count = sum(len(lv.get("per_request") or []) for lv in by_level[named])
        result.levels.append(Level(named if named is not None else 0, count, failures=max(count, 1),
                                   errors=[f"concurrency {named!r} is not a level the host asked for "
                                           f"({','.join(map(str, levels))})"]))
        result.failed_level = result.levels[0].concurrency
        check = as_check(result, levels, min_tokens)
        return {**check, "data": {**dict(check.get("data") or {}), "judged_on": "host"}}, result.to_dict()
    for concurrency in levels:
        said_level = by_level.get(concurrency)
        if said_level is None:
            if result.failed_level is None:
                # A level the runner skipped before anything failed: nothing of it can pass.
                result.levels.append(Level(concurrency, requests, failures=requests,
                                           errors=["the runner sent no reply at this level"]))
                result.failed_level = concurrency
            break
        level = Level(concurrency, requests)
        try:
            level.wall_s = float(said_level[0].get("wall_s") or 0.0)
        except (TypeError, ValueError):
            level.wall_s = 0.0
        exact = reference is not None and concurrency == 1
        departs = off_schedule(said_level, concurrency, requests, prompts)
        measured = {} if departs else {int(r["index"]): r for r in said_level[0].get("per_request") or []}
        for index in range(requests):
            ev = _fresh(measured.get(index) or {}, concurrency, index, index % prompts)
            if departs:
                ev.judged_by, ev.passed, ev.error = "schedule", False, departs
                level.per_request.append(ev)
                continue
            reply = None
            got = raw.get(f"{concurrency}:{index}")
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
                    judge(ev, ev.prompt, reply, reference, basis, exact)
                if exact and ev.passed and reply.tokens is not None:
                    basis.setdefault(ev.prompt, reply)
            if ev.passed and min_tokens is not None:
                short(ev, reply, min_tokens)
            level.per_request.append(ev)
        summarise(level)
        result.levels.append(level)
        if (level.failures or level.successes < level.requests) and result.failed_level is None:
            result.failed_level = level.concurrency
            if not keep_going:
                break
    if result.server_died and result.failed_level is None:
        result.failed_level = result.levels[-1].concurrency if result.levels else None
    check = as_check(result, levels, min_tokens)
    return {**check, "data": {**dict(check.get("data") or {}), "judged_on": "host"}}, result.to_dict()
