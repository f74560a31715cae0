"""The runner without an image: pure-Python P-256 against cryptography and securesystemslib, a job run
with this Python, and the results read back as launchers read them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from securesystemslib.dsse import Envelope
from securesystemslib.signer import SSlibKey

from vllm_hotfix.checking.launchers import base
from vllm_hotfix.checking.runner import p256
from vllm_hotfix.errors import SmokeError
from vllm_hotfix.trust import signing

IMAGE_ID = "sha256:" + "cd" * 32


def test_rfc6979_p256_sha256_vector() -> None:
    # RFC 6979 A.2.5, P-256 with SHA-256, message "sample".
    import hashlib

    x = 0xC9AFA9D845BA75166B5C215767B1D6934E50C3DB36E89B127B8A622B120F6721
    digest = hashlib.sha256(b"sample").digest()
    assert p256.nonce(x, digest) == 0xA6E3C57DD01ABE90086538398355DD4C3B17AA873382B0F24D6129493D8AAD60
    assert p256.sign_digest(x, digest) == (
        0xEFD48B2AACB6A8FD1140DD9CD45E81D69D2C877B56AAF991C34D0EA84EAF3716,
        0xF7CB1C942D657C41D436C7A1B6E29F65F3E900DBB9AFF4064DC4AB2F843ACDA8,
    )


@pytest.mark.parametrize("fmt", [serialization.PrivateFormat.PKCS8, serialization.PrivateFormat.TraditionalOpenSSL])
def test_runner_envelope_verifies_with_signing_and_securesystemslib(fmt: serialization.PrivateFormat) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, fmt, serialization.NoEncryption())
    secret = p256.load_private(pem)
    assert secret == key.private_numbers().private_value
    assert p256.key_id(secret) == signing.key_id(key.public_key())
    doc = p256.statement({"ops/vllm:fix": IMAGE_ID}, {"status": "pass", "gpu_verified": False})
    data = p256.sign_envelope(doc, secret)
    # Laid out as the host's signing lays it out, and deterministic.
    assert data == p256.sign_envelope(doc, secret)
    found = signing.open_envelope(data, key.public_key(), "runner envelope")
    assert found.digests == {IMAGE_ID} and found.predicate["status"] == "pass"
    envelope = Envelope.from_dict(json.loads(data))
    public = SSlibKey.from_crypto(key.public_key(), keyid=signing.key_id(key.public_key()),
                                  scheme="ecdsa-sha2-nistp256")
    assert list(envelope.verify([public], 1)) == [public.keyid]
    ours = json.loads(data)
    theirs = json.loads(signing.sign(doc, key))
    assert ours["payload"] == theirs["payload"] and ours.keys() == theirs.keys()


def test_keys_the_runner_cannot_use_are_refused_without_showing_them() -> None:
    other = ec.generate_private_key(ec.SECP384R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    with pytest.raises(p256.UnusableKey, match="not an ECDSA P-256 key"):
        p256.load_private(other)
    encrypted = ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.BestAvailableEncryption(b"pw"))
    with pytest.raises(p256.UnusableKey, match="encrypted"):
        p256.load_private(encrypted)
    with pytest.raises(p256.UnusableKey, match="not a PEM private key"):
        p256.load_private(b"hello")


def _job(**more: object) -> dict[str, object]:
    return {"image": "ops/vllm:fix", "image_id": IMAGE_ID, "launcher": "test", "env_names": [], "pins": None,
            "cpu_checks": [], "gpu": {"mode": "off"}, "serve": None, "sign": None, "probe_timeout": 60,
            "checks": [{"name": "patch-landed", "status": "pass", "detail": "read from the layers"}], **more}


def _run(folder: Path) -> subprocess.CompletedProcess[str]:
    # -I: nothing of this checkout on sys.path, as in an image; the folder alone must do.
    return subprocess.run([sys.executable, "-I", str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=120, cwd=folder)


def test_staged_runner_runs_alone_and_signs(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    key_file = tmp_path / "k.pem"
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    folder = tmp_path / "runner"
    sign = {"key": str(folder / base.KEY_FILE), "subjects": {"ops/vllm:fix": IMAGE_ID},
            "predicate": {"definition": "v0.25.1-m3patch"}}
    base.stage(folder, _job(sign=sign), key=key_file)
    assert oct((folder / base.KEY_FILE).stat().st_mode & 0o777) == "0o600"
    done = _run(folder)
    assert done.returncode == 0, done.stderr
    launched = base.results(done.stdout, done.stderr, "test runner")
    v = launched.verdict
    assert v.image_id == IMAGE_ID and v.status.value == "pass", v.checks
    names = [c.name for c in v.checks]
    assert names[0] == "patch-landed" and "env-report" in names and names[-2:] == ["gpu", "serve-sweep"]
    assert v.gpu["mode"] == "off" and v.gpu_verified is False
    assert launched.envelope is not None
    found = signing.open_envelope(launched.envelope, key.public_key(), "runner")
    assert found.predicate["definition"] == "v0.25.1-m3patch"
    assert found.predicate["status"] == "pass" and found.predicate["image_id"] == IMAGE_ID


def test_gpu_require_without_a_gpu_is_incomplete(tmp_path: Path) -> None:
    folder = base.stage(tmp_path / "runner", _job(gpu={"mode": "require", "request": "cdi:nvidia.com/gpu=all"}))
    done = _run(folder)
    v = base.results(done.stdout, done.stderr, "test runner").verdict
    gpu = next(c for c in v.checks if c.name == "gpu")
    assert gpu.status.value == "incomplete" and "cdi:nvidia.com/gpu=all sees no GPU" in gpu.detail
    assert v.status.value == "incomplete"


def test_bad_job_and_no_report_are_one_line(tmp_path: Path) -> None:
    folder = base.stage(tmp_path / "runner", _job())
    (folder / "job.json").write_text("[]")
    done = _run(folder)
    assert done.returncode == 2 and "not a version 1 runner job" in done.stderr
    with pytest.raises(SmokeError, match=r"runner in x: the runner gave no report \(boom\)"):
        base.results("", "boom\n", "runner in x")


def test_compiled_files_the_image_lacks_keep_it_gpu_unverified(tmp_path: Path) -> None:
    missing = ["vllm/_C.abi3.so", "vllm/_moe_C.abi3.so (the base's)"]
    folder = base.stage(tmp_path / "runner", _job(gpu={"mode": "auto", "request": "none",
                                                       "compiled_missing": missing}))
    done = _run(folder)
    v = base.results(done.stdout, done.stderr, "test runner").verdict
    check = next(c for c in v.checks if c.name == "compiled-files")
    assert check.status.value == "skip" and "image is GPU-unverified" in check.detail
    assert (check.data or {})["answered_by"] == "filesystem" and (check.data or {})["missing"] == missing
    assert v.gpu_verified is False and v.gpu["compiled_missing"] == missing
    assert "2 compiled file(s)" in v.gpu["why_unverified"]


def test_compiled_files_missing_fail_under_require_with_a_gpu_reached() -> None:
    from vllm_hotfix.checking.runner.main import Run

    run = Run(_job(gpu={"mode": "require", "compiled_missing": ["vllm/_C.abi3.so"]}))
    gpu: dict[str, object] = {"mode": "require", "verified": True, "devices": ["NVIDIA H200"]}
    assert run.compiled_stop(True, gpu) is False
    assert gpu["verified"] is False and run.checks[-1].name == "compiled-files"
    assert run.checks[-1].status.value == "fail" and run.checks[-1].detail.startswith("--gpu require, but 1")
    # Nothing missing: the GPU checks' own answer stands.
    assert Run(_job(gpu={"mode": "require"})).compiled_stop(True, {}) is True


def test_the_job_carries_the_compiled_files_the_file_facts_found(tmp_path: Path) -> None:
    from vllm_hotfix.checking.launchers import plan
    from vllm_hotfix.checking.smoke import SmokeOptions

    target = plan.Target("ops/vllm:fix", IMAGE_ID, IMAGE_ID, {})
    job, _ = plan.job(tmp_path, target, SmokeOptions(), launcher="podman", gpu_request=None,
                      compiled_missing=["vllm/_C.abi3.so"])
    assert job["gpu"]["compiled_missing"] == ["vllm/_C.abi3.so"]


def test_the_runner_leaves_no_scratch_folder(tmp_path: Path) -> None:
    """Run on a host (as these tests do), the runner's own scratch folder goes with it (12 were left per unit run)."""
    folder = tmp_path / "runner"
    base.stage(folder, _job())
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-I", str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=120, cwd=folder, env={"TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stderr
    assert list(scratch.iterdir()) == []


def test_staging_folders_of_gone_processes_are_swept(tmp_path: Path) -> None:
    """A run killed mid-smoke leaves its staging folder (with a key copy, when signing): the next run removes it."""
    from vllm_hotfix.journal import leftovers

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{leftovers.STAGING}pytest-run-1-{gone.pid}-abcd_123"
    live = tmp_path / f"{leftovers.staging_prefix()}efgh_456"
    other = tmp_path / "vllm-hotfix-runner-abcdefgh"  # no owner in its name: not the sweep's to judge
    for d in (dead, live, other):
        (d / "runner").mkdir(parents=True)
        (d / "runner" / base.KEY_FILE).write_text("key")
    assert leftovers.sweep_staging(tmp_path) == 1
    assert not dead.exists() and live.exists() and other.exists()
