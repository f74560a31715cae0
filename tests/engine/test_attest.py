"""Signed verdicts end to end: signed by smoke, attached by push, checked by verify and by another host's push."""

from __future__ import annotations

import base64
import json
import shutil
from dataclasses import replace
from pathlib import Path

from conftest import RegistryPlace, cli, key_pair
from vllm_hotfix.engine import Engine, split_reference
from vllm_hotfix.journal import records
from vllm_hotfix.registry import client as registry_client
from vllm_hotfix.trust import attest, referrers, signing
from vllm_hotfix.verdicts import Check, Status


def _keys(folder: Path, name: str) -> tuple[str, str]:
    private, public, _ = key_pair(folder, name)
    return str(private), str(public)


def _checkout(project: Path, where: Path) -> Path:
    """The project's definitions and patch sets without its journal: another host's checkout."""
    for part in ("images", "patches"):
        shutil.copytree(project / part, where / part)
    return where


def test_signed_verdict_travels_with_the_image(
    engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path
) -> None:
    project, ref, image_id = built
    key, pub = _keys(tmp_path, "site")
    _other_key, other_pub = _keys(tmp_path, "other")
    envelope = tmp_path / "verdict.dsse.json"
    r = cli("smoke", ref, "--sign-key", key, "--attestation", str(envelope), root=project)
    assert r.rc == 0, r.err
    assert "signed verdict" in r.err and key not in r.out + r.err.replace(f"--sign-key {key}", "")
    statement = json.loads(base64.b64decode(json.loads(envelope.read_text())["payload"]))
    assert statement["subject"][0]["digest"]["sha256"] == image_id.removeprefix("sha256:")
    assert statement["predicate"]["status"] == "pass" and statement["predicate"]["patches"]

    dest = f"{registry.place}/ops"
    r = cli("push", ref, "--registry", dest, "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    pushed = json.loads(r.out)
    assert len(pushed["attestations"]) == 1
    target = pushed["ref"]

    # Checked from the registry alone, with no journal (another checkout of the project, as on another host).
    elsewhere = _checkout(project, tmp_path / "elsewhere")
    r = cli("verify", "--definition", "v0.25.1", target, "--key", pub, "--allow-gpu-unverified", root=elsewhere)
    assert r.rc == 0, r.err
    assert f"verified {target} {pushed['digest']}" in r.out
    # The default policy is the definition's full smoke: a CPU host's pass (no GPU checks, no sweep, no
    # exact-levels) covers none of it.
    r = cli("verify", "--definition", "v0.25.1", target, "--key", pub, root=elsewhere)
    assert r.rc == 24 and "covers what the policy requires" in r.last_error and "gpu-torch not run" in r.last_error
    # The signed predicate names what this host proved: the definition, its patch set's digest, the base it found.
    assert statement["predicate"]["definition"] == "v0.25.1" and statement["predicate"]["claimed"]["definition"]
    proved = statement["predicate"]["patch_set"]["digest"]
    r = cli("verify", target, "--key", pub, "--allow-gpu-unverified", "--definition", "v0.25.1", "--json",
            root=elsewhere)
    assert r.rc == 0, r.err
    found = {f["requirement"]: f["found"] for f in json.loads(r.out)["found"]}
    assert found["definition v0.25.1"] == "v0.25.1" and found[f"patch-set digest {proved}"] == proved
    # The runbook's deployment gate: on this CPU host's verdict, no GPU product can be met.
    r = cli("verify", target, "--key", pub, "--definition", "v0.25.1", "--require-gpu", "NVIDIA H200",
            "--max-age", "7d", root=elsewhere)
    assert r.rc == 24 and "gpu-torch not run" in r.last_error, r.err
    deploy = tmp_path / "deploy.toml"
    deploy.write_text(f'allow_gpu_unverified = true\ndefinition = "v0.25.1"\npatch_set_digest = "{proved}"\n'
                      'max_age = "1d"\n')
    r = cli("verify", target, "--key", pub, "--policy", str(deploy), root=elsewhere)
    assert r.rc == 0 and "GPU-unverified, accepted under --allow-gpu-unverified" in r.out, r.err
    # The checkout's patch set changed: its digest is no longer the one the host proved.
    with (elsewhere / "patches/v0.25.1/series").open("a") as fh:
        fh.write("# a comment changes no patch\n")
    assert cli("verify", target, "--key", pub, "--allow-gpu-unverified", "--definition", "v0.25.1",
               root=elsewhere).rc == 0
    series = elsewhere / "patches/v0.25.1/series"
    [name] = [line for line in series.read_text().splitlines() if line and not line.startswith("#")]
    (series.parent / name).rename(series.parent / f"renamed-{name}")
    series.write_text(f"renamed-{name}\n")
    r = cli("verify", target, "--key", pub, "--allow-gpu-unverified", "--definition", "v0.25.1", root=elsewhere)
    assert r.rc == 24 and "not sha256:" in r.last_error and "patch-set digest" in r.last_error, r.err
    (series.parent / f"renamed-{name}").rename(series.parent / name)  # as it was: the definition's product again
    series.write_text(f"{name}\n")
    # A registry that cannot be read: nothing was judged, the registry's code (8), never the policy's refusal.
    r = cli("verify", "--definition", "v0.25.1", "127.0.0.1:9/ops/vllm-openai:nothing", "--key", pub, root=elsewhere)
    assert r.rc == 8 and "cannot read its signed verdicts" in r.last_error, r.err
    r = cli("verify", "--definition", "v0.25.1", target, "--key", other_pub, "--allow-gpu-unverified", root=elsewhere)
    assert r.rc == 22 and "signed with another key" in r.err
    r = cli("verify", "--definition", "v0.25.1",
            target, "--key", pub, "--allow-gpu-unverified", "--require-gpu", "H200", root=elsewhere)
    assert r.rc == 24 and "not on H200" in r.err

    # The host that pushes need not be the one that ran smoke: a signed verdict and the key suffice.
    r = cli("push", "--definition", "v0.25.1",
            ref, "--registry", f"{registry.place}/second", "--require-attestation", pub,
            "--attestation", str(envelope), "--allow-gpu-unverified", root=elsewhere)
    assert r.rc == 0, r.err
    r = cli("push", "--definition", "v0.25.1",
            ref, "--registry", f"{registry.place}/third", "--require-attestation", other_pub,
            "--attestation", str(envelope), "--allow-gpu-unverified", root=elsewhere)
    assert r.rc == 22, r.err
    # Nothing given: the signed verdicts beside the image's registry copies (the engine's repo digests) travel.
    r = cli("push", "--definition", "v0.25.1",
            ref, "--registry", f"{registry.place}/third", "--require-attestation", pub,
            "--allow-gpu-unverified", root=elsewhere)
    assert r.rc == 0 and "attached the signed verdict from" in r.err, r.err

    # A tampered envelope (fail edited into pass, or the payload swapped) is named as such.
    doc = json.loads(envelope.read_text())
    inner = json.loads(base64.b64decode(doc["payload"]))
    inner["predicate"]["gpu_verified"] = True
    doc["payload"] = base64.b64encode(json.dumps(inner).encode()).decode()
    tampered = tmp_path / "tampered.dsse.json"
    tampered.write_text(json.dumps(doc))
    r = cli("push", "--definition", "v0.25.1",
            ref, "--registry", f"{registry.place}/third", "--require-attestation", pub,
            "--attestation", str(tampered), root=elsewhere)
    assert r.rc == 23 and "does not match its content" in r.err
    # On the host whose journal holds the signed pass the tampered file given is refused all the same, named,
    # and nothing goes to the registry (it went through on the journal's pass and was attached).
    r = cli("push", "--definition", "v0.25.1",
            ref, "--registry", f"{registry.place}/fourth", "--require-attestation", pub,
            "--attestation", str(tampered), "--allow-gpu-unverified", root=project)
    assert r.rc == 23 and str(tampered) in r.err, r.err
    assert cli("verify", "--definition", "v0.25.1", f"{registry.place}/fourth/{ref.split('/')[-1]}", "--key", pub,
               "--allow-gpu-unverified", root=elsewhere).rc != 0
    r = cli("verify", "--definition", "v0.25.1",
            target, "--key", pub, "--allow-gpu-unverified", "--attestation", str(tampered), root=elsewhere)
    assert r.rc == 23 and str(tampered) in r.err, r.err


def test_a_signed_verdict_of_another_image_lets_nothing_through(
    engine: Engine, built: tuple[Path, str, str], base_v0251: str, registry: RegistryPlace, tmp_path: Path
) -> None:
    project, ref, _image_id = built
    key, pub = _keys(tmp_path, "site")
    envelope = tmp_path / "base.dsse.json"
    # A verdict signed for the unpatched base (its smoke fails the patch checks, but it is signed all the same).
    cli("smoke", base_v0251, "--definition", "v0.25.1", "--sign-key", key, "--attestation", str(envelope),
        root=project)
    assert envelope.exists()
    r = cli("push", "--definition", "v0.25.1", ref, "--registry", f"{registry.place}/ops", "--require-attestation", pub,
            "--attestation", str(envelope), "--allow-gpu-unverified", root=_checkout(project, tmp_path / "elsewhere"))
    assert r.rc == 24 and "another image" in r.err


def test_image_without_signed_verdicts_and_bad_keys(built: tuple[Path, str, str], registry: RegistryPlace,
                                                    tmp_path: Path) -> None:
    project, ref, _image_id = built
    _key, pub = _keys(tmp_path, "site")
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    target = json.loads(r.out)["ref"]
    (tmp_path / "x").mkdir()
    r = cli("verify", "--definition", "v0.25.1", target, "--key", pub, root=tmp_path / "x")
    assert r.rc == 21 and "no signed verdict" in r.err
    (tmp_path / "garbage.pub").write_text("-----BEGIN PUBLIC KEY-----\nnot a key\n-----END PUBLIC KEY-----\n")
    r = cli("verify", "--definition", "v0.25.1", target, "--key", str(tmp_path / "garbage.pub"), root=tmp_path / "x")
    assert r.rc == 20 and "garbage.pub: not a PEM public key" in r.err
    r = cli("smoke", ref, "--sign-key", "env:HOTFIX_NO_SUCH_KEY", root=project)
    assert r.rc == 20 and "$HOTFIX_NO_SUCH_KEY" in r.err
    # A run the host could not finish (no GPU here) judged nothing, so nothing is signed.
    key, _pub = _keys(tmp_path, "gpu")
    envelope = tmp_path / "gpu.dsse.json"
    r = cli("smoke", ref, "--gpu", "require", "--sign-key", key, "--attestation", str(envelope), root=project)
    assert r.rc == 11 and not envelope.exists(), r.err


def _statuses(engine: Engine, ref: str) -> list[str]:
    """The status of every signed verdict beside ``ref`` (HOST/PATH:TAG) in its registry, read back over HTTP."""
    repo, tag = split_reference(ref)
    host, path = registry_client.split_repo(repo)
    client = registry_client.client_for(engine, host)
    manifest = client.manifest(path, tag)
    assert manifest is not None
    return sorted(json.loads(base64.b64decode(json.loads(data)["payload"]))["predicate"]["status"]
                  for _artifact, data in referrers.envelopes(client, path, manifest.digest))


def test_a_fail_beside_the_staging_copy_travels_with_the_promoted_image(
    engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path
) -> None:
    """Promoted from staging to another registry, the image takes every signed verdict of its copies along, pass and
    fail: a gate on signed verdicts sees the fail another host attached beside the staging copy, and the promoted
    copy carries both, so verify there refuses it too."""
    project, ref, image_id = built
    key, pub = _keys(tmp_path, "site")
    passed = tmp_path / "pass.dsse.json"
    assert cli("smoke", ref, "--sign-key", key, "--attestation", str(passed), root=project).rc == 0
    r = cli("push", ref, "--registry", f"{registry.place}/staging", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    staged = json.loads(r.out)
    # Another host judged the staging copy later and failed it: its signed fail stands beside that copy only.
    [entry] = [v for v in records.verdicts(project, image_id) if v.verdict.passed][:1]
    failed = replace(entry.verdict, status=Status.FAIL, started=records.now_iso(),
                     checks=(*entry.verdict.checks, Check("serve-sweep", Status.FAIL, "wrong answers at 4")))
    other = _checkout(project, tmp_path / "other")
    subjects = signing.subjects(staged["ref"], image_id, [f"{split_reference(staged['ref'])[0]}@{staged['digest']}"])
    _kept, envelope = attest.sign(other, failed, {}, subjects, key)
    attest.attach_and_read_back(engine, f"{split_reference(staged['ref'])[0]}@{staged['digest']}", envelope)
    assert _statuses(engine, staged["ref"]) == ["fail", "pass"]

    # A host with neither journal nor the fail's file promotes the staging copy it pulled, given the older pass:
    # the fail beside staging decides.
    elsewhere = _checkout(project, tmp_path / "elsewhere")
    engine.pull(staged["ref"])
    try:
        r = cli("push", "--definition", "v0.25.1",
                staged["ref"], "--registry", f"{registry.place}/final", "--require-attestation", pub,
                "--attestation", str(passed), "--allow-gpu-unverified", root=elsewhere)
    finally:
        engine.untag(staged["ref"])
    assert r.rc == 24 and "fail" in r.last_error, r.err
    # The build host's journal gate lets it through on its pass; the promoted copy carries both verdicts, and its
    # dry run says so first (it counted the journal's pass alone).
    r = cli("push", ref, "--registry", f"{registry.place}/final", "--allow-gpu-unverified", "--dry-run", root=project)
    assert r.rc == 0 and "and attach 2 signed verdict(s): " in r.out, r.out + r.err
    r = cli("push", ref, "--registry", f"{registry.place}/final", "--allow-gpu-unverified", "--dry-run", "--json",
            root=project)
    assert r.rc == 0 and len(json.loads(r.out)["attestations"]) == 2, r.out
    r = cli("push", ref, "--registry", f"{registry.place}/final", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    promoted = json.loads(r.out)
    assert _statuses(engine, promoted["ref"]) == ["fail", "pass"]
    assert len(promoted["attestations"]) == 2
    r = cli("verify", "--definition", "v0.25.1",
            promoted["ref"], "--key", pub, "--allow-gpu-unverified", root=elsewhere)
    assert r.rc == 24, r.err
