"""Mistaken and hostile input the CLI refuses before any engine work.

One `error:` line, the documented exit code, nothing left behind. Every
`cli()` call also asserts that no Python error dump reached stderr (conftest).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from conftest import REPO, STANDIN_REPO, cli, fails
from vllm_hotfix.engine import split_reference

PATCH = "0001-minimax-m3-topk-buffer-layout.patch"


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


@pytest.mark.parametrize("value", ["ops:s3cret-pw@127.0.0.1:5000/ops", "https://ops:s3cret-pw@host:5000/x"])
def test_registry_with_credentials_is_refused_without_echo(value: str) -> None:
    r = cli("push", "vllm/vllm-openai:v0.25.1-m3patch", "--registry", value)
    fails(r, "--registry holds credentials")
    assert r.rc == 64
    assert "s3cret" not in r.err + r.out


def _edit_patch(project: Path, old: str, new: str) -> None:
    path = project / "patches/v0.25.1" / PATCH
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))


@pytest.mark.parametrize(
    "old, new, needles",
    [
        ("@@ -424,6 +424,9 @@", "@@ -424,6 +424,19 @@", ("malformed diff",)),
        ("--- a/vllm/models/minimax_m3/common/indexer.py", "--- /vllm/models/minimax_m3/common/indexer.py",
         ("absolute path",)),
        ("+++ b/vllm/models/minimax_m3/common/sparse_attention.py",
         "+++ b/vllm/../../../etc/sparse_attention.py", ("'..'",)),
    ],
)
def test_bad_diffs_are_refused_before_the_engine(
    project: Path, unique: str, old: str, new: str, needles: tuple[str, ...]
) -> None:
    _edit_patch(project, old, new)
    # No engine needed: validation happens before anything is touched.
    r = cli("image", "--base", "v0.25.1", "--tag", f"hotfix-test/bad:{unique}", "--no-smoke", root=project,
            env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    fails(r, PATCH, *needles)


def test_no_engine(project: Path) -> None:
    r = cli("image", "--base", "v0.25.1", "--no-smoke", root=project,
            env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    fails(r, "no Docker engine answers")
    assert r.rc == 5


def test_unknown_base_tag(project: Path) -> None:
    r = cli("image", "--base", "v9.9.9", "--no-smoke", root=project)
    fails(r, "v9.9.9.toml", "no image definition")


def test_unknown_builder_is_refused(project: Path) -> None:
    r = cli("image", "--base", "v0.25.1", "--no-smoke", "--builder", "kaniko", root=project)
    fails(r, "--builder", "'kaniko' is not one of 'dockerfile', 'assemble'")
    assert r.rc == 64


# Tests may run with --root elsewhere; the wheels stay in the repository's cache.
CACHE = {"VLLM_HOTFIX_CACHE": str(REPO / "build" / "cache")}


def test_check_upstream_bad_input(project: Path, tmp_path: Path) -> None:
    r = cli(
        "check-upstream", "--patches", "v9.9.9", "--base", "v0.27.0", "--from-wheel", root=project, env=CACHE
    )
    fails(r, "patches/v9.9.9/series")
    # A release PyPI cannot give (no index reachable) is one clear line.
    r = cli(
        "check-upstream",
        "--patches",
        "v0.25.1",
        "--base",
        "v9.9.9",
        "--from-wheel",
        root=project,
        env={
            "VLLM_HOTFIX_CACHE": str(tmp_path / "cache"),
            "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
            "PIP_RETRIES": "0",
            "PIP_TIMEOUT": "2",
        },
    )
    fails(r, "vllm==9.9.9")
