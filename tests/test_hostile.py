"""Hostile and mistaken input: one `error:` line, the documented exit code, nothing left behind.

Every `cli()` call also asserts that no Python error dump reached stderr
(conftest). Where the engine is needed, the inputs are real images built on
top of the stand-in base.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import REPO, STANDIN_REPO, cli, derive, fails, free_port
from vllm_hotfix import standin
from vllm_hotfix.engine import Engine, split_reference

PATCH = "0001-minimax-m3-topk-buffer-layout.patch"
CACHE = {"VLLM_HOTFIX_CACHE": str(REPO / "build" / "cache")}


@pytest.mark.parametrize("tag", ["Evil/X:y", "a;b", "ops/vllm:" + "x" * 200, "ops/vllm@sha256:" + "0" * 64])
def test_bad_output_tag_fails_before_any_work(project: Path, tag: str) -> None:
    start = time.monotonic()
    r = cli("image", "--base", "v0.25.1", "--tag", tag, root=project, env={"DOCKER_HOST": "unix:///nonexistent"})
    fails(r, "--tag")
    assert r.rc == 64
    assert time.monotonic() - start < 30  # no engine was even asked (DOCKER_HOST points nowhere)


@pytest.mark.parametrize("registry, needle", [
    ("host/../x", "expected HOST[:PORT]/PATH"),
    ("HTTP://registry.internal:5000/ml", "without a scheme"),
    ("registry.internal:5000/ML", "lowercase"),
])
def test_bad_registry_fails_before_any_work(registry: str, needle: str) -> None:
    r = cli("push", "ops/vllm:x", "--registry", registry, env={"DOCKER_HOST": "unix:///nonexistent"})
    fails(r, needle)
    assert r.rc == 64


def test_digest_references_split_as_the_engine_does() -> None:
    digest = "sha256:" + "a" * 64
    assert split_reference(f"vllm/vllm-openai@{digest}") == ("vllm/vllm-openai", digest)
    assert split_reference("registry.internal:5000/vllm/vllm-openai") == ("registry.internal:5000/vllm/vllm-openai",
                                                                          "latest")


def test_usage_errors_have_their_own_exit_code() -> None:
    r = cli("image", "--no-such-flag")
    fails(r, "No such option")
    assert r.rc == 64 and "hint: build.py image --help" in r.err
    r = cli("serve-check", "--url", "http://127.0.0.1:9", "--concurrency", "1,x")
    fails(r, "--concurrency '1,x'")
    assert r.rc == 64
    r = cli("--help")
    assert r.rc == 0 and "Exit codes:" in r.out and "VLLM_HOTFIX_CACHE" in r.out
    # -v is accepted after the subcommand too, and does not flood with the SDK's debug lines.
    r = cli("list", "-v")
    assert r.rc == 0 and "urllib3" not in r.err and "docker.utils" not in r.err


def test_serve_check_on_a_refused_port_says_what_it_waits_for() -> None:
    port = free_port()
    start = time.monotonic()
    r = cli("serve-check", "--url", f"http://127.0.0.1:{port}", "--wait", "2")
    fails(r, f"http://127.0.0.1:{port}/health did not answer within 2 s")
    assert r.rc == 7 and "waiting up to 2 s" in r.err
    assert time.monotonic() - start < 20


def test_no_engine_hint_names_a_real_target(project: Path) -> None:
    r = cli("image", "--base", "v0.25.1", root=project, env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    fails(r, "no Docker engine answers")
    assert r.rc == 5 and "make services" in r.err
    makefile = (REPO / "Makefile").read_text()
    assert "\nservices:" in makefile


def test_crlf_patch_is_named_as_such(project: Path) -> None:
    path = project / "patches/v0.25.1" / PATCH
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    r = cli("render", "--base", "v0.25.1", root=project, env={"DOCKER_HOST": "unix:///nonexistent"})
    fails(r, PATCH, "CRLF")
    assert r.rc == 3


def test_oversized_patch_is_refused_at_once(project: Path) -> None:
    path = project / "patches/v0.25.1" / PATCH
    with path.open("a") as fh:
        fh.write(("# padding\n" * 1024) * 600)  # about 6 MB
    start = time.monotonic()
    r = cli("render", "--base", "v0.25.1", root=project, env={"DOCKER_HOST": "unix:///nonexistent"})
    fails(r, PATCH, "larger than a hotfix patch may be")
    assert r.rc == 3 and time.monotonic() - start < 30


def test_repository_with_a_newline_is_refused(project: Path) -> None:
    toml = project / "images/v0.25.1.toml"
    toml.write_text(toml.read_text().replace(f'repository = "{STANDIN_REPO}"',
                                             'repository = "vllm/vllm-openai\\nFROM evil"'))
    r = cli("render", "--base", "v0.25.1", root=project)
    fails(r, "v0.25.1.toml", "base.repository")
    assert r.rc == 2


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


@pytest.mark.engine
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
        r = cli("image", "--base", "v0.25.1", "--base-repo", repo, "--tag", f"{repo}:out", "--pull", "never",
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


@pytest.mark.engine
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
