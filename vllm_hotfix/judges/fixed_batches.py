"""Exact above concurrency 1: the host's judgement of the fixed-batch probe, and the per-level answers it needs.

Over HTTP the batches of a level depend on when each request reaches the
engine, so the oracle can judge a reply above concurrency 1 only within the
noise (:mod:`.oracle`): measured on an H100, at concurrency 16 the trusted
image's replies differed from its own concurrency-1 replies in 48 of 48, so
the tolerance there admitted nearly every token of the model's top-5, and a
backport broken only under load would have passed. The probe
(``probes/batches.py``, run by the runner beside the server) fixes every
step's batch instead: at level ``c`` it keeps ``c`` requests in vLLM's
engine, stepped in its own process, refilled in order. A level's replies are
then the image's alone, and they must equal, bit for bit, what the
reference image replied at the same level under the same schedule.

The reference keeps those answers in its ``levels`` section, recorded by
``smoke --record-reference`` (the probe runs the whole schedule twice on one
engine; both passes must agree bit for bit, or nothing is written) with the
schedule they were recorded under (levels, requests, tokens per reply). A
run at another schedule is refused before it starts.

The probe's replies never meet the reference inside the image: the runner
sends them back raw, and :func:`judge` compares them here, on the host.
Pure: no network, no engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import SmokeError, UsageError
from ..inimage import reference as answers
from ..inimage.oracle import compare
from ..verdicts import Check, Status
from . import oracle

CHECK = "exact-levels"
PASSES_RECORDING = 2  # the whole schedule run twice when recording: the second must repeat the first
MAX_BATCHED_TOKENS = 8192  # the probe engine's token budget per step, unless the server's arguments give one


def schedule(levels: Sequence[int], requests: int, max_tokens: int) -> dict[str, Any]:
    """What a level's replies depend on beside the settings a reference names: the schedule."""
    return {"levels": [int(c) for c in levels], "requests": int(requests), "max_tokens": int(max_tokens),
            "top_logprobs": answers.TOP_LOGPROBS, "max_batched_tokens": MAX_BATCHED_TOKENS}


def job_part(settings: Mapping[str, Any], levels: Sequence[int], requests: int, prompts: Sequence[str],
             max_tokens: int, recording: bool) -> dict[str, Any]:
    """The job's ``batches`` part: what the probe runs (never the reference's answers)."""
    return {"model": "/model", "engine_args": list(settings["serve_args"]), "env": dict(settings["env"]),
            "prompts": list(prompts), "passes": PASSES_RECORDING if recording else 1,
            **schedule(levels, requests, max_tokens)}


def refuse_other_schedule(ref: answers.Reference, levels: Sequence[int], requests: int) -> None:
    """UsageError, naming the file, when ``ref`` holds no answers for this run's levels and requests."""
    section = ref.levels
    where = f"--reference {ref.path}"
    if not section:
        raise UsageError(f"{where}: holds no per-level answers (recorded by serve-check or an earlier version): "
                         "record it again with smoke --record-reference, which records every level under fixed "
                         "batches")
    recorded = section.get("schedule") or {}
    want = schedule(levels, requests, ref.max_tokens)
    missing = [c for c in want["levels"] if str(c) not in (section.get("answers") or {})]
    differ = [f"{k} {recorded.get(k)!r} there, {want[k]!r} here" for k in ("requests", "max_tokens", "top_logprobs",
                                                                          "max_batched_tokens")
              if recorded.get(k) != want[k]]
    if missing:
        differ.insert(0, f"no answers at concurrency {','.join(map(str, missing))} (recorded at "
                         f"{','.join(map(str, recorded.get('levels') or []))})")
    if differ:
        raise UsageError(f"{where}: recorded under another schedule ({'; '.join(differ)}); record the reference "
                         "again at these levels, or run at the ones it names")


@dataclass(frozen=True, slots=True)
class ProbeRun:
    """What the probe wrote, as the runner sent it back: replies per (pass, level), and how it ended."""

    runs: Mapping[tuple[int, int], Sequence[Mapping[str, Any]]] = field(default_factory=dict)
    seconds: Mapping[tuple[int, int], float] = field(default_factory=dict)
    error: str = ""  # the engine's exception, or why the probe gave no lines
    exit: int | None = None
    log: Sequence[str] = ()
    ready_s: float | None = None  # the engine's start
    imported_s: float | None = None  # of which vLLM's imports (the probe's own measurement, shown only)
    wall_s: float | None = None
    done: bool = False

    def ended(self) -> str:
        """Why the probe stopped early, in one line ('' when it finished)."""
        if self.done:
            return ""
        if self.error:
            return self.error
        cause = next((ln for ln in reversed(self.log) if "Error" in ln or "error" in ln), "")
        return f"the probe exited {self.exit}" + (f": {cause.strip()[:300]}" if cause else " with no output")


def parse(raw: bytes | None) -> ProbeRun:
    """The runner's batch report; an empty ProbeRun saying why where there is none or it is malformed."""
    if raw is None:
        return ProbeRun(error="the runner sent no replies from the batch probe")
    try:
        doc = json.loads(raw)
        lines = doc["lines"]
        if not isinstance(lines, list):
            raise TypeError("lines is not a list")
        runs: dict[tuple[int, int], Sequence[Mapping[str, Any]]] = {}
        seconds: dict[tuple[int, int], float] = {}
        error, ready, imported, done = str(doc.get("error") or ""), None, None, False
        for line in lines:
            if not isinstance(line, dict):
                continue
            if "level" in line:
                key = (int(line["pass"]), int(line["level"]))
                replies = line["replies"]
                if not isinstance(replies, list) or not all(isinstance(r, dict) for r in replies):
                    raise TypeError(f"replies of level {key[1]} are not a list of objects")
                runs[key], seconds[key] = replies, float(line.get("seconds") or 0)
            elif "error" in line:
                error = str(line["error"])
            elif "ready" in line:
                ready = float(line["ready"])
                imported = float(line["imported"]) if line.get("imported") is not None else None
            elif line.get("done"):
                done = True
        code = doc.get("exit")
        return ProbeRun(runs, seconds, error, int(code) if code is not None else None,
                        [str(x) for x in doc.get("log") or []], ready, imported, float(doc.get("seconds") or 0),
                        done)
    except (KeyError, TypeError, ValueError) as exc:
        return ProbeRun(error=f"the runner's batch report is malformed ({type(exc).__name__}: {exc})")


def _answer(prompts: Sequence[str], reply: Mapping[str, Any], request: int) -> answers.Answer:
    """One probe reply, to the host's ``request`` of its level, as an Answer to the prompt the host scheduled
    for it (request ``i`` asks prompt ``i mod prompts``: the runner's ``prompt`` is not taken as a fact);
    ValueError when it is malformed."""
    try:
        tokens = tuple(str(t) for t in reply["tokens"])
        counted = reply.get("prompt_tokens")
        return answers.Answer(
            prompts[request % len(prompts)], None if counted is None else int(counted), tokens,
            tuple(None if x is None else float(x) for x in reply["logprobs"]),
            tuple({str(a): float(b) for a, b in t.items()} for t in reply["top_logprobs"]),
            str(reply["finish_reason"]), answers.tokens_sha256(tokens))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ValueError(f"a malformed reply ({type(exc).__name__}: {exc})") from None


def _level(run: ProbeRun, key: tuple[int, int], prompts: Sequence[str], requests: int) -> list[answers.Answer]:
    replies = run.runs[key]
    indices = [r.get("request") for r in replies]
    if indices != list(range(requests)):
        raise ValueError(f"replies to requests {indices[:8]}..., not the {requests} asked for")
    return [_answer(prompts, r, i) for i, r in enumerate(replies)]


def record(run: ProbeRun, prompts: Sequence[str], levels: Sequence[int], requests: int,
           max_tokens: int) -> dict[str, Any]:
    """The reference's ``levels`` section from a recording probe run; SmokeError unless every level came back
    in both passes, bit for bit the same."""
    out: dict[str, list[dict[str, Any]]] = {}
    identical = 0
    for p, c in [(p, c) for p in range(PASSES_RECORDING) for c in levels]:
        if (p, c) not in run.runs:
            raise SmokeError(f"cannot record per-level answers: the batch probe gave none at concurrency {c} in "
                             f"pass {p + 1} ({run.ended() or 'missing'})")
    for c in levels:
        try:
            first = _level(run, (0, c), prompts, requests)
            again = _level(run, (1, c), prompts, requests)
        except ValueError as exc:
            raise SmokeError(f"cannot record per-level answers at concurrency {c}: {exc}") from None
        for i, (a, b) in enumerate(zip(first, again, strict=True)):
            dev = compare(a, b)
            if not dev.identical:
                raise SmokeError(f"cannot record per-level answers: at concurrency {c}, request {i} differs between "
                                 f"two passes of the same schedule ({dev.detail}): the engine is not repeatable "
                                 "under fixed batches")
        identical += len(first)
        out[str(c)] = [{**a.to_dict(), "prompt": i % len(prompts)} for i, a in enumerate(first)]
    return {"schedule": schedule(levels, requests, max_tokens), "answers": out,
            "repeat": {"passes": PASSES_RECORDING, "replies": identical, "identical": identical},
            "seconds": {str(c): run.seconds.get((0, c)) for c in levels}, "engine_start_s": run.ready_s}


def stored(section: Mapping[str, Any], level: int, prompts: Sequence[str]) -> list[answers.Answer]:
    """The reference's answers at ``level`` (ValueError when malformed)."""
    return [_answer(prompts, a, i) for i, a in enumerate(section["answers"][str(level)])]


@dataclass
class LevelEvidence:
    """One level of fixed batches against the reference's answers at the same level."""

    concurrency: int
    requests: int
    answered: int = 0
    identical: int = 0
    wrong: int = 0
    seconds: float | None = None
    first_wrong: str | None = None  # request, prompt and where it departs
    replies: list[dict[str, Any]] = field(default_factory=list)  # per request: sha, first difference

    def to_dict(self) -> dict[str, Any]:
        return {"concurrency": self.concurrency, "requests": self.requests, "answered": self.answered,
                "identical": self.identical, "wrong": self.wrong, "seconds": self.seconds,
                "first_wrong": self.first_wrong, "replies": self.replies}


def judge(ref: answers.Reference, run: ProbeRun, levels: Sequence[int], requests: int) -> tuple[Check, dict[str, Any]]:
    """The ``exact-levels`` check: every level's replies bitwise the reference's at that level; and its
    evidence (per level: answered, identical, wrong, the first wrong reply; the first level that failed)."""
    prompts = ref.prompts
    evidence: list[LevelEvidence] = []
    failed: list[int] = []
    stopped = ""
    for c in levels:
        ev = LevelEvidence(c, requests, seconds=run.seconds.get((0, c)))
        evidence.append(ev)
        if (0, c) not in run.runs:
            stopped = stopped or f"no replies from concurrency {c} on: {run.ended() or 'missing'}"
            failed.append(c)
            continue
        try:
            got = _level(run, (0, c), prompts, requests)
            want = stored(ref.levels, c, prompts)
        except (KeyError, ValueError) as exc:
            ev.first_wrong = f"unreadable: {exc}"
            failed.append(c)
            continue
        if len(want) != len(got):
            ev.first_wrong = f"the reference holds {len(want)} answers at this level, the probe gave {len(got)}"
            failed.append(c)
            continue
        for i, (a, b) in enumerate(zip(want, got, strict=True)):
            verdict = oracle.exact(a, b)
            dev = verdict.deviation
            # The prompt's token count is the one recorded for the prompt the host scheduled; an image that
            # counted another read another prompt, whatever tokens it replied.
            counted = a.prompt_tokens is None or b.prompt_tokens == a.prompt_tokens
            ok = verdict.ok and counted
            ev.answered += 1
            ev.identical += ok
            ev.wrong += not ok
            ev.replies.append({"request": i, "prompt": i % len(prompts), "identical": ok,
                               "reply_sha256": b.sha256, "first_difference": dev.first_difference,
                               "token_divergence": dev.token_divergence})
            if not ok and ev.first_wrong is None:
                ev.first_wrong = f"request {i} (prompt {i % len(prompts)}): " + (
                    dev.detail if not verdict.ok else f"the image counted {b.prompt_tokens} prompt tokens, "
                                                      f"{a.prompt_tokens} were recorded for this prompt")
        if ev.wrong:
            failed.append(c)
    first = failed[0] if failed else None
    data = {"levels": [ev.to_dict() for ev in evidence], "first_failed_level": first,
            "engine_start_s": run.ready_s, "imports_s": run.imported_s, "probe_s": run.wall_s, "ended": run.ended(),
            "reference_sha256": ref.sha256, "reference_image_id": ref.image_id}
    if first is None:
        detail = (f"levels {','.join(map(str, levels))}: each of the {requests} replies per level bitwise the "
                  f"reference's at the same level, under fixed batches: reproducible against image "
                  f"{ref.image_id or 'not named by the reference'}")
        return Check(CHECK, Status.PASS, detail, data=data), data
    wrong = [ev for ev in evidence if ev.wrong]
    parts = [f"concurrency {ev.concurrency}: {ev.wrong} of {ev.answered} replies not bitwise the reference's "
             f"({ev.first_wrong})" for ev in wrong[:2]]
    if stopped:
        parts.append(stopped)
    detail = f"wrong under fixed batches from concurrency {first}: " + "; ".join(parts)
    return Check(CHECK, Status.FAIL, detail[:1500], data=data), data


def recorded_check(section: Mapping[str, Any]) -> Check:
    """A recording run's ``exact-levels`` check: a skip (a recording is never judged against itself)."""
    levels = section["schedule"]["levels"]
    return Check(CHECK, Status.SKIP, f"recorded the answers at concurrency {','.join(map(str, levels))} "
                                     f"({section['repeat']['replies']} replies, each repeated bit for bit in a "
                                     "second pass); a recording is not judged against itself",
                 data={"recorded": {"levels": levels, "seconds": section.get("seconds")}})
