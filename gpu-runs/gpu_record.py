"""What a GPU run record says, derived from the smoke reports alone (gpu_host.py record writes it).

Per image (``reference``: the image the reference answers were recorded
from; ``patched``, ``patched_again`` and ``patched_third``: the image judged,
in three server starts; ``unpatched``: the base, warm, and
``unpatched_first``: its first run where one was made; ``mutant_NAME``: each
broken backport of gpu-runs/mutants/; ``variant_NAME``: each correct backport
of gpu-runs/variants/): its verdict, smoke time and phase times,
checks, the top-k check's scenarios, and the serve sweep per level with every
request's evidence as rows. In words (``result``): each image's verdict and
times against the target, then per level the requests passed, their HTTP
statuses, reply lengths and finish reasons, how the oracle judged them (bit
for bit at concurrency 1; within the tolerance above it: identical, within
noise, wrong) and the widest deviation. ``findings`` answers the run's
questions from the same evidence: does the patched image pass every level in
every start, exactly under fixed batches (the ``exact-levels`` check), with no
wrong answer; what share of the unpatched base's answered concurrency-1
replies the oracle judged wrong, and was it wrong by its answers at every
level where it answered; which check failed each mutant first, at which
level; does each correct variant pass every level exactly, as the right patch
does; is each warm smoke (patched, unpatched: run alone) within the target;
does the model read its prompt; was the reference recorded from another image
than the one judged.
"""

from __future__ import annotations

from typing import Any

EVIDENCE_COLUMNS = ("level", "index", "prompt", "http_status", "latency_s", "prompt_tokens", "reply_tokens",
                    "finish_reason", "reply_sha256", "judged_by", "passed", "basis", "divergence", "token_divergence",
                    "max_logprob_diff", "gap_nats", "deviation_nats", "error")
KINDS = ("reference", "patched", "patched_again", "patched_third", "unpatched_first", "unpatched")  # + mutant_NAME,
# variant_NAME
RIGHT = ("patched", "patched_again", "patched_third")  # the right patch, in three server starts
WRONG_SHARE = 0.8  # the unpatched base must have at least this share of its answered concurrency-1 replies wrong
DISTINCT_TARGET = 24
GAP_TARGET = 1.0  # nats: the median first-token top-two gap a prompt-reading model shows
LEVELS = (1, 2, 4, 8, 16)


def image(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "ref": report.get("image"),
        "id": report.get("image_id"),
        "status": report.get("status"),
        "gpu_verified": report.get("gpu_verified"),
        "gpu": report.get("gpu"),
        "seconds": report.get("seconds"),
        "phases": report.get("phases") or {},
        "compile_cache": (report.get("environment") or {}).get("compile_cache"),
        "checks": [{"name": c.get("name"), "status": c.get("status"), "detail": c.get("detail")}
                   for c in report.get("checks", [])],
        "topk_layout": _topk(report),
        "serve": _serve(report),
        "exact": _exact(report),
        "golden": _golden(report),
    }


def _golden(report: dict[str, Any]) -> dict[str, Any] | None:
    """The golden check (the model's forward in plain PyTorch, judged on the host): its verdict and numbers (the
    positions judged, confident and agreeing), as the report holds them."""
    check = next((c for c in report.get("checks", []) if c.get("name") == "golden"), None)
    if check is None:
        return None
    return {"status": check.get("status"), "detail": check.get("detail"), "data": check.get("data")}


def _exact(report: dict[str, Any]) -> dict[str, Any] | None:
    """The exact-levels check (fixed batches, judged on the host): per level its counts and first wrong reply."""
    check = next((c for c in report.get("checks", []) if c.get("name") == "exact-levels"), None)
    if check is None:
        return None
    evidence = (report.get("sweep") or {}).get("exact") or {}
    levels = [{k: lv.get(k) for k in ("concurrency", "requests", "answered", "identical", "wrong", "seconds",
                                      "first_wrong")} for lv in evidence.get("levels") or []]
    return {"status": check.get("status"), "detail": check.get("detail"), "levels": levels,
            "first_failed_level": evidence.get("first_failed_level"), "ended": evidence.get("ended"),
            "engine_start_s": evidence.get("engine_start_s"), "probe_s": evidence.get("probe_s")}


def _serve(report: dict[str, Any]) -> dict[str, Any] | None:
    """The serve sweep: per level its summary, per request its evidence (as rows), and how the server ended."""
    check = next((c for c in report.get("checks", []) if c.get("name") == "serve-sweep"), None)
    if check is None:
        return None
    sweep = report.get("sweep") or {}
    levels = []
    for level in sweep.get("levels") or []:
        summary = {k: v for k, v in level.items() if k != "per_request"}
        rows = [[ev.get(c) for c in EVIDENCE_COLUMNS] for ev in level.get("per_request") or []]
        levels.append({**summary, "per_request": {"columns": list(EVIDENCE_COLUMNS), "rows": rows}})
    return {
        "status": check.get("status"),
        "detail": check.get("detail"),
        "seconds": check.get("seconds"),
        "model": sweep.get("model"),
        "max_tokens": sweep.get("max_tokens"),
        "min_tokens": sweep.get("min_tokens"),
        "reference": sweep.get("reference"),
        "failed_level": sweep.get("failed_level"),
        "levels": levels,
        "server_log_tail": (check.get("data") or {}).get("server_log")
        or (sweep.get("server_log") or "").splitlines()[-40:],
    }


def _topk(report: dict[str, Any]) -> dict[str, Any] | None:
    """Per scenario: how it ended, the views the installed code used, the row counts."""
    check = next((c for c in report.get("checks", []) if c.get("name") == "topk-layout"), None)
    if check is None:
        return None
    per_gpu = (check.get("data") or {}).get("per_gpu")
    if isinstance(per_gpu, list):
        # A tensor-parallel run's: the check on each GPU the server used.
        return {"per_gpu": [{"gpu": one.get("gpu"), "status": one.get("status"), **_topk_runs(one.get("data") or {})}
                            for one in per_gpu if isinstance(one, dict)]}
    return _topk_runs(check.get("data") or {})


def _topk_runs(data: dict[str, Any]) -> dict[str, Any]:
    """One GPU's topk-layout data: per scenario how it ended, the views, the row counts."""
    runs: dict[str, Any] = {}
    for scenario, run in (data.get("runs") or {}).items():
        result = run.get("result") or {}
        entry = {k: run[k] for k in ("outcome", "seconds", "fault", "timeout") if k in run}
        entry.update({k: result[k] for k in ("impls", "config", "write_views", "read_views", "decode", "prefill",
                                             "attention", "error", "read_out_of_bounds") if k in result})
        runs[scenario] = entry
    stubs = next((r.get("import", {}).get("stubs") for r in (data.get("runs") or {}).values() if r.get("import")), None)
    path = data.get("path") or next((r.get("path") for r in (data.get("runs") or {}).values() if r.get("path")),
                                    None)
    return {"outcomes": data.get("outcomes"), "stubs": stubs, "path": path, "runs": runs}


def _counts(values: list[Any]) -> str:
    seen: dict[str, int] = {}
    for v in values:
        seen[str(v)] = seen.get(str(v), 0) + 1
    return ", ".join(f"{k} {n}" for k, n in sorted(seen.items()))


def _span(values: list[int]) -> str:
    return "-" if not values else str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"


def level_sentence(level: dict[str, Any]) -> str:
    """One level in words, from its requests' evidence alone (its summary where a report has none)."""
    c, n = level.get("concurrency"), level.get("requests")
    evidence = level.get("per_request") or []
    if not evidence:
        return (f"concurrency {c}: {level.get('successes')}/{n} passed (no per-request evidence in the report; "
                f"shortest reply {level.get('shortest_reply_tokens')} tokens, finish reasons "
                f"{_counts([k for k, m in (level.get('finish_reasons') or {}).items() for _ in range(m)]) or 'none'})")
    passed = sum(bool(ev.get("passed")) for ev in evidence)
    parts = [f"concurrency {c}: {passed}/{len(evidence)} passed",
             f"HTTP status {_counts([ev.get('http_status') or 'no answer' for ev in evidence])}"]
    replies = [ev for ev in evidence if ev.get("reply_tokens") is not None]
    if replies:
        parts.append(f"replies of {_span(sorted(ev['reply_tokens'] for ev in replies))} tokens "
                     f"(finish_reason {_counts([ev.get('finish_reason') for ev in replies])})")
    parts.append(f"judged by {_counts([ev.get('judged_by') for ev in evidence])}")
    # "form": above concurrency 1 by its form, how far it moved measured; "noise": within a tolerance (earlier runs)
    judged = [ev for ev in replies if ev.get("judged_by") in ("exact", "noise", "form")]
    if judged:
        wrong = [ev for ev in judged if not ev.get("passed")]
        same = [ev for ev in judged if ev.get("passed") and ev.get("divergence") is None]
        noisy = [ev for ev in judged if ev.get("passed") and ev.get("divergence") is not None]
        where = sorted(ev["divergence"] for ev in wrong if ev.get("divergence") is not None)
        first = f" (first difference at position {_span(where)})" if where else ""
        sizes = [ev["deviation_nats"] for ev in judged if ev.get("deviation_nats") is not None]
        tol = level.get("tolerance_nats")
        rule = "bit for bit" if c == 1 else f"within {tol:.3g} nats of the concurrency-1 reply" \
            if isinstance(tol, (int, float)) else "by its form, movement from the concurrency-1 reply measured"
        kind = "within noise" if isinstance(tol, (int, float)) or c == 1 else "moved"
        parts.append(f"{len(wrong)} wrong answer(s){first}, {len(same)} bitwise equal, {len(noisy)} {kind} "
                     f"({rule}; widest deviation {max(sizes):.3g} nats)" if sizes else
                     f"{len(wrong)} wrong answer(s){first}, {len(same)} bitwise equal ({rule})")
    short = [ev for ev in evidence if ev.get("judged_by") == "min-tokens" and not ev.get("passed")]
    if short:
        parts.append(f"{len(short)} short repl(ies)")
    return "; ".join(parts)


def time_sentence(img: dict[str, Any], target: float | None = None) -> str:
    """The smoke's wall time and each phase's, from the report."""
    seconds = img.get("seconds")
    phases = img.get("phases") or {}
    words = f"smoke {seconds:.1f} s" if isinstance(seconds, (int, float)) else "smoke time not reported"
    if target is not None and isinstance(seconds, (int, float)):
        words += f" ({'at or under' if seconds <= target else 'over'} the {target:g} s target)"
    words += "; phases: " + (", ".join(f"{k} {v:.1f} s" for k, v in phases.items()) or "not reported")
    cache = img.get("compile_cache")
    if cache:
        words += f"; compile cache {cache.get('base_id', '')[:12]}/{cache.get('gpu')}"
    return words


def image_sentences(img: dict[str, Any], target: float | None = None) -> list[str]:
    """What one image's report shows, in words: its verdict and times, then each level the sweep ran."""
    serve = img.get("serve") or {}
    head = f"{img.get('status')} ({'GPU-verified' if img.get('gpu_verified') else 'GPU-unverified'})"
    not_applicable = (img.get("gpu") or {}).get("not_applicable")
    if not_applicable:
        head += f"; not applicable on this GPU family: {'; '.join(map(str, not_applicable))}"
    failing = [c["name"] for c in img.get("checks") or [] if c.get("status") not in ("pass", "skip")]
    if failing:
        head += f"; checks not passed: {', '.join(failing)}"
    head += f"; {time_sentence(img, target)}"
    if not serve:
        return [head + "; no serve sweep"]
    ref = serve.get("reference")
    above = (f"tolerance above concurrency 1 {ref.get('tolerance_nats')} nats = {ref.get('noise_multiple')} x the "
             "recorded noise" if ref and "tolerance_nats" in ref else
             "above concurrency 1 by form, movement measured")
    how = (f"the oracle against {ref.get('file')} (sha256 {ref.get('sha256')}, {ref.get('prompts')} prompts; "
           f"{above})" if ref else
           f"at least {serve['min_tokens']} tokens per reply" if serve.get("min_tokens") else "HTTP status only")
    head += f"; serve sweep {serve.get('status')}, judged by {how}"
    if serve.get("failed_level") is not None:
        head += f", failed at concurrency {serve['failed_level']}"
    rows = [rows_to_evidence(level) for level in serve.get("levels") or []]
    return [head, *(level_sentence(level) for level in rows), *exact_sentences(img)]


def exact_sentences(img: dict[str, Any]) -> list[str]:
    """The fixed-batch levels in words: per level, replies answered, bitwise the reference's at that level, wrong."""
    exact = img.get("exact")
    if not exact:
        return []
    out = [f"exact-levels {exact.get('status')}" + (f", first failing at concurrency {exact['first_failed_level']}"
                                                     if exact.get("first_failed_level") is not None else "")
           + (f"; the probe ended early: {exact['ended']}" if exact.get("ended") else "")]
    for lv in exact.get("levels") or []:
        out.append(f"fixed batches, concurrency {lv.get('concurrency')}: {lv.get('answered')}/{lv.get('requests')} "
                   f"answered, {lv.get('identical')} bitwise the reference's at this level, {lv.get('wrong')} wrong"
                   + (f" (first: {lv['first_wrong']})" if lv.get("first_wrong") else ""))
    return out


def rows_to_evidence(level: dict[str, Any]) -> dict[str, Any]:
    table = level.get("per_request") or {}
    if isinstance(table, dict):
        cols = table.get("columns") or []
        return {**level, "per_request": [dict(zip(cols, row, strict=True)) for row in table.get("rows") or []]}
    return level




def _evidence(img: dict[str, Any], concurrency: int) -> list[dict[str, Any]]:
    for level in (img.get("serve") or {}).get("levels") or []:
        if level.get("concurrency") == concurrency:
            return rows_to_evidence(level).get("per_request") or []
    return []


def passes_every_level(img: dict[str, Any]) -> tuple[bool, str]:
    """The image passed, at every level, every request, with no wrong answer; and in words."""
    serve = img.get("serve") or {}
    levels = {lv.get("concurrency"): lv for lv in serve.get("levels") or []}
    missing = [c for c in LEVELS if c not in levels]
    bad = [c for c, lv in levels.items() if lv.get("failures") or lv.get("wrong_answers")]
    exact = img.get("exact") or {}
    exact_levels = {lv.get("concurrency"): lv for lv in exact.get("levels") or []}
    inexact = [c for c in LEVELS if c not in exact_levels or exact_levels[c].get("wrong")
               or exact_levels[c].get("identical") != exact_levels[c].get("requests")]
    ok = (img.get("status") == "pass" and serve.get("status") == "pass" and exact.get("status") == "pass"
          and not missing and not bad and not inexact)
    words = (f"{img.get('status')}; levels {','.join(str(c) for c in sorted(levels))} all passed, no wrong answer; "
             f"under fixed batches every reply at every level bitwise the reference's at that level"
             if ok else f"{img.get('status')}; levels not run: {missing or 'none'}; levels with a failure or wrong "
                        f"answer: {bad or 'none'}; levels not bitwise the reference's under fixed batches: "
                        f"{inexact or 'none'}")
    return ok, words


def caught(img: dict[str, Any]) -> dict[str, Any]:
    """Which check failed an image that must fail, and at which level: the topk-layout GPU check (no level), the
    exact judge under fixed batches, the HTTP sweep; the first level either failed at."""
    topk = next((c for c in img.get("checks") or [] if c.get("name") == "topk-layout"), None)
    exact = img.get("exact") or {}
    serve = img.get("serve") or {}
    by = {"topk-layout": topk.get("status") if topk else None,
          "exact-levels": exact.get("first_failed_level"),
          "serve-sweep": serve.get("failed_level")}
    levels = [v for v in (by["exact-levels"], by["serve-sweep"]) if isinstance(v, int)]
    first = min(levels) if levels else None
    checks = [name for name in ("exact-levels", "serve-sweep") if by[name] == first and first is not None]
    failing = [c.get("name") for c in img.get("checks") or [] if c.get("status") == "fail"]
    return {"status": img.get("status"), "first_failing_level": first, "failed_there_by": checks,
            "topk_layout": by["topk-layout"], "exact_first_level": by["exact-levels"],
            "sweep_first_level": by["serve-sweep"], "failing_checks": failing,
            "met": img.get("status") == "fail" and bool(set(failing) & {"topk-layout", "exact-levels", "serve-sweep",
                                                                         "golden"})}


def wrong_by_answers(img: dict[str, Any]) -> dict[str, Any]:
    """At every level where the image answered under fixed batches, some answer was wrong (not status alone)."""
    per = {lv.get("concurrency"): (lv.get("answered") or 0, lv.get("wrong") or 0)
           for lv in (img.get("exact") or {}).get("levels") or []}
    answering = [c for c, (n, _w) in per.items() if n]
    right_there = [c for c in answering if not per[c][1]]
    return {"levels": {str(c): {"answered": n, "wrong": w} for c, (n, w) in per.items()},
            "answering_levels": answering, "levels_answered_right": right_there,
            "met": bool(answering) and not right_there}


def wrong_share(img: dict[str, Any]) -> dict[str, Any]:
    """Of the answered concurrency-1 replies (HTTP 200 with a reply), how many the oracle judged wrong."""
    evidence = _evidence(img, 1)
    answered = [ev for ev in evidence if ev.get("http_status") == 200 and ev.get("reply_tokens") is not None]
    wrong = [ev for ev in answered if ev.get("judged_by") == "exact" and not ev.get("passed")]
    share = len(wrong) / len(answered) if answered else 0.0
    return {"requests": len(evidence), "answered": len(answered), "judged_wrong": len(wrong),
            "share": round(share, 4), "at_least": WRONG_SHARE, "met": bool(answered) and share >= WRONG_SHARE}


def coverage(img: dict[str, Any]) -> dict[str, Any]:
    """How much of a right image's run the golden judged, per level and per prompt class, held to the floors the
    policy holds a deploy pass to (vllm_hotfix.golden.coverage)."""
    from vllm_hotfix.golden import coverage as floors

    golden = img.get("golden") or {}
    data = golden.get("data") if isinstance(golden.get("data"), dict) else {}
    found = data.get("coverage")
    short = floors.shortfall(found, levels=LEVELS)
    return {"status": golden.get("status"), "coverage": found, "floors": {"level": floors.LEVEL_FLOOR,
                                                                          **dict(floors.CLASS_FLOOR)},
            "shortfall": short, "met": golden.get("status") == "pass" and short is None}


def refused_recording(img: dict[str, Any], wrote: bool) -> dict[str, Any]:
    """A broken backport's second build used as the recording image: the golden check itself must fail the
    recording, and no answers may be written."""
    golden = img.get("golden") or {}
    return {"status": img.get("status"), "golden": golden.get("status"), "golden_detail": golden.get("detail"),
            "answers_written": wrote, "met": golden.get("status") == "fail" and not wrote}


def campaign(images: dict[str, dict[str, Any]], *, warm: list[str], make_smoke: str | None,
             bad: dict[str, bool], host_seconds: float | None, host_target: float, target: float) -> dict[str, Any]:
    """The campaign's questions (this model's part): the warm verdicts alone within the target, every judge run;
    the golden's coverage of every right start; the make smoke verdict the long command's; every bad recording
    refused by the golden; the GPU host's time so far within its target."""
    out: dict[str, Any] = {}
    if warm:
        seconds = {k: images[k].get("seconds") for k in warm if k in images}
        judges = {k: sorted(c.get("name") for c in images[k].get("checks") or [] if c.get("status") == "pass")
                  for k in warm if k in images}
        out["warm_verdict_alone"] = {"target": target, "seconds": seconds, "passed_checks": judges,
                                     "met": bool(seconds) and all(isinstance(v, (int, float)) and v <= target
                                                                  for v in seconds.values())
                                     and all(images[k].get("status") == "pass" for k in seconds)}
    starts = {k: coverage(images[k]) for k in RIGHT if k in images}
    if starts:
        out["golden_coverage"] = {"starts": starts, "met": all(v["met"] for v in starts.values())}
    if make_smoke and make_smoke in images and "patched" in images:
        mine, long = images[make_smoke], images["patched"]

        def said(img: dict[str, Any]) -> dict[str, Any]:
            return {"status": img.get("status"), "gpu_verified": img.get("gpu_verified"),
                    "checks": {c.get("name"): c.get("status") for c in img.get("checks") or []},
                    "signed": bool(img.get("attestation"))}
        a, b = said(mine), said(long)
        out["make_smoke_same_verdict"] = {"make_smoke": a, "long_command": b, "met": a == b and a["status"] == "pass"}
    if bad:
        refused = {name.removeprefix("badrecord_"): refused_recording(images[name], wrote)
                   for name, wrote in bad.items() if name in images}
        out["golden_refuses_bad_recordings"] = {"recordings": refused,
                                                "met": bool(refused) and all(v["met"] for v in refused.values())}
    if host_seconds is not None:
        out["gpu_host_seconds"] = {"seconds": round(host_seconds, 1), "target": host_target,
                                   "read": "the GPU host's uptime when this record was written (from its start, "
                                           "the parts' transfer included)",
                                   "met": host_seconds <= host_target}
    return out


def findings(images: dict[str, dict[str, Any]], reference: dict[str, Any], target: float,
             alone: bool = True) -> dict[str, Any]:
    """The run's questions answered from the reports (see the module's docstring). ``alone``: the patched and
    unpatched smokes ran alone, so their times are warm times held to the target; otherwise (a campaign's later
    models) no warm time is judged here and the record says where they are."""
    out: dict[str, Any] = {}
    for kind in RIGHT:
        if kind in images:
            ok, words = passes_every_level(images[kind])
            out[f"{kind}_passes_every_level"] = {"met": ok, "detail": words}
    starts = [kind for kind in RIGHT if kind in images]
    if len(starts) == len(RIGHT):
        failed = [k for k in starts if not out[f"{k}_passes_every_level"]["met"]]
        out["right_patch_no_false_failure_in_3_starts"] = {"starts": len(starts), "false_failures": len(failed),
                                                          "met": not failed}
    if "unpatched" in images:
        out["unpatched_wrong_at_concurrency_1"] = wrong_share(images["unpatched"])
        if images["unpatched"].get("exact"):
            out["unpatched_wrong_by_answers_at_every_answering_level"] = wrong_by_answers(images["unpatched"])
    mutants = {kind.removeprefix("mutant_"): caught(img) for kind, img in images.items() if kind.startswith("mutant_")}
    if mutants:
        out["every_mutant_fails"] = {"mutants": mutants, "met": all(m["met"] for m in mutants.values())}
    variants = {kind.removeprefix("variant_"): passes_every_level(img) for kind, img in images.items()
                if kind.startswith("variant_")}
    if variants:
        # A correct backport written another way is judged as the right patch: a false failure is as costly.
        out["every_variant_passes"] = {"variants": {name: {"met": ok, "detail": words}
                                                    for name, (ok, words) in variants.items()},
                                       "met": all(ok for ok, _ in variants.values())}
    # The warm times are of smokes that ran alone (patched, unpatched); the other starts and the mutants may run
    # side by side on the GPU (gpu-host-serve.sh PARALLEL), so their times are shown, not held to the target.
    warm = {kind: images[kind].get("seconds") for kind in ("patched", "unpatched") if kind in images and alone}
    beside = {kind: images[kind].get("seconds") for kind in images
              if kind not in warm and kind not in ("reference", "unpatched_first")}
    if alone:
        out["warm_smoke_seconds"] = {"target": target, "seconds": warm, "side_by_side_seconds": beside,
                                     "met": bool(warm) and all(isinstance(v, (int, float)) and v <= target
                                                               for v in warm.values())}
    else:
        # Shown, never a bar met or missed: there is no warm time here to hold to the target.
        out["warm_times"] = {"judged": False, "side_by_side_seconds": beside,
                             "why": "every smoke of this model ran beside others; the first model's record has them"}
    sens = reference.get("prompt_sensitivity") or {}
    gap = sens.get("median_first_token_gap_nats")
    out["model_reads_its_prompt"] = {
        **sens, "targets": {"distinct_replies": DISTINCT_TARGET, "median_first_token_gap_nats": GAP_TARGET},
        "met": sens.get("distinct_replies") == DISTINCT_TARGET and isinstance(gap, (int, float)) and gap >= GAP_TARGET}
    judged = {images[k].get("id") for k in images if k in (*RIGHT, "unpatched") or k.startswith(("mutant_",
                                                                                                  "variant_",
                                                                                                  "badrecord_"))}
    recorded = (images.get("reference") or {}).get("id")
    out["reference_from_another_image"] = {"reference_image": recorded, "judged_images": sorted(filter(None, judged)),
                                           "met": bool(recorded) and recorded not in judged}
    out["done"] = all(v["met"] for v in out.values() if isinstance(v, dict) and "met" in v)
    return out


def finding_sentences(found: dict[str, Any]) -> list[str]:
    said = []
    for name, value in found.items():
        if isinstance(value, dict):
            detail = value.get("detail") or {k: v for k, v in value.items() if k not in ("met", "detail")}
            verdict = "" if "met" not in value else ("met " if value["met"] else "NOT met ")
            said.append(f"{name}: {verdict}({detail})")
    said.append(f"done: {found.get('done')}")
    return said
