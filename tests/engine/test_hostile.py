"""Hostile images and releases: one `error:` line, the documented exit code, nothing left behind.

The inputs are real images built on top of the stand-in base, and a release
PyPI does not have.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, Product, RegistryPlace, cli, derive, fails, free_port
from vllm_hotfix.building import standin
from vllm_hotfix.engine import Engine

CACHE = {"VLLM_HOTFIX_CACHE": str(REPO / "build" / "cache")}


def _definition_python(project: Path, python: str) -> None:
    toml = project / "images/v0.25.1.toml"
    toml.write_text(toml.read_text().replace('name = "vllm"', f'name = "vllm"\npython = "{python}"'))


FAKE_PY = b"""#!/bin/sh
# Answers like a broken interpreter: keeps the probe container alive, prints {} to probes.
case "$2" in *time.sleep*) exec python3 "$@";; esac
echo '{}'
"""
HANGING_PY = b"""#!/bin/sh
case "$2" in *time.sleep*) exec python3 "$@";; esac
sleep 3600
"""


@pytest.mark.parametrize("python, script, needle", [
    ("sh", None, "exited at once"),
    ("/usr/local/bin/fakepy", FAKE_PY, "answered without python"),
    ("/usr/local/bin/fakepy", HANGING_PY, "timed out after 3 s"),
])
def test_base_whose_python_misbehaves(engine: Engine, base_v0251: str, project: Path, unique: str,
                                      python: str, script: bytes | None, needle: str) -> None:
    repo = f"hotfix-test/oddpython-{unique}"
    if script is not None:
        derive(engine, base_v0251, f"{repo}:v0.25.1", "COPY fakepy /usr/local/bin/fakepy", {"fakepy": script},
               {"fakepy": 0o755})
    else:
        engine.tag(base_v0251, f"{repo}:v0.25.1")
    _definition_python(project, python)
    try:
        r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--tag", f"{repo}:out", "--pull", "never",
                root=project, env={"VLLM_HOTFIX_PROBE_TIMEOUT": "3"})
        fails(r, needle)
        assert r.rc == 4
        assert engine.image(f"{repo}:out") is None
    finally:
        info = engine.image(f"{repo}:v0.25.1")
        engine.untag(f"{repo}:v0.25.1")
        if info is not None and script is not None:
            engine.remove_untagged(info.id)


def test_unknown_release_from_the_wheel_is_an_upstream_error(tmp_path: Path) -> None:
    r = cli("check-upstream", "--patches", "v0.25.1", "--base", "v0.99.0", "--from-wheel",
            env={"VLLM_HOTFIX_CACHE": str(tmp_path / "cache")})
    fails(r, "cannot download vllm==0.99.0")
    assert r.rc == 9


def test_standin_never_replaces_an_image_that_is_not_one(engine: Engine, base_v0251: str, unique: str) -> None:
    ref = f"hotfix-test/precious-{unique}:v1"
    rootfs = standin.ROOTFS_REF  # present once any stand-in exists; has no stand-in label
    engine.tag(rootfs, ref)
    try:
        r = cli("standin", "--version", "0.25.1", "--ref", ref, env=CACHE)
        fails(r, ref, "not a stand-in")
        assert r.rc == 4
        assert engine.image(ref).id == engine.image(rootfs).id  # type: ignore[union-attr]
    finally:
        engine.untag(ref)


@pytest.mark.parametrize("built_on", ["0.25.1", "0.26.0"])
def test_standin_never_replaces_an_image_built_on_one(engine: Engine, base_v0251: str, base_v0260: str,
                                                      unique: str, built_on: str) -> None:
    # A hotfix image made on a stand-in inherits its labels, the same version's or another's; only the
    # stand-in itself (its own top layer) may be replaced or taken as present.
    ref = f"hotfix-test/onstandin-{unique}:v1"
    base = base_v0251 if built_on == "0.25.1" else base_v0260
    made = derive(engine, base, ref, "COPY fix.py /opt/fix.py", {"fix.py": b"FIXED = True\n"})
    same = f"hotfix-test/standin-copy-{unique}:v1"
    engine.tag(base_v0251, same)
    try:
        r = cli("standin", "--version", "0.25.1", "--ref", ref, env=CACHE)
        fails(r, ref, "not a stand-in (it is built on one")
        assert r.rc == 4
        assert engine.image(ref).id == made  # type: ignore[union-attr]
        kept = cli("standin", "--version", "0.25.1", "--ref", same, env=CACHE)
        assert kept.rc == 0 and "already present" in kept.err, kept.err
    finally:
        engine.untag(same)
        engine.remove_image(ref)
        engine.remove_image(made)  # by ID: what a replacing stand-in took the tag from


def test_smoke_of_an_image_not_in_the_engine_is_a_missing_image(engine: Engine, unique: str) -> None:
    ref = f"hotfix-test/nosuch-{unique}:1"
    r = cli("smoke", ref)
    fails(r, f"'{ref}'", "is not in the engine")
    assert r.rc == 4  # nothing was checked, so no check failed (7)
    assert "smoke 1/5" not in r.err


def test_rebuild_does_not_take_the_engines_build_cache(engine: Engine, base_v0251: str, project: Path,
                                                       unique: str) -> None:
    out = f"hotfix-test/nocache-{unique}:t"
    made: list[str] = []
    try:
        for _ in range(2):
            r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", "--rebuild",
                    root=project)
            assert r.rc == 0, r.err
            assert "Using cache" not in r.err
            made.append(r.out.split()[-1])
        assert made[0] != made[1]
    finally:
        # The first lost its tag to the second: both are this test's. Removed by ID, so that the steps
        # they were built from go with them.
        for image_id in made:
            engine.remove_image(image_id)


def _odd_runner_python(engine: Engine, base: str, project: Path, unique: str, name: str, runner: bytes) -> Product:
    """The patch set built over a base whose python3 misbehaves only as the runner is started (``-I``)."""
    wrapper = b"#!/bin/sh\ncase \"$1\" in -I) " + runner + b" ;; esac\nexec /usr/bin/python3 \"$@\"\n"
    return Product(engine, base, project, f"hotfix-test/{name}-{unique}", "COPY python3 /usr/local/bin/python3",
                   {"python3": wrapper}, {"python3": 0o755})


def test_an_image_whose_python_gives_the_runner_no_voice_fails_on_record(
        engine: Engine, base_v0251: str, project: Path, unique: str) -> None:
    """The runner is the image's own Python: one that prints garbage is the image's failing, recorded as such."""
    from vllm_hotfix.journal import records
    from vllm_hotfix.verdicts import Status

    made = _odd_runner_python(engine, base_v0251, project, unique, "mutepython", b"echo 'not a verdict'; exit 3")
    ref, derived = made.ref, made.image_id
    try:
        r = cli("smoke", ref, "--gpu", "off", root=project)
        fails(r, "smoke failed", "runner")
        assert r.rc == 7
        assert "the runner gave no report" in r.err
        [entry] = records.verdicts(project, derived)
        assert entry.verdict.status is Status.FAIL
        checks = {c.name: c.status for c in entry.verdict.checks}
        assert checks["layer-identity"] is Status.PASS and checks["patch-landed"] is Status.PASS
    finally:
        made.drop()


@pytest.mark.parametrize("platform", ["all", "linux/amd64,linux/arm64"])
def test_every_platform_from_a_registry_that_does_not_answer_fails(engine: Engine, base_v0251: str, project: Path,
                                                                   unique: str, platform: str) -> None:
    """--platform all (or two) with the base in the engine but its registry down: never one platform, exit 0."""
    repo = f"127.0.0.1:{free_port()}/hostile-{unique}"
    engine.tag(base_v0251, f"{repo}:v0.25.1")
    out = f"hotfix-test/every-platform-{unique}:x"
    try:
        r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--platform", platform, "--tag", out,
                "--no-smoke", root=project)
        fails(r, f"--platform {platform}", f"cannot read {repo}:v0.25.1 from its registry")
        assert r.rc == 4
        assert engine.image(out) is None and engine.image(f"{out}-x86_64") is None
        r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--platform", platform, "--pull", "never",
                "--tag", out, "--no-smoke", root=project)
        fails(r, f"--platform {platform}", "--pull never")
        assert r.rc == 64
    finally:
        engine.untag(f"{repo}:v0.25.1")


def test_push_of_an_image_not_in_the_engine_is_a_missing_image(engine: Engine, unique: str) -> None:
    """As under smoke: exit 4 with a hint (it was 8, the push gate's code, with none)."""
    ref = f"hotfix-test/nosuch-{unique}:1"
    r = cli("push", ref, "--registry", "127.0.0.1:5000/ops")
    fails(r, f"'{ref}'", "is not in the engine")
    assert r.rc == 4 and "hint: build it with `image`" in r.err


def test_smoke_through_podman_of_an_image_podman_lacks_is_a_missing_image(unique: str) -> None:
    import shutil

    if shutil.which("podman") is None:
        pytest.skip("podman is not installed")
    ref = f"hotfix-test/nosuch-{unique}:1"
    r = cli("smoke", ref, "--launcher", "podman")
    fails(r, f"podman has no image {ref}")
    # Neither podman nor the Docker engine has it, so there is nothing the tool could move into podman's store.
    assert r.rc == 4 and "nor the journal had it to move there" in r.err and "podman pull" in r.err, r.err


def test_a_base_from_elsewhere_on_an_older_engine_says_nothing_of_platform_all(engine: Engine, base_v0251: str,
                                                                              project: Path, unique: str) -> None:
    """`image --base-repo X` without --platform on a 20.10 engine: no word of a --platform all nobody asked for."""
    if engine.api_version >= (1, 45):
        pytest.skip(f"the default engine is {engine.version_text}; this is about engines that lose platforms")
    repo = f"127.0.0.1:{free_port()}/elsewhere-{unique}"
    r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--no-smoke", "--tag", f"hotfix-test/x-{unique}:1",
            root=project)
    assert r.rc == 4, r.err
    assert "--platform" not in r.err and "building for its own platform only" in r.err, r.err


def _signing_key(folder: Path, public: bool = False) -> str:
    """A P-256 key pair in ``folder``: the private key's path, or the public one's."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    made = ec.generate_private_key(ec.SECP256R1())
    key, pub = folder / "site.key", folder / "site.pub"
    key.write_bytes(made.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    key.chmod(0o600)  # a signing key others may read is refused
    pub.write_bytes(made.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return str(pub if public else key)


def test_push_refuses_an_attestation_about_another_image(built: tuple[Path, str, str], base_v0251: str,
                                                          registry: RegistryPlace, tmp_path: Path) -> None:
    """push IMAGE --attestation F where F names the unpatched base: refused before the push (it went out, exit 0)."""
    import json

    project, ref, image_id = built
    envelope = tmp_path / "base.dsse.json"
    cli("smoke", base_v0251, "--definition", "v0.25.1", "--sign-key", _signing_key(tmp_path), "--attestation",
        str(envelope), root=project)
    assert envelope.exists()
    r = cli("push", ref, "--registry", registry.place, "--allow-gpu-unverified", "--attestation", str(envelope),
            root=project)
    fails(r, f"--attestation {envelope}", "about another image", image_id[:19])
    assert r.rc == 24 and "pushing" not in r.err
    # Its own envelope goes out with it, and the line names the file whole (it was cut to 16 characters).
    own = tmp_path / "own-verdict-with-a-long-name.dsse.json"
    cli("smoke", ref, "--sign-key", _signing_key(tmp_path), "--attestation", str(own), root=project)
    r = cli("push", ref, "--registry", registry.place, "--allow-gpu-unverified", "--attestation", str(own),
            "--json", root=project)
    assert r.rc == 0, r.err
    assert f"attached the signed verdict from {own.name} as" in r.err and json.loads(r.out)["attestations"]


@pytest.mark.parametrize("command", ["push", "verify"])
def test_an_attestation_that_is_a_fifo_is_refused_at_once(built: tuple[Path, str, str], registry: RegistryPlace,
                                                          tmp_path: Path, command: str) -> None:
    """--attestation naming a FIFO nobody writes to: one line, exit 20 (push waited forever)."""
    import os
    import time

    project, ref, image_id = built
    fifo = tmp_path / "verdict.dsse.json"
    os.mkfifo(fifo)
    started = time.monotonic()
    if command == "push":
        r = cli("push", ref, "--registry", registry.place, "--allow-gpu-unverified", "--attestation", str(fifo),
                root=project, timeout=60)
    else:
        r = cli("verify", "--definition", "v0.25.1",
                image_id, "--key", _signing_key(tmp_path, public=True), "--attestation", str(fifo),
                root=project,
                timeout=60)
    fails(r, str(fifo), "not a regular file")
    assert r.rc == 20 and time.monotonic() - started < 30


def test_an_image_whose_python_hangs_ends_at_the_smoke_deadline(engine: Engine, base_v0251: str, project: Path,
                                                                 unique: str) -> None:
    """The runner is the image's Python: one that never returns kept smoke waiting an hour. --deadline ends it,
    incomplete (the host, not the image, stopped the check), and the container goes."""
    import time

    from vllm_hotfix.journal import records
    from vllm_hotfix.verdicts import Status

    made = _odd_runner_python(engine, base_v0251, project, unique, "hangingpython", b"sleep 3600")
    ref, derived = made.ref, made.image_id
    try:
        started = time.monotonic()
        r = cli("smoke", ref, "--gpu", "off", "--deadline", "5", root=project)
        took = time.monotonic() - started
        fails(r, "incomplete")
        assert r.rc == 11 and "did not finish within 5 s" in r.err and "--deadline" in r.err
        assert took < 60, f"took {took:.0f} s"
        [entry] = records.verdicts(project, derived)
        assert entry.verdict.status is Status.INCOMPLETE
    finally:
        made.drop()


def test_the_default_deadline_fits_the_checks_asked_for() -> None:
    from vllm_hotfix.checking import smoke
    from vllm_hotfix.checking.launchers import plan

    cpu = smoke.SmokeOptions(gpu="off")
    assert plan.deadline(cpu, gpu=False) == 600
    assert plan.deadline(cpu, gpu=True) == 600 + 1800
    assert plan.deadline(smoke.SmokeOptions(serve_model=Path("/m")), gpu=True) == 600 + 1800 + 900 + 1800
    assert plan.deadline(smoke.SmokeOptions(deadline=42), gpu=True) == 42


@pytest.mark.parametrize(("name", "runner", "said"), [
    # python3 gone as the runner starts (a base whose interpreter answers the build's probes, then not).
    ("missingpython", b"echo \"/bin/sh: 1: exec: python3: not found\" >&2; exit 127", "python3: not found"),
    # 8 MiB of output on stdout and stderr (80 times what an error may show of it), and no report.
    ("floodingpython", b"yes 'flood flood flood flood flood flood flood' | head -c 4194304;"
                       b" yes 'err err err err err err' | head -c 4194304 >&2; exit 0", "err err err"),
])
def test_an_image_whose_base_python_fails_the_runner_fails_on_record(
        engine: Engine, base_v0251: str, project: Path, unique: str, name: str, runner: bytes, said: str) -> None:
    """A broken base, the patch set built over it by the tool (so the layer identity check passes and the runner
    is reached): its python3 is missing as the runner starts, or floods both streams. Either is the image's
    failing, recorded as such in one line with the last of what it said; nothing is left behind."""
    import time

    from vllm_hotfix.journal import records
    from vllm_hotfix.verdicts import Status

    made = _odd_runner_python(engine, base_v0251, project, unique, name, runner)
    try:
        started = time.monotonic()
        r = cli("smoke", made.ref, "--gpu", "off", root=project)
        took = time.monotonic() - started
        fails(r, "smoke failed", "runner")
        assert r.rc == 7 and "the runner gave no report" in r.err and said in r.err, r.err[-2000:]
        assert len(r.err) < 100_000, len(r.err)  # the last lines, never the flood
        assert took < 300, f"took {took:.0f} s"
        [entry] = records.verdicts(project, made.image_id)
        checks = {c.name: c.status for c in entry.verdict.checks}
        assert entry.verdict.status is Status.FAIL and checks["layer-identity"] is Status.PASS
    finally:
        made.drop()
