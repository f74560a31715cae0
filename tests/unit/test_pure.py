"""Pure pieces of smoke, sweep, push and the probes."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from vllm_hotfix.checking import smoke
from vllm_hotfix.engine import split_reference
from vllm_hotfix.errors import UsageError
from vllm_hotfix.inimage import sweep
from vllm_hotfix.inimage.probes import env_report
from vllm_hotfix.judges import sweep as judged
from vllm_hotfix.release import push
from vllm_hotfix.verdicts import Check, Status, judge


def test_split_reference_keeps_registry_ports() -> None:
    assert split_reference("127.0.0.1:5000/ops/vllm-openai:v1") == ("127.0.0.1:5000/ops/vllm-openai", "v1")
    assert split_reference("127.0.0.1:5000/ops/vllm-openai") == ("127.0.0.1:5000/ops/vllm-openai", "latest")
    assert split_reference("vllm/vllm-openai:v0.25.1-m3patch") == ("vllm/vllm-openai", "v0.25.1-m3patch")


def test_push_target_uses_last_path_part_and_tag() -> None:
    assert push.target_ref("vllm/vllm-openai:v0.25.1-m3patch", "127.0.0.1:5000/ops") == (
        "127.0.0.1:5000/ops/vllm-openai:v0.25.1-m3patch"
    )
    with pytest.raises(UsageError, match="without a scheme"):
        push.target_ref("a/b:c", "https://registry/x")
    with pytest.raises(UsageError, match="without a scheme"):
        push.target_ref("a/b:c", "HTTP://registry.internal/x")


def test_parse_levels() -> None:
    assert sweep.parse_levels("1,2,4,8,16") == (1, 2, 4, 8, 16)
    for bad in ("", "0,1", "a"):
        with pytest.raises(UsageError):
            sweep.parse_levels(bad)


# The end of a real vLLM 0.25.1 server log (unpatched MiniMax-M3, concurrency 8): the
# engine core's death, then one access line per request the dead engine refused.
DEAD_SERVER_LOG = """\
(EngineCore pid=114)   File "/usr/lib/python3.12/multiprocessing/process.py", line 108, in run
(EngineCore pid=114)     self._target(*self._args, **self._kwargs)
(EngineCore pid=114)   File "/opt/torch/.venv/lib/python3.12/site-packages/torch/accelerator/__init__.py", line 263
(EngineCore pid=114)     torch._C._accelerator_synchronizeDevice(device_index)
(EngineCore pid=114) torch.AcceleratorError: CUDA error: an illegal memory access was encountered
(EngineCore pid=114) CUDA kernel errors might be asynchronously reported at some other API call.
(EngineCore pid=114) For debugging consider passing CUDA_LAUNCH_BLOCKING=1
""" + "".join(f'(APIServer pid=1) INFO:     127.0.0.1:{32900 + i} - "POST /v1/chat/completions HTTP/1.1" '
              '500 Internal Server Error\n' for i in range(80))


def test_server_log_condensed_to_its_cause() -> None:
    kept = sweep.condense(DEAD_SERVER_LOG).splitlines()
    assert len(kept) == 7 and "Internal Server Error" not in "".join(kept)
    assert kept[4].endswith("illegal memory access was encountered")
    assert len(sweep.condense(DEAD_SERVER_LOG, lines=3).splitlines()) == 3
    cause = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert sweep.cause(DEAD_SERVER_LOG) == cause
    assert sweep.cause("INFO: started\nINFO: ready\n") is None
    result = sweep.SweepResult("http://x", "m", [sweep.Level(8, 32, successes=3, failures=29,
                                                              errors=["HTTP 500: EngineCore encountered an issue"])],
                               failed_level=8, server_log=sweep.condense(DEAD_SERVER_LOG))
    assert judged.failure_message(result) == (
        "serve sweep failed at concurrency 8: 29/32 requests failed (HTTP 500: EngineCore encountered an issue); "
        "server: torch.AcceleratorError: CUDA error: an illegal memory access was encountered")


def test_percentiles() -> None:
    values = [float(i) for i in range(1, 101)]
    assert judged.percentile(values, 50) == pytest.approx(50.5)
    assert judged.percentile(values, 95) == pytest.approx(95.05)
    assert judged.percentile([0.3], 95) == 0.3


def test_junit_has_one_case_per_check(tmp_path: Path) -> None:
    verdict = judge("x:y", "sha256:" + "1" * 64, [
        Check("patch-landed", Status.PASS, "", 0.5),
        Check("integrity", Status.FAIL, "2 files differ", 1.0),
        Check("gpu", Status.SKIP, "no runtime", 0.0),
    ], gpu_verified=False, seconds=1.5)
    smoke.write_junit(verdict, tmp_path / "j.xml")
    suite = ET.parse(tmp_path / "j.xml").getroot()
    assert (suite.get("tests"), suite.get("failures"), suite.get("skipped")) == ("3", "1", "1")
    cases = {c.get("name"): c for c in suite}
    failure = cases["integrity"].find("failure")
    assert failure is not None and failure.get("message") == "2 files differ"
    assert cases["gpu"].find("skipped") is not None


def test_known_bad_pair_is_flagged_only_when_probe_confirms() -> None:
    versions = {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.7.1"}
    missing = lambda _m, _a: False  # noqa: E731
    present = lambda _m, _a: True  # noqa: E731
    assert env_report.flag_known_bad(versions, [(10, 0)], missing)
    assert not env_report.flag_known_bad(versions, [(10, 0)], present)
    assert not env_report.flag_known_bad(versions, [(9, 0)], missing)  # Hopper is not affected
    good = {"quack-kernels": "0.6.4", "nvidia-cutlass-dsl": "4.6.2"}
    assert not env_report.flag_known_bad(good, [(10, 0)], missing)
    # The pair present but the module not importable: not flagged, and not cleared either.
    unknown: list[str] = []
    assert not env_report.flag_known_bad(versions, [(10, 0)], lambda _m, _a: None, unconfirmed=unknown)
    assert unknown == ["quack-0.6.5+cutlass-dsl-4.7.1-sm100"]


def test_known_bad_pair_that_cannot_be_confirmed_is_incomplete(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(env_report, "dist_version",
                        lambda n: {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.7.1"}.get(n, "absent"))
    monkeypatch.setattr(env_report, "has_attribute", lambda _m, _a: None)
    # The CUDA and GPU lines are not what is tested, and would import the test environment's PyTorch here.
    monkeypatch.setattr(env_report, "cuda_runtime_version", lambda: (None, "not found"))
    monkeypatch.setattr(env_report, "gpus", lambda: ([], "none"))
    env_report.main([])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    check = next(c for c in out["checks"] if c["name"] == "known-bad-deps")
    assert check["status"] == "incomplete" and "cannot be imported here" in check["detail"]
