"""The host's verdict on a runner's report: its own facts stand, GPU claims need a GPU it gave, nothing is missing."""

from __future__ import annotations

from typing import Any

from vllm_hotfix.judges import judging
from vllm_hotfix.verdicts import Check, Status, Verdict, judge

IMAGE_ID = "sha256:" + "ab" * 32
LANDED_FAIL = {"name": "patch-landed", "status": "fail", "detail": "indexer.py differs",
               "data": {"answered_by": "filesystem"}}


def _job(**more: Any) -> dict[str, Any]:
    return {"image": "ops/vllm:fix", "image_id": IMAGE_ID, "launcher": "test", "checks": [LANDED_FAIL],
            "landed": {"package": "vllm", "site_dir": "/usr/lib/python3/dist-packages"},
            "gpu": {"mode": "auto", "request": None, "unavailable": {"status": "skip", "detail": "no GPU here",
                                                                     "why": "no GPU here"}}, **more}


def _report(*checks: Check, image_id: str = IMAGE_ID, **more: Any) -> Verdict:
    return judge("ops/vllm:fix", image_id, list(checks), **{"gpu_verified": False, **more})


PASSING = (Check("patch-landed", Status.PASS, "all fine", data={"answered_by": "filesystem"}),
           Check("import-location", Status.PASS, "ok"), Check("env-report", Status.PASS, "ok"),
           Check("gpu", Status.SKIP, "no GPU here"), Check("serve-sweep", Status.SKIP, "no model"))


def test_the_hosts_file_facts_stand_whatever_the_report_says() -> None:
    v = judging.host_verdict(_job(), _report(*PASSING))
    landed = [c for c in v.checks if c.name == "patch-landed"]
    assert [c.status for c in landed] == [Status.FAIL] and v.status is Status.FAIL
    # Checks the image answered say so, whatever they claimed.
    assert {(c.data or {}).get("answered_by") for c in v.checks if c.name == "env-report"} == {"image-python"}


def test_gpu_claims_from_a_container_given_no_gpu_are_refused() -> None:
    torch = Check("gpu-torch", Status.PASS, "ok", ran_against="torch")
    report = _report(*PASSING[1:], torch, gpu_verified=True,
                     gpu={"devices": ["NVIDIA H200"], "raw_checks": [torch.to_dict()]})
    v = judging.host_verdict(_job(checks=[]), report)
    claim = next(c for c in v.checks if c.name == "gpu-claim")
    assert claim.status is Status.FAIL and "NVIDIA H200" in claim.detail and "GPU-verified" in claim.detail
    assert v.gpu_verified is False and v.gpu["devices"] == [] and v.status is Status.FAIL
    assert next(c for c in v.checks if c.name == "gpu").detail == "no GPU here"  # the host's settled check
    # Given a GPU, the same GPU checks are judged here and stand.
    given = _job(checks=[], gpu={"mode": "auto", "request": "cdi:nvidia.com/gpu=all"})
    assert judging.host_verdict(given, report).gpu_verified is True
    # ... but a GPU-verified claim with no GPU check behind it does not.
    bare = _report(*PASSING[1:4], Check("serve-sweep", Status.SKIP), gpu_verified=True, gpu={"devices": ["H200"]})
    assert judging.host_verdict(given, bare).gpu_verified is False


def test_a_check_the_job_asks_for_cannot_be_left_out() -> None:
    v = judging.host_verdict(_job(checks=[]), _report(*PASSING[2:]))
    missing = next(c for c in v.checks if c.name == "import-location")
    assert missing.status is Status.FAIL and "did not report" in missing.detail


def test_a_report_of_another_image_or_other_options_is_not_this_runs() -> None:
    v = judging.host_verdict(_job(checks=[]), _report(*PASSING[1:], image_id="sha256:" + "cd" * 32))
    runner = next(c for c in v.checks if c.name == "runner")
    assert runner.status is Status.FAIL and "not sha256:abababab" in runner.detail
    v = judging.host_verdict(_job(checks=[]), _report(*PASSING[1:], gpu={"mode": "off"}))
    assert "ran with --gpu off, the host judges --gpu auto" in next(c for c in v.checks if c.name == "runner").detail
