"""What came back from a runner, judged on the host: the report, the sweep's replies, the batches, the golden.

The runner's report is the image's word. The host judges it
(:mod:`vllm_hotfix.judges.judging`) together with what it makes itself of
what came back: the sweep's replies judged again (:func:`sweep_judged`,
:mod:`vllm_hotfix.judges.replies`), the fixed-batch probe's replies
(``exact-levels``, :func:`batch_check`), the golden forward's check of the
replies (:func:`golden_check`) and which reference judged them
(:func:`reference_check`). A run ends with that verdict (:class:`Ran`), not
the runner's.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import Malformed, RunnerFailed, SmokeError
from ...golden import check as golden
from ...inimage.reference import PROMPTS, Reference
from ...judges import fixed_batches, judging, replies
from ...trust.references import UNCHECKED, Signature
from ...verdicts import Check, Status, Verdict
from .base import Launched
from .plan import Target

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Ran:
    """A run through a launcher: the host's verdict, the job it judged by, and what the runner recorded."""

    verdict: Verdict
    job: Mapping[str, Any]
    answers: bytes | None = None  # reference answers the runner recorded (the file's bytes)
    levels: Mapping[str, Any] | None = None  # per-level answers recorded under fixed batches (the host's reading)
    golden: Mapping[str, Any] | None = None  # the golden section a recording run kept (its envelope; the host's)


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the host knows of a run beside its job: its file facts' compiled files, how it found the GPU
    request, its own environment notes, and a way to ask the image's base which imports fail there too."""

    compiled_missing: Sequence[str] = ()
    gpu: Mapping[str, Any] | None = None
    environment: Mapping[str, Any] | None = None
    base_imports: Callable[[list[str]], Mapping[str, str] | None] | None = None


def refused(target: Target, identity: Mapping[str, Any], host: Mapping[str, Any], gpu_mode: str, *,
            started: str = "", seconds: float = 0.0) -> Ran:
    """The run of an image whose identity check (``identity``) failed or could not be judged: nothing of it
    started, and its verdict holds that check alone."""
    job = {"image": target.ref, "image_id": target.image_id, "platform": target.platform, "host": dict(host),
           "gpu": {"mode": gpu_mode}}
    return Ran(judging.not_its_product(job, identity, started=started, seconds=seconds), job)


def batch_check(job: Mapping[str, Any], launched: Launched, reference: Reference | None
                ) -> tuple[list[Check], dict[str, Any] | None, Mapping[str, Any] | None]:
    """The host's ``exact-levels`` check of the probe's replies (none where the job ran no probe), its evidence,
    and, for a recording, the per-level answers to keep (None where they cannot be kept, and the check fails)."""
    spec = (job.get("serve") or {}).get("batches")
    if not spec:
        return [], None, None
    ran = launched.report.checks
    sweep = next((c for c in ran if c.name == "serve-sweep"), None)
    if launched.batches is None and (sweep is None or sweep.status is Status.SKIP):
        why = sweep.detail if sweep is not None else "the sweep did not run"
        return [Check(fixed_batches.CHECK, Status.SKIP, f"not run: {why}")], None, None
    run = fixed_batches.parse(launched.batches)
    levels, requests = [int(c) for c in spec["levels"]], int(spec["requests"])
    if reference is None:  # recording
        try:
            section = fixed_batches.record(run, [str(p) for p in spec["prompts"]], levels, requests,
                                           int(spec["max_tokens"]))
        except SmokeError as exc:
            return [Check(fixed_batches.CHECK, Status.FAIL, str(exc))], None, None
        return [fixed_batches.recorded_check(section)], None, section
    check, evidence = fixed_batches.judge(reference, run, levels, requests)
    return [check], evidence, None


def golden_check(job: Mapping[str, Any], launched: Launched, reference: Reference | None, model: Path | None
                 ) -> tuple[list[Check], dict[str, Any] | None]:
    """The host's ``golden`` check of the replies that came back (none where the job judged no answers, or the
    host has no model folder), and, for a recording, the golden's envelope to keep in the reference. Every level
    the job scheduled (the sweep's and the fixed batches') must be covered."""
    spec = (job.get("serve") or {}).get("batches")
    if not spec or model is None:
        return [], None
    sweep = next((c for c in launched.report.checks if c.name == "serve-sweep"), None)
    if launched.batches is None and (sweep is None or sweep.status is Status.SKIP):
        return [golden.judge.skipped(sweep.detail if sweep is not None else "the sweep did not run")], None
    prompts = [str(p) for p in spec["prompts"]]
    probe = fixed_batches.parse(launched.batches)
    try:
        http = json.loads(launched.replies) if launched.replies is not None else {}
        if not isinstance(http, dict):
            raise Malformed("the sweep's replies are not an object")
        served = golden.served_replies(http, len(prompts), probe.runs)
    except (ValueError, Malformed) as exc:
        return [Check(golden.judge.CHECK, Status.FAIL, f"the runner's replies cannot be read: {exc}")], None
    asked, requests, errors = _sweep_reached(job, launched)
    gone = golden.unanswered(http, asked, requests, len(prompts), probe.runs,
                             [int(c) for c in spec.get("levels") or ()], int(spec.get("requests") or 0),
                             probe.ended(), errors)
    start = time.monotonic()
    levels = sorted({int(c) for c in [*(spec.get("levels") or ()), *((job.get("serve") or {}).get("levels") or ())]})
    check, section = golden.run(model, prompts, served, section=reference.golden if reference is not None else None,
                                recording=reference is None, levels=levels, tokens=spec.get("max_tokens"),
                                gone=gone)
    return [replace(check, seconds=round(time.monotonic() - start, 3))], section


def _sweep_reached(job: Mapping[str, Any], launched: Launched) -> tuple[list[int], int, dict[tuple[int, int], str]]:
    """The HTTP sweep's levels of the host's schedule that the runner reports having asked (a level it never
    reached is the serve-sweep check's to fail, and the golden's coverage's), the requests a level, and the error
    the runner measured for a request that got no reply (words for the report, never a judgement)."""
    spec = job.get("serve") or {}
    sweep = launched.report.sweep if isinstance(launched.report.sweep, Mapping) else {}
    schedule = [int(c) for c in spec.get("levels") or ()]
    reached = replies.said_levels(sweep)
    errors = {}
    for level, said in reached.items():
        for ev in (ev for entry in said for ev in entry.get("per_request") or ()):
            if level is not None and isinstance(ev, Mapping) and isinstance(ev.get("index"), int) and ev.get("error"):
                errors[(level, int(ev["index"]))] = str(ev["error"])
    return [c for c in schedule if c in reached], int(spec.get("requests") or 0), errors


def sweep_judged(job: Mapping[str, Any], launched: Launched, reference: Reference | None) -> Verdict:
    """The runner's report with its serve-sweep judged here from the replies it sent back
    (:mod:`vllm_hotfix.judges.replies`): against ``reference`` where there is one, else by status and length alone
    (a recording run included)."""
    report = launched.report
    spec = job.get("serve") or {}
    said = next((c for c in report.checks if c.name == "serve-sweep"), None)
    if not spec or said is None or said.status is Status.SKIP or not isinstance(report.sweep, Mapping) \
            or not report.sweep.get("levels"):
        return report
    try:
        raw = json.loads(launched.replies) if launched.replies is not None else {}
        if not isinstance(raw, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        raw = {}
        log.info("the runner's sweep replies are unreadable (%s): every request fails", exc)
    # The schedule is the job's: its levels, its requests per level, its prompts (the fixed set where it named none).
    check, sweep = replies.rejudge(report.sweep, raw, reference, [int(c) for c in spec.get("levels") or []],
                                   int(spec.get("requests") or 0), prompts=len(spec.get("prompts") or PROMPTS),
                                   min_tokens=spec.get("min_tokens"),
                                   keep_going=bool(spec.get("keep_going")))
    if said.status is Status.FAIL and check["status"] == "pass":
        # The runner's own failure (no server, a request refused) stands: the host found nothing to judge against it.
        return report
    mine = Check(str(check["name"]), Status(str(check["status"])), str(check["detail"]),
                 data={**dict(check.get("data") or {}), "answered_by": "filesystem"}, seconds=said.seconds)
    marks = report.sweep.get("server_marks")
    if isinstance(marks, list) and sweep is not None:
        # The server's start-up lines as the image's server printed them: a measurement of where its start went,
        # kept as said (strings, at most the runner's cap), never read as a fact about the image.
        sweep = {**sweep, "server_marks": [str(m)[:300] for m in marks[:60]]}
    return replace(report, checks=tuple(mine if c is said else c for c in report.checks), sweep=sweep)


def judged(job: Mapping[str, Any], launched: Launched | RunnerFailed, facts: HostFacts | None = None, *,
           started: str = "", seconds: float = 0.0, reference: Reference | None = None,
           model: Path | None = None, signature: Signature | None = None
           ) -> tuple[Verdict, Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """The host's verdict on what came back: the report judged, or the runner's failure to give one; the
    per-level answers a recording run gave (``reference``: the loaded reference the probe's replies are judged
    against; None while recording) and the golden's noise it measured (``model``: the served model's folder on
    this host, which the golden computes); ``signature``: what the host found of the reference's signature."""
    facts = facts or HostFacts()
    if isinstance(launched, RunnerFailed):
        return judging.unanswered(job, "incomplete" if launched.incomplete else "fail", str(launched),
                                  started=started, seconds=seconds, gpu_facts=facts.gpu), None, None
    checks, evidence, levels = batch_check(job, launched, reference)
    found, noise = golden_check(job, launched, reference, model)
    checks += found
    if reference is not None:
        checks.append(reference_check(reference, signature or UNCHECKED))
    report = sweep_judged(job, launched, reference)
    here = ["serve-sweep"] if report is not launched.report else []
    verdict = judging.host_verdict(job, report, judged_here=here, compiled_missing=facts.compiled_missing,
                                   base_imports=facts.base_imports, started=started, seconds=seconds,
                                   gpu_facts=facts.gpu, environment=facts.environment, host_checks=checks,
                                   exact=evidence)
    if reference is not None:
        verdict = restamp(verdict, reference, signature=signature or UNCHECKED)
    return verdict, levels, noise


REFERENCE_CHECK = "reference"


def reference_check(reference: Reference, signature: Signature) -> Check:
    """The host's ``reference`` check: which answers the run is judged against, the image they were recorded from
    (refused before the run where it is the judged image or its base) and their signature. A pass only where the
    site key's signature verified; a skip, saying why, where it was not checked or was accepted unsigned."""
    status = Status.PASS if signature.state == "signed" else Status.SKIP
    detail = (f"{reference.path} (sha256 {reference.sha256}) recorded from image {reference.image_id}, neither the "
              f"judged image nor its base; {signature.words()}")
    return Check(REFERENCE_CHECK, status, detail,
                 data={"file": reference.path, "sha256": reference.sha256, "image_id": reference.image_id,
                       "recorded_from": reference.recorded_from, "signature": signature.to_dict()})


def proves(verdict: Verdict, reference: Reference) -> str | None:
    """What the run's answers prove, in words, where they prove anything: every level bitwise the reference's
    under fixed batches and every HTTP reply judged passed make the judged image reproduce the reference image's
    answers; no more (a wrong backport built twice would reproduce itself, hence a reference of another image)."""
    passed = {c.name for c in verdict.checks if c.status is Status.PASS}
    if {fixed_batches.CHECK, "serve-sweep"} <= passed:
        return f"reproducible against image {reference.image_id}"
    return None


def restamp(verdict: Verdict, reference: Reference, *, recorded: bool = False,
            signature: Signature | None = None) -> Verdict:
    """The verdict naming the reference file as the host has it (path, sha256, the image it was recorded from,
    levels, its signature, what the answers prove): which file judged or was recorded by a run is the host's fact
    (the runner wrote its recording before the host added the per-level answers). A recording run, never judged
    against what it recorded, names it under ``recorded``."""
    entry: dict[str, Any] = {"file": reference.path, "sha256": reference.sha256, "image_id": reference.image_id,
                             "levels": reference.summary()["levels"], "noise": reference.noise}
    if signature is not None:
        entry["signature"] = signature.to_dict()
    if not recorded:
        entry["proves"] = proves(verdict, reference)
    if verdict.sweep is None:
        return verdict
    if recorded:
        return replace(verdict, sweep={**dict(verdict.sweep), "recorded": entry})
    said = verdict.sweep.get("reference")
    if not isinstance(said, Mapping):
        return verdict
    return replace(verdict, sweep={**dict(verdict.sweep), "reference": {**dict(said), **entry}})
