"""gpu-runs/gpu_host.py: the record's sentences come from the reports, reused inputs must hash the same."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

from conftest import REPO
from vllm_hotfix.checking import sweep

SCRIPT = REPO / "gpu-runs" / "gpu_host.py"


def _gpu_host() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_host", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _level(c: int, evidence: list[sweep.RequestEvidence]) -> sweep.Level:
    level = sweep.Level(c, len(evidence), per_request=evidence, wall_s=1.0)
    sweep.summarise(level)
    return level


def _report(levels: list[sweep.Level], failed: int | None) -> dict[str, Any]:
    result = sweep.SweepResult("http://x", "/model", levels, failed_level=failed,
                               reference={"file": "ref.json", "sha256": "ab" * 32, "prompts": 24,
                                          "tolerance_nats": 0.5})
    status = "fail" if failed else "pass"
    return {"image": "img:x", "image_id": "sha256:1", "status": status, "gpu_verified": True, "seconds": 90.0,
            "checks": [{"name": "serve-sweep", "status": status, "detail": "d", "seconds": 40.0}],
            "sweep": json.loads(json.dumps(result.to_dict()))}


def ok(c: int, i: int, **kw: Any) -> sweep.RequestEvidence:
    base = dict(http_status=200, latency_s=0.1, prompt_tokens=20, reply_tokens=32, finish_reason="length",
                reply_sha256="0" * 64, judged_by="reference", passed=True)
    return sweep.RequestEvidence(c, i, i, **{**base, **kw})  # type: ignore[arg-type]


def test_sentences_are_derived_from_the_evidence() -> None:
    host = _gpu_host()
    patched = _report([_level(1, [ok(1, 0), ok(1, 1)]),
                       _level(16, [ok(16, 0), ok(16, 1, divergence=4, gap_nats=0.21)])], None)
    unpatched = _report([_level(1, [ok(1, 0), ok(1, 1, passed=False, divergence=0, reply_tokens=1,
                                                 finish_reason="stop", error="wrong answer"),
                                    sweep.RequestEvidence(1, 2, 2, 500, 0.2, error="HTTP 500")])], 1)
    lines = host.image_sentences(host._image(patched))
    assert lines[0].startswith("pass (GPU-verified); smoke 90.0 s; phases: not reported; serve sweep pass, "
                               "judged by reference answers ref.json")
    assert lines[1] == ("concurrency 1: 2/2 passed; HTTP status 200 2; replies of 32 tokens (finish_reason length 2); "
                        "judged by reference 2; 0 wrong answer(s); 0 near-tie(s)")
    assert lines[2].endswith("0 wrong answer(s); 1 near-tie(s) (widest 0.210 nats)")
    lines = host.image_sentences(host._image(unpatched))
    assert "failed at concurrency 1" in lines[0]
    assert lines[1] == ("concurrency 1: 1/3 passed; HTTP status 200 2, 500 1; replies of 1-32 tokens "
                        "(finish_reason length 1, stop 1); judged by reference 2, status 1; "
                        "1 wrong answer(s) (first divergence at token 0); 0 near-tie(s)")
    # Evidence travels as rows under named columns, one per request, and reads back the same.
    level = host._image(unpatched)["serve"]["levels"][0]
    assert level["per_request"]["columns"][0] == "level" and len(level["per_request"]["rows"]) == 3
    failed = asdict(sweep.RequestEvidence(1, 2, 2, 500, 0.2, error="HTTP 500"))
    assert host._rows_to_evidence(level)["per_request"][2] == failed


def test_inputs_are_refused_when_their_hash_changed(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    kept = tmp_path / "inputs.json"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(SCRIPT), "inputs", "--model", str(model), *args],
                              capture_output=True, text=True, timeout=60)

    r = run("--write", str(kept))
    assert r.returncode == 0, r.stderr
    assert json.loads(kept.read_text())["inputs"]["model"]["files"] == 2
    assert run("--check", str(kept)).returncode == 0
    (model / "model.safetensors").write_bytes(b"\1" * 64)
    r = run("--check", str(kept))
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: model {model}: sha256 ") and f"but {kept} was made with" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
