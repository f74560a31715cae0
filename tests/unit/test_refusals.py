"""Mistaken and hostile input the CLI refuses before any engine work.

One `error:` line, the documented exit code, nothing left behind. Every
`cli()` call also asserts that no Python error dump reached stderr (conftest).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, STANDIN_REPO, Result, cli, fails
from vllm_hotfix.engine import split_reference

PATCH = "0001-minimax-m3-topk-buffer-layout.patch"


@pytest.mark.parametrize("tag", ["Evil/X:y", "a;b", "ops/vllm:" + "x" * 200, "ops/vllm@sha256:" + "0" * 64])
def test_bad_output_tag_fails_before_any_work(project: Path, tag: str) -> None:
    start = time.monotonic()
    r = cli("image", "--definition", "v0.25.1", "--tag", tag, root=project, env={"DOCKER_HOST": "unix:///nonexistent"})
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
    fails(r, "no such option")
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
    r = cli("image", "--definition", "v0.25.1", root=project, env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    fails(r, "no Docker engine answers")
    assert r.rc == 5 and "make services" in r.err
    makefile = (REPO / "Makefile").read_text()
    assert "\nservices:" in makefile


def test_crlf_patch_is_named_as_such(project: Path) -> None:
    path = project / "patches/v0.25.1" / PATCH
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    r = cli("render", "--definition", "v0.25.1", root=project, env={"DOCKER_HOST": "unix:///nonexistent"})
    fails(r, PATCH, "CRLF")
    assert r.rc == 3


def test_oversized_patch_is_refused_at_once(project: Path) -> None:
    path = project / "patches/v0.25.1" / PATCH
    with path.open("a") as fh:
        fh.write(("# padding\n" * 1024) * 600)  # about 6 MB
    start = time.monotonic()
    r = cli("render", "--definition", "v0.25.1", root=project, env={"DOCKER_HOST": "unix:///nonexistent"})
    fails(r, PATCH, "larger than a hotfix patch may be")
    assert r.rc == 3 and time.monotonic() - start < 30


def test_repository_with_a_newline_is_refused(project: Path) -> None:
    toml = project / "images/v0.25.1.toml"
    toml.write_text(toml.read_text().replace(f'repository = "{STANDIN_REPO}"',
                                             'repository = "vllm/vllm-openai\\nFROM evil"'))
    r = cli("render", "--definition", "v0.25.1", root=project)
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
    r = cli("image", "--definition", "v0.25.1", "--tag", f"hotfix-test/bad:{unique}", "--no-smoke", root=project,
            env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    fails(r, PATCH, *needles)


def test_no_engine(project: Path) -> None:
    r = cli("image", "--definition", "v0.25.1", "--no-smoke", root=project,
            env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    fails(r, "no Docker engine answers")
    assert r.rc == 5


def test_unknown_base_tag(project: Path) -> None:
    r = cli("image", "--definition", "v9.9.9", "--no-smoke", root=project)
    fails(r, "v9.9.9.toml", "no image definition")


def test_unknown_builder_is_refused(project: Path) -> None:
    r = cli("image", "--definition", "v0.25.1", "--no-smoke", "--builder", "kaniko", root=project)
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


# -- hostile input, kind by kind: exit code, one line naming the input, no dump, nothing left --------------------


def _one_line(r: Result, rc: int, *needles: str) -> None:
    """Exit ``rc``, exactly one `error:` line holding every needle, and nothing on stderr but it and a hint."""
    assert r.rc == rc, r.err
    fails(r, *needles)
    lines = r.err.splitlines()
    assert sum(ln.startswith("error: ") for ln in lines) == 1, r.err
    assert all(ln.startswith(("error: ", "hint: ")) for ln in lines), f"a line split or a stray line:\n{r.err}"


REGISTRY = ("--registry", "127.0.0.1:5000/ops")
BAD_REFERENCES = [
    (("push", "VLLM/vllm-openai:v0.25.1-m3patch", *REGISTRY), "IMAGE 'VLLM/vllm-openai"),
    (("push", "http://x/y:z", *REGISTRY), "IMAGE 'http://x/y:z'"),
    (("push", "ops/vllm:v1\n", *REGISTRY), "IMAGE 'ops/vllm:v1\\n'"),
    (("smoke", "Bad Ref:!!"), "IMAGE 'Bad Ref:!!'"),
    (("smoke", ""), "IMAGE ''"),
    (("smoke", "ops/vllm:v1\n"), "IMAGE 'ops/vllm:v1\\n'"),
    (("smoke", "ops/vllm:v1\x1b[2J"), "IMAGE 'ops/vllm:v1\\x1b[2J'"),
    (("smoke", "ops/" + "x" * 300), "more characters"),
    (("verify", "Bad:Ref:x", "--key", "env:NOPE"), "REF 'Bad:Ref:x'"),
    (("image", "--definition", "v0.25.1", "--base-repo", "UPPER/repo"), "--base-repo 'UPPER/repo'"),
    (("image", "--definition", "v0.25.1", "--base-repo", "ops/vllm:v1"), "takes no tag or digest"),
    (("image", "--definition", "v0.25.1", "--tag", "ops/vllm:v1\n"), "--tag 'ops/vllm:v1\\n'"),
    (("render", "--definition", "v0.25.1", "--base-repo", "a b"), "--base-repo 'a b'"),
    (("check-upstream", "--patches", "v0.25.1", "--base", "v0.27.0", "--base-repo", "A:b"), "--base-repo 'A:b'"),
    (("new-patchset", "--definition", "v0.25.1", "--pin", "x==1", "--base-repo", "Evil/x"), "--base-repo 'Evil/x'"),
    (("rollback", "--definition", "v0.25.1", "--tag", "Bad Ref"), "--tag 'Bad Ref'"),
    (("rollback", "--definition", "v0.25.1", "--to", "nothex\n"), "--to 'nothex\\n'"),
    (("standin", "--version", "0.25.1", "--ref", "UP/x:1"), "--ref 'UP/x:1'"),
]


@pytest.mark.parametrize("args, needle", BAD_REFERENCES, ids=range(len(BAD_REFERENCES)))
def test_bad_references_are_usage_errors_before_any_work(args: tuple[str, ...], needle: str) -> None:
    # DOCKER_HOST points nowhere (unit tier): reaching the engine would be exit 5, not 64.
    r = cli(*args)
    _one_line(r, 64, needle)
    assert "not a valid image reference" in r.err or "not an image ID" in r.err or "no tag or digest" in r.err


def test_every_reference_argument_is_checked_while_parsing() -> None:
    """No command can forget: each IMAGE, REF, --tag, --ref, --to and --base-repo has a checked type."""
    from vllm_hotfix import cli as climod

    names = {"image_ref", "ref", "output_ref", "base_repo", "to_image"}
    seen = 0
    for command in climod.every_command().values():
        for param in command.params:
            if param.name in names:
                assert isinstance(param.type, climod.Checked), f"{command.name} {param.name} is not checked"
                seen += 1
    assert seen >= 11


def test_references_with_a_registry_host_are_still_valid() -> None:
    from vllm_hotfix.registry import refs

    for ok in ("vllm/vllm-openai:v0.25.1", "Registry.Example.com:5000/ops/vllm:v1", "localhost/x:1",
               "127.0.0.1:5000/ops/vllm@sha256:" + "a" * 64):
        assert refs.check_reference(ok, "x") == ok
    assert refs.check_image("sha256:" + "b" * 64, "IMAGE")


ENV_CASES = [
    ({"VLLM_HOTFIX_RUN_ID": "a/b"}, ("list",), "VLLM_HOTFIX_RUN_ID='a/b'"),
    ({"VLLM_HOTFIX_RUN_ID": "run\nX"}, ("list",), "VLLM_HOTFIX_RUN_ID='run\\nX'"),
    ({"VLLM_HOTFIX_RUN_ID": "x" * 5000}, ("list",), "more characters"),
    ({"VLLM_HOTFIX_CACHE": "/etc/hostname"}, ("render", "--definition", "v0.25.1"), "is a file, not a folder"),
    ({"VLLM_HOTFIX_CACHE": "/etc/hostname/cache"}, ("image", "--definition", "v0.25.1"), "is a file, not a folder"),
    ({"VLLM_HOTFIX_CACHE": "/proc/1/cache-here"}, ("render", "--definition", "v0.25.1"), "not writable"),
    ({"VLLM_HOTFIX_CACHE": ""}, ("render", "--definition", "v0.25.1"), "is empty"),
    # Past a day a thread's join overflows (an OverflowError, exit 70): refused before any work.
    ({"VLLM_HOTFIX_PROBE_TIMEOUT": "9" * 30}, ("render", "--definition", "v0.25.1"), "expected whole seconds from 1"),
    ({"VLLM_HOTFIX_PROBE_TIMEOUT": "-5"}, ("list",), "VLLM_HOTFIX_PROBE_TIMEOUT='-5'"),
]


@pytest.mark.parametrize("env, args, needle", ENV_CASES, ids=range(len(ENV_CASES)))
def test_bad_environment_values_are_usage_errors(env: dict[str, str], args: tuple[str, ...], needle: str) -> None:
    r = cli(*args, env=env)
    _one_line(r, 64, needle)


OUTPUT_FILES = [
    ("smoke", "ops/vllm:v1", "--report", "/etc/hostname/r.json"),
    ("smoke", "ops/vllm:v1", "--junit", "/etc/hostname/deeper/j.xml"),
    ("smoke", "ops/vllm:v1", "--junit", "/proc/1/j.xml"),
    ("smoke", "ops/vllm:v1", "--attestation", "/etc/hostname/a.json", "--sign-key", "env:NOPE"),
    ("serve-check", "--url", "http://127.0.0.1:9", "--report", "/etc/hostname/s.json"),
    # A folder that does not exist under one that takes no new files, whatever os.access says to root.
    ("serve-check", "--url", "http://127.0.0.1:9", "--report", "/proc/nope/r.json"),
]


@pytest.mark.parametrize("args", OUTPUT_FILES, ids=range(len(OUTPUT_FILES)))
def test_report_files_that_cannot_be_written_fail_before_the_run(args: tuple[str, ...]) -> None:
    r = cli(*args)
    _one_line(r, 64, "cannot write there")


DEEP_OUTPUTS = [
    ("smoke", "ops/vllm:v1", "--report"),
    ("smoke", "ops/vllm:v1", "--junit"),
    ("smoke", "ops/vllm:v1", "--html"),
    ("smoke", "ops/vllm:v1", "--launcher", "kubernetes", "--emit"),
    ("report", str(REPO / "gpu-runs" / "h100-2026-12-05-oracle" / "patched.json"), "--out"),
]


@pytest.mark.parametrize("args", DEEP_OUTPUTS, ids=[a[-1] for a in DEEP_OUTPUTS])
def test_an_output_file_two_folders_down_a_missing_path_is_refused(tmp_path: Path, args: tuple[str, ...]) -> None:
    """A mistyped path makes no tree of folders: one line naming the first missing one, 64, nothing made."""
    r = cli(*args, str(tmp_path / "typo" / "deeper" / "out.file"), env={"DOCKER_HOST": "unix:///nonexistent"})
    _one_line(r, 64, args[-1], f"{str(tmp_path / 'typo')!r} does not exist")
    assert list(tmp_path.iterdir()) == []


def test_the_output_files_own_folder_is_made(tmp_path: Path) -> None:
    # The committed report without its sweep and phases: a page without charts (drawing them, a second of
    # matplotlib, is tested in tests/serve/test_report_page.py), written all the same.
    report = json.loads((REPO / "gpu-runs" / "h100-2026-12-05-oracle" / "patched.json").read_text())
    del report["sweep"], report["phases"]
    given = tmp_path / "patched.json"
    given.write_text(json.dumps(report))
    out = tmp_path / "pages" / "record.html"
    r = cli("report", str(given), "--out", str(out))
    assert r.rc == 0, r.err
    assert out.is_file() and "0 chart(s)" in r.out


@pytest.mark.parametrize("make_root", ["missing", "file"])
def test_root_that_is_no_folder_is_refused(tmp_path: Path, make_root: str) -> None:
    root = tmp_path / "nowhere"
    if make_root == "file":
        root.write_text("x")
    for args in (("--root", str(root), "list"), ("list", "--root", str(root)), ("render", "--definition", "v0.25.1",
                                                                               "--root", str(root))):
        r = cli(*args)
        _one_line(r, 64, "--root", str(root))


def test_root_after_the_subcommand_is_the_same_as_before(project: Path) -> None:
    (project / "images/v0.25.1-sm100.toml").unlink()
    before = cli("list", root=project)
    after = cli("list", "--root", str(project))
    assert before.rc == after.rc == 0
    assert before.out == after.out and "v0.25.1-sm100" not in after.out


def test_bare_command_prints_its_help_plainly() -> None:
    r = cli()
    assert r.rc == 0 and r.out.startswith("Usage:") and "error" not in r.err


def test_series_with_a_latin1_byte_names_the_file_and_line(project: Path) -> None:
    series = project / "patches/v0.25.1/series"
    series.write_bytes(b"# caf\xe9\n" + series.read_bytes())
    r = cli("render", "--definition", "v0.25.1", root=project)
    _one_line(r, 3, f"{series}:1", "not UTF-8")


PYTHONS = ["python3\\nRUN touch /x", "python3; touch x", "{{ 7 * 7 }}", "'{{ python }}'", "$(id)", "python3 -c x",
           "../python3", "/usr/bin/py thon", "`id`"]


@pytest.mark.parametrize("python", PYTHONS, ids=range(len(PYTHONS)))
def test_definition_python_that_is_no_program_is_refused(project: Path, python: str) -> None:
    toml = project / "images/v0.25.1.toml"
    escaped = python.replace('"', '\\"')
    toml.write_text(toml.read_text().replace('name = "vllm"', f'name = "vllm"\npython = "{escaped}"'))
    r = cli("render", "--definition", "v0.25.1", root=project)
    _one_line(r, 2, "v0.25.1.toml", "package.python")


@pytest.mark.parametrize("key, value", [("version", "0.25.1\\nRUN x"), ("version", "0.25.1 $(id)"),
                                        ("version", "{{x}}")])
def test_definition_version_that_is_no_version_is_refused(project: Path, key: str, value: str) -> None:
    toml = project / "images/v0.25.1.toml"
    text = toml.read_text()
    start = text.index(f"{key} = ")
    toml.write_text(text[:start] + f'{key} = "{value}"' + text[text.index("\n", start):])
    r = cli("render", "--definition", "v0.25.1", root=project)
    _one_line(r, 2, "v0.25.1.toml", f"package.{key}")


@pytest.mark.parametrize("hosts", ["SM100\\nLABEL x=y", "${PATH}", "{{ x }}", "x" * 300])
def test_variant_hosts_must_be_one_plain_line(project: Path, hosts: str) -> None:
    toml = project / "images/v0.25.1-sm100.toml"
    text = toml.read_text()
    start = text.index("hosts = ")
    end = text.index("\n", start)
    toml.write_text(text[:start] + f'hosts = "{hosts}"' + text[end:])
    r = cli("render", "--definition", "v0.25.1-sm100", root=project)
    _one_line(r, 2, "v0.25.1-sm100.toml", "variant.hosts")


PATCH_NAMES = ["0002-a\tb.patch", "0002-${PATH}.patch", "0002-a\\b.patch", '0002-a"b.patch', "0002-a'b.patch",
               "0002-caf\u00e9.patch", "0002-a=b.patch", "-p0.patch"]


@pytest.mark.parametrize("name", PATCH_NAMES, ids=range(len(PATCH_NAMES)))
def test_patch_names_that_would_reach_a_label_key_are_refused(project: Path, name: str) -> None:
    folder = project / "patches/v0.25.1"
    (folder / name).write_bytes((folder / PATCH).read_bytes())
    with (folder / "series").open("a", encoding="utf-8") as fh:
        fh.write(name + "\n")
    r = cli("render", "--definition", "v0.25.1", root=project)
    _one_line(r, 3, f"{folder / 'series'}:", "not a patch file name")


def test_patch_file_name_is_checked_when_the_patch_loads(tmp_path: Path) -> None:
    from vllm_hotfix.building import patches
    from vllm_hotfix.errors import PatchError

    path = tmp_path / "0001-a b.patch"
    path.write_bytes((REPO / "patches/v0.25.1" / PATCH).read_bytes())
    with pytest.raises(PatchError, match="file name may hold only"):
        patches.load_patch(path, "vllm")


@pytest.mark.parametrize("mode_lines", ["old mode 100644\nnew mode 100755\n", "old mode 100755\nnew mode 100644\n"])
def test_patch_changing_a_mode_is_refused(project: Path, mode_lines: str) -> None:
    path = project / "patches/v0.25.1" / PATCH
    text = path.read_text()
    at = text.index("--- a/")
    path.write_text(text[:at] + mode_lines + text[at:])
    r = cli("render", "--definition", "v0.25.1", root=project)
    _one_line(r, 3, PATCH, "changes a file's mode")


def test_label_values_are_escaped_and_keys_checked() -> None:
    from vllm_hotfix.building import render

    assert render._label_value('a\\b"c$d\te\nf\rg') == 'a\\\\b\\"c\\$d e f g'
    assert render.LABEL_KEY.match("io.vllm-hotfix.patch.0001-x.patch")
    for bad in ("io.x.patch.a\tb", "io.x.${PATH}", 'io.x."', "io.x.a b"):
        assert not render.LABEL_KEY.match(bad)


NEW_PATCHSET_USAGE = [
    (("--from-pr", "not-a-pr"), "--from-pr 'not-a-pr'"),
    (("--from-pr", "https://example.com/x"), "neither a PR number"),
    (("--pin", "quack-kernels"), "--pin 'quack-kernels'"),
    (("--pin", "quack-kernels>=0.6"), "NAME==VERSION"),
    (("--pin", "x==1", "--from-pr", "5"), "--pin goes alone"),
    ((), "exactly one of --from-pr"),
    (("--from-file", "/nonexistent/x.diff"), "/nonexistent/x.diff"),
]


@pytest.mark.parametrize("args, needle", NEW_PATCHSET_USAGE, ids=range(len(NEW_PATCHSET_USAGE)))
def test_new_patchset_usage_errors_exit_64(project: Path, args: tuple[str, ...], needle: str) -> None:
    r = cli("new-patchset", "--definition", "v0.25.1", *args, root=project)
    _one_line(r, 64, needle)


@pytest.mark.parametrize("url", ["notaurl", "ftp://127.0.0.1/x", "http://", "http://127.0.0.1:port", "http://a\nb"])
def test_serve_check_url_that_is_no_url_exits_64(url: str) -> None:
    r = cli("serve-check", "--url", url)
    _one_line(r, 64, "--url")


@pytest.mark.parametrize("api, cause", [("http://127.0.0.1:9", "connection refused by 127.0.0.1:9"),
                                        ("http://no-such-host.invalid", "cannot resolve the name of no-such-host")])
def test_from_pr_offline_names_the_cause(project: Path, api: str, cause: str) -> None:
    r = cli("new-patchset", "--definition", "v0.25.1", "--from-pr", "49149", "--from-wheel", root=project,
            env={"VLLM_HOTFIX_GITHUB_API": api})
    _one_line(r, 9, "cannot fetch PR #49149", cause)


def test_from_pr_timeout_is_named() -> None:
    import requests

    from vllm_hotfix.building import newpatch

    exc = requests.exceptions.ConnectTimeout("timed out")
    assert "did not answer in time" in newpatch.network_cause(exc, "http://10.0.0.1/x")


def _upstream_report(pin_verdicts: tuple[str, ...], *patch_verdicts: str) -> Any:
    from vllm_hotfix.building import upstream

    return upstream.Report(
        "v0.25.1-sm100", "v0.27.0", "wheel", "vllm", "0.27.0",
        tuple(upstream.Verdict(f"000{i}-x.patch", w, ()) for i, w in enumerate(patch_verdicts)),
        tuple({"pin": f"pin{i}==1", "verdict": w, "detail": "d"} for i, w in enumerate(pin_verdicts)))


@pytest.mark.parametrize("pins, patches, rc, needle", [
    (("contradicts", "contradicts"), ("included",), 12, "pin0==1, pin1==1: the set still needs attention"),
    (("contradicts",), ("needed",), 12, "the set still needs attention"),
    (("allowed",), ("included",), 0, "but not its pins pin0==1"),
    (("included",), ("included",), 0, "needs no hotfix"),
    ((), ("included",), 0, "needs no hotfix"),
])
def test_check_upstream_conclusion_agrees_with_its_pins(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], pins: tuple[str, ...],
    patches: tuple[str, ...], rc: int, needle: str,
) -> None:
    from vllm_hotfix import cli as climod
    from vllm_hotfix.building import upstream

    monkeypatch.setattr(upstream, "check", lambda *a, **k: _upstream_report(pins, *patches))
    got = climod._run(["check-upstream", "--patches", "v0.25.1-sm100", "--base", "v0.27.0", "--from-wheel"], "t")
    err = capsys.readouterr().err
    assert got == rc, err
    assert needle in err
    if rc:
        assert "needs no hotfix" not in err
    assert _upstream_report(pins, *patches).needs_hotfix == (needle != "needs no hotfix")


def test_runbook_shaped_commands_with_bad_values_fail_before_work() -> None:
    # The runbook's SM100 stand-in and signed smoke lines, each with one value a user might mistype.
    r = cli("standin", "--version", "0.25.1", "--deps", "race", "--ref", "Demo/vllm-openai-sm100:v0.25.1")
    _one_line(r, 64, "--ref 'Demo/vllm-openai-sm100:v0.25.1'", "not a valid image reference")
    r = cli("smoke", "ops/vllm:v1", "--gpu", "require", "--sign-key", "env:NOPE", "--attestation",
            "/etc/hostname/verdict.dsse.json")
    _one_line(r, 64, "--attestation", "cannot write there")


def test_hints_under_make_name_its_variables_but_keep_commands_whole(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Run by make, a flag in a hint becomes the make variable; a `python build.py ...` command stays a command
    (it read `python build.py image --base TAG PLATFORM=all`)."""
    from vllm_hotfix.cli.app import report_error
    from vllm_hotfix.errors import BaseImageError, PushError

    monkeypatch.setenv("VLLM_HOTFIX_VIA_MAKE", "1")
    assert report_error(PushError("not GPU-verified", hint="pass --allow-gpu-unverified to push it anyway")) == 8
    assert "hint: run make again with ALLOW_GPU_UNVERIFIED=1 to push it anyway" in capsys.readouterr().err
    report_error(BaseImageError("no per-platform images",
                                hint="build them with: python build.py image --definition TAG --platform all"))
    err = capsys.readouterr().err
    assert "hint: build them with: python build.py image --definition TAG --platform all" in err
    assert "PLATFORM=all" not in err


@pytest.mark.parametrize("sign", [False, True])
def test_podman_launcher_without_podman_is_one_line(tmp_path: Path, sign: bool) -> None:
    """smoke --launcher podman on a host without podman (with and without --sign-key): exit 5, not a traceback."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    args = ["smoke", "ops/vllm:fix", "--launcher", "podman"]
    if sign:
        key = tmp_path / "k.pem"
        key.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
        key.chmod(0o600)
        args += ["--sign-key", str(key)]
    empty = tmp_path / "bin"
    empty.mkdir()
    r = cli(*args, root=tmp_path, env={"PATH": str(empty)})
    fails(r, "podman is not installed or not on PATH")
    assert r.rc == 5 and "hint: install podman" in r.err
