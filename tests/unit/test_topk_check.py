"""The #49149 check's verdict logic, without a GPU.

What runs on a GPU (the installed indexer and sparse attention on vLLM's
Triton kernels) is proven on a GPU host (gpu-runs/); here: a host without
torch gets `skip`, and neither a timeout nor an unrelated fault is a pass or a
caught bug.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from types import ModuleType

import pytest

from conftest import REPO

CHECK = REPO / "patches" / "v0.25.1" / "checks" / "gpu_topk_layout.py"


@pytest.fixture(scope="module")
def check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_topk_layout", CHECK)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_without_torch_the_check_skips() -> None:
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') is None else 3)"
    if subprocess.run([sys.executable, "-c", probe]).returncode == 3:
        pytest.skip("torch is installed in this Python")
    p = subprocess.run([sys.executable, str(CHECK)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    [c] = json.loads(p.stdout.strip().splitlines()[-1])["checks"]
    assert c["name"] == "topk-layout" and c["status"] == "skip" and "torch" in c["detail"]


def _rec(**result: object) -> dict[str, object]:
    return {"returncode": 0, "result": dict(result)}


def test_outcomes(check: ModuleType) -> None:
    assert check.outcome({"timeout": "no result within 5 s"}) == "timeout"
    assert check.outcome({"error": "ModuleNotFoundError: No module named 'pydantic'"}) == "env-error"
    assert check.outcome(_rec(ok=True)) == "correct"
    ima = "indexer forward (top-k write): AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert check.outcome(_rec(ok=False, error=ima)) == "illegal-memory-access"
    assert check.outcome(_rec(ok=False, decode={"mismatch": 6, "rows": 12}, prefill={"mismatch": 0})) == "wrong-rows"
    assert check.outcome(_rec(ok=False, error="reference scores: KeyError: 'decode_write'")) == "fault"


@pytest.mark.parametrize(("kinds", "status", "lead"), [
    ({"tp1": "correct", "tp4": "correct"}, "pass", "read back what they wrote"),
    ({"tp1": "illegal-memory-access", "tp4": "timeout"}, "fail", "breaks the top-k layout (tp1)"),
    ({"tp1": "wrong-rows"}, "fail", "breaks the top-k layout"),
    ({"tp1": "correct", "tp4": "timeout"}, "fail", "inconclusive"),
    ({"tp1": "timeout"}, "fail", "inconclusive"),
    ({"tp1": "fault"}, "fail", "inconclusive"),
    ({}, "fail", "inconclusive"),
])
def test_verdict(check: ModuleType, kinds: dict[str, str], status: str, lead: str) -> None:
    got_status, got_lead = check.verdict(kinds)
    assert got_status == status and lead in got_lead


def test_a_worker_that_times_out_is_inconclusive(check: ModuleType) -> None:
    args = argparse.Namespace(device="cuda", seed=0, vllm_src=None, timeout=0.05)
    rec = check.run_worker(args, "tp1")
    assert check.outcome(rec) == "timeout"
    assert check.verdict({"tp1": check.outcome(rec)})[0] == "fail"
    assert "inconclusive" in check.summarize(rec)
