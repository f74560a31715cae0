"""The runner's serve sweep judges replies as the host's does: reference answers, per-request evidence,
phases, --keep-going. The runner starts tests/fake_openai.py as the image's server, as a pod would start
`vllm serve`, with this Python standing in for the image's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, free_port
from vllm_hotfix.checking import recording, reference, sweep
from vllm_hotfix.checking.launchers import base, judging, plan
from vllm_hotfix.checking.smoke import SmokeOptions
from vllm_hotfix.errors import SmokeError, UsageError
from vllm_hotfix.verdicts import Status, Verdict

FAKE = REPO / "tests" / "fake_openai.py"
IMAGE_ID = "sha256:" + "ab" * 32


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> reference.Reference:
    """Answers recorded once from a healthy server (the trusted image)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "serve", "test-model", "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        sweep.wait_healthy(url, 20)
        return reference.write(recording.record(url), tmp_path_factory.mktemp("ref") / "answers.json")
    finally:
        proc.kill()
        proc.wait()


TARGET = plan.Target("ops/vllm:fix", IMAGE_ID, IMAGE_ID, {}, entrypoint=(sys.executable, str(FAKE), "serve"))


def run_job(tmp_path: Path, server: list[str], options: SmokeOptions,
            edit: Callable[[dict[str, Any]], None] = lambda _job: None) -> Verdict:
    (tmp_path / "model").mkdir(exist_ok=True)
    job, extra = plan.job(tmp_path, TARGET, options, launcher="test", gpu_request=None)
    # The oracle's settings: prefix caching off, batch-invariant mode on, whatever the user's arguments.
    assert job["serve"]["argv"][-1] == "--no-enable-prefix-caching"
    assert job["serve"]["env"] == {"VLLM_BATCH_INVARIANT": "1"} and job["serve"]["overlap"] is False
    # The job serves /model on port 8000 inside a container; here the fake serves on a free port of the host.
    port = free_port()
    job["serve"]["argv"] = [sys.executable, str(FAKE), "serve", "test-model", "--port", str(port), *server]
    job["serve"]["port"] = port
    edit(job)
    folder = base.stage(tmp_path / "runner", job, extra)
    done = subprocess.run([sys.executable, "-I", str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=120, cwd=folder)
    assert done.returncode == 0, done.stderr
    return judging.host_verdict(job, base.results(done.stdout, done.stderr, "test runner").report)


def options(tmp_path: Path, **more: Any) -> SmokeOptions:
    """Options for a run; a reference given is taken as recorded under this run's own settings."""
    (tmp_path / "model").mkdir(exist_ok=True)
    opts = SmokeOptions(gpu="off", serve_model=tmp_path / "model", levels=(1, 2, 4), requests=8, **more)
    if opts.reference is not None:
        mine = replace(opts.reference, settings=plan.serve_settings(opts, TARGET))
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
            assert ev["judged_by"] == ("exact" if level["concurrency"] == 1 else "noise")
            assert ev["passed"] and ev["reply_sha256"] == by_prompt[ev["prompt"]]
            assert ev["finish_reason"] and ev["latency_s"] > 0 and ev["prompt_tokens"] > 0
    assert set(v.phases) == {"checks", "gpu_checks", "server_start", "sweep"}


def test_runner_sweep_catches_wrong_answers_at_every_level_with_keep_going(
        answers: reference.Reference, tmp_path: Path) -> None:
    v = run_job(tmp_path, ["--wrong-at-concurrency", "2"], options(tmp_path, reference=answers, keep_going=True))
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status.value == "fail"
    assert check.detail.startswith("serve sweep failed at concurrency 2; also failed at concurrency 4")
    levels = {lv["concurrency"]: lv for lv in v.sweep["levels"]} if v.sweep else {}
    assert levels[1]["wrong_answers"] == 0 and levels[2]["wrong_answers"] > 0 and levels[4]["wrong_answers"] > 0
    # Without --keep-going the sweep stops at the first failing level.
    v = run_job(tmp_path, ["--wrong-at-concurrency", "2"], options(tmp_path, reference=answers))
    assert [lv["concurrency"] for lv in (v.sweep or {})["levels"]] == [1, 2]


def test_a_changed_reference_fails_the_runner_sweep_and_recording_needs_docker(
        answers: reference.Reference, tmp_path: Path) -> None:
    def tamper(job: dict[str, Any]) -> None:  # the answers changed between the host and the runner
        job["serve"]["reference"]["answers"][3]["tokens"][5] = "token_id:7"

    v = run_job(tmp_path, [], options(tmp_path, reference=answers), tamper)
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status.value == "fail" and "does not match the sha256 it carries" in check.detail
    with pytest.raises(UsageError, match="--record-reference needs --launcher docker"):
        plan.job(tmp_path, plan.Target("x", IMAGE_ID, IMAGE_ID, {}),
                 options(tmp_path, record_reference=tmp_path / "new.json"), launcher="podman", gpu_request=None)


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
        reference.refuse_other_settings(ref, plan.run_settings(ran))


def test_the_runner_records_the_settings_and_judges_with_the_file_the_host_keeps(tmp_path: Path) -> None:
    """Recording in the runner: the host's settings plus the run's own facts go into the file it records, so the
    sweep after it judges with the very file the host keeps (one sha256 in the report and on disk)."""
    opts = replace(options(tmp_path, record_reference=tmp_path / "new.json"), levels=(1, 2))
    job, extra = plan.job(tmp_path, TARGET, opts, launcher="docker", gpu_request=None)
    port = free_port()
    job["serve"]["argv"] = [sys.executable, str(FAKE), "serve", "test-model", "--port", str(port)]
    job["serve"]["port"] = port
    folder = base.stage(tmp_path / "runner", job, extra)
    done = subprocess.run([sys.executable, "-I", str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=180, cwd=folder)
    assert done.returncode == 0, done.stderr
    launched = base.results(done.stdout, done.stderr, "test runner")
    judged = judging.host_verdict(job, launched.report)
    assert launched.answers is not None and judged.status is Status.PASS
    settings = {**plan.serve_settings(opts, TARGET), **plan.run_settings(judged)}
    kept = reference.keep(tmp_path / "new.json", launched.answers, settings)
    # This Python has neither vLLM nor torch: the image's env-report says so, and the file keeps it.
    assert kept.settings == {**plan.serve_settings(opts, TARGET), "vllm": "absent", "torch": "absent"}
    assert judged.sweep is not None and judged.sweep["reference"]["sha256"] == kept.sha256
    # A recording whose settings are not this run's is refused and not kept.
    with pytest.raises(SmokeError, match=r"recorded other settings than this run's \(torch 'absent' there, "
                                         r"'2.11.0' here\); nothing written"):
        reference.keep(tmp_path / "other.json", launched.answers, {**settings, "torch": "2.11.0"})
    assert not (tmp_path / "other.json").exists()
