"""GPU access without a GPU: every request path, on real engines.

The CDI-capable engine (Docker 26.1, started by `.ci/services start-cdi-engine`
on its own socket) has a CDI spec defining `nvidia.com/gpu=all` over
/dev/zero, as `nvidia-ctk cdi generate` would over the real device nodes. It
proves the CDI request reaches the container, and that a container without
CUDA is reported GPU-unverified (auto) or a failure (require), never verified.
The distribution's 20.10 engine shows what a host without CDI says.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, RUN_ID, STANDIN_REPO, cli, copy_tracked, drop_standins, make_standin, unique_name
from vllm_hotfix.checking.launchers.docker import DockerRun
from vllm_hotfix.checking.smoke import SmokeOptions
from vllm_hotfix.engine import Engine, GpuRequest

CDI_HOST = os.environ.get("CDI_DOCKER_HOST", "unix:///run/vllm-hotfix-cdi/docker.sock")
ENV_PROBE = ["python3", "-c", "import os; print(os.environ.get('VLLM_HOTFIX_CDI_DEVICE', '-')); "
             "print(os.path.exists('/dev/zero'))"]


@pytest.fixture(scope="module")
def cdi_engine() -> Iterator[Engine]:
    saved = os.environ.get("DOCKER_HOST")
    os.environ["DOCKER_HOST"] = CDI_HOST
    try:
        eng = Engine.connect(timeout=30)
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"no CDI-capable engine on {CDI_HOST} ({exc}): run `.ci/services start-cdi-engine`")
    finally:
        if saved is None:
            os.environ.pop("DOCKER_HOST", None)
        else:
            os.environ["DOCKER_HOST"] = saved
    yield eng
    leaks = eng.containers_with_role(RUN_ID)
    assert not leaks, f"containers left behind on the CDI engine: {leaks}"


@pytest.fixture(scope="module")
def cdi_base(cdi_engine: Engine) -> Iterator[str]:
    """The vLLM 0.25.1 stand-in (Python, vLLM sources, no CUDA) in the CDI engine."""
    yield make_standin(cdi_engine, "0.25.1")
    drop_standins(cdi_engine)


def test_cdi_request_reaches_the_container(cdi_engine: Engine, cdi_base: str) -> None:
    facts = cdi_engine.facts()
    assert facts.cdi_spec_dirs, f"engine {facts.server_version} lists no CDI spec folders"
    with_cdi = cdi_engine.run(cdi_base, ENV_PROBE, gpu=GpuRequest("cdi", device="nvidia.com/gpu=all"), timeout=60)
    assert with_cdi.stdout.split() == ["nvidia.com/gpu=all", "True"], with_cdi
    without = cdi_engine.run(cdi_base, ENV_PROBE, timeout=60)
    assert without.stdout.split()[0] == "-"


@pytest.fixture(scope="module")
def cdi_built(cdi_engine: Engine, cdi_base: str,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """The patch set built by the tool on the CDI engine (its smoke ran with --gpu auto)."""
    project = tmp_path_factory.mktemp("cdi") / "project"
    copy_tracked(REPO, ("images", "patches"), project)
    ref = f"hotfix-test/cdi-{unique_name()}:v0.25.1-m3patch"
    r = cli("image", "--definition", "v0.25.1", "--base-repo", STANDIN_REPO, "--tag", ref, "--pull", "never",
            root=project, env={"DOCKER_HOST": CDI_HOST})
    assert r.rc == 0, r.err
    yield project, ref
    cdi_engine.remove_image(ref)


def test_auto_on_cdi_host_without_cuda_is_gpu_unverified(cdi_engine: Engine, cdi_built: tuple[Path, str]) -> None:
    project, ref = cdi_built
    report = DockerRun(cdi_engine, project, SmokeOptions(gpu="auto"), lambda _l: None).run(ref)
    assert report.status == "pass", report.checks
    gpu = next(c for c in report.checks if c.name == "gpu")
    assert gpu.status == "skip" and "GPU-unverified" in gpu.detail
    assert report.gpu_verified is False and report.gpu["verified"] is False
    tried = {a["way"]: a for a in report.gpu["tried"]}
    # CDI was offered, tried first, reached the container, and found no driver there.
    assert report.gpu["tried"][0]["way"] == "cdi:nvidia.com/gpu=all"
    assert tried["cdi:nvidia.com/gpu=all"]["tried"] and "sees no GPU" in tried["cdi:nvidia.com/gpu=all"]["detail"]
    assert "could not select device driver" in tried["gpus"]["detail"]
    assert report.gpu["way"] is None and "cdi:nvidia.com/gpu=all" in report.gpu["why_unverified"]
    assert report.to_dict()["gpu"] == report.gpu


def test_require_on_cdi_host_without_cuda_fails(cdi_built: tuple[Path, str], tmp_path: Path) -> None:
    project, ref = cdi_built
    out = tmp_path / "report.json"
    r = cli("smoke", ref, "--gpu", "require", "--gpu-request", "cdi", "--report", str(out),
            root=project, env={"DOCKER_HOST": CDI_HOST})
    # The host's shortcoming: the run fails, the verdict is incomplete (never a pass, never verified).
    assert r.rc == 11, r.err
    assert "--gpu require: no GPU request gave a container of this image a GPU" in r.last_error
    assert "cdi:nvidia.com/gpu=all: container started but sees no GPU" in r.last_error
    report = json.loads(out.read_text())
    gpu = next(c for c in report["checks"] if c["name"] == "gpu")
    assert gpu["status"] == "incomplete" and report["status"] == "incomplete"
    assert report["gpu_verified"] is False and report["gpu"]["verified"] is False
    assert [a["way"] for a in report["gpu"]["tried"]] == ["cdi:nvidia.com/gpu=all"]


def test_explicit_request_the_engine_cannot_serve(engine: Engine, base_v0251: str, project: Path,
                                                  tmp_path: Path) -> None:
    # The definition's base itself (its identity check skips); --keep-going: it fails its file checks first, and
    # the GPU request is what is under test.
    r = cli("smoke", base_v0251, "--definition", "v0.25.1", "--gpu", "require", "--gpu-request", "runtime:nvidia",
            "--keep-going", "--report", str(tmp_path / "r.json"), root=project)
    assert r.rc != 0
    report = json.loads((tmp_path / "r.json").read_text())
    [attempt] = report["gpu"]["tried"]
    assert attempt["way"] == "runtime:nvidia" and attempt["tried"] and not attempt["ok"]
    assert "nvidia" in attempt["detail"]
