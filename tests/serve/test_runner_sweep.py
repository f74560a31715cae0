"""The runner's serve sweep judges replies as the host's does: reference answers, per-request evidence,
phases, --keep-going. The runner starts tests/fake_openai.py as the image's server, as a pod would start
`vllm serve`, with this Python standing in for the image's; its batch probe finds tests/fake_vllm, a toy
stand-in for vLLM's offline engine, where the image would have vLLM. The host judges the probe's replies
against the reference's per-level answers (exact-levels)."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, free_port, requests_site, site_key
from vllm_hotfix import report_page
from vllm_hotfix.checking import smoke as smokelib
from vllm_hotfix.checking.launchers import base, judge_run, plan, recorded
from vllm_hotfix.checking.smoke import SmokeOptions
from vllm_hotfix.errors import AttestationMismatch, AttestationMissing, AttestationTampered, SmokeError, UsageError
from vllm_hotfix.inimage import recording, reference, sweep
from vllm_hotfix.judges import fixed_batches
from vllm_hotfix.trust import reference_fit, references, signing
from vllm_hotfix.verdicts import Check, Status, Verdict

FAKE = REPO / "tests" / "fake_openai.py"
ENGINE = REPO / "tests" / "fake_vllm"  # on the probe's path: the stand-in for vLLM's offline engine
PROBE = REPO / "vllm_hotfix" / "inimage" / "probes" / "batches.py"
IMAGE_ID = "sha256:" + "ab" * 32
TRUSTED_ID = "sha256:" + "cd" * 32  # the image the test references were recorded from: another than the judged one
LEVELS, REQUESTS = (1, 2, 4), 8


def probe_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ENGINE)}


def probe(tmp: Path, prompts: tuple[str, ...], levels: tuple[int, ...], requests: int, passes: int,
          args: tuple[str, ...] = ()) -> fixed_batches.ProbeRun:
    """The batch probe run here on the stand-in engine, as the runner runs it."""
    spec = fixed_batches.job_part({"serve_args": ["--no-enable-prefix-caching", *args], "env": {}}, levels,
                                  requests, prompts, sweep.MAX_TOKENS, recording=passes == 2)
    (tmp / "spec.json").write_text(json.dumps({**spec, "out": str(tmp / "out.jsonl")}))
    done = subprocess.run([sys.executable, str(PROBE), str(tmp / "spec.json")], capture_output=True, text=True,
                          timeout=60, env=probe_env())
    lines = [json.loads(ln) for ln in (tmp / "out.jsonl").read_text().splitlines()]
    return fixed_batches.parse(json.dumps({"lines": lines, "exit": done.returncode, "log": []}).encode())


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> reference.Reference:
    """Answers recorded once from a healthy server and engine (the trusted image), every level included."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "serve", "test-model", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = tmp_path_factory.mktemp("ref")
    try:
        url = f"http://127.0.0.1:{port}"
        sweep.wait_healthy(url, 20)
        made = recording.record(url)
    finally:
        proc.kill()
        proc.wait()
    run = probe(folder, made.prompts, LEVELS, REQUESTS, 2)
    levels = fixed_batches.record(run, made.prompts, LEVELS, REQUESTS, made.max_tokens)
    return reference.write(replace(made, levels=levels), folder / "answers.json")


TARGET = plan.Target("ops/vllm:fix", IMAGE_ID, IMAGE_ID, {}, entrypoint=(sys.executable, str(FAKE), "serve"))


def run_job(tmp_path: Path, server: list[str], options: SmokeOptions,
            edit: Callable[[dict[str, Any]], None] = lambda _job: None, *, probe_too: bool = True) -> Verdict:
    """The job run by the runner here, the fake server given ``server`` (and the probe's engine too, unless
    ``probe_too`` is False: an HTTP server whose batches move the numerics while fixed batches stay right),
    judged here."""
    job, launched = launch_job(tmp_path, server, options, edit, probe_too=probe_too)
    verdict, _, _ = judge_run.judged(job, launched, reference=options.reference)
    return verdict


def launch_staged(tmp_path: Path, job: dict[str, Any], extra: dict[str, bytes]) -> base.Launched:
    """``job`` staged as the docker launcher stages it and run by the runner here, the fake server on a free port
    of the host; what came back, unjudged."""
    port = free_port()
    job["serve"]["argv"] = [sys.executable, str(FAKE), "serve", "test-model", "--port", str(port)]
    job["serve"]["port"] = port
    job["python_path"] = [str(ENGINE), str(requests_site())]
    folder = base.stage(tmp_path / "runner", job, extra)
    done = subprocess.run([*base.argv(sys.executable)[:-2], str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=180, cwd=folder, env=probe_env())
    assert done.returncode == 0, done.stderr
    return base.results(done.stdout, done.stderr, "test runner")


def launch_job(tmp_path: Path, server: list[str], options: SmokeOptions,
               edit: Callable[[dict[str, Any]], None] = lambda _job: None, *,
               probe_too: bool = True) -> tuple[dict[str, Any], base.Launched]:
    """The job the host judges by, and what the runner sent back for it, unjudged (see :func:`run_job`)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    job, extra = plan.job(tmp_path, TARGET, options, launcher="test", gpu_request=None)
    # The oracle's settings: prefix caching off, batch-invariant mode on, whatever the user's arguments.
    assert job["serve"]["argv"][-1] == "--no-enable-prefix-caching"
    assert job["serve"]["env"] == {"VLLM_BATCH_INVARIANT": "1"} and job["serve"]["overlap"] is False
    # The job serves /model on port 8000 inside a container; here the fake serves on a free port of the host.
    port = free_port()
    job["serve"]["argv"] = [sys.executable, str(FAKE), "serve", "test-model", "--port", str(port), *server]
    job["serve"]["port"] = port
    if job["serve"].get("batches") and probe_too:  # the server's arguments reach the probe's engine, as --serve-arg
        job["serve"]["batches"]["engine_args"] += server
    # Started as a launcher starts it (no site module, PYTHON* variables ignored): the stand-in engine and a folder
    # holding requests are the "base's sys.path" the host gives the job.
    job["python_path"] = [str(ENGINE), str(requests_site())]
    # ``edit`` changes the job the runner gets, never the one the host judges by (a runner that does not keep to
    # its job is what it stands for).
    sent = copy.deepcopy(job)
    edit(sent)
    folder = base.stage(tmp_path / "runner", sent, extra)
    done = subprocess.run([*base.argv(sys.executable)[:-2], str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=120, cwd=folder, env=probe_env())
    assert done.returncode == 0, done.stderr
    return job, base.results(done.stdout, done.stderr, "test runner")


def options(tmp_path: Path, **more: Any) -> SmokeOptions:
    """Options for a run; a reference given is taken as recorded under this run's own settings."""
    (tmp_path / "model").mkdir(exist_ok=True)
    opts = SmokeOptions(gpu="off", serve_model=tmp_path / "model", levels=LEVELS, requests=REQUESTS, **more)
    if opts.reference is not None:
        mine = replace(opts.reference, settings=plan.serve_settings(opts, TARGET), image_id=TRUSTED_ID)
        opts = replace(opts, reference=reference.write(mine, tmp_path / "answers.json"))
    return opts


def test_runner_sweep_matches_the_reference_and_keeps_per_request_evidence(
        answers: reference.Reference, tmp_path: Path) -> None:
    opts = options(tmp_path, reference=answers)
    assert opts.reference is not None
    v = run_job(tmp_path, [], opts)
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status.value == "pass", v.checks
    assert "every reply at concurrency 1 bitwise the reference answer" in check.detail
    assert v.sweep is not None and v.sweep["reference"]["sha256"] == opts.reference.sha256
    assert v.sweep["reference"]["file"] == str(tmp_path / "answers.json")  # the user's file, not the runner's copy
    by_prompt = {i: a.sha256 for i, a in enumerate(answers.answers)}
    for level in v.sweep["levels"]:
        assert len(level["per_request"]) == 8
        for ev in level["per_request"]:
            assert ev["judged_by"] == ("exact" if level["concurrency"] == 1 else "form")
            assert ev["passed"] and ev["reply_sha256"] == by_prompt[ev["prompt"]]
            assert ev["finish_reason"] and ev["latency_s"] > 0 and ev["prompt_tokens"] > 0
    assert set(v.phases) == {"checks", "gpu_checks", "server_start", "sweep", "batches"}
    # Where the server's start went, as it said it: its start-up lines with the second each came, measured only.
    marks = v.sweep["server_marks"]
    assert any(re.fullmatch(r"\+\d+\.\ds INFO: +Application startup complete\.", m) for m in marks), marks
    # Every level again under fixed batches, judged here: bit for bit the reference's answers at that level.
    exact = next(c for c in v.checks if c.name == "exact-levels")
    assert exact.status is Status.PASS and exact.data["answered_by"] == "filesystem", exact
    assert [(lv["concurrency"], lv["identical"], lv["wrong"]) for lv in v.sweep["exact"]["levels"]] == \
        [(1, 8, 0), (2, 8, 0), (4, 8, 0)]
    assert v.sweep["exact"]["first_failed_level"] is None
    # The stand-in's numerics follow the batch: a level's replies are the same level's answers, not another's.
    at1 = {r["reply_sha256"] for r in v.sweep["exact"]["levels"][0]["replies"]}
    assert at1 == {a.sha256 for a in answers.answers[:REQUESTS]}
    assert v.sweep["reference"]["levels"]["schedule"]["levels"] == list(LEVELS)
    # What the answers prove, and which answers: the reference's image and digest, its signature not checked here.
    assert v.sweep["reference"]["proves"] == f"reproducible against image {TRUSTED_ID}"
    assert exact.detail.endswith(f"under fixed batches: reproducible against image {TRUSTED_ID}")
    ref_check = next(c for c in v.checks if c.name == "reference")
    assert ref_check.status is Status.SKIP and ref_check.data["answered_by"] == "filesystem"
    assert ref_check.detail == (f"{opts.reference.path} (sha256 {opts.reference.sha256}) recorded from image "
                                f"{TRUSTED_ID}, neither the judged image nor its base; its signature not checked "
                                "(no --sign-key)")
    assert v.sweep["reference"]["image_id"] == TRUSTED_ID and v.sweep["reference"]["signature"]["state"] == \
        "unchecked"


def test_a_reference_recorded_from_the_judged_image_or_its_base_is_refused(answers: reference.Reference,
                                                                           tmp_path: Path) -> None:
    opts = options(tmp_path, reference=answers)
    assert opts.reference is not None
    base = "sha256:" + "ba" * 32
    itself = reference.write(replace(opts.reference, image_id=IMAGE_ID), tmp_path / "itself.json")
    with pytest.raises(UsageError, match=rf"--reference {tmp_path}/itself.json: recorded from {IMAGE_ID}, the "
                                         "judged image itself"):
        plan.job(tmp_path, TARGET, replace(opts, reference=itself), launcher="test", gpu_request=None)
    of_base = reference.write(replace(opts.reference, image_id=base), tmp_path / "base.json")
    with pytest.raises(UsageError, match=rf"recorded from {base}, the base of the judged image {IMAGE_ID}"):
        plan.job(tmp_path, replace(TARGET, base_id=base), replace(opts, reference=of_base), launcher="test",
                 gpu_request=None)
    unnamed = reference.write(replace(opts.reference, image_id=""), tmp_path / "unnamed.json")
    with pytest.raises(UsageError, match="names no image it was recorded from"):
        plan.job(tmp_path, TARGET, replace(opts, reference=unnamed), launcher="test", gpu_request=None)
    # Another image than both (and recorded under this run's settings): the job is made.
    job, _ = plan.job(tmp_path, TARGET, opts, launcher="test", gpu_request=None)
    assert job["serve"]["prompts"] == list(opts.reference.prompts)


def test_the_image_never_sees_the_reference_answers(answers: reference.Reference, tmp_path: Path) -> None:
    """The job carries the prompts, their length and the probe's schedule, never an answer the host judges the
    replies against (a runner that echoed them back would pass)."""
    job, _ = plan.job(tmp_path, TARGET, options(tmp_path, reference=answers), launcher="test", gpu_request=None)
    text = json.dumps(job)
    assert "reference" not in job["serve"] and job["serve"]["batches"]["passes"] == 1
    assert job["serve"]["prompts"] == list(answers.prompts) and job["serve"]["max_tokens"] == answers.max_tokens
    stored = answers.levels["answers"]["4"][5]
    assert json.dumps(stored["top_logprobs"][3]) not in text
    for answer in answers.answers:
        assert answer.sha256 not in text and json.dumps(list(answer.tokens or ())) not in text
        assert json.dumps(answer.top[0]) not in text


def test_the_runner_only_measures_its_sweep_and_the_host_makes_the_check(answers: reference.Reference,
                                                                         tmp_path: Path) -> None:
    """The image judges nothing of its sweep: its serve-sweep entry says what it asked and how many requests
    replied, incomplete until the host has judged the replies it sent back, and no request in its report is
    passed or failed; the check is the host's, made from those replies."""
    opts = options(tmp_path, reference=answers)
    job, launched = launch_job(tmp_path, [], opts)
    said = next(c for c in launched.report.checks if c.name == "serve-sweep")
    assert said.status is Status.INCOMPLETE, said
    assert said.detail == (f"asked concurrency 1,2,4: {3 * REQUESTS} of {3 * REQUESTS} requests replied; the "
                           "replies go to the host, which judges them")
    measured = [ev for lv in (launched.report.sweep or {})["levels"] for ev in lv["per_request"]]
    assert len(measured) == 3 * REQUESTS and all(ev["http_status"] == 200 for ev in measured)
    assert not any(ev["passed"] for ev in measured) and {ev["judged_by"] for ev in measured} == {"status"}
    verdict = judge_run.judged(job, launched, reference=opts.reference)[0]
    check = next(c for c in verdict.checks if c.name == "serve-sweep")
    assert verdict.status is Status.PASS and check.status is Status.PASS, verdict.checks
    assert check.data["judged_on"] == "host" and "bitwise the reference answer" in check.detail


def test_a_runner_that_claims_a_pass_without_the_replies_fails_here(answers: reference.Reference,
                                                                     tmp_path: Path) -> None:
    """What the runner says of its sweep is only its measurement: with its replies withheld, or replies that are
    not the reference's, the host's judgement fails every request it cannot check."""
    opts = options(tmp_path, reference=answers)
    job, _ = plan.job(tmp_path, TARGET, opts, launcher="test", gpu_request=None)
    honest = run_job(tmp_path, [], opts)
    report = replace(honest, checks=tuple(replace(c, status=Status.PASS) for c in honest.checks))
    withheld = judge_run.judged(job, base.Launched(report, replies=None), reference=opts.reference)[0]
    sweep_check = next(c for c in withheld.checks if c.name == "serve-sweep")
    assert withheld.status is Status.FAIL and sweep_check.status is Status.FAIL, sweep_check
    assert "no reply came back from the runner" in sweep_check.detail
    level = (honest.sweep or {})["levels"][0]
    first = level["per_request"][0]
    echoed = {f"1:{first['index']}": {"text": "x", "finish_reason": "length", "prompt_tokens": first["prompt_tokens"],
                                      "completion_tokens": 3, "tokens": ["a", "b", "c"], "logprobs": [0.0] * 3,
                                      "top": [{"a": 0.0}] * 3}}
    forged = judge_run.judged(job, base.Launched(report, replies=json.dumps(echoed).encode()),
                         reference=opts.reference)[0]
    assert forged.status is Status.FAIL
    assert next(c for c in forged.checks if c.name == "serve-sweep").data["judged_on"] == "host"


def test_the_host_sets_the_schedule_a_runner_that_sends_fewer_requests_fails(tmp_path: Path) -> None:
    """The levels, the requests of each and their prompts are the job's: a runner that asked one request per level
    (or two levels), however right its replies, fails the level whose requests are not the ones the host sent."""
    honest = run_job(tmp_path, [], options(tmp_path))
    assert honest.status is Status.PASS, honest.checks

    def one_request(job: dict[str, Any]) -> None:
        job["serve"]["requests"] = 1

    v = run_job(tmp_path, [], options(tmp_path), one_request)
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status is Status.FAIL and check.status is Status.FAIL, check
    assert check.detail.startswith(f"serve sweep failed at concurrency 1: {REQUESTS}/{REQUESTS} requests failed "
                                   f"(the runner reported requests [0] at concurrency 1, the host sent {REQUESTS} "
                                   f"(0 to {REQUESTS - 1}))"), check.detail
    assert v.sweep is not None and [lv["requests"] for lv in v.sweep["levels"]] == [REQUESTS]

    def two_levels(job: dict[str, Any]) -> None:
        job["serve"]["levels"] = [1, 2]

    v = run_job(tmp_path, [], options(tmp_path), two_levels)
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert check.status is Status.FAIL and "at concurrency 4" in check.detail, check.detail
    assert "the runner sent no reply at this level" in check.detail

    def other_levels(job: dict[str, Any]) -> None:
        job["serve"]["levels"] = [1, 3]

    v = run_job(tmp_path, [], options(tmp_path), other_levels)
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert check.status is Status.FAIL and "concurrency 3 is not a level the host asked for (1,2,4)" in check.detail


def test_a_report_that_moves_requests_between_prompts_fails_its_level(tmp_path: Path) -> None:
    """The runner's per-request list is read for what it measured only: a report whose request 1 names another
    prompt, or that repeats a request in place of another, fails that level; the host's prompt stands in the
    evidence."""
    opts = options(tmp_path)
    honest = run_job(tmp_path, [], opts)
    job, _ = plan.job(tmp_path, TARGET, opts, launcher="test", gpu_request=None)
    assert honest.sweep is not None
    raw = {f"{lv['concurrency']}:{r['index']}": {"text": "x", "finish_reason": "length", "prompt_tokens": 3,
                                                 "completion_tokens": 4, "tokens": ["a"] * 4,
                                                 "logprobs": [0.0] * 4, "top": [{"a": 0.0}] * 4}
           for lv in honest.sweep["levels"] for r in lv["per_request"]}
    assert judge_run.judged(job, base.Launched(honest, replies=json.dumps(raw).encode()))[0].status is Status.PASS
    moved = copy.deepcopy(honest.sweep)
    moved["levels"][1]["per_request"][1]["prompt"] = 5
    v = judge_run.judged(job, base.Launched(replace(honest, sweep=moved), replies=json.dumps(raw).encode()))[0]
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status is Status.FAIL and "failed at concurrency 2" in check.detail, check.detail
    assert "request 1 of concurrency 2 as prompt 5, the host sent prompt 1" in check.detail
    repeated = copy.deepcopy(honest.sweep)
    repeated["levels"][2]["per_request"][3] = dict(repeated["levels"][2]["per_request"][2])
    v = judge_run.judged(job, base.Launched(replace(honest, sweep=repeated), replies=json.dumps(raw).encode()))[0]
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert "failed at concurrency 4" in check.detail and "requests [0,1,2,2,4,5,6,7]" in check.detail, check.detail


def test_exact_levels_fail_at_the_first_level_the_engine_answers_wrongly(
        answers: reference.Reference, tmp_path: Path) -> None:
    v = run_job(tmp_path, ["--wrong-at-concurrency", "4"], options(tmp_path, reference=answers, keep_going=True))
    exact = next(c for c in v.checks if c.name == "exact-levels")
    assert v.status is Status.FAIL and exact.status is Status.FAIL
    assert re.match(r"wrong under fixed batches from concurrency 4: concurrency 4: [1-8] of 8 replies not bitwise "
                    r"the reference's \(request 0 \(prompt 0\): served token_id:\d+ at position 2", exact.detail), \
        exact.detail
    assert v.sweep is not None and v.sweep["exact"]["first_failed_level"] == 4
    assert [lv["wrong"] > 0 for lv in v.sweep["exact"]["levels"]] == [False, False, True]


def test_an_engine_that_dies_under_load_fails_the_levels_it_never_answered(
        answers: reference.Reference, tmp_path: Path) -> None:
    v = run_job(tmp_path, ["--die-at-concurrency", "2"], options(tmp_path, reference=answers, keep_going=True))
    exact = next(c for c in v.checks if c.name == "exact-levels")
    assert exact.status is Status.FAIL
    assert "no replies from concurrency 2 on: RuntimeError: CUDA error: an illegal memory access" in exact.detail
    assert v.sweep is not None and v.sweep["exact"]["first_failed_level"] == 2
    assert [lv["answered"] for lv in v.sweep["exact"]["levels"]] == [8, 0, 0]


def test_a_reference_of_other_levels_or_none_is_refused_before_anything_runs(
        answers: reference.Reference, tmp_path: Path) -> None:
    opts = options(tmp_path, reference=answers)
    with pytest.raises(UsageError, match=r"recorded under another schedule \(no answers at concurrency 8 \(recorded "
                                         r"at 1,2,4\)\)"):
        plan.job(tmp_path, TARGET, replace(opts, levels=(1, 8)), launcher="test", gpu_request=None)
    with pytest.raises(UsageError, match=r"recorded under another schedule \(requests 8 there, 6 here\)"):
        plan.job(tmp_path, TARGET, replace(opts, requests=6), launcher="test", gpu_request=None)
    assert opts.reference is not None
    bare = reference.write(replace(opts.reference, levels={}), tmp_path / "bare.json")
    with pytest.raises(UsageError, match="holds no per-level answers"):
        plan.job(tmp_path, TARGET, replace(opts, reference=bare), launcher="test", gpu_request=None)


def test_recording_per_level_answers_needs_two_passes_bit_for_bit(answers: reference.Reference,
                                                                  tmp_path: Path) -> None:
    with pytest.raises(SmokeError, match="differs between two passes of the same schedule"):
        fixed_batches.record(probe(tmp_path, answers.prompts, (1, 2), 4, 2, ("--unrepeatable",)), answers.prompts,
                             (1, 2), 4, sweep.MAX_TOKENS)
    with pytest.raises(SmokeError, match="the batch probe gave none at concurrency 2 .*illegal memory access"):
        fixed_batches.record(probe(tmp_path, answers.prompts, (1, 2), 4, 2, ("--die-at-concurrency", "2")),
                             answers.prompts, (1, 2), 4, sweep.MAX_TOKENS)


def test_runner_sweep_measures_replies_that_move_far_and_fails_malformed_ones_with_keep_going(
        answers: reference.Reference, tmp_path: Path) -> None:
    # Above concurrency 1 the server answers other tokens than at 1, beyond the concurrency-1 reply's top-5 (a
    # model sensitive to its batch): the host measures how far, never fails the run for it; the page shows it.
    v = run_job(tmp_path, ["--wrong-at-concurrency", "2"], options(tmp_path, reference=answers), probe_too=False)
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status.value == "pass", [(c.name, c.status.value, c.detail) for c in v.checks if c.status.value != "pass"]
    assert "measured and not judged" in check.detail
    levels = {lv["concurrency"]: lv for lv in v.sweep["levels"]} if v.sweep else {}
    assert levels[1]["movement"] is None and levels[1]["identical"] == 8
    moved = [levels[c]["movement"] for c in (2, 4)]
    assert all(m["replies"] == 8 and m["beyond_top_k"] > 0 and m["first_difference"]["min"] == 2 for m in moved)
    page = report_page.write_verdict(v.to_dict(), "moved", None, tmp_path / "page.html")
    text = (tmp_path / "page.html").read_text()
    assert "deviation" in page.figures and "id='movement'" in text
    assert f"<td>moved</td><td>2</td><td>8</td><td>{moved[0]['identical']}</td>" in text
    assert f"recorded from image {TRUSTED_ID}; signature: unchecked; they prove: reproducible against image " \
        f"{TRUSTED_ID}" in text
    # The same fault under fixed batches (the engine's own numerics, not the timing's): exact-levels fails there.
    v = run_job(tmp_path, ["--wrong-at-concurrency", "2"], options(tmp_path, reference=answers))
    failed = {c.name: c for c in v.checks if c.status is Status.FAIL}
    assert set(failed) == {"exact-levels"} and failed["exact-levels"].detail.startswith(
        "wrong under fixed batches from concurrency 2"), failed
    # A NaN is no movement: it fails its level, and with --keep-going every later level is judged too.
    v = run_job(tmp_path, ["--nan-at-concurrency", "2"], options(tmp_path, reference=answers, keep_going=True),
                probe_too=False)
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status.value == "fail"
    assert check.detail.startswith("serve sweep failed at concurrency 2; also failed at concurrency 4"), check.detail
    levels = {lv["concurrency"]: lv for lv in v.sweep["levels"]} if v.sweep else {}
    assert levels[1]["wrong_answers"] == 0 and levels[2]["wrong_answers"] > 0 and levels[4]["wrong_answers"] > 0
    # Without --keep-going the sweep stops at the first failing level.
    v = run_job(tmp_path, ["--nan-at-concurrency", "2"], options(tmp_path, reference=answers), probe_too=False)
    assert [lv["concurrency"] for lv in (v.sweep or {})["levels"]] == [1, 2]


def test_a_changed_prompt_fails_the_runner_sweep_and_recording_needs_docker(
        answers: reference.Reference, tmp_path: Path) -> None:
    def tamper(job: dict[str, Any]) -> None:  # the prompts changed between the host and the runner
        job["serve"]["prompts"][0] = "Something else entirely, asked in the image."

    v = run_job(tmp_path, [], options(tmp_path, reference=answers), tamper)
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status.value == "fail" and "serve sweep failed at concurrency 1" in check.detail, check.detail
    with pytest.raises(UsageError, match="--record-reference needs --launcher docker or podman"):
        plan.job(tmp_path, plan.Target("x", IMAGE_ID, IMAGE_ID, {}),
                 options(tmp_path, record_reference=tmp_path / "new.json"), launcher="kubernetes", gpu_request=None)


def test_a_reference_recorded_under_other_settings_is_refused_naming_the_difference(
        answers: reference.Reference, tmp_path: Path) -> None:
    opts = options(tmp_path, reference=answers)
    assert opts.reference is not None
    here = dict(opts.reference.settings)
    (tmp_path / "model" / "config.json").write_text("{}")  # another model than the one recorded with
    with pytest.raises(UsageError, match=r"recorded under other settings \(model '[0-9a-f]{64}' there, "
                                         r"'[0-9a-f]{64}' here\)"):
        plan.job(tmp_path, TARGET, opts, launcher="test", gpu_request=None)
    (tmp_path / "model" / "config.json").unlink()
    other = replace(opts, serve_args=("--max-model-len", "4096"))
    with pytest.raises(UsageError, match=r"serve_args \['--no-enable-prefix-caching'\] there, \['--max-model-len', "
                                         r"'4096', '--no-enable-prefix-caching'\] here"):
        plan.job(tmp_path, TARGET, other, launcher="test", gpu_request=None)
    with pytest.raises(UsageError, match="--serve-arg=--enable-prefix-caching: the sweep's server runs with "
                                         "--no-enable-prefix-caching"):
        plan.job(tmp_path, TARGET, replace(opts, serve_args=("--enable-prefix-caching",)), launcher="test",
                 gpu_request=None)
    # After the run: the versions and the GPU model the image reported, against the reference's.
    ref = replace(opts.reference, settings={**here, "gpu": "NVIDIA H100", "torch": "2.11.0", "vllm": "0.25.1"})
    ran = Verdict("i", IMAGE_ID, Status.PASS, (), True, environment={"packages": {"torch": "2.11.0",
                                                                                   "vllm": "0.25.1"}},
                  gpu={"devices": ["NVIDIA H200"]})
    with pytest.raises(UsageError, match=r"recorded under other settings \(gpu 'NVIDIA H100' there, "
                                         r"'NVIDIA H200' here\)"):
        reference_fit.refuse_other_settings(ref, plan.run_settings(ran))


def test_the_runner_records_the_settings_and_the_recording_run_is_not_judged_against_itself(tmp_path: Path) -> None:
    """Recording in the runner: the host's settings plus the run's own facts go into the file it records; the
    sweep after it is judged by status alone (never against what it just recorded), and the report names the
    file the host keeps (one sha256 in the report and on disk)."""
    opts = replace(options(tmp_path, record_reference=tmp_path / "new.json"), levels=(1, 2))
    job, extra = plan.job(tmp_path, TARGET, opts, launcher="docker", gpu_request=None)
    launched = launch_staged(tmp_path, job, extra)
    judged, levels, _ = judge_run.judged(job, launched)
    sweep_check = next(c for c in judged.checks if c.name == "serve-sweep")
    assert "bitwise" not in sweep_check.detail and (judged.sweep or {}).get("reference") is None, sweep_check
    assert sweep_check.data["judged_on"] == "host" and sweep_check.data["answered_by"] == "filesystem"
    assert launched.answers is not None and judged.status is Status.PASS, judged.checks
    # Recorded under fixed batches too, in two passes; not judged against itself.
    exact = next(c for c in judged.checks if c.name == "exact-levels")
    assert exact.status is Status.SKIP and "a recording is not judged against itself" in exact.detail
    assert levels is not None and levels["repeat"] == {"passes": 2, "replies": 2 * REQUESTS,
                                                       "identical": 2 * REQUESTS}
    settings = {**plan.serve_settings(opts, TARGET), **plan.run_settings(judged)}
    kept = reference_fit.keep(tmp_path / "new.json", launched.answers, settings, dict(levels), image_id=IMAGE_ID)
    # The image recorded is the host's fact, named in the file it keeps.
    assert kept.image_id == IMAGE_ID and json.loads((tmp_path / "new.json").read_text())["image_id"] == IMAGE_ID
    # The report names the file the host keeps (with the per-level answers), as the docker launcher stamps it.
    judged = judge_run.restamp(judged, kept, recorded=True)
    assert judged.sweep is not None and judged.sweep["recorded"]["levels"]["schedule"]["levels"] == [1, 2]
    assert json.loads((tmp_path / "new.json").read_text())["sha256"] == kept.sha256
    # The runner's site folder here holds neither vLLM nor torch: the image's env-report says so, and the file
    # keeps it.
    torch = "absent"
    assert kept.settings == {**plan.serve_settings(opts, TARGET), "vllm": "absent", "torch": torch}
    assert judged.sweep["recorded"]["sha256"] == kept.sha256
    # A recording whose settings are not this run's is refused and not kept.
    with pytest.raises(SmokeError, match=r"recorded other settings than this run's \(torch "
                                         rf"'{re.escape(torch)}' there, '2.11.0' here\); nothing written"):
        reference_fit.keep(tmp_path / "other.json", launched.answers, {**settings, "torch": "2.11.0"})
    assert not (tmp_path / "other.json").exists()
    # Kept by the host only from a passing recording: this one ran on no GPU and no golden judged its replies, so
    # the launcher's keep writes nothing, says why, and nothing is signed.
    said: list[str] = []
    ran = judge_run.Ran(judged, job, launched.answers, levels)
    assert recorded.keep_recorded(ran, replace(opts, record_reference=tmp_path / "cpu.json"), TARGET,
                                  said.append) is ran
    assert not (tmp_path / "cpu.json").exists() and len(said) == 1, said
    assert said[0].endswith("nothing written: its golden check did not pass (not run); answers are kept only where "
                            "the golden judged them")
    # The same run as a GPU host that runs the golden sees it (stood in here: the GPU checks verified, the golden
    # passed and measured its noise): kept, and with the site key signed after the verdict, naming it.
    key = site_key(tmp_path / "site.key")
    on_gpu = replace(judged, gpu_verified=True, checks=(*judged.checks, Check("golden", Status.PASS, "judged")))
    said.clear()
    kept_ran = recorded.keep_recorded(replace(ran, verdict=on_gpu, golden={"noise": {"max": 0.0}}),
                                  replace(opts, record_reference=tmp_path / "gpu.json"), TARGET, said.append)
    assert (tmp_path / "gpu.json").exists() and said[0].startswith(f"    wrote {tmp_path}/gpu.json"), said
    request = smokelib.SmokeRequest("ops/vllm:fix", replace(opts, record_reference=tmp_path / "gpu.json"),
                                    sign_key=str(tmp_path / "site.key"))
    named = smokelib.name_signature(kept_ran.verdict, request)
    envelope = tmp_path / "gpu.dsse.json"
    assert named.sweep is not None and named.sweep["recorded"]["signature"] == {
        "state": "signed", "key_id": signing.key_id(key.public_key()), "envelope": str(envelope), "why": ""}
    verdict_envelope = signing.sign(signing.statement({"ops/vllm:fix": IMAGE_ID}, signing.predicate(
        named.to_dict(), {}, signing.now(), named.started or None)), key)
    smokelib.sign_recorded(named, verdict_envelope, request, lambda _line: None)
    gpu_kept = reference.load(tmp_path / "gpu.json")
    found = signing.open_envelope(envelope.read_bytes(), key.public_key(), "gpu.dsse.json",
                                  signing.REFERENCE_PREDICATE_TYPE)
    assert found.digests == {f"sha256:{gpu_kept.sha256}"} and found.predicate["image_id"] == IMAGE_ID
    assert found.predicate["settings"] == gpu_kept.settings and found.predicate["signed_at"]
    digest = "sha256:" + hashlib.sha256(verdict_envelope).hexdigest()
    assert found.predicate["recording_verdict"] == digest
    assert (tmp_path / "gpu.verdict.dsse.json").read_bytes() == verdict_envelope
    # Never taken for a smoke verdict (nor a verdict for it): each is opened as its own predicate type.
    with pytest.raises(AttestationTampered, match="not a smoke-report statement"):
        signing.open_envelope(envelope.read_bytes(), key.public_key(), "gpu.dsse.json")
    checked = references.check(tmp_path / "gpu.json", gpu_kept.sha256, str(tmp_path / "site.key"))
    assert (checked.state, checked.recording) == ("signed", digest)
    # Its recording verdict is looked for beside it, then in the journal folders given; where it is in neither, the
    # reference is refused (21), or accepted as unsigned where the run says so.
    (tmp_path / "gpu.verdict.dsse.json").rename(tmp_path / f"{digest[7:]}.dsse.json")
    assert references.check(tmp_path / "gpu.json", gpu_kept.sha256, str(tmp_path / "site.key"),
                            journal=[tmp_path]).recording == digest
    (tmp_path / f"{digest[7:]}.dsse.json").unlink()
    with pytest.raises(AttestationMissing, match=r"the verdict of the run that recorded it \(sha256:"):
        references.check(tmp_path / "gpu.json", gpu_kept.sha256, str(tmp_path / "site.key"), journal=[tmp_path])
    accepted = references.check(tmp_path / "gpu.json", gpu_kept.sha256, str(tmp_path / "site.key"),
                                accept_unsigned=True)
    assert accepted.state == "accepted" and "neither beside it" in accepted.why
    # A signed reference whose recording did not pass (here: GPU-unverified) is refused whatever the flag (24).
    cpu_envelope = signing.sign(signing.statement({"ops/vllm:fix": IMAGE_ID}, signing.predicate(
        restamp_recorded(judged, gpu_kept).to_dict(), {}, signing.now())), key)
    references.envelope_path(tmp_path / "gpu.json").unlink()
    references.sign(tmp_path / "gpu.json", gpu_kept.sha256, {"image_id": IMAGE_ID}, str(tmp_path / "site.key"),
                    recording=cpu_envelope)
    with pytest.raises(AttestationMismatch, match="recorded by a run that did not pass .*golden check did not pass"):
        references.check(tmp_path / "gpu.json", gpu_kept.sha256, str(tmp_path / "site.key"), accept_unsigned=True)


def restamp_recorded(verdict: Verdict, kept: reference.Reference) -> Verdict:
    """``verdict`` naming ``kept`` as the answers it recorded, as the launcher stamps a recording's verdict."""
    return judge_run.restamp(verdict, kept, recorded=True)


def test_a_recording_whose_checks_failed_writes_and_signs_nothing(tmp_path: Path) -> None:
    """A recording run whose patch-set check failed (topk-layout, given here by the host) while the server and the
    engine answered every level: its answers are not kept, so nothing is there to sign, whatever the GPU and the
    golden said of them (they would judge every later image by a wrong image's answers)."""
    opts = replace(options(tmp_path, record_reference=tmp_path / "new.json"), levels=(1, 2), keep_going=True)
    job, extra = plan.job(tmp_path, TARGET, opts, launcher="docker", gpu_request=None,
                          checks=[{"name": "topk-layout", "status": "fail", "detail": "wrong layout at 4 heads"}])
    launched = launch_staged(tmp_path, job, extra)
    judged, levels, _ = judge_run.judged(job, launched)
    assert judged.status is Status.FAIL and judged.failed == ["topk-layout"], judged.checks
    assert launched.answers is not None and levels, "the server and the engine answered every level"
    # As a GPU host with the golden would see it: everything else verified and passed.
    on_gpu = replace(judged, gpu_verified=True, checks=(*judged.checks, Check("golden", Status.PASS, "judged")))
    said: list[str] = []
    ran = recorded.keep_recorded(judge_run.Ran(on_gpu, job, launched.answers, levels, {"noise": {"max": 0.0}}),
                                 opts, TARGET, said.append)
    assert ran.verdict is on_gpu and said == [f"    --record-reference {tmp_path}/new.json: nothing written: the "
                                              "recording run is a fail (topk-layout)"]
    assert not (tmp_path / "new.json").exists()
    site_key(tmp_path / "site.key")
    request = smokelib.SmokeRequest("ops/vllm:fix", opts, sign_key=str(tmp_path / "site.key"))
    assert smokelib.name_signature(ran.verdict, request) is ran.verdict
    smokelib.sign_recorded(ran.verdict, b"{}", request, lambda _line: None)
    assert not list(tmp_path.glob("new*"))
