"""Podman's copy of an image read without running it (a stand-in podman on PATH), and the file checks that follow.

The stand-in answers as podman 4.3 does: ``cp CTR:PATH -`` writes a tar of
PATH named by its last part (a link named as the path itself followed), and
a missing path is exit 125 with "could not be found ... no such file or
directory". It logs every call, so the removal of its container is seen.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from vllm_hotfix.building.expected import Expected
from vllm_hotfix.checking.launchers import facts
from vllm_hotfix.checking.launchers.podman import PodmanFiles, PodmanLauncher
from vllm_hotfix.engine import ImageInfo

IMAGE_ID = "sha256:" + "ab" * 32

FAKE = r'''#!PYTHON -IS
import json, os, sys, tarfile
# Its settings beside it: podman runs with a minimal environment (launchers.podman.podman_env).
cfg = json.load(open(os.path.join(os.path.dirname(os.path.abspath(sys.argv[0])), "fake.json")))
root, log = cfg["root"], cfg["log"]
args = sys.argv[1:]
with open(log, "a") as fh:
    fh.write(" ".join(args) + "\n")
if args[:2] == ["image", "inspect"]:
    if args[2] == "absent":
        sys.stderr.write("Error: absent: image not known\n"); sys.exit(125)
    print(json.dumps([{"Id": "ab" * 32, "Config": {"Labels": {}}, "Os": "linux", "Architecture": "amd64"}]))
elif args[0] == "create":
    print("c0ffee")
elif args[0] == "cp":
    ctr, _, path = args[1].partition(":")
    real = os.path.realpath(root + path)
    if not os.path.lexists(root + path):
        sys.stderr.write(f'Error: "{path}" could not be found on container {ctr}: no such file or directory\n')
        sys.exit(125)
    with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
        tar.add(real, arcname=os.path.basename(real))
elif args[0] == "rm":
    pass
'''


@pytest.fixture
def podman(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[PodmanFiles, Path, Path]:
    exe = tmp_path / "bin" / "podman"
    exe.parent.mkdir()
    # The interpreter of the tests by its path, without site: `python3` on PATH may be a version manager's shim,
    # a shell script costing far more than the stand-in's own work at each of its calls.
    exe.write_text(FAKE.replace("PYTHON", sys.executable, 1))
    exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    root = tmp_path / "image"
    (root / "site" / "pkg").mkdir(parents=True)
    (root / "site" / "pkg" / "a.py").write_text("altered\n")
    info = root / "site" / "pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pkg\nVersion: 1.0\n")
    (info / "RECORD").write_text("pkg/a.py,,\npkg-1.0.dist-info/METADATA,,\npkg-1.0.dist-info/RECORD,,\n")
    (root / "elsewhere").mkdir()
    (root / "elsewhere" / "real").mkdir()
    os.symlink("../elsewhere/real", root / "site" / "linked")
    log = tmp_path / "calls.log"
    (exe.parent / "fake.json").write_text(json.dumps({"root": str(root), "log": str(log)}))
    return PodmanFiles(PodmanLauncher(podman=str(exe))), root, log


def test_reads_folders_names_missing_and_links_and_removes_its_container(
        podman: tuple[PodmanFiles, Path, Path]) -> None:
    files, _, log = podman
    info = files.image("ops/vllm:fix")
    assert info is not None and info.id == IMAGE_ID  # as the Docker engine writes IDs
    assert files.image("absent") is None
    with files.files(IMAGE_ID) as reader:
        tree = reader.read(["/site/pkg", "/site/nothing", "/site/linked"], keep=lambda p: p.endswith(".py"))
    fact = tree.file("/site/pkg/a.py")
    assert fact is not None and fact.kind == "file"
    assert fact.sha256 == hashlib.sha256(b"altered\n").hexdigest() and tree.kept["/site/pkg/a.py"] == b"altered\n"
    assert tree.missing == ("/site/nothing",)
    # podman followed the link; the reader reports a link, not the folder it reached.
    linked = tree.file("/site/linked")
    assert linked is not None and linked.kind == "link" and "/site/real" not in tree.entries
    calls = [c for c in log.read_text().splitlines() if not c.startswith("image inspect")]
    assert calls[0].startswith("create") and "--entrypoint /nonexistent-vllm-hotfix-never-started" in calls[0]
    assert calls[-1].startswith("rm --force vllm-hotfix-read-")  # never started, always removed


def _expect(monkeypatch: pytest.MonkeyPatch, good: bytes) -> None:
    want = Expected({"pkg/a.py": hashlib.sha256(good).hexdigest()}, "pkg", "1.0", "x", "test", site_dir="/site")
    monkeypatch.setattr(facts.expected, "for_image", lambda _e, _r, _i, **_found: want)


def _info() -> ImageInfo:
    return ImageInfo(IMAGE_ID, (), (), None, None, (), "")


def test_an_altered_patched_file_fails_patch_landed_read_through_podman(
        podman: tuple[PodmanFiles, Path, Path], monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    files, _, _ = podman
    _expect(monkeypatch, b"patched\n")
    monkeypatch.setenv("VLLM_HOTFIX_CACHE", str(tmp_path / "cache"))
    found = facts.file_facts(tmp_path, _info(), files, None)
    by_name = {c["name"]: c for c in found.checks}
    landed = by_name["patch-landed"]
    assert landed["status"] == "fail" and "altered after the build" in landed["detail"]
    assert by_name["patch-landed"]["data"]["answered_by"] == "filesystem"


def test_files_that_cannot_be_read_are_incomplete_never_skipped(monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    _expect(monkeypatch, b"patched\n")
    files = PodmanFiles(PodmanLauncher(podman=str(tmp_path / "no-podman")))
    found = facts.file_facts(tmp_path, _info(), files, None)
    statuses = {c["name"]: c["status"] for c in found.checks}
    assert {statuses[n] for n in facts.FILE_CHECKS} == {"incomplete"}, statuses
    assert "skip" not in statuses.values()
    assert json.dumps(found.checks)


def test_podman_gpu_request_is_settled_from_the_cdi_specs_it_reads(tmp_path: Path) -> None:
    from vllm_hotfix.checking.launchers.podman import settle_gpu

    empty, specs = tmp_path / "etc-cdi", tmp_path / "run-cdi"
    empty.mkdir()
    specs.mkdir()
    dirs = (str(empty), str(specs), str(tmp_path / "missing"))
    assert settle_gpu("off", "auto", dirs) == (None, None)
    request, settled = settle_gpu("auto", "auto", dirs)
    assert request is None and settled is not None and settled["status"] == "skip"
    assert "defines nvidia.com/gpu=all" in settled["why"] and settled["detail"].endswith("image is GPU-unverified")
    request, settled = settle_gpu("require", "cdi", dirs)
    assert request is None and settled is not None and settled["status"] == "incomplete"
    (specs / "nvidia.yaml").write_text("cdiVersion: 0.5.0\nkind: nvidia.com/gpu\ndevices:\n- name: all\n"
                                       "  containerEdits: {}\n")
    assert settle_gpu("require", "auto", dirs) == ("cdi:nvidia.com/gpu=all", None)
    request, settled = settle_gpu("auto", "cdi:nvidia.com/gpu=0", dirs)  # a device the spec does not define
    assert request is None and settled is not None and "nvidia.com/gpu=0" in settled["why"]


def test_podman_runs_with_only_what_it_needs_of_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """With env_host=true in containers.conf podman hands its environment to the container: a signing key given
    as env:NAME must not be in it."""
    from vllm_hotfix.checking.launchers.podman import podman_env

    monkeypatch.setenv("HOTFIX_SIGNING_KEY", "-----BEGIN PRIVATE KEY-----")
    monkeypatch.setenv("VLLM_HOTFIX_SIGN_KEY_PASSWORD", "secret")
    env = podman_env()
    assert "HOTFIX_SIGNING_KEY" not in env and "VLLM_HOTFIX_SIGN_KEY_PASSWORD" not in env
    assert env.get("PATH") == os.environ["PATH"]


def test_recording_answers_is_planned_for_podman_too(tmp_path: Path) -> None:
    """--record-reference under podman: the job asks the runner to record (it was refused: docker only)."""
    from vllm_hotfix.checking.launchers import plan
    from vllm_hotfix.checking.smoke import SmokeOptions

    target = plan.Target("ops/vllm:x", "sha256:" + "ab" * 32, "sha256:" + "ab" * 32, {})
    model = tmp_path / "model"
    model.mkdir()
    job, _extra = plan.job(tmp_path, target, SmokeOptions(serve_model=model, record_reference=tmp_path / "a.json"),
                           launcher="podman", gpu_request=None)
    assert job["serve"]["record"]["file"] == str(tmp_path / "a.json")
    assert job["serve"]["batches"]
