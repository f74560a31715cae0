"""The ``golden`` check of a smoke run: which replies, scored by the golden on this host, judged against what.

Judged: every reply of the HTTP sweep at concurrency 1 (its requests are
alone on the server, so the reply is the image's computation of that prompt)
and every reply of the fixed-batch probe at every level (each level's batches
are fixed, so a reply above concurrency 1 is the image's too). The replies
above concurrency 1 over HTTP are not: their batches depend on timing.

Where the threshold comes from: a recording run (``--record-reference``)
measures the noise on the trusted image's replies and keeps it in the
reference (:func:`.judge.recorded`); a judged run takes it from the
reference. A host without torch or tokenizers, a reference without the
golden's noise, or a run whose sweep did not run gives a skip that says so;
the check never passes without having judged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import Malformed
from ..verdicts import Check
from . import judge
from .scoring import Served, missing

log = logging.getLogger(__name__)


def _served(source: str, level: int, request: int, prompt: int, reply: Mapping[str, Any]) -> Served:
    """A reply as the runner sent it (the sweep's ``Reply`` fields, or the probe's); Malformed when it is not."""
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
    """What the golden judges of a run: the HTTP sweep's replies at concurrency 1 (``http``: ``LEVEL:I`` ->
    reply; request ``i`` asked prompt ``i mod prompts``) and the probe's first pass at every level."""
    out = []
    for key, reply in sorted(http.items(), key=lambda kv: str(kv[0])):
        at, _, index = str(key).partition(":")
        if at == "1" and index.isdigit() and isinstance(reply, Mapping):
            out.append(_served("http", 1, int(index), int(index) % prompts, reply))
    for (passed, level), replies in sorted(probe.items()):
        if passed != 0:
            continue
        for reply in replies:
            out.append(_served("fixed", level, int(reply["request"]), int(reply["prompt"]), reply))
    return out


def run(model: Path, prompts: Sequence[str], replies: Sequence[Served], *, section: Mapping[str, Any] | None,
        recording: bool, device: str | None = None) -> tuple[Check, dict[str, Any] | None]:
    """The ``golden`` check of ``replies`` (to ``prompts``, by the model in ``model``): judged at the thresholds
    the reference's golden ``section`` names, or, ``recording``, the noise measured on them and the section to
    keep in the reference (None where nothing is to be kept)."""
    absent = missing()
    if absent:
        return judge.skipped(absent), None
    thresholds = None
    if not recording:
        thresholds = judge.thresholds(section)
        if thresholds is None:
            return judge.skipped("the reference records no golden noise (recorded where the golden could not run, "
                                 "or by an earlier version): record it again on a host with torch"), None
    if not replies:
        return judge.skipped("no reply at concurrency 1 or under fixed batches came back to judge"), None
    from .scoring import Scorer

    try:
        scorer = Scorer(model, device)
        scored = scorer.score(prompts, replies)
    except Malformed as exc:
        return judge.skipped(f"the golden cannot compute this model: {exc}"), None
    except (RuntimeError, ValueError, IndexError, KeyError) as exc:
        # torch's errors for weights that do not fit the config (a shape, a dtype, memory): the golden cannot
        # compute this folder, which is no judgement of the image.
        return judge.skipped(f"the golden cannot compute the model in {model}: {type(exc).__name__}: "
                             f"{' '.join(str(exc).split())[:300]}"), None
    timing = {"timing": scorer.timing.to_dict()}
    log.info("golden: %s", timing["timing"])
    if recording:
        return judge.recorded(scored, timing)
    assert thresholds is not None
    recorded = dict((section or {}).get("noise") or {})
    return judge.check(judge.judge(scored, thresholds), {**timing, "noise": recorded}), None
