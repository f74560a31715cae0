"""Faults that need no engine: SIGTERM, damaged journal entries, a missing credential helper, a full disk.

Each must end in one `error:` line naming what is at fault and its documented
exit code, with no Python error dump (``cli`` asserts that) and nothing left.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, cli, fails
from vllm_hotfix import records
from vllm_hotfix.errors import EXIT_TERMINATED, RecordError, exit_table


def test_sigterm_ends_like_ctrl_c_with_one_line() -> None:
    """SIGTERM while the tool waits (here for a server's /health): `error: terminated`, exit 143."""
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "build.py"), "serve-check", "--url", "http://127.0.0.1:9", "--wait", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.stderr is not None
    first = proc.stderr.readline()
    assert first.startswith("==> waiting"), first
    proc.send_signal(signal.SIGTERM)
    _out, rest = proc.communicate(timeout=30)
    assert proc.returncode == EXIT_TERMINATED, rest
    assert "Traceback" not in rest, rest
    assert [ln for ln in rest.splitlines() if ln.startswith("error:")] == ["error: terminated"], rest
    assert EXIT_TERMINATED in dict(exit_table())


def _entry(project: Path, kind: str, data: dict[str, object]) -> Path:
    folder = project / "build" / "records" / kind
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{'0' * 19}1-bad.json"
    path.write_text(json.dumps({"kind": kind, **data}))
    return path


WRONG = [
    ("build", {"seq": "abc", "image_id": "sha256:" + "a" * 64}, "'seq'"),
    ("build", {"seq": 1, "inputs": "oops"}, "'inputs'"),
    ("build", {"seq": 1, "image_id": 7}, "'image_id'"),
    ("build", {"seq": 1, "files": {"a.py": "nohash"}}, "'files'"),
    ("build", {"seq": True}, "'seq'"),
    ("push", {"seq": 1, "image_ids": "oops"}, "'image_ids'"),
    ("push", {"seq": 1, "ref": ["x"]}, "'ref'"),
    ("push", {"seq": "abc"}, "'seq'"),
    ("tag", {"seq": 1, "ref": {"a": 1}}, "'ref'"),
    ("tag", {"seq": [1]}, "'seq'"),
]


@pytest.mark.parametrize(("kind", "data", "field"), WRONG)
def test_wrong_typed_entry_is_named(tmp_path: Path, kind: str, data: dict[str, object], field: str) -> None:
    path = _entry(tmp_path, kind, data)
    with pytest.raises(RecordError) as caught:
        records.load(tmp_path, kind)
    assert str(path) in str(caught.value) and field in str(caught.value)


@pytest.mark.parametrize("data", [{"seq": "abc"}, {"seq": 1, "inputs": "oops"}])
def test_list_names_a_wrong_typed_build_entry(project: Path, data: dict[str, object]) -> None:
    path = _entry(project, "build", data)
    r = cli("list", root=project)
    fails(r, str(path), "malformed")
    assert r.rc == RecordError.exit_code


def test_list_names_a_wrong_typed_push_entry(project: Path) -> None:
    _entry(project, "build", {"seq": 1, "image_id": "sha256:" + "a" * 64, "inputs": {"definition": "v0.25.1"}})
    path = _entry(project, "push", {"seq": "abc", "image_id": "sha256:" + "a" * 64})
    r = cli("list", root=project)
    fails(r, str(path), "malformed")
    assert r.rc == RecordError.exit_code


# -- a credential helper named in the docker config that is not installed ------


def _docker_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: dict[str, object]) -> Path:
    folder = tmp_path / "docker-config"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DOCKER_CONFIG", str(folder))
    return folder / "config.json"


@pytest.mark.parametrize(("config", "host", "helper"), [
    ({"credHelpers": {"registry.internal:5000": "nohelper"}}, "registry.internal:5000", "docker-credential-nohelper"),
    ({"credsStore": "nostore"}, "registry.internal:5000", "docker-credential-nostore"),
    ({"credsStore": "nostore"}, "docker.io", "docker-credential-nostore"),
])
def test_missing_credential_helper_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            config: dict[str, object], host: str, helper: str) -> None:
    from vllm_hotfix.engine import dockerconfig
    from vllm_hotfix.errors import PushError

    path = _docker_config(tmp_path, monkeypatch, config)
    with pytest.raises(PushError) as caught:
        dockerconfig.registry_credentials(host)
    assert caught.value.exit_code == 8
    assert helper in str(caught.value) and str(path) in str(caught.value) and "not installed" in str(caught.value)


@pytest.mark.parametrize("operation", ["push of r.internal/x:1", "pulling r.internal/x:1", "asking r.internal"])
def test_sdk_credential_helper_error_maps_to_exit_8(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    operation: str) -> None:
    """What the SDK raises from any call that needs a login (push, pull, a digest lookup): exit 8, helper named."""
    import docker.errors

    from vllm_hotfix.engine.mapping import translating
    from vllm_hotfix.errors import PushError

    _docker_config(tmp_path, monkeypatch, {"credsStore": "gone"})
    raised = docker.errors.DockerException(
        "Credentials store error: StoreError('docker-credential-gone not installed or not available in PATH')")
    with pytest.raises(PushError) as caught, translating(operation, refused=lambda m: PushError(m)):
        raise raised
    assert "docker-credential-gone" in str(caught.value) and caught.value.exit_code == 8


def test_failing_credential_helper_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import docker.errors

    from vllm_hotfix.engine.mapping import translate
    from vllm_hotfix.errors import PushError

    path = _docker_config(tmp_path, monkeypatch, {"credsStore": "broken"})
    mapped = translate("push of r.internal/x:1",
                       docker.errors.DockerException("Credentials store error: StoreError('exit status 1')"))
    assert isinstance(mapped, PushError) and "credential helper" in str(mapped) and str(path) in str(mapped)
