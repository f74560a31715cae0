"""The [smoke] table of a definition through the command line: validated when loaded, used for an image of that
definition, overridden by a flag, explained without starting anything; and the Job options it and the flags give,
held to the Kubernetes API's schema."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, cli, copy_tracked

IMAGE = "registry.example/ops/vllm-openai:v0.25.1-m3patch"
DIGEST = "registry.example/ops/vllm-openai@sha256:" + "ef" * 32

TABLE = """
[smoke]
gpu = "require"
model = "models/tiny"
reference = "/srv/answers/v0.25.1.json"
concurrency = [1, 4]
requests = 12
serve_args = ["--max-model-len", "8192", "--enforce-eager"]
sign_key = "env:SITE_SIGN_KEY"

[smoke.kubernetes]
namespace = "gpu"
service_account = "vllm-hotfix"
pull_secrets = ["internal-registry", "mirror"]
node_selector = { "nvidia.com/gpu.product" = "NVIDIA-H200" }
tolerations = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
resources = { requests = { cpu = "8", memory = "64Gi" }, limits = { memory = "96Gi" } }
"""


@pytest.fixture
def project(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    copy_tracked(REPO, ("images", "patches"), root)  # the project's own, never a user's untracked sets
    return root


def with_table(root: Path, text: str = TABLE, name: str = "v0.25.1") -> Path:
    """The definition ``name`` with ``text`` as its [smoke] table (in place of the one it ships with, if any)."""
    path = root / "images" / f"{name}.toml"
    shipped = path.read_text()
    path.write_text(shipped.split("\n[smoke]", 1)[0] + text)
    return path


def settings_of(out: str) -> dict[str, tuple[str, str]]:
    """--explain's lines as setting -> (value, source)."""
    import re

    rows = {}
    for line in out.splitlines()[1:]:
        found = re.match(r"^  (\S+) +(.*?) {2,}(\S.*)$", line)
        if found:
            rows[found.group(1)] = (found.group(2), found.group(3))
    return rows


def test_explain_names_each_setting_and_where_it_came_from_and_starts_nothing(project: Path) -> None:
    with_table(project)
    r = cli("smoke", IMAGE, "--explain", "--requests", "5", "--serve-arg=--enforce-eager", root=project,
            env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert r.rc == 0, r.err
    rows = settings_of(r.out)
    table = "images/v0.25.1.toml [smoke]"
    assert rows["definition"][0] == "v0.25.1" and "the image's tag v0.25.1-m3patch" in rows["definition"][1]
    assert rows["gpu"] == ("require", f"{table} gpu")
    # A relative path is the project folder's (--root), wherever the tool was started; missing here, and said.
    assert rows["model"] == (f"{project}/models/tiny (missing on this host)", f"{table} model")
    assert rows["concurrency"] == ("1,4", f"{table} concurrency")
    assert rows["requests"] == ("5", "flag --requests")
    # A flag's list replaces the table's whole.
    assert rows["serve_args"] == ("--enforce-eager", "flag --serve-arg")
    assert rows["sign_key"] == ("env:SITE_SIGN_KEY", f"{table} sign_key")
    assert rows["min_tokens"] == ("-", "default")
    # The docker launcher: the Job's settings the table gives are shown, and said to be the Job's alone.
    assert rows["kubernetes.namespace"] == ("gpu", "images/v0.25.1.toml [smoke.kubernetes] namespace")
    assert "kubernetes.gpus" not in rows
    assert "(kubernetes.* apply with --launcher kubernetes only)" in r.out
    assert r.out.rstrip().endswith("nothing was started")
    assert not (project / "build" / "records").exists()


def test_explain_for_a_job_shows_the_table_and_the_flags_over_it(project: Path) -> None:
    with_table(project)
    r = cli("smoke", IMAGE, "--explain", "--launcher", "kubernetes", "--pull-secret", "other",
            "--toleration", "dedicated=gpu:NoExecute", root=project)
    assert r.rc == 0, r.err
    rows = settings_of(r.out)
    job = "images/v0.25.1.toml [smoke.kubernetes]"
    assert rows["kubernetes.namespace"] == ("gpu", f"{job} namespace")
    assert rows["kubernetes.service_account"] == ("vllm-hotfix", f"{job} service_account")
    assert rows["kubernetes.pull_secrets"] == ("other", "flag --pull-secret")
    assert rows["kubernetes.tolerations"] == ("dedicated=gpu:NoExecute", "flag --toleration")
    assert rows["kubernetes.resources"] == ("requests: cpu=8,memory=64Gi; limits: memory=96Gi", f"{job} resources")


def test_which_definition_an_image_gets(project: Path) -> None:
    with_table(project, '\n[smoke]\ngpu = "off"\n', name="v0.25.1-sm100")
    # A platform's tag of a definition's output, and a --definition that beats the tag.
    r = cli("smoke", "ops/vllm:v0.25.1-m3patch-sm100-aarch64", "--explain", root=project)
    assert r.rc == 0 and settings_of(r.out)["gpu"] == ("off", "images/v0.25.1-sm100.toml [smoke] gpu"), r.err
    r = cli("smoke", "ops/vllm:v0.25.1-m3patch-sm100", "--explain", "--definition", "v0.25.1", root=project)
    assert settings_of(r.out)["definition"] == ("v0.25.1", "flag --definition")
    assert settings_of(r.out)["gpu"] == ("auto", "images/v0.25.1.toml [smoke] gpu")  # the shipped table
    # No tag, or a tag that is no definition's output: the defaults, and what would choose a table.
    for image in (DIGEST, "ops/vllm:latest", "sha256:" + "ab" * 32):
        r = cli("smoke", image, "--explain", root=project)
        assert r.rc == 0, r.err
        assert settings_of(r.out)["definition"][0] == "-" and "give --definition TAG" in r.out
        assert settings_of(r.out)["gpu"] == ("auto", "default")


@pytest.mark.parametrize(("text", "needle"), [
    ('[smoke]\ngpu = "maybe"', "smoke.gpu 'maybe': expected one of auto, require, off"),
    ("[smoke]\nconcurrency = [1, 0]", "smoke.concurrency must be a list of whole numbers"),
    ('[smoke]\nconcurency = [1]', "unknown key smoke.concurency"),
    ("[smoke]\nrequests = true", "smoke.requests must be a whole number"),
    ('[smoke]\nserve_args = "--enforce-eager"', "smoke.serve_args must be a list of strings"),
    ('[smoke]\nsign_key = "awskms:///alias/vllm-hotfix"',
     "smoke.sign_key 'awskms:///alias/vllm-hotfix': a key held by a KMS (awskms://) is not supported"),
    ('[smoke]\nsign_key = "hashivault://transit/keys/smoke"', "(hashivault://) is not supported"),
    ('[smoke]\nsign_key = "env:1BAD"', "env:NAME needs an environment variable's name"),
    ('[smoke.kubernetes]\npull_secret = ["a"]', "unknown key smoke.kubernetes.pull_secret"),
    ('[smoke.kubernetes]\ntolerations = [{ key = "a", effect = "Never" }]',
     "smoke.kubernetes.tolerations[0]: effect 'Never'"),
    ('[smoke.kubernetes]\nresources = { requests = { "nvidia.com/gpu" = "2" } }',
     "smoke.kubernetes.resources.requests.nvidia.com/gpu: the GPUs are the Job's gpus"),
    ('[smoke.kubernetes]\nresources = { limits = { memory = "lots" } }', "'lots' is not a quantity"),
])
def test_a_bad_table_is_one_line_naming_the_file_and_key(project: Path, text: str, needle: str) -> None:
    path = with_table(project, "\n" + text + "\n")
    for args in (("smoke", IMAGE, "--explain"), ("smoke", DIGEST, "--definition", "v0.25.1"),
                 ("render", "--definition", "v0.25.1")):
        r = cli(*args, root=project)
        assert r.rc == 2, r.err  # a definition error, before any engine is asked
        assert r.last_error.startswith(f"error: {path}: ") and needle in r.last_error, r.err
        assert len(r.err.strip().splitlines()) <= 2


def test_a_broken_table_of_another_definition_is_not_skipped_silently(project: Path) -> None:
    """A tag no loadable definition makes, where one cannot be loaded: that one's error, never a run under the
    defaults it was meant to tighten; a tag another definition makes is that one's."""
    path = with_table(project, '\n[smoke]\ngpu = "requires"\n', name="v0.25.1-sm100")
    r = cli("smoke", "ops/vllm:v0.25.1-m3patch-sm100", "--explain", root=project)
    assert r.rc == 2 and str(path) in r.last_error, r.err
    r = cli("smoke", IMAGE, "--explain", root=project)
    assert r.rc == 0 and settings_of(r.out)["definition"][0] == "v0.25.1", r.err


def test_a_table_path_this_host_lacks_is_named_before_anything_runs(project: Path) -> None:
    path = with_table(project, '\n[smoke]\nmodel = "/nonexistent/model"\n')
    r = cli("smoke", IMAGE, root=project, env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert r.rc == 64, r.err
    assert r.last_error == f"error: {path.relative_to(project)} [smoke] model: /nonexistent/model does not exist " \
                           "on this host"
    assert "hint: --serve-model overrides it" in r.err


def test_the_table_key_reaches_signing_and_an_emitted_job_is_signed_later(project: Path, tmp_path: Path) -> None:
    """A table's sign_key is used as --sign-key is (a key that cannot sign fails before the run); an emitted Job
    holds no key, so the table's key waits for --collect instead of refusing the emit."""
    with_table(project, '\n[smoke]\nsign_key = "keys/absent.pem"\n')
    r = cli("smoke", IMAGE, root=project, env={"DOCKER_HOST": "unix:///nonexistent/docker.sock"})
    assert r.rc == 20 and f"{project}/keys/absent.pem" in r.last_error, r.err
    # Past the key: the emit stops only where the image's files cannot be read (no engine here, exit 5; an
    # emitted Job with the table's key: tests/engine/test_registry_files.py).
    out = tmp_path / "job.yaml"
    r = cli("smoke", DIGEST, "--definition", "v0.25.1", "--launcher", "kubernetes", "--emit", str(out), root=project)
    assert r.rc == 5 and "no Docker engine answers" in r.last_error and not out.exists(), r.err


def test_base_is_the_old_name_of_definition(project: Path) -> None:
    r = cli("render", "--base", "v0.25.1", "--definition", "v0.25.1-sm100", root=project)
    assert r.rc == 64 and "--base is the old name of --definition; give one" in r.last_error, r.err
    r = cli("rollback", "--base", "v9.9.9", root=project)
    assert r.err.splitlines()[0] == ("note: --base is the old name of --definition (a definition's name, "
                                     "images/NAME.toml); use --definition")
    assert r.rc == 2 and "no image definition for base v9.9.9" in r.last_error, r.err
    r = cli("image", root=project)
    assert r.rc == 64 and "missing option --definition NAME" in r.last_error, r.err


def test_make_smoke_runs_smoke_with_the_image_alone() -> None:
    """`make smoke IMAGE=...` hands smoke the image and nothing else: the [smoke] table decides the rest."""
    import subprocess

    done = subprocess.run(["make", "-n", "smoke", f"IMAGE={IMAGE}"], cwd=REPO, capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip().splitlines()[-1].endswith(f"build.py smoke {IMAGE}")


def test_make_smoke_names_the_sites_model_reference_and_key_for_the_table() -> None:
    """`make smoke IMAGE=... MODEL=... REFERENCE=... SIGN_KEY=...`: the site's files as smoke's flags, the rest from
    the definition's [smoke] table (the shipped v0.25.1 one names concurrency, requests and the server's arguments)."""
    import shlex
    import subprocess

    done = subprocess.run(["make", "-n", "smoke", f"IMAGE={IMAGE}", "MODEL=/models/m", "REFERENCE=/refs/a.json",
                           "SIGN_KEY=/keys/k.pem"], cwd=REPO, capture_output=True, text=True, check=True)
    argv = shlex.split(done.stdout.strip().splitlines()[-1].split("tool_run ", 2)[-1])
    assert argv[argv.index("smoke"):] == ["smoke", IMAGE, "--serve-model", "/models/m", "--reference", "/refs/a.json",
                                          "--sign-key", "/keys/k.pem"]
    table = definitions_table()
    assert table["concurrency"] == [1, 2, 4, 8, 16] and table["requests"] == 32 and table["gpu"] == "auto"
    assert "--kv-cache-memory-bytes" in table["serve_args"]


def definitions_table() -> dict[str, object]:
    import tomllib

    return dict(tomllib.loads((REPO / "images" / "v0.25.1.toml").read_text())["smoke"])
