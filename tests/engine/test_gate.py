"""Integration tier: the push gate cannot be fooled, and registries that need a login work.

Real engine, real stand-in images, real registries (one behind htpasswd basic
auth, with credentials stored by a real `docker login` in a private
DOCKER_CONFIG). Journal entries are edited here only the way a person with
write access to build/records could edit them.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from conftest import STANDIN_REPO, Registry, RegistryPlace, Result, cli, derive, fails, key_pair, site_key
from vllm_hotfix.engine import Engine
from vllm_hotfix.errors import PushError
from vllm_hotfix.journal import records
from vllm_hotfix.registry import client as registry
from vllm_hotfix.registry.write import Repo, Writer
from vllm_hotfix.trust import policy
from vllm_hotfix.verdicts import Check, Status, Verdict, judge


@pytest.fixture
def auth_registry(tmp_path: Path) -> Iterator[Registry]:
    (tmp_path / "auth").mkdir()
    reg = Registry(tmp_path / "auth", user="ops", password="s3cret-pw")
    reg.start()
    yield reg
    reg.stop()


def edit_entry(path: Path, **changes: object) -> None:
    """Change a journal entry the way a person with write access to build/records could."""
    data = json.loads(path.read_text())
    data.update(changes)
    path.write_text(json.dumps(data))


def docker_login(reg: Registry, config: Path) -> None:
    config.mkdir(parents=True, exist_ok=True)
    assert reg.auth is not None
    user, password = reg.auth
    subprocess.run(["docker", "login", reg.addr, "-u", user or "", "--password-stdin"], input=password or "",
                   text=True, capture_output=True, check=True, env=dict(os.environ, DOCKER_CONFIG=str(config)))


def test_push_to_a_registry_that_needs_a_login(built: tuple[Path, str, str], auth_registry: Registry,
                                               tmp_path: Path) -> None:
    project, ref, image_id = built
    dest = f"{auth_registry.addr}/ops"

    # No credentials at all: one line naming the registry, and the login hint.
    empty = tmp_path / "no-login"
    empty.mkdir()
    r = cli("push", ref, "--registry", dest, "--allow-gpu-unverified", root=project,
            env={"DOCKER_CONFIG": str(empty)})
    fails(r, auth_registry.addr, "refused the credentials")
    assert r.rc == 8 and f"hint: docker login {auth_registry.addr}" in r.err

    # Stored but wrong (a stale login): same message.
    wrong = tmp_path / "wrong-login"
    wrong.mkdir()
    token = base64.b64encode(b"ops:not-the-password").decode()
    (wrong / "config.json").write_text(json.dumps({"auths": {auth_registry.addr: {"auth": token}}}))
    r = cli("push", ref, "--registry", dest, "--allow-gpu-unverified", root=project,
            env={"DOCKER_CONFIG": str(wrong)})
    fails(r, auth_registry.addr, "refused the credentials")
    assert "not-the-password" not in r.err + r.out
    assert records.pushes(project, image_id) == []

    # After `docker login`: lands, is confirmed through the engine, and is recorded.
    good = tmp_path / "login"
    docker_login(auth_registry, good)
    start = time.monotonic()
    r = cli("push", ref, "--registry", dest, "--allow-gpu-unverified", root=project,
            env={"DOCKER_CONFIG": str(good)})
    took = time.monotonic() - start
    assert r.rc == 0, r.err
    digest = r.out.split()[-1]
    [entry] = records.pushes(project, image_id)
    assert entry.data["digest"] == digest
    print(f"push to the authenticated registry took {took:.2f} s")
    name = ref.split("/")[-1].split(":")[0]
    resp = requests.get(f"http://{auth_registry.addr}/v2/ops/{name}/manifests/v0.25.1-m3patch",
                        auth=("ops", "s3cret-pw"), timeout=10,
                        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"})
    assert resp.status_code == 200 and resp.headers["Docker-Content-Digest"] == digest
    for path in (project / "build" / "records").rglob("*.json"):
        assert "s3cret-pw" not in path.read_text()


def test_relabelled_unpatched_image_fails_smoke_and_push(
    engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, unique: str
) -> None:
    project, ref, image_id = built
    info = engine.image(image_id)
    assert info is not None
    labels = dict(info.labels)
    base_id = labels["io.vllm-hotfix.base.id"]
    # Claim the unpatched file hashes are the expected ones.
    unpatched = records.builds_of_image(project, image_id)[0].data["files"]
    labels["io.vllm-hotfix.files"] = json.dumps({rel: v["original_sha256"] for rel, v in unpatched.items()})
    fake = f"hotfix-test/relabelled-{unique}:x"
    body = "LABEL " + " ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items()))
    fake_id = derive(engine, base_id, fake, body.replace("$", "\\$"))
    try:
        r = cli("smoke", fake, root=project)
        # The base's layers alone under the patched image's labels: not the patch set's product (exit 14).
        fails(r, "not the product of definition v0.25.1", "0 layer(s) over the base; the builder writes 1")
        assert r.rc == 14
        # Even with the failing verdict edited into a pass (the patched image's checks copied in, so that the
        # journal's verdict meets the policy), the push re-checks the files.
        entry = records.verdicts(project, fake_id)[0].path
        checks = json.loads(records.verdicts(project, image_id)[0].path.read_text())["checks"]
        edit_entry(entry, status="pass", gpu_verified=True, checks=checks)
        r = cli("push", fake, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        fails(r, "refusing to push", "layer-identity", "0 layer(s) over the base")
        assert r.rc == 8
    finally:
        engine.remove_image(fake)


def test_edited_verdict_pointing_at_the_unpatched_base_is_refused(
    engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, unique: str
) -> None:
    project, ref, image_id = built
    verdict = records.verdicts(project, image_id)[0]
    info = engine.image(image_id)
    assert info is not None
    base_id = info.labels["io.vllm-hotfix.base.id"]
    forged = verdict.path.with_name("99999999999999999999-forged.json")
    forged.write_bytes(verdict.path.read_bytes())
    edit_entry(forged, image_id=base_id, gpu_verified=True, status="pass", seq=99999999999999999999)
    alias = f"hotfix-test/base-alias-{unique}:x"
    engine.tag(base_id, alias)
    try:
        r = cli("push", alias, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        fails(r, "refusing to push", "layer-identity", "cannot tell what it is the product of")
        assert r.rc == 8
        name = alias.split("/")[1].split(":")[0]
        assert requests.get(registry.api(f"ops/{name}/tags/list"), timeout=5).status_code == 404
    finally:
        engine.untag(alias)


def test_a_push_whose_base_this_host_cannot_find_is_refused_as_unchecked_not_as_a_difference(
    engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace
) -> None:
    """The definition pins a base this host lacks (its tag here names another image): the re-check knows nothing
    against the image, so the gate refuses (8, nothing pushed) saying its files could not be re-checked here, and
    does not send a sound image to be rebuilt."""
    project, ref, image_id = built
    path = project / "images" / "v0.25.1.toml"
    pinned = "sha256:" + "0" * 64
    path.write_text(path.read_text().replace("\n[package]", f'\n[base.digests]\n"linux/amd64" = "{pinned}"\n\n'
                                                             "[package]", 1))
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
    fails(r, f"refusing to push {ref} ({image_id[:19]}): its files could not be re-checked on this host: "
             "layer-identity: no base to compare it with", f"definition v0.25.1 pins {pinned}")
    assert r.rc == 8 and "hint: nothing is known against the image" in r.err and "rebuild" not in r.err, r.err
    name = ref.split("/")[-1].split(":")[0]
    assert requests.get(registry.api(f"ops/{name}/tags/list"), timeout=5).status_code == 404


def test_a_patch_set_this_host_cannot_load_leaves_identity_incomplete_in_smoke_and_push(
    engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace
) -> None:
    """The project's patch file damaged on this host after a passing build: layer identity cannot be judged, which
    says nothing of the image. Smoke ends incomplete (11, no fail of the image recorded), and the push gate refuses
    (8) saying its files could not be re-checked, not that they differ."""
    project, ref, image_id = built
    (project / "patches" / "v0.25.1" / "0001-minimax-m3-topk-buffer-layout.patch").write_text("not a patch\n")
    r = cli("smoke", ref, "--gpu", "off", root=project)
    assert r.rc == 11 and "incomplete layer-identity" in r.err, r.err
    assert "cannot compare it with what the builder writes for definition v0.25.1" in r.last_error, r.err
    assert not [v for v in records.verdicts(project, image_id) if v.verdict.status == "fail"]
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
    fails(r, "its files could not be re-checked on this host: layer-identity: cannot compare it with what the "
             "builder writes", "patches/v0.25.1: ")
    assert r.rc == 8 and "rebuild" not in r.err, r.err


def test_a_later_failing_verdict_on_a_shared_image_id_closes_the_gate(
    engine: Engine, base_v0251: str, project: Path, registry: RegistryPlace, unique: str, tmp_path: Path
) -> None:
    ref = f"hotfix-test/shared-{unique}:v0.25.1-m3patch"
    # The assemble builder gives the same image ID for the same inputs, so a --rebuild (which takes
    # nothing from the engine's build cache) writes a second build record for the same image.
    r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", "--builder", "assemble", root=project)
    assert r.rc == 0, r.err
    image_id = r.out.split()[-1]
    try:
        r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", "--rebuild", "--no-smoke",
                "--builder", "assemble", root=project)
        assert r.rc == 0 and r.out.split()[-1] == image_id, r.err
        assert len(records.builds_of_image(project, image_id)) == 2
        # A later smoke run of that image fails for real: the stand-in has no `vllm serve`.
        model = tmp_path / "model"
        model.mkdir()
        r = cli("smoke", ref, "--serve-model", str(model), "--concurrency", "1", "--requests", "1", root=project)
        assert r.rc == 7, r.err
        r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        fails(r, "failed its newest smoke run")
        # ...and `image` says why it does not reuse it.
        r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", "--no-smoke", "--builder",
                "assemble",
                root=project)
        assert r.rc == 0, r.err
        assert "its newest smoke verdict" in r.err and "failed" in r.err
    finally:
        engine.remove_image(ref)


def test_tag_equal_to_the_base_or_a_foreign_image_is_refused(
    engine: Engine, base_v0251: str, project: Path, unique: str
) -> None:
    r = cli("image", "--definition", "v0.25.1", "--tag", f"{STANDIN_REPO}:v0.25.1", "--pull", "never", "--no-smoke",
            root=project)
    fails(r, "is the base's own reference")
    assert r.rc == 13  # a refusal, with a code of its own
    assert engine.image(f"{STANDIN_REPO}:v0.25.1").id == base_v0251  # type: ignore[union-attr]
    foreign = f"hotfix-test/foreign-{unique}:x"
    foreign_id = derive(engine, base_v0251, foreign, "LABEL owner=someone-else")
    try:
        r = cli("image", "--definition", "v0.25.1", "--tag", foreign, "--pull", "never", "--no-smoke", root=project)
        fails(r, foreign, "this tool did not build")
        assert r.rc == 13
        assert engine.image(foreign).id == foreign_id  # type: ignore[union-attr]
        r = cli("image", "--definition", "v0.25.1", "--tag", foreign, "--pull", "never", "--no-smoke", "--force",
                root=project)
        assert r.rc == 0, r.err
        assert engine.image(foreign).id != foreign_id  # type: ignore[union-attr]
    finally:
        engine.remove_image(foreign)
        engine.remove_untagged(foreign_id)


def test_unwritable_records_stop_before_any_effect(engine: Engine, base_v0251: str, project: Path,
                                                   unique: str, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    out = f"hotfix-test/norecord-{unique}:x"
    r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", root=project,
            env={"VLLM_HOTFIX_RECORDS": str(blocker / "records")})
    fails(r, "records folder", "not writable")
    assert r.rc == 10
    assert engine.image(out) is None


def _parallel(n: int, fn: object) -> list[Result]:
    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(fn, range(n)))  # type: ignore[arg-type]


def test_eight_parallel_runs_lose_no_entry(engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace,
                                           unique: str) -> None:
    project, ref, image_id = built
    before = {k: len(records.load(project, k)) for k in records.KINDS}
    # The assemble builder: eight rebuilds of the same inputs make one image (no build cache is taken, and
    # the Dockerfile builder would leave seven untagged images behind).
    builds = _parallel(8, lambda i: cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never",
                                        "--rebuild", "--no-smoke", "--builder", "assemble", root=project))
    made = {r.out.split()[-1] for r in builds if r.rc == 0 and r.out.strip()} - {image_id}
    try:
        assert all(r.rc == 0 for r in builds), [r.err for r in builds if r.rc]
        assert len(made) == 1
        smokes = _parallel(8, lambda i: cli("smoke", ref, root=project))
        assert all(r.rc == 0 for r in smokes), [r.err for r in smokes if r.rc]
        pushes = _parallel(8, lambda i: cli("push", ref, "--registry", f"{registry.place}/ops{i}",
                                            "--allow-gpu-unverified", root=project))
        assert all(r.rc == 0 for r in pushes), [r.err for r in pushes if r.rc]
        after = {k: len(records.load(project, k)) for k in records.KINDS}
        counts = {k: after[k] - before[k] for k in records.KINDS}
        print(f"entries added by 8 parallel image, smoke and push runs: {counts}")
        assert counts["build"] == 8 and counts["verdict"] == 8 and counts["push"] == 8 and counts["tag"] == 8
    finally:
        # The session's image gets its tag back; what these runs made goes.
        engine.tag(image_id, ref)
        for other in made:
            engine.remove_image(other)


def test_registry_client_uses_the_stored_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Basic auth against a real htpasswd registry, with what `docker login` stored; the secret never shown."""
    (tmp_path / "reg").mkdir()
    reg = Registry(tmp_path / "reg", user="ops", password="plat-s3cret")
    reg.start()
    try:
        eng = Engine.connect()
        assert not eng.registry_secure(reg.addr)  # loopback: the engine itself talks plain HTTP to it
        empty = tmp_path / "no-login"
        empty.mkdir()
        monkeypatch.setenv("DOCKER_CONFIG", str(empty))
        with pytest.raises(PushError, match="refused the credentials") as refused:
            registry.read_index(eng, f"{reg.addr}/ops/absent:v1")
        assert refused.value.hint == f"docker login {reg.addr}"
        login = tmp_path / "login"
        login.mkdir()
        subprocess.run(["docker", "login", reg.addr, "-u", "ops", "--password-stdin"], input="plat-s3cret",
                       text=True, capture_output=True, check=True, env=dict(os.environ, DOCKER_CONFIG=str(login)))
        monkeypatch.setenv("DOCKER_CONFIG", str(login))
        assert registry.read_index(eng, f"{reg.addr}/ops/absent:v1") is None  # past the login: a plain 404
        # Push scope too: the registry reads the index and refuses it for its unknown child, not for the login.
        kid = registry.Child("sha256:" + "d" * 64, registry.DOCKER_MANIFEST, 10, "linux", "arm64")
        with pytest.raises(PushError, match="refused the manifest ops/absent:v1") as bad:
            Writer(Repo(registry.Client(reg.addr, secure=False, credentials=("ops", "plat-s3cret")),
                        "ops/absent")).put_manifest("v1", *registry.index_body([kid]))
        assert "plat-s3cret" not in str(bad.value)
    finally:
        reg.stop()


def test_a_tag_naming_an_image_with_a_signed_pass_moves_only_with_replace(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, unique: str, tmp_path: Path) -> None:
    """Another image pushed under a tag whose image passed, signed: refused (13) unless --replace, which says what
    it replaces (was: replaced without a word, and verify then found no verdict, 21)."""

    project, ref, image_id = built
    key = tmp_path / "site.key"
    site_key(key)
    assert cli("smoke", ref, "--sign-key", str(key), root=project).rc == 0
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0 and len(json.loads(r.out)["attestations"]) == 1, r.err
    first = json.loads(r.out)
    # The same patch set built by the other builder: another image that passed its smoke, under the same name.
    other = f"hotfix-test/{unique}/{ref.split('/')[-1]}"
    r = cli("image", "--definition", "v0.25.1", "--tag", other, "--pull", "never", "--builder", "assemble",
            root=project)
    assert r.rc == 0, r.err
    other_id = r.out.split()[-1]
    try:
        assert other_id != image_id
        r = cli("push", other, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        fails(r, "refusing to push over", first["ref"], image_id[:19], "1 signed verdict(s) saying pass")
        assert r.rc == 13 and "--replace" in r.err
        assert engine.registry_digest(first["ref"]) == first["digest"]  # the tag still names the signed image
        r = cli("push", other, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", "--replace",
                root=project)
        assert r.rc == 0 and f", replacing {first['ref']}" in r.out, r.err
        # The image now there has no signed pass: moving the tag back needs no word.
        r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", root=project)
        assert r.rc == 0 and "replacing" not in r.out, r.err
    finally:
        engine.remove_image(other)


def _key_pair(folder: Path) -> tuple[str, str]:
    """A signing key (mode 0600) and its public key, as PEM files."""
    private, public, _ = key_pair(folder)
    return str(private), str(public)


def test_the_attestation_gate_asks_a_policy_of_the_signed_verdicts(
        built: tuple[Path, str, str], registry: RegistryPlace, auth_registry: Registry, tmp_path: Path) -> None:
    project, ref, _image_id = built
    key, pub = _key_pair(tmp_path)
    envelope = tmp_path / "verdict.dsse.json"
    r = cli("smoke", ref, "--sign-key", key, "--attestation", str(envelope), root=project)
    assert r.rc == 0, r.err
    dest = f"{registry.place}/ops"
    # A pass without answers (no GPU checks, no sweep, no exact-levels) is no deploy pass by default.
    r = cli("push", "--definition", "v0.25.1",
            ref, "--registry", dest, "--require-attestation", pub, "--attestation", str(envelope),
            root=project)
    assert r.rc == 24 and "covers what the policy requires" in r.last_error and "pushing" not in r.err, r.err
    # A policy naming another definition, or one that requires nothing: nothing is pushed.
    r = cli("push", ref, "--registry", dest, "--require-attestation", pub, "--attestation", str(envelope),
            "--allow-gpu-unverified", "--definition", "v0.26.0", root=project)
    assert r.rc == 24 and "definition v0.25.1, not v0.26.0" in r.last_error, r.err
    empty = tmp_path / "empty.json"
    empty.write_text("{}")
    r = cli("push", ref, "--registry", dest, "--require-attestation", pub, "--policy", str(empty), root=project)
    assert r.rc == 64 and "requires nothing" in r.last_error, r.err
    r = cli("push", ref, "--registry", dest, "--definition", "v0.25.1", root=project)
    assert r.rc == 64 and "give --require-attestation" in r.last_error, r.err
    name = ref.rsplit("/", 1)[-1].split(":")[0]
    assert requests.get(registry.api(f"ops/{name}/tags/list"), timeout=5).status_code == 404
    # A target registry whose verdicts cannot be read (no login): the registry's fault (8), not a refusal (24).
    r = cli("push", "--definition", "v0.25.1",
            ref, "--registry", f"{auth_registry.addr}/ops", "--require-attestation", pub,
            "--attestation", str(envelope), "--allow-gpu-unverified", root=project,
            env={"DOCKER_CONFIG": str(tmp_path / "no-login")})
    assert r.rc == 8 and "cannot read the signed verdicts beside" in r.last_error, r.err
    # What the policy allows goes through, on the host's proved facts.
    r = cli("push", ref, "--registry", dest, "--require-attestation", pub, "--attestation", str(envelope),
            "--allow-gpu-unverified", "--definition", "v0.25.1", root=project)
    assert r.rc == 0 and "GPU-unverified (" in r.err and "accepted under --allow-gpu-unverified" in r.err, r.err


def _gpu_run(base: Verdict, *, fail: tuple[str, ...] = (), skip: tuple[str, ...] = (),
             absent: tuple[str, ...] = ()) -> Verdict:
    """``base`` (the image's own CPU smoke in the journal) as a GPU host's full smoke: its host checks as they
    were, the GPU checks, the sweep, exact-levels at the full schedule, the golden with its coverage and a signed
    reference passed, unless said otherwise."""
    entry = {"judged": 800, "positions": 1536}
    extra = {
        "gpu": None, **{name: None for name in policy.GPU_CHECKS}, "serve-sweep": None,
        "exact-levels": {"levels": [{"concurrency": c, "requests": 32} for c in policy.LEVELS]},
        "golden": {"coverage": {"levels": {str(c): dict(entry) for c in policy.LEVELS},
                                "classes": {"short": dict(entry), "long": dict(entry)}}},
        "reference": None}
    # A GPU host's image has its compiled files (the stand-in's lack them: a skip there).
    checks = [c for c in base.checks if c.name not in extra and c.name != "compiled-files"]
    for name, data in extra.items():
        if name not in absent:
            status = Status.FAIL if name in fail else Status.SKIP if name in skip else Status.PASS
            checks.append(Check(name, status, "as a GPU host judged it", data=data, ran_against="vllm"))
    return judge(base.image, base.image_id, checks, gpu_verified=not fail, gpu={"devices": ["NVIDIA H100"]},
                 started=records.now_iso(), seconds=60)


def test_the_journal_gate_asks_the_default_policy(built: tuple[Path, str, str], registry: RegistryPlace) -> None:
    project, ref, image_id = built
    own = records.verdicts(project, image_id)[0].verdict
    dest = f"{registry.place}/ops"
    # A GPU pass whose golden was skipped, or whose reference was never checked: refused.
    for skipped in ("golden", "reference"):
        records.append_verdict(project, _gpu_run(own, skip=(skipped,)))
        r = cli("push", ref, "--registry", dest, "--dry-run", root=project)
        fails(r, "refusing to push", f"left out {skipped} skip")
        assert "re-checking the files" not in r.err
    # A full smoke whose exact-levels failed, then the same image smoked again without --serve-model: refused,
    # naming the older fail and what clears it.
    failed = records.append_verdict(project, _gpu_run(own, fail=("exact-levels",)))
    records.append_verdict(project, _gpu_run(own, skip=("serve-sweep",), absent=("exact-levels", "golden",
                                                                                  "reference")))
    r = cli("push", ref, "--registry", dest, "--dry-run", root=project)
    fails(r, "refusing to push", failed.path.name, "exact-levels", "does not clear it")
    assert "every check the failing run ran" in r.err.splitlines()[-1], r.err
    assert "re-checking the files" not in r.err
    # A run of the same scope that passed clears it: the gate lets it through to the re-check of its files (which
    # then refuses the stand-in's GPU-verified claim: it lacks the compiled files a GPU host's image has).
    records.append_verdict(project, _gpu_run(own))
    r = cli("push", ref, "--registry", dest, "--dry-run", root=project)
    assert "re-checking the files" in r.err and "compiled-files: its verdict says GPU-verified" in r.last_error, r.err
