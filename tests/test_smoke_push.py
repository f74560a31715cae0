"""Integration tier: smoke inside built images, the serve sweep, the push gate.

Real engine, real registry (Debian's docker-registry on a loopback port the
test picks), real stand-in images. vLLM cannot run here, so the sweep runs
against tests/fake_openai.py, as a host process and as an image's own
`vllm` entrypoint, healthy and dying at concurrency 2 as the bug did.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from conftest import REPO, cli, derive
from vllm_hotfix import records
from vllm_hotfix.engine import Engine

pytestmark = pytest.mark.engine
SITE = "/usr/local/lib/python3.12/dist-packages"
INDEXER = "vllm/models/minimax_m3/common/indexer.py"
FAKE = REPO / "tests" / "fake_openai.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    def __init__(self, tmp: Path) -> None:
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.config = tmp / "registry.yml"
        self.config.write_text(
            "version: 0.1\nlog: {level: error}\n"
            f"storage: {{filesystem: {{rootdirectory: {tmp / 'data'}}}}}\n"
            f"http: {{addr: {self.addr}}}\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        exe = shutil.which("docker-registry")
        assert exe, "docker-registry is not installed (apt-get install docker-registry)"
        self.proc = subprocess.Popen([exe, "serve", str(self.config)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                if requests.get(f"http://{self.addr}/v2/", timeout=1).status_code == 200:
                    return
            except requests.RequestException:
                time.sleep(0.2)
        raise RuntimeError("registry did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def registry(tmp_path: Path) -> Iterator[Registry]:
    reg = Registry(tmp_path)
    reg.start()
    yield reg
    reg.stop()


@pytest.fixture
def built(engine: Engine, base_v0251: str, project: Path, unique: str) -> Iterator[tuple[Path, str, str]]:
    """A patched image built (and smoke-tested) by the tool, in a project copy."""
    ref = f"hotfix-test/smoke-{unique}:v0.25.1-m3patch"
    r = cli("image", "--base", "v0.25.1", "--tag", ref, "--pull", "never", root=project)
    assert r.rc == 0, r.err
    image_id = r.out.split()[-1]
    yield project, ref, image_id
    engine.untag(ref)


def test_image_runs_smoke_and_records_it(built: tuple[Path, str, str]) -> None:
    project, ref, image_id = built
    [rec] = records.find_by_image(project, image_id)
    smoke = rec.data["smoke"]
    assert rec.data["smoke_status"] == "pass"
    names = {c["name"]: c["status"] for c in smoke["checks"]}
    assert names["patch-landed"] == "pass"
    assert names["integrity"] == "pass"
    assert names["gpu"] == "skip"  # no NVIDIA runtime on this host
    assert smoke["gpu_verified"] is False
    assert rec.data["inputs"]["patches"]


def test_unchanged_rebuild_reuses_the_recorded_image(engine: Engine, built: tuple[Path, str, str]) -> None:
    project, ref, image_id = built
    r = cli("image", "--base", "v0.25.1", "--tag", ref, "--pull", "never", root=project)
    assert r.rc == 0, r.err
    assert r.out.strip() == f"reused {ref} {image_id}"
    assert "inputs unchanged" in r.err
    r = cli("image", "--base", "v0.25.1", "--tag", ref, "--pull", "never", "--no-smoke", "--rebuild", root=project)
    assert r.rc == 0 and r.out.startswith("built "), r.err


def test_reuse_of_an_unsmoked_build_runs_smoke_first(engine: Engine, base_v0251: str, project: Path,
                                                     unique: str) -> None:
    ref = f"hotfix-test/nosmoke-{unique}:x"
    r = cli("image", "--base", "v0.25.1", "--tag", ref, "--pull", "never", "--no-smoke", root=project)
    assert r.rc == 0, r.err
    image_id = r.out.split()[-1]
    try:
        [rec] = records.find_by_image(project, image_id)
        assert rec.data["smoke_status"] is None
        r = cli("image", "--base", "v0.25.1", "--tag", ref, "--pull", "never", root=project)
        assert r.rc == 0 and r.out.strip() == f"reused {ref} {image_id}", r.err
        assert "no smoke result recorded yet" in r.err
        [rec] = records.find_by_image(project, image_id)
        assert rec.data["smoke_status"] == "pass"
    finally:
        engine.untag(ref)


def test_smoke_reports_and_tampered_image_fails(engine: Engine, built: tuple[Path, str, str], tmp_path: Path,
                                                unique: str) -> None:
    project, ref, image_id = built
    ok = cli("smoke", ref, "--report", str(tmp_path / "ok.json"), "--junit", str(tmp_path / "ok.xml"), root=project)
    assert ok.rc == 0, ok.err
    assert "GPU-unverified" in ok.out
    report = json.loads((tmp_path / "ok.json").read_text())
    assert report["status"] == "pass" and report["image_id"] == image_id
    assert report["environment"]["packages"]["vllm"] == "0.25.1"
    suite = ET.parse(tmp_path / "ok.xml").getroot()
    assert int(suite.get("tests", "0")) == len(report["checks"]) and suite.get("failures") == "0"

    tampered = f"hotfix-test/tampered-{unique}:x"
    derive(engine, image_id, tampered, f"RUN echo '# edited by hand' >> {SITE}/{INDEXER}")
    try:
        bad = cli("smoke", tampered, "--report", str(tmp_path / "bad.json"), "--junit", str(tmp_path / "bad.xml"),
                  root=project)
        assert bad.rc != 0
        assert "patch-landed" in bad.last_error and tampered in bad.last_error
        report = json.loads((tmp_path / "bad.json").read_text())
        landed = next(c for c in report["checks"] if c["name"] == "patch-landed")
        assert landed["status"] == "fail" and "altered after the build" in landed["detail"]
        integrity = next(c for c in report["checks"] if c["name"] == "integrity")
        assert integrity["status"] == "fail"
        suite = ET.parse(tmp_path / "bad.xml").getroot()
        failed = [tc.get("name") for tc in suite if tc.find("failure") is not None]
        assert "patch-landed" in failed
    finally:
        engine.remove_image(tampered)


def test_stale_bytecode_fails_smoke(engine: Engine, built: tuple[Path, str, str], unique: str) -> None:
    project, ref, image_id = built
    stale = f"hotfix-test/stale-{unique}:x"
    # An unchecked pyc compiled from other source: Python would serve it.
    derive(engine, image_id, stale, (
        "RUN python3 -c \"import py_compile, importlib.util as u; "
        f"p='{SITE}/{INDEXER}'; open('/tmp/o.py','w').write('x = 1\\n'); "
        "py_compile.compile('/tmp/o.py', cfile=u.cache_from_source(p), "
        "invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\""
    ))
    try:
        r = cli("smoke", stale, root=project)
        assert r.rc != 0 and "patch-landed" in r.last_error
        assert "stale" in r.err
    finally:
        engine.remove_image(stale)


def test_gpu_require_without_nvidia_runtime(built: tuple[Path, str, str]) -> None:
    project, ref, _ = built
    r = cli("smoke", ref, "--gpu", "require", root=project)
    assert r.rc != 0 and "gpu" in r.last_error
    assert "--gpu require: no GPU request gave a container of this image a GPU" in r.err
    assert 'could not select device driver "" with capabilities: [[gpu]]' in r.err


def _serve(port: int, *extra: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, str(FAKE), "serve", "test-model", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc


def test_serve_check_healthy_server(tmp_path: Path) -> None:
    port = free_port()
    proc = _serve(port)
    try:
        r = cli("serve-check", "--url", f"http://127.0.0.1:{port}", "--concurrency", "1,2,4,8,16",
                "--requests", "32", "--report", str(tmp_path / "s.json"))
        assert r.rc == 0, r.err
        data = json.loads((tmp_path / "s.json").read_text())
        assert [lv["concurrency"] for lv in data["levels"]] == [1, 2, 4, 8, 16]
        for lv in data["levels"]:
            assert lv["successes"] == 32 and lv["failures"] == 0
            assert lv["p50_s"] <= lv["p95_s"]
            assert lv["output_tokens_per_s"] > 0
    finally:
        proc.kill()
        proc.wait()


def test_serve_check_server_dying_at_concurrency_2() -> None:
    port = free_port()
    proc = _serve(port, "--die-at-concurrency", "2")
    try:
        r = cli("serve-check", "--url", f"http://127.0.0.1:{port}", "--requests", "8")
        assert r.rc != 0
        assert "serve sweep failed at concurrency 2" in r.last_error
        assert "concurrency   1:    8/8" in r.err  # single requests worked
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("die", [False, True])
def test_smoke_serve_sweep_uses_the_image_entrypoint(
    engine: Engine, built: tuple[Path, str, str], tmp_path: Path, unique: str, die: bool
) -> None:
    project, ref, image_id = built
    served = f"hotfix-test/served-{unique}:x"
    derive(engine, image_id, served, "COPY vllm /usr/local/bin/vllm", {"vllm": FAKE.read_bytes()}, {"vllm": 0o755})
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    args = ["--serve-arg=--die-at-concurrency", "--serve-arg=2"] if die else []
    try:
        r = cli("smoke", served, "--serve-model", str(model), *args, "--concurrency", "1,2,4", "--requests", "6",
                "--report", str(tmp_path / "r.json"), root=project)
        report = json.loads((tmp_path / "r.json").read_text())
        sweep_check = next(c for c in report["checks"] if c["name"] == "serve-sweep")
        if die:
            assert r.rc != 0
            assert sweep_check["status"] == "fail"
            assert "concurrency 2" in sweep_check["detail"]
            assert any("illegal memory access" in ln for ln in sweep_check["data"]["server_log"])
        else:
            assert r.rc == 0, r.err
            assert sweep_check["status"] == "pass"
            assert [lv["successes"] for lv in report["sweep"]["levels"]] == [6, 6, 6]
    finally:
        engine.remove_image(served)


def test_push_gate_and_push(engine: Engine, built: tuple[Path, str, str], registry: Registry, unique: str) -> None:
    project, ref, image_id = built
    dest = f"{registry.addr}/ops"
    # GPU-unverified: refused without the flag.
    r = cli("push", ref, "--registry", dest, root=project)
    assert r.rc != 0 and "GPU-unverified" in r.last_error
    r = cli("push", ref, "--registry", dest, "--allow-gpu-unverified", root=project)
    assert r.rc == 0, r.err
    target = f"{dest}/smoke-{unique}:v0.25.1-m3patch"
    line = r.out.strip().splitlines()[-1]
    assert line.startswith(f"pushed {target} sha256:")
    digest = line.split()[-1]
    resp = requests.get(
        f"http://{registry.addr}/v2/ops/smoke-{unique}/manifests/v0.25.1-m3patch",
        headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"}, timeout=10,
    )
    assert resp.status_code == 200 and resp.headers["Docker-Content-Digest"] == digest
    [rec] = records.find_by_image(project, image_id)
    assert rec.data["pushes"][-1] == {**rec.data["pushes"][-1], "ref": target, "digest": digest}
    assert engine.image(target) is None  # the push tag is not left behind


def test_push_refuses_untested_image(engine: Engine, built: tuple[Path, str, str], registry: Registry,
                                     unique: str) -> None:
    project, ref, image_id = built
    untested = f"hotfix-test/untested-{unique}:x"
    derive(engine, image_id, untested, "LABEL extra=1")
    try:
        r = cli("push", untested, "--registry", f"{registry.addr}/ops", "--allow-gpu-unverified", root=project)
        assert r.rc != 0 and "no passing smoke record" in r.last_error and untested in r.last_error
        assert requests.get(f"http://{registry.addr}/v2/ops/untested-{unique}/tags/list", timeout=5).status_code == 404
    finally:
        engine.remove_image(untested)


def test_push_retries_while_registry_is_down(built: tuple[Path, str, str], tmp_path: Path) -> None:
    project, ref, _ = built
    reg = Registry(tmp_path)  # configured, not started: down when the push starts
    timer = threading.Timer(2.5, reg.start)
    timer.start()
    try:
        r = cli("push", ref, "--registry", f"{reg.addr}/ops", "--allow-gpu-unverified", root=project)
        timer.join()
        assert r.rc == 0, r.err
        assert "retrying" in r.err
        assert r.out.startswith(f"pushed {reg.addr}/ops/")
    finally:
        timer.cancel()
        reg.stop()
