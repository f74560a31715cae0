"""The runner without an image: a job run with this Python, and its report read back and judged as the host
judges it (the runner signs nothing and holds no key)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from vllm_hotfix.checking.launchers import base
from vllm_hotfix.errors import SmokeError
from vllm_hotfix.judges import judging

IMAGE_ID = "sha256:" + "cd" * 32


def _job(**more: object) -> dict[str, object]:
    return {"image": "ops/vllm:fix", "image_id": IMAGE_ID, "launcher": "test", "env_names": [], "pins": None,
            "cpu_checks": [], "gpu": {"mode": "off"}, "serve": None, "probe_timeout": 60,
            "checks": [{"name": "patch-landed", "status": "pass", "detail": "read from the layers"}], **more}


def _run(folder: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    # -I: nothing of this checkout on sys.path, as in an image; -S: no site-packages either (an image's
    # hold anything, or nothing): the staged folder and the standard library alone must do.
    return subprocess.run([sys.executable, "-I", "-S", *flags, str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=120, cwd=folder)


def test_the_runner_imports_nothing_but_the_standard_library(tmp_path: Path) -> None:
    job = _job()
    folder = base.stage(tmp_path / "runner", job)
    done = _run(folder, "-X", "importtime")
    assert done.returncode == 0, done.stderr
    assert judging.host_verdict(job, base.results(done.stdout, done.stderr, "test runner").report).status.value \
        == "pass"
    imported = {line.rsplit("|", 1)[-1].strip().split(".")[0] for line in done.stderr.splitlines()
                if line.startswith("import time:") and not line.endswith("imported package")}
    assert "vllm_hotfix" in imported  # the staged copy: nothing else of the tool is on the path
    outside = sorted(imported - set(sys.stdlib_module_names) - {"vllm_hotfix"})
    # importtime also lists imports that were tried and failed (pickle looks for Jython's org.python): such a
    # name must not be importable here, so the runner did without it.
    found = subprocess.run([sys.executable, "-I", "-S", "-c", "import importlib.util, sys; "
                            "print([n for n in sys.argv[1:] if importlib.util.find_spec(n)])", *outside],
                           capture_output=True, text=True, cwd=folder)
    assert found.stdout.strip() == "[]", (outside, found.stdout, found.stderr)


def test_staged_runner_runs_alone_and_the_host_judges_its_report(tmp_path: Path) -> None:
    job = _job()
    folder = base.stage(tmp_path / "runner", job)
    assert not [p for p in folder.rglob("*") if "key" in p.name or "p256" in p.name]
    done = _run(folder)
    assert done.returncode == 0, done.stderr
    launched = base.results(done.stdout, done.stderr, "test runner")
    v = judging.host_verdict(job, launched.report)
    assert v.image_id == IMAGE_ID and v.status.value == "pass", v.checks
    names = [c.name for c in v.checks]
    assert names[0] == "patch-landed" and "env-report" in names and names[-2:] == ["gpu", "serve-sweep"]
    assert v.gpu["mode"] == "off" and v.gpu_verified is False
    assert "@@vllm-hotfix-runner:envelope" not in done.stdout


def test_gpu_require_without_a_gpu_is_incomplete(tmp_path: Path) -> None:
    job = _job(gpu={"mode": "require", "request": "cdi:nvidia.com/gpu=all"})
    done = _run(base.stage(tmp_path / "runner", job))
    v = judging.host_verdict(job, base.results(done.stdout, done.stderr, "test runner").report)
    gpu = next(c for c in v.checks if c.name == "gpu")
    assert gpu.status.value == "incomplete" and "cdi:nvidia.com/gpu=all sees no GPU" in gpu.detail
    assert v.status.value == "incomplete"


def test_bad_job_and_no_report_are_one_line(tmp_path: Path) -> None:
    folder = base.stage(tmp_path / "runner", _job())
    (folder / "job.json").write_text("[]")
    done = _run(folder)
    assert done.returncode == 2 and "not a version 3 runner job" in done.stderr
    with pytest.raises(SmokeError, match=r"runner in x: the runner gave no report \(boom\)"):
        base.results("", "boom\n", "runner in x")


def test_compiled_files_the_image_lacks_keep_it_gpu_unverified(tmp_path: Path) -> None:
    missing = ["vllm/_C.abi3.so", "vllm/_moe_C.abi3.so (the base's)"]
    job = _job(gpu={"mode": "auto", "request": "none"})
    folder = base.stage(tmp_path / "runner", job)
    done = _run(folder)
    v = judging.host_verdict(job, base.results(done.stdout, done.stderr, "test runner").report,
                             compiled_missing=missing)
    check = next(c for c in v.checks if c.name == "compiled-files")
    assert check.status.value == "skip" and "image is GPU-unverified" in check.detail
    assert (check.data or {})["answered_by"] == "filesystem" and (check.data or {})["missing"] == missing
    assert v.gpu_verified is False and v.gpu["compiled_missing"] == missing
    assert "2 compiled file(s)" in v.gpu["why_unverified"]


def test_compiled_files_missing_fail_under_require_with_a_gpu_reached() -> None:
    from vllm_hotfix.verdicts import Check, Status, judge

    job = _job(gpu={"mode": "require", "request": "cdi:nvidia.com/gpu=all"})
    torch = Check("gpu-torch", Status.PASS, "ok", ran_against="torch")
    report = judge("x", IMAGE_ID, [Check("env-report", Status.PASS), torch, Check("serve-sweep", Status.SKIP)],
                   gpu_verified=True, gpu={"devices": ["NVIDIA H200"], "raw_checks": [torch.to_dict()]})
    v = judging.host_verdict(job, report, compiled_missing=["vllm/_C.abi3.so"])
    compiled = next(c for c in v.checks if c.name == "compiled-files")
    assert compiled.status.value == "fail" and compiled.detail.startswith("--gpu require, but 1")
    assert v.gpu_verified is False
    # Nothing missing: the GPU checks, judged here, stand.
    assert judging.host_verdict(job, report).gpu_verified is True


def test_the_job_names_where_the_package_must_import_from(tmp_path: Path) -> None:
    from vllm_hotfix.checking.launchers import plan
    from vllm_hotfix.checking.smoke import SmokeOptions

    target = plan.Target("ops/vllm:fix", IMAGE_ID, IMAGE_ID, {})
    landed = {"package": "vllm", "site_dir": "/usr/lib/python3/dist-packages"}
    job, _ = plan.job(tmp_path, target, SmokeOptions(), launcher="podman", gpu_request=None, landed=landed)
    assert job["landed"] == landed and "sign" not in job and "compiled_missing" not in job["gpu"]
    assert judging.required(job) == ["import-location", "env-report", "serve-sweep"]


def test_the_runner_leaves_no_scratch_folder(tmp_path: Path) -> None:
    """Run on a host (as these tests do), the runner's own scratch folder goes with it (12 were left per unit run)."""
    folder = tmp_path / "runner"
    base.stage(folder, _job())
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-I", str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=120, cwd=folder, env={"TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stderr
    assert list(scratch.iterdir()) == []


def test_staging_folders_of_gone_processes_are_swept(tmp_path: Path) -> None:
    """A run killed mid-smoke leaves its staging folder: the next run removes it."""
    from vllm_hotfix.journal import leftovers

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    dead = tmp_path / f"{leftovers.STAGING}pytest-run-1-{gone.pid}-abcd_123"
    dead_scratch = tmp_path / f"{leftovers.SCRATCH}pytest-run-1-{gone.pid}-abcd_123"  # a build's, killed
    live = tmp_path / f"{leftovers.staging_prefix()}efgh_456"
    live_scratch = tmp_path / f"{leftovers.staging_prefix(leftovers.SCRATCH)}efgh_456"
    other = tmp_path / "vllm-hotfix-runner-abcdefgh"  # no owner in its name: not the sweep's to judge
    for d in (dead, dead_scratch, live, live_scratch, other):
        (d / "runner").mkdir(parents=True)
        (d / "runner" / "job.json").write_text("{}")
    assert leftovers.sweep_staging(tmp_path) == 2
    assert not dead.exists() and not dead_scratch.exists() and live.exists() and live_scratch.exists()
    assert other.exists()


def test_an_interrupted_run_removes_its_own_staging_folder_the_interrupt_caught_half_made(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM landing inside ``tempfile.TemporaryDirectory`` (the folder made, its clean-up not yet set up) left
    the folder behind a run that reported "terminated": the run removes this process's own before it reports."""
    import tempfile

    from vllm_hotfix import cli
    from vllm_hotfix.errors import Terminated
    from vllm_hotfix.journal import leftovers

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    other = tmp_path / f"{leftovers.STAGING}pytest-run-1-1-abcd_123"  # pid 1: alive, and not this process
    other.mkdir()

    def caught_half_made(**_kw: object) -> None:
        from vllm_hotfix.building import sources

        tempfile.mkdtemp(prefix=leftovers.staging_prefix())
        tempfile.mkdtemp(prefix=sources.scratch_prefix())  # a build's scratch tree, caught the same way
        raise Terminated()

    monkeypatch.setattr(cli.main, "main", caught_half_made)
    assert cli._run([], "build.py") == 143
    assert sorted(p.name for p in tmp_path.iterdir()) == [other.name]


def test_the_batch_probe_starts_with_the_server_only_where_the_kv_cache_size_is_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --kv-cache-memory-bytes each vLLM engine measures the GPU's free memory as it starts: the probe's
    engine then waits for the server's sweep to end (it starts in finish), and gets its own time there."""
    from vllm_hotfix.inimage.runner import serve

    events: list[str] = []

    class Recorder:
        def __init__(self, spec: object, scratch: str, probe: str) -> None:
            self.proc = None

        def start(self) -> None:
            events.append("probe-start")

        def finish(self, grace: float) -> dict[str, object]:
            events.append(f"probe-finish({grace:.0f})")
            return {"lines": [], "exit": 0, "error": "", "log": [], "seconds": 0.0}

        def stop(self) -> None:
            events.append("probe-stop")

    monkeypatch.setattr(serve, "Batches", Recorder)
    for overlap in (False, True):
        events.clear()
        spec = {"argv": [str(tmp_path / "no-such-server")], "port": 9, "overlap": overlap, "batches": {"levels": [1]}}
        serving = serve.Serving(spec, str(tmp_path), say=lambda _l: None, phases={}, probe="p")
        serving.start()
        assert events == (["probe-start"] if overlap else []), events
        check, _ = serving.finish()
        assert check["status"] == "fail"  # no server: the sweep fails, the probe's replies are still collected
        assert events[-1] == f"probe-finish({serve.BATCH_GRACE})"


# Shows FAKE_GPUS devices to whoever loads it (the GPU listing asks the driver library itself).
LIBCUDA = r"""
#include <stdlib.h>
#include <string.h>
int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDeviceGetCount(int *n) { const char *e = getenv("FAKE_GPUS"); *n = e ? atoi(e) : 0; return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDeviceGetName(char *buf, int len, int d) { (void)d; strncpy(buf, "Test GPU", len); return 0; }
int cuGetErrorName(int rc, const char **s) { (void)rc; *s = "CUDA_ERROR_TEST"; return 0; }
"""
# A patch-set GPU check that says which GPU it was shown and how its Python was started.
SEEN_CHECK = b"""
import json, os, sys
seen = os.environ.get("CUDA_VISIBLE_DEVICES", "")
flags = {"no_site": sys.flags.no_site, "no_user_site": sys.flags.no_user_site}
print(json.dumps({"checks": [{"name": "seen", "status": "fail" if seen == "5" else "pass", "ran_against": "vllm",
                              "detail": f"visible {seen}", "data": flags}]}))
"""


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("libcuda")
    (folder / "libcuda.c").write_text(LIBCUDA)
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), str(folder / "libcuda.c")],
                   check=True)
    return folder


def _gpu_run(tmp_path: Path, driver: Path, gpus: int, parallel: int,
             visible: str) -> tuple[dict[str, Any], dict[str, Any]]:
    job = _job(gpu={"mode": "auto", "request": "test", "extra": ["checks/seen.py"], "tensor_parallel": parallel})
    folder = base.stage(tmp_path / "runner", job, {"checks/seen.py": SEEN_CHECK})
    env = {"PATH": "/usr/bin:/bin", "LD_LIBRARY_PATH": str(driver), "FAKE_GPUS": str(gpus),
           "CUDA_VISIBLE_DEVICES": visible, "PYTHONPATH": str(tmp_path / "not-for-children")}
    done = subprocess.run([sys.executable, "-I", "-S", str(folder / "run.py"), str(folder / "job.json")],
                          capture_output=True, text=True, timeout=120, cwd=folder, env=env)
    report = base.results(done.stdout, done.stderr, "test runner").report.to_dict()
    checks = {c["name"]: c for c in report["checks"]}
    return checks, report


def test_a_tensor_parallel_run_checks_each_gpu_of_the_server_in_a_child_as_isolated_as_itself(
        tmp_path: Path, fake_driver: Path) -> None:
    checks, _ = _gpu_run(tmp_path, fake_driver, gpus=3, parallel=2, visible="3,4,5")
    seen = checks["seen"]
    # One check, run on the first two GPUs of the three, each alone: their details and runs side by side.
    assert seen["status"] == "pass" and seen["detail"] == "GPU 0: visible 3; GPU 1: visible 4", seen
    runs = seen["data"]["per_gpu"]
    assert [r["gpu"] for r in runs] == [0, 1]
    # No site module and no user site in the check's Python: no .pth file of the image runs there.
    assert all(r["data"]["no_site"] == 1 and r["data"]["no_user_site"] == 1 for r in runs), runs
    # A GPU whose run fails fails the check, whatever the others said.
    checks, _ = _gpu_run(tmp_path, fake_driver, gpus=3, parallel=3, visible="3,4,5")
    assert checks["seen"]["status"] == "fail" and "GPU 2: visible 5" in checks["seen"]["detail"]


def test_a_server_on_more_gpus_than_the_container_sees_leaves_the_image_gpu_unverified(
        tmp_path: Path, fake_driver: Path) -> None:
    checks, report = _gpu_run(tmp_path, fake_driver, gpus=2, parallel=4, visible="")
    assert "seen" not in checks
    assert checks["gpu"]["status"] == "skip"
    assert "to run on 4 GPUs (tensor parallel) and the container sees 2" in checks["gpu"]["detail"]


def test_one_gpu_runs_the_check_once_without_a_per_gpu_split(tmp_path: Path, fake_driver: Path) -> None:
    checks, _ = _gpu_run(tmp_path, fake_driver, gpus=2, parallel=1, visible="")
    assert checks["seen"]["detail"] == "visible " and "per_gpu" not in checks["seen"]["data"]
