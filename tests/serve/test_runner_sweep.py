"""The runner's serve sweep judges replies as the host's does: reference answers, per-request evidence,
phases, --keep-going. The runner starts tests/fake_openai.py as the image's server, as a pod would start
`vllm serve`, with this Python standing in for the image's."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, free_port
from vllm_hotfix.checking import reference, sweep
from vllm_hotfix.checking.launchers import base, plan
from vllm_hotfix.checking.smoke import SmokeOptions
from vllm_hotfix.errors import UsageError
from vllm_hotfix.verdicts import Verdict

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
        return reference.write(sweep.record(url), tmp_path_factory.mktemp("ref") / "answers.json")
    finally:
        proc.kill()
        proc.wait()


def run_job(tmp_path: Path, server: list[str], options: SmokeOptions,
            edit: Callable[[dict[str, Any]], None] = lambda _job: None) -> Verdict:
    (tmp_path / "model").mkdir(exist_ok=True)
    target = plan.Target("ops/vllm:fix", IMAGE_ID, IMAGE_ID, {}, entrypoint=(sys.executable, str(FAKE), "serve"))
    job, extra = plan.job(tmp_path, target, options, launcher="test", gpu_request=None)
    # The job serves /model on port 8000 inside a container; here the fake serves on a free port of the host.
    port = free_port()
    job["serve"]["argv"] = [sys.executable, str(FAKE), "serve", "test-model", "--port", str(port), *server]
    job["serve"]["port"] = port
    edit(job)
    folder = base.stage(tmp_path / "runner", job, extra)
    done = subprocess.run([sys.executable, "-I", str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=120, cwd=folder)
    assert done.returncode == 0, done.stderr
    return base.results(done.stdout, done.stderr, "test runner").verdict


def options(tmp_path: Path, **more: object) -> SmokeOptions:
    return SmokeOptions(gpu="off", serve_model=tmp_path / "model", levels=(1, 2, 4), requests=8, **more)  # type: ignore[arg-type]


def test_runner_sweep_matches_the_reference_and_keeps_per_request_evidence(
        answers: reference.Reference, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    v = run_job(tmp_path, [], options(tmp_path, reference=answers))
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status.value == "pass", v.checks
    assert "every reply matched the reference answers" in check.detail
    assert v.sweep is not None and v.sweep["reference"]["sha256"] == answers.sha256
    assert v.sweep["reference"]["file"] == answers.path  # the user's file, not the runner's copy
    by_prompt = {i: a.sha256 for i, a in enumerate(answers.answers)}
    for level in v.sweep["levels"]:
        assert len(level["per_request"]) == 8
        for ev in level["per_request"]:
            assert ev["judged_by"] == "reference" and ev["passed"] and ev["reply_sha256"] == by_prompt[ev["prompt"]]
            assert ev["finish_reason"] and ev["latency_s"] > 0 and ev["prompt_tokens"] > 0
    assert set(v.phases) == {"checks", "gpu_checks", "server_start", "sweep"}


def test_runner_sweep_catches_wrong_answers_at_every_level_with_keep_going(
        answers: reference.Reference, tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
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
    (tmp_path / "model").mkdir()

    def tamper(job: dict[str, Any]) -> None:  # the answers changed between the host and the runner
        job["serve"]["reference"]["answers"][3]["tokens"][5] = "token_id:7"

    v = run_job(tmp_path, [], options(tmp_path, reference=answers), tamper)
    check = next(c for c in v.checks if c.name == "serve-sweep")
    assert v.status.value == "fail" and "does not match the sha256 it carries" in check.detail
    with pytest.raises(UsageError, match="--record-reference needs --launcher docker"):
        plan.job(tmp_path, plan.Target("x", IMAGE_ID, IMAGE_ID, {}),
                 options(tmp_path, record_reference=tmp_path / "new.json"), launcher="podman", gpu_request=None)
