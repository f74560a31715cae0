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
