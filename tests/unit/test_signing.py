"""Signed verdicts: DSSE envelopes checked by an independent implementation, and every way to refuse one."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from securesystemslib.dsse import Envelope
from securesystemslib.signer import SSlibKey

from conftest import REPO
from vllm_hotfix.errors import AttestationError, AttestationMismatch, AttestationTampered, AttestationWrongKey
from vllm_hotfix.trust import policy, signing
from vllm_hotfix.verdicts import FORMAT

IMAGE_ID = "sha256:" + "ab" * 32
# What a full smoke's checks carry: the golden's coverage (half of every level and class judged), the schedule.
_JUDGED = {"judged": 768, "positions": 1536}
_DATA = {"golden": {"coverage": {"levels": {str(c): _JUDGED for c in policy.LEVELS},
                                 "classes": {"short": _JUDGED, "long": _JUDGED}}},
         "exact-levels": {"levels": [{"concurrency": c, "requests": 32} for c in policy.LEVELS]}}
# A full smoke's signed predicate: every check of the definition's plan passed, on one H200, the host having proved
# the image the product of v0.25.1 (nothing claimed by its labels).
REPORT = {"format": FORMAT, "image_id": IMAGE_ID, "status": "pass", "gpu_verified": True,
          "gpu": {"devices": ["NVIDIA H200"]}, "definition": "v0.25.1", "claimed": {},
          "checks": [{"name": name, "status": "pass", **({"data": _DATA[name]} if name in _DATA else {})}
                     for name in policy.FULL_SMOKE]}


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _signed(key: ec.EllipticCurvePrivateKey, report: dict[str, object] = REPORT,
            at: str = "2026-12-05T10:00:00.000000Z") -> bytes:
    doc = signing.statement({"ops/vllm-openai:v0.25.1-m3patch": IMAGE_ID}, {**report, "signed_at": at})
    return signing.sign(doc, key)


def _private(path: Path, data: bytes) -> Path:
    """A private key file as people keep one: readable by its owner alone."""
    path.write_bytes(data)
    path.chmod(0o600)
    return path


def _public(path: Path, key: ec.EllipticCurvePrivateKey) -> Path:
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return path


def test_an_independent_dsse_implementation_verifies_the_envelope() -> None:
    key = _key()
    data = _signed(key)
    envelope = Envelope.from_dict(json.loads(data))
    public = SSlibKey.from_crypto(key.public_key(), keyid=signing.key_id(key.public_key()),
                                  scheme="ecdsa-sha2-nistp256")
    assert list(envelope.verify([public], 1)) == [public.keyid]
    doc = json.loads(envelope.payload)
    assert doc["_type"] == "https://in-toto.io/Statement/v1"
    assert doc["subject"] == [{"name": "ops/vllm-openai:v0.25.1-m3patch", "digest": {"sha256": "ab" * 32}}]
    assert doc["predicate"]["status"] == "pass" and doc["predicate"]["signed_at"] == "2026-12-05T10:00:00.000000Z"
    # And what it signs, ours reads back.
    found = signing.open_envelope(data, key.public_key(), "x")
    assert found.digests == {IMAGE_ID} and found.predicate["checks"] == REPORT["checks"]


def test_a_wrong_key_is_named_as_such() -> None:
    data = _signed(_key())
    with pytest.raises(AttestationWrongKey, match="signed with another key"):
        signing.open_envelope(data, _key().public_key(), "verdict.json")


def test_a_tampered_payload_does_not_verify() -> None:
    key = _key()
    envelope = json.loads(_signed(key, {**REPORT, "status": "fail"}))
    doc = json.loads(base64.b64decode(envelope["payload"]))
    doc["predicate"]["status"] = "pass"
    envelope["payload"] = base64.b64encode(json.dumps(doc).encode()).decode()
    with pytest.raises(AttestationTampered, match="verdict.json: the signature does not match"):
        signing.open_envelope(json.dumps(envelope).encode(), key.public_key(), "verdict.json")
    with pytest.raises(AttestationTampered, match="not a DSSE envelope"):
        signing.open_envelope(b"{}", key.public_key(), "verdict.json")


def test_the_subject_is_checked() -> None:
    key = _key()
    found = signing.open_envelope(_signed(key), key.public_key(), "v")
    signing.require_subject(found, {IMAGE_ID, "sha256:" + "cd" * 32}, "img", "v")
    with pytest.raises(AttestationMismatch, match="another image"):
        signing.require_subject(found, {"sha256:" + "ef" * 32}, "img", "v")


def test_keys_from_files_and_the_environment_never_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = _key()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    pub = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    _private(tmp_path / "k.pem", pem)
    monkeypatch.setenv("HOTFIX_PUB", pub.decode())
    loaded = signing.load_private_key(str(tmp_path / "k.pem"))
    assert signing.key_id(loaded.public_key()) == signing.key_id(signing.load_public_key("env:HOTFIX_PUB"))
    # An RSA-looking or garbled key: one line naming the source, never its content.
    _private(tmp_path / "bad.pem", pem[:60] + b"SECRETSECRET" + pem[60:])
    with pytest.raises(AttestationError) as info:
        signing.load_private_key(str(tmp_path / "bad.pem"))
    assert str(tmp_path / "bad.pem") in str(info.value) and "SECRET" not in str(info.value)
    with pytest.raises(AttestationError, match=r"\$NOPE: the variable is not set"):
        signing.load_public_key("env:NOPE")
    with pytest.raises(AttestationError, match="cannot read it"):
        signing.load_public_key(str(tmp_path / "missing.pem"))
    with pytest.raises(AttestationError, match="not a PEM public key"):
        signing.load_public_key(str(tmp_path / "k.pem"))
    encrypted = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.BestAvailableEncryption(b"pw"))
    _private(tmp_path / "enc.pem", encrypted)
    with pytest.raises(AttestationError, match="VLLM_HOTFIX_SIGN_KEY_PASSWORD"):
        signing.load_private_key(str(tmp_path / "enc.pem"))
    monkeypatch.setenv(signing.PASSWORD_ENV, "pw")
    assert signing.load_private_key(str(tmp_path / "enc.pem")).curve.name == "secp256r1"


def test_verify_a_signed_verdict_file_offline(tmp_path: Path) -> None:
    from conftest import cli

    key = _key()
    (tmp_path / "k.pub").write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                                  serialization.PublicFormat.SubjectPublicKeyInfo))
    (tmp_path / "v.dsse.json").write_bytes(_signed(key))
    args = ["--attestation", str(tmp_path / "v.dsse.json"), "--key", str(tmp_path / "k.pub")]
    r = cli("verify", "--definition", "v0.25.1", IMAGE_ID, *args, "--require-gpu", "NVIDIA H200", root=tmp_path)
    assert r.rc == 0 and "signed pass" in r.out and "GPU-verified on NVIDIA H200" in r.out, r.err
    r = cli("verify", "--definition", "v0.25.1", "sha256:" + "cd" * 32, *args, root=tmp_path)
    assert r.rc == 24 and "another image" in r.err
    r = cli("verify", "--definition", "v0.25.1", "ops/vllm:v1", *args, root=tmp_path)
    assert r.rc == 64 and "the image's ID" in r.err


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660])
def test_a_signing_key_others_may_read_is_refused_as_ssh_refuses_it(tmp_path: Path, mode: int) -> None:
    key = _private(tmp_path / "site.key", _key().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key.chmod(mode)
    with pytest.raises(AttestationError, match=f"others may read it \\(mode {mode:04o}\\)") as info:
        signing.load_private_key(str(key))
    assert info.value.hint == f"chmod 600 {key}"
    # smoke refuses it before anything runs (here: no engine at all).
    from conftest import cli

    r = cli("smoke", "ops/vllm:fix", "--sign-key", str(key), root=tmp_path)
    assert r.rc == 20 and "others may read it" in r.last_error, r.err
    key.chmod(0o400)
    assert signing.load_private_key(str(key)).curve.name == "secp256r1"


def test_verify_takes_several_keys_and_names_the_one_that_signed(tmp_path: Path) -> None:
    from conftest import cli

    site, other = _key(), _key()
    folder = tmp_path / "trusted"
    folder.mkdir()
    _public(folder / "a-other.pem", other)
    _public(folder / "b-site.pub", site)
    (folder / "README").write_text("not a key")
    envelope = tmp_path / "v.dsse.json"
    envelope.write_bytes(_signed(site))
    r = cli("verify", "--definition", "v0.25.1",
            IMAGE_ID, "--attestation", str(envelope), "--key", str(folder), "--json", root=tmp_path)
    assert r.rc == 0, r.err
    assert json.loads(r.out)["key"] == str(folder / "b-site.pub")
    lone = _public(tmp_path / "other.pub", other)
    r = cli("verify", "--definition", "v0.25.1", IMAGE_ID, "--attestation", str(envelope), "--key", str(lone),
            "--key", str(folder / "b-site.pub"), root=tmp_path)
    assert r.rc == 0 and f"signed pass by key {folder / 'b-site.pub'}" in r.out, r.err
    r = cli("verify", "--definition", "v0.25.1",
            IMAGE_ID, "--attestation", str(envelope), "--key", str(lone), "--key", str(lone),
            root=tmp_path)
    assert r.rc == 22 and "signed with another key" in r.err
    empty = tmp_path / "empty"
    empty.mkdir()
    r = cli("verify", "--definition", "v0.25.1",
            IMAGE_ID, "--attestation", str(envelope), "--key", str(empty), root=tmp_path)
    assert r.rc == 20 and "holds no *.pem or *.pub file" in r.err


def test_the_newest_signed_verdict_decides_and_a_tie_is_refused(tmp_path: Path) -> None:
    from conftest import cli

    key = _key()
    pub = _public(tmp_path / "k.pub", key)
    older = tmp_path / "older-pass.dsse.json"
    newer = tmp_path / "newer-fail.dsse.json"
    older.write_bytes(_signed(key, REPORT, "2026-12-05T10:00:00.000000Z"))
    newer.write_bytes(_signed(key, {**REPORT, "status": "fail"}, "2026-12-05T11:00:00.000000Z"))
    r = cli("verify", "--definition", "v0.25.1",
            IMAGE_ID, "--attestation", str(older), "--attestation", str(newer), "--key", str(pub),
            root=tmp_path)
    assert r.rc == 24, r.err
    [line] = [x for x in r.err.splitlines() if x.startswith("error:")]
    assert str(newer) in line and "'fail', not a pass" in line and str(older) in line and "does not count" in line
    # The other way round the pass is the newest, and it stands.
    older.write_bytes(_signed(key, {**REPORT, "status": "fail"}, "2026-12-05T10:00:00.000000Z"))
    newer.write_bytes(_signed(key, REPORT, "2026-12-05T11:00:00.000000Z"))
    assert cli("verify", "--definition", "v0.25.1",
               IMAGE_ID, "--attestation", str(older), "--attestation", str(newer), "--key", str(pub),
               root=tmp_path).rc == 0
    # Two signed at the same instant: neither is the newest.
    older.write_bytes(_signed(key, {**REPORT, "gpu_verified": False}, "2026-12-05T11:00:00.000000Z"))
    r = cli("verify", "--definition", "v0.25.1",
            IMAGE_ID, "--attestation", str(older), "--attestation", str(newer), "--key", str(pub),
            root=tmp_path)
    assert r.rc == 25 and "at the same instant" in r.err, r.err
    # The same statement given twice is one verdict, not a tie.
    assert cli("verify", "--definition", "v0.25.1",
               IMAGE_ID, "--attestation", str(newer), "--attestation", str(newer), "--key", str(pub),
               root=tmp_path).rc == 0
    # A verdict that does not say when it was signed cannot be told the newest.
    undated = tmp_path / "undated.dsse.json"
    undated.write_bytes(signing.sign(signing.statement({"x": IMAGE_ID}, REPORT), key))
    r = cli("verify", "--definition", "v0.25.1",
            IMAGE_ID, "--attestation", str(undated), "--key", str(pub), root=tmp_path)
    assert r.rc == 25 and "carries no signed time" in r.err


def _in_child(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``code`` in a child Python with a time limit: a read that hangs must fail the test, not hold the suite."""
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=30,
                          cwd=str(REPO))


def test_a_fifo_is_no_key_and_no_reference(tmp_path: Path) -> None:
    fifo = tmp_path / "key.pem"
    os.mkfifo(fifo, 0o600)
    for code, needle in (
        ("import sys; from vllm_hotfix.trust import signing; signing.load_private_key(sys.argv[1])",
         "signing key {}: not a regular file"),
        ("import sys; from vllm_hotfix.trust import signing; signing.load_public_key(sys.argv[1])",
         "public key {}: not a regular file"),
        ("import sys; from pathlib import Path; from vllm_hotfix.inimage import reference; "
         "reference.load(Path(sys.argv[1]))", "--reference {}: not a regular file"),
    ):
        r = _in_child(code, str(fifo))
        assert r.returncode != 0 and needle.format(fifo) in r.stderr, r.stderr


def test_a_signing_key_another_user_owns_is_refused(tmp_path: Path) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root to give the file to another user")
    key = tmp_path / "key.pem"
    key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    key.chmod(0o600)
    assert signing.load_private_key(str(key)) is not None  # this user's own: signs
    os.chown(key, 12345, 12345)
    with pytest.raises(AttestationError, match=r"owned by user 12345, not by this user \(0\)"):
        signing.load_private_key(str(key))


def test_a_public_key_given_to_sign_is_named_a_public_key(tmp_path: Path) -> None:
    from conftest import cli

    public = _public(tmp_path / "site.pub", _key())
    public.chmod(0o644)  # as public keys are: the mode's refusal would have sent the user to chmod it
    r = cli("smoke", "ops/vllm:fix", "--sign-key", str(public), root=tmp_path)
    assert r.rc == 20, r.err
    assert f"signing key {public}: it is a public key" in r.last_error, r.err
    assert "others may read" not in r.err and "chmod" not in r.err
