"""The same image smoke-tested through the runner with docker and with podman: the same checks, the same verdict.

Both on the CDI test device (`.ci/services start-cdi-engine` writes the spec
for the CDI engine in its own folder; for podman, which reads only /etc/cdi
and /var/run/cdi, the `podman_cdi` fixture writes it there for these tests
alone and removes it after, and skips on a host whose own spec already
defines an NVIDIA device, which the stand-in would shadow). The image is built by
the tool on the CDI engine and copied into podman's store (`docker save` |
`podman load`), so both start the same image ID.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import STANDIN_REPO, cli, site_key
from vllm_hotfix.checking.launchers import plan, smoke_run
from vllm_hotfix.checking.launchers.docker import DockerLauncher
from vllm_hotfix.checking.launchers.podman import PodmanLauncher
from vllm_hotfix.checking.smoke import SmokeOptions
from vllm_hotfix.engine import Engine
from vllm_hotfix.trust import signing

from .test_gpu_access import CDI_HOST, cdi_base, cdi_built, cdi_engine  # noqa: F401  (fixtures)

pytestmark = pytest.mark.skipif(shutil.which("podman") is None,
                                reason="podman is not installed (`.ci/services install` installs it)")


PODMAN_CDI = (Path("/etc/cdi"), Path("/var/run/cdi"))  # where podman 4.3 reads CDI specs (no option for another)
TEST_SPEC = Path("/var/run/cdi/vllm-hotfix-test-gpu.json")


def _nvidia_specs() -> list[Path]:
    found = []
    for folder in PODMAN_CDI:
        for spec in sorted(folder.glob("*")) if folder.is_dir() else []:
            try:
                if spec != TEST_SPEC and "nvidia.com/gpu" in spec.read_text(errors="replace"):
                    found.append(spec)
            except OSError:
                continue
    return found


@pytest.fixture(scope="module")
def podman_cdi() -> Iterator[Path]:
    """The stand-in NVIDIA CDI device for podman, for this module's tests only (never left behind)."""
    real = _nvidia_specs()
    if real:
        pytest.skip(f"this host's own CDI spec defines NVIDIA devices ({real[0]}): a stand-in would shadow them")
    TEST_SPEC.parent.mkdir(parents=True, exist_ok=True)
    TEST_SPEC.write_text(json.dumps({
        "cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
        "devices": [{"name": "all", "containerEdits": {"deviceNodes": [{"path": "/dev/zero"}],
                                                       "env": ["VLLM_HOTFIX_CDI_DEVICE=nvidia.com/gpu=all"]}}],
        "containerEdits": {"env": [f"VLLM_HOTFIX_CDI_SPEC={TEST_SPEC}"]}}))
    try:
        yield TEST_SPEC
    finally:
        TEST_SPEC.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def in_podman(podman_cdi: Path, cdi_engine: Engine, cdi_built: tuple[Path, str]) -> Iterator[tuple[Path, str, str]]:  # noqa: F811
    project, ref = cdi_built
    info = cdi_engine.image(ref)
    assert info is not None
    # By name: podman then knows the image by the same short name the engine does.
    save = subprocess.Popen(["docker", "-H", CDI_HOST, "save", ref], stdout=subprocess.PIPE)
    loaded = subprocess.run(["podman", "load"], stdin=save.stdout, capture_output=True, text=True, timeout=300)
    assert save.wait() == 0 and loaded.returncode == 0, loaded.stderr
    yield project, ref, info.id
    subprocess.run(["podman", "rmi", "--force", info.id], capture_output=True, check=False)


def test_docker_and_podman_give_the_same_checks_and_verdict(cdi_engine: Engine,  # noqa: F811
                                                            in_podman: tuple[Path, str, str],
                                                            tmp_path: Path) -> None:
    project, ref, image_id = in_podman
    info = cdi_engine.image(image_id)
    assert info is not None
    target = plan.Target(ref, image_id, image_id, dict(info.labels), f"{info.os}/{info.architecture}")
    options = SmokeOptions(gpu="auto")
    request = "cdi:nvidia.com/gpu=all"
    by_docker = smoke_run.smoke(DockerLauncher(cdi_engine), project, target, options, gpu_request=request).verdict
    by_podman = smoke_run.smoke(PodmanLauncher(), project, target, options, gpu_request=request).verdict

    def shape(v: object) -> list[tuple[str, str, str]]:
        return [(c.name, c.status.value, c.detail) for c in v.checks]  # type: ignore[attr-defined]

    assert shape(by_docker) == shape(by_podman)
    assert by_docker.status == by_podman.status and by_docker.gpu_verified == by_podman.gpu_verified
    # The patch set's GPU check was carried in, and the CDI device reached both containers (no driver in it).
    assert by_podman.gpu["devices"] == [] and "libcuda" in by_podman.gpu["why_unverified"]
    assert {"env-report", "gpu", "serve-sweep"} <= {c.name for c in by_podman.checks}
    assert by_podman.image_id == image_id == by_docker.image_id
    assert json.dumps(by_podman.to_dict()["checks"], sort_keys=True)  # the report serialises as the journal keeps it


def test_smoke_cli_through_podman(in_podman: tuple[Path, str, str], tmp_path: Path) -> None:
    project, ref, image_id = in_podman
    out = tmp_path / "report.json"
    key_file = tmp_path / "hotfix.key"
    key = site_key(key_file)
    envelope = tmp_path / "verdict.dsse.json"
    r = cli("smoke", ref, "--launcher", "podman", "--gpu", "auto", "--gpu-request", "cdi", "--report", str(out),
            "--sign-key", str(key_file), "--attestation", str(envelope), root=project, env={"DOCKER_HOST": CDI_HOST})
    assert r.rc == 0, r.err
    # Signed on this host after it judged the runner's report, verified here with cryptography.
    found = signing.open_envelope(envelope.read_bytes(), key.public_key(), str(envelope))
    assert image_id in found.digests and found.predicate["status"] == "pass"
    report = json.loads(out.read_text())
    assert report["image_id"] == image_id and report["status"] == "pass"
    by_name = {c["name"]: c for c in report["checks"]}
    # File facts from the layers, outside the image; the rest answered by the image's Python through the runner.
    assert by_name["patch-landed"]["status"] == "pass"
    assert by_name["patch-landed"]["data"]["answered_by"] == "filesystem"
    assert by_name["env-report"]["data"]["answered_by"] == "image-python"
    assert report["gpu"]["launcher"] == "podman" and report["gpu_verified"] is False


def test_an_altered_patched_file_is_refused_read_from_podmans_copy(
        cdi_engine: Engine, in_podman: tuple[Path, str, str], tmp_path: Path) -> None:  # noqa: F811
    """The altered image is only in podman's store: its files can only have been read from podman's copy."""
    from vllm_hotfix.building import expected

    project, ref, image_id = in_podman
    info = cdi_engine.image(image_id)
    assert info is not None
    want = expected.for_image(cdi_engine, project, info)
    rel = sorted(want.files)[0]
    context = tmp_path / "ctx"
    context.mkdir()
    (context / "altered.py").write_text("# altered after the build\n")
    (context / "Dockerfile").write_text(f"FROM {image_id}\nCOPY altered.py {want.site_dir}/{rel}\n")
    altered = f"localhost/vllm-hotfix-altered-{uuid.uuid4().hex[:10]}:x"
    built = subprocess.run(["docker", "-H", CDI_HOST, "build", "-q", "-t", altered, str(context)],
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    try:
        save = subprocess.Popen(["docker", "-H", CDI_HOST, "save", altered], stdout=subprocess.PIPE)
        loaded = subprocess.run(["podman", "load"], stdin=save.stdout, capture_output=True, text=True, timeout=300)
        assert save.wait() == 0 and loaded.returncode == 0, loaded.stderr
    finally:
        subprocess.run(["docker", "-H", CDI_HOST, "rmi", altered], capture_output=True, check=False)
    try:
        out = tmp_path / "report.json"
        # No build record of it: its base is the definition's, in the repository the patch set was built from.
        r = cli("smoke", altered, "--launcher", "podman", "--gpu", "off", "--base-repo", STANDIN_REPO, "--report",
                str(out), root=project, env={"DOCKER_HOST": CDI_HOST})
        # Read from podman's copy, the layer the edit added is not the builder's: refused before any check (14).
        assert r.rc == 14, r.err
        [identity] = json.loads(out.read_text())["checks"]
        assert identity["name"] == "layer-identity" and identity["status"] == "fail", identity
        assert "2 layer(s) over the base" in identity["detail"]
        assert identity["data"]["answered_by"] == "filesystem"
    finally:
        subprocess.run(["podman", "rmi", "--force", altered], capture_output=True, check=False)


def test_podman_without_a_cdi_spec_behaves_as_docker_without_a_gpu(in_podman: tuple[Path, str, str],
                                                                     podman_cdi: Path, tmp_path: Path) -> None:
    """A host whose CDI specs define no NVIDIA device: --gpu auto leaves the image GPU-unverified (the checks
    that need no GPU still run), --gpu require is incomplete (exit 11); podman is never asked for the device."""
    project, ref, _ = in_podman
    podman_cdi.unlink()
    try:
        out = tmp_path / "auto.json"
        r = cli("smoke", ref, "--launcher", "podman", "--gpu", "auto", "--report", str(out), root=project,
                env={"DOCKER_HOST": CDI_HOST})
        assert r.rc == 0, r.err
        report = json.loads(out.read_text())
        gpu = next(c for c in report["checks"] if c["name"] == "gpu")
        assert gpu["status"] == "skip" and "no CDI spec in /etc/cdi or /var/run/cdi defines nvidia.com/gpu=all" \
            in gpu["detail"]
        assert report["gpu_verified"] is False and report["status"] == "pass"
        r = cli("smoke", ref, "--launcher", "podman", "--gpu", "require", root=project, env={"DOCKER_HOST": CDI_HOST})
        assert r.rc == 11 and "unresolvable CDI devices" not in r.err, r.err
        assert "--gpu require: podman: no CDI spec" in r.err
    finally:
        podman_cdi.write_text(json.dumps({
            "cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
            "devices": [{"name": "all", "containerEdits": {"deviceNodes": [{"path": "/dev/zero"}],
                                                           "env": ["VLLM_HOTFIX_CDI_DEVICE=nvidia.com/gpu=all"]}}],
            "containerEdits": {"env": [f"VLLM_HOTFIX_CDI_SPEC={podman_cdi}"]}}))


def test_podman_runs_the_runner_without_any_host_wide_limits(in_podman: tuple[Path, str, str], tmp_path: Path) -> None:
    """Only the distribution's containers.conf (CONTAINERS_CONF makes podman read that file alone): no drop-in
    that lowers every container's limits. Where this host's hard limits are below podman's defaults, podman's
    own choice fails in runc ("error setting rlimits"); the launcher gives its container limits the host allows."""
    project, ref, _ = in_podman
    distribution = Path("/usr/share/containers/containers.conf")
    conf = tmp_path / "containers.conf"
    conf.write_text(distribution.read_text() if distribution.is_file() else "")
    out = tmp_path / "report.json"
    r = cli("smoke", ref, "--launcher", "podman", "--gpu", "off", "--report", str(out), root=project,
            env={"DOCKER_HOST": CDI_HOST, "CONTAINERS_CONF": str(conf)})
    assert r.rc == 0, r.err
    assert json.loads(out.read_text())["status"] == "pass"
