"""The GPU host's scripts without a GPU or an engine: their shell logic (DRY_RUN) and the record from fake reports.

What the H200 run executes is gpu-runs/gpu-host-serve.sh; here its steps are
walked with every engine-touching command printed instead of run, and
gpu_host.py record is fed reports and signed envelopes made here.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from conftest import REPO
from vllm_hotfix.trust import signing

SCRIPTS = REPO / "gpu-runs"
SERVE = SCRIPTS / "gpu-host-serve.sh"
RECORD = SCRIPTS / "gpu_host.py"


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_scripts_parse(script: str) -> None:
    r = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_shellcheck_finds_no_warning_in_the_serve_scripts() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("no shellcheck on this machine")
    r = subprocess.run(["shellcheck", "-S", "warning", str(SERVE)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout


def _dry(tmp_path: Path, steps: str) -> tuple[list[list[str]], str, Path]:
    parts, out, work = tmp_path / "parts", tmp_path / "out", tmp_path / "work"
    parts.mkdir(exist_ok=True)
    (parts / "SHA256SUMS").write_text("")
    env = {**os.environ, "DRY_RUN": "1", "STEPS": steps, "GPU_HOST_WORK": str(work)}
    r = subprocess.run(["bash", str(SERVE), str(parts), str(out)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    log = (out / "run.log").read_text()
    commands = [shlex.split(line[2:]) for line in log.splitlines() if line.startswith("+ ")]
    return commands, log, out


def _smokes(commands: list[list[str]]) -> dict[str, list[str]]:
    found = {}
    for argv in commands:
        if "smoke" in argv and "build.py" in argv:
            report = argv[argv.index("--report") + 1]
            found[Path(report).stem] = argv
    return found


def test_the_three_smokes_are_the_ones_the_record_needs(tmp_path: Path) -> None:
    commands, log, out = _dry(tmp_path, "cold warm unpatched record")
    smokes = _smokes(commands)
    assert list(smokes) == ["patched-cold", "patched", "unpatched"]
    answers = str(out / "answers.json")
    for which, argv in smokes.items():
        assert "--min-tokens" not in argv
        assert {"--gpu", "require", "--keep-going", "--serve-model"} <= set(argv)
        assert argv[argv.index("--attestation") + 1] == str(out / f"{which}.dsse.json")
        assert Path(argv[argv.index("--sign-key") + 1]).name == "signing-key.pem"
        assert argv[0] == "timeout"
    assert smokes["patched-cold"][smokes["patched-cold"].index("--record-reference") + 1] == answers
    assert "--reference" not in smokes["patched-cold"]
    for which in ("patched", "unpatched"):
        assert smokes[which][smokes[which].index("--reference") + 1] == answers
    assert smokes["unpatched"][smokes["unpatched"].index("--definition") + 1] == "v0.25.1"
    assert smokes["unpatched"][5].endswith(":v0.25.1") and smokes["patched"][5].endswith(":v0.25.1-m3patch")
    # Cold means the compile caches go first; the key stays on the host, its public half in OUTDIR.
    assert ["rm", "-rf", str(tmp_path / "work" / "cache" / "compile")] in commands
    assert (out / "signing-key.pub.pem").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert not (out / "signing-key.pem").exists()
    [record] = [argv for argv in commands if "record" in argv]
    assert {"--patched-cold", "--inputs-from", "--public-key", "--reference", "--base"} <= set(record)
    assert "smoke patched-cold: exit code 0" in log


def test_a_step_whose_report_is_there_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "patched-cold.json").write_text("{}")
    commands, log, _ = _dry(tmp_path, "cold warm")
    assert list(_smokes(commands)) == ["patched"]
    assert "smoke patched-cold: done already" in log
    assert not any(argv[:2] == ["rm", "-rf"] for argv in commands)  # a done cold run keeps the warm caches


def _gpu_host() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_host", RECORD)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _report(image: str, image_id: str, status: str, seconds: float, phases: dict[str, float]) -> dict[str, Any]:
    return {"image": image, "image_id": image_id, "status": status, "gpu_verified": status == "pass",
            "started": f"2026-12-03T10:00:{int(seconds) % 60:02d}Z", "seconds": seconds, "phases": phases,
            "gpu": {"way": "cdi:nvidia.com/gpu=all", "devices": ["NVIDIA H200"], "verified": status == "pass"},
            "environment": {"compile_cache": {"base_id": "b" * 64, "gpu": "nvidia-h200", "host": "/x",
                                              "container": "/root/.cache"}},
            "checks": [{"name": "serve-sweep", "status": status, "detail": "d", "seconds": 1.0}],
            "sweep": {"levels": [], "reference": {"file": "answers.json", "sha256": "ab" * 32}}}


def test_record_from_fake_reports_keeps_phases_and_verifies_attestations(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pub = tmp_path / "signing-key.pub.pem"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    patched_id, base_id = "sha256:" + "a" * 64, "sha256:" + "b" * 64
    reports = {
        "patched-cold": _report("p", patched_id, "pass", 301.5, {"checks": 20.0, "server_start": 188.0}),
        "patched": _report("p", patched_id, "pass", 97.25, {"checks": 12.0, "server_start": 36.0, "sweep": 40.0}),
        "unpatched": _report("b", base_id, "fail", 150.0, {"checks": 12.0, "gpu_checks": 30.0}),
    }
    args = []
    for which, report in reports.items():
        (tmp_path / f"{which}.json").write_text(json.dumps(report))
        envelope = signing.sign(signing.statement({report["image"]: report["image_id"]}, report), key)
        (tmp_path / f"{which}.dsse.json").write_bytes(envelope)
        args += ["--attestation", f"{which.replace('-', '_')}={tmp_path / f'{which}.dsse.json'}"]

    def record(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(RECORD), "record", str(tmp_path / "record.json"), "--no-engine",
                               "--patched", str(tmp_path / "patched.json"),
                               "--patched-cold", str(tmp_path / "patched-cold.json"),
                               "--unpatched", str(tmp_path / "unpatched.json"), "--public-key", str(pub), *extra],
                              capture_output=True, text=True, timeout=60)

    r = record(*args)
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "record.json").read_text())
    assert rec["images"]["patched"]["phases"] == {"checks": 12.0, "server_start": 36.0, "sweep": 40.0}
    assert rec["result"]["patched"][0].startswith(
        "pass (GPU-verified); smoke 97.2 s (at or under the 120 s target); phases: checks 12.0 s, "
        "server_start 36.0 s, sweep 40.0 s; compile cache bbbbbbbbbbbb/nvidia-h200")
    assert "smoke 301.5 s (over the 120 s target)" in rec["result"]["patched_cold"][0]
    signed = rec["images"]["unpatched"]["attestation"]
    assert signed["file"] == "unpatched.dsse.json" and signed["verified"] is True
    assert signed["key_id"] == signing.key_id(key.public_key()) and signed["status"] == "fail"
    assert set(rec["inputs"]["reports"]) == {"patched", "patched_cold", "unpatched"}
    assert rec["gpu_devices"] == ["NVIDIA H200"]

    # An envelope of another run (here: the warm run's, offered as the cold one's) is refused.
    (tmp_path / "record.json").unlink()
    swapped = [a.replace("patched_cold=" + str(tmp_path / "patched-cold.dsse.json"),
                         "patched_cold=" + str(tmp_path / "patched.dsse.json")) for a in args]
    r = record(*swapped)
    assert r.returncode == 2 and "not the verdict of that run" in r.stderr
    assert not (tmp_path / "record.json").exists()
    # An envelope signed with another key is refused too.
    other = ec.generate_private_key(ec.SECP256R1())
    report = reports["patched"]
    (tmp_path / "patched.dsse.json").write_bytes(signing.sign(signing.statement({"p": patched_id}, report), other))
    r = record(*args)
    assert r.returncode == 2 and "signed with another key" in r.stderr
