"""The ``golden`` check of a smoke run: which replies, scored by the golden on this host, judged against what.

Judged: every reply of the HTTP sweep at every level and every reply of the
fixed-batch probe at every level. Teacher-forced, the golden scores a reply
given its prompt and the tokens sent before each position, whatever batch
produced it. Which prompt a reply answers is the host's schedule (request
``i`` of a level asks prompt ``i mod prompts``), never the runner's say; the
prompt's tokens are the host's tokenizer's, and a reply whose server counted
others cannot be scored (:mod:`.scoring`). A request of the schedule that
got no reply (the probe's engine died at its level, the server answered it
with an error or not at all) fails the check: the golden answers every
prompt, and an image that gave no answer did not give the golden's
(:func:`unanswered`).

What it is judged against: the golden's envelope (:mod:`.envelope`), measured
on this host from the golden alone when a reference is recorded, and kept in
the reference's signed ``golden`` section; a judged run takes it from there.
A recording whose replies lie outside it fails and keeps nothing
(:func:`.judge.recorded`). A host without torch or tokenizers, a reference
without an envelope, or a run whose sweep did not run gives a skip that says
so; the check never passes without having judged, nor under the coverage
floors (:mod:`.coverage`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import Malformed
from ..verdicts import Check
from . import judge
from .judge import Scored
from .scoring import Served, missing

log = logging.getLogger(__name__)


def _served(source: str, level: int, request: int, prompt: int, reply: Mapping[str, Any]) -> Served:
    """A reply as the runner sent it (the sweep's ``Reply`` fields, or the probe's), to the request and prompt
    the host scheduled; Malformed when it is not."""
    if not isinstance(reply, Mapping):
        raise Malformed(f"{source} reply {level}:{request} is not an object")
    try:
        top = reply.get("top") if reply.get("top") is not None else reply.get("top_logprobs")
        return Served(source, level, request, prompt, tuple(str(t) for t in reply["tokens"] or ()),
                      tuple(None if v is None else float(v) for v in reply.get("logprobs") or ()),
                      tuple({str(k): float(v) for k, v in dict(t or {}).items()} for t in top or ()),
                      None if reply.get("prompt_tokens") is None else int(reply["prompt_tokens"]))
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise Malformed(f"{source} reply {level}:{request} is malformed ({type(exc).__name__}: {exc})") from None


def served_replies(http: Mapping[str, Any], prompts: int, probe: Mapping[tuple[int, int], Sequence[Mapping[str, Any]]]
                   ) -> list[Served]:
    """What the golden judges of a run: the HTTP sweep's replies at every level (``http``: ``LEVEL:I`` -> reply)
    and the probe's first pass at every level (its ``I``-th reply answers request ``I``), each answering prompt
    ``I mod prompts`` as the host scheduled it. A probe reply that names another request is Malformed."""
    out = []
    keys = [(str(key).partition(":"), reply) for key, reply in http.items()]
    for (at, _, index), reply in sorted(((k, r) for k, r in keys if k[0].isdigit() and k[2].isdigit()),
                                        key=lambda kr: (int(kr[0][0]), int(kr[0][2]))):
        out.append(_served("http", int(at), int(index), int(index) % prompts, reply))
    for (passed, level), replies in sorted(probe.items()):
        if passed != 0:
            continue
        for i, reply in enumerate(replies):
            said = reply.get("request") if isinstance(reply, Mapping) else None
            if said != i:
                raise Malformed(f"fixed reply {level}:{i} names request {said!r}, not the {i} the host scheduled "
                                "there")
            out.append(_served("fixed", level, i, i % prompts, reply))
    return out


def unanswered(http: Mapping[str, Any], asked: Sequence[int], requests: int, prompts: int,
               probe: Mapping[tuple[int, int], Sequence[Any]], probe_levels: Sequence[int], probe_requests: int,
               probe_ended: str, errors: Mapping[tuple[int, int], str] | None = None) -> list[Scored]:
    """The scheduled requests that got no reply, each as a :class:`~.judge.Scored` whose ``problem`` says how it
    ended: of the HTTP sweep, every request ``I`` (``requests`` a level) of each level in ``asked`` (the levels
    the sweep reached) with no ``LEVEL:I`` in ``http`` (``errors``: the server's answer to it, where the runner
    measured one); of the fixed batches, every request of each level of ``probe_levels`` whose first pass did not
    reply to it (``probe_ended``: why the probe stopped). The schedule is the host's: request ``I`` asks prompt
    ``I mod prompts``."""
    out = []
    for level in asked:
        for i in range(requests):
            if f"{level}:{i}" not in http:
                said = (errors or {}).get((level, i)) or "no reply came back from the runner"
                out.append(Scored("http", level, i, i % prompts, problem=" ".join(str(said).split())[:300]))
    for level in probe_levels:
        got = len(probe.get((0, level)) or ())
        why = " ".join((probe_ended or "missing").split())[:300]
        for i in range(got, probe_requests):
            out.append(Scored("fixed", level, i, i % prompts, problem=f"the probe gave no reply ({why})"))
    return out


def run(model: Path, prompts: Sequence[str], replies: Sequence[Served], *, section: Mapping[str, Any] | None,
        recording: bool, device: str | None = None, levels: Sequence[int] = (), tokens: int | None = None,
        gone: Sequence[Scored] = ()) -> tuple[Check, dict[str, Any] | None]:
    """The ``golden`` check of ``replies`` (to ``prompts``, by the model in ``model``): judged at the thresholds
    of the envelope the reference's golden ``section`` keeps, or, ``recording``, the envelope measured here
    (``tokens`` generated positions per prompt: the replies' length) and the section to keep in the reference
    (None where nothing is to be kept). ``levels``: the schedule's, each of which the coverage must reach.
    ``gone``: the scheduled requests that got no reply (:func:`unanswered`); with any, the check fails without
    computing anything (:func:`.judge.unanswered`)."""
    absent = missing()
    if absent:
        return judge.skipped(absent), None
    if gone:
        return judge.unanswered(gone, recording=recording), None
    limits = None
    if not recording:
        limits = judge.thresholds(section)
        if limits is None:
            return judge.skipped("the reference records no golden envelope (recorded where the golden could not "
                                 "run, or by an earlier version): record it again on a host with torch"), None
    if not replies:
        return judge.skipped("no reply of the HTTP sweep or the fixed batches came back to judge"), None
    from . import warm
    from .scoring import Scorer

    want = tuple(int(c) for c in levels)
    try:
        # What was computed while the image ran (warm.py), where it was computed for this model and these prompts
        prepared = warm.take(model, prompts) if device is None else None
        scorer = prepared if prepared is not None else Scorer(model, device)
        scored = scorer.score(prompts, replies)
        if recording:
            longest = max((len(r.tokens) for r in replies), default=0)
            envelope = scorer.envelope(prompts, int(tokens or longest))
    except Malformed as exc:
        return judge.skipped(f"the golden cannot compute this model: {exc}"), None
    except (RuntimeError, ValueError, IndexError, KeyError) as exc:
        # torch's errors for weights that do not fit the config (a shape, a dtype, memory): the golden cannot
        # compute this folder, which is no judgement of the image.
        return judge.skipped(f"the golden cannot compute the model in {model}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:300]}"), None
    timing = {"timing": scorer.timing.to_dict(), "served": judge.served(scored)}
    log.info("golden: %s", timing["timing"])
    if recording:
        return judge.recorded(scored, envelope, timing, want)
    assert limits is not None
    j = judge.judge(scored, limits)
    try:
        measured: dict[str, Any] = judge.noise(scored)
    except ValueError:
        measured = {}
    return judge.check(j, {**timing, "noise": measured, "envelope": dict((section or {}).get("envelope") or {})},
                       want), None
