"""GPU checks fail closed, on the CDI engine, with a stand-in GPU stack.

The CDI test device cannot run CUDA, so the image under test carries stand-ins
for what the GPU checks call: a ``libcuda.so.1`` (built here) that shows one
device only in a container the CDI device reached, and ``torch``/``triton``
modules that claim that device. What is judged is real: a patched module that
does not import, a patch-set check that ran against a stub, and a check that
ran against the image's code and passed, each smoked with ``--gpu require``
through CDI.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO, cli, copy_tracked, derive, unique_name
from gpu_access.test_gpu_access import CDI_HOST, cdi_base, cdi_engine  # noqa: F401  (fixtures)
from vllm_hotfix.engine import Engine

SITE = "/usr/local/lib/python3.12/dist-packages"
PYLIB = "/usr/local/lib/python3.11/dist-packages"
# Sees a device only where the CDI spec's environment reached the container.
LIBCUDA = r"""
#include <stdlib.h>
#include <string.h>
static int reached(void) { const char *e = getenv("VLLM_HOTFIX_CDI_DEVICE"); return e != 0 && *e != 0; }
int cuInit(unsigned flags) { (void)flags; return 0; }
int cuDeviceGetCount(int *n) { *n = reached() ? 1 : 0; return 0; }
int cuDeviceGet(int *d, int i) { *d = i; return 0; }
int cuDeviceGetName(char *buf, int len, int d) { (void)d; strncpy(buf, "CDI test GPU", len); return 0; }
int cuGetErrorName(int rc, const char **s) { (void)rc; *s = "CUDA_ERROR_TEST"; return 0; }
"""
TORCH = '''
import os
__version__ = "0.0+cditest"
class version:
    cuda = "13.0"
class _T:
    def __init__(self, *a, **k): pass
    def double(self): return self
    def to(self, *a, **k): return self
    def cpu(self): return self
    def norm(self): return self
    def __matmul__(self, other): return self
    __sub__ = __add__ = __truediv__ = __matmul__
    def __float__(self): return 0.0
class cuda:
    is_available = staticmethod(lambda: bool(os.environ.get("VLLM_HOTFIX_CDI_DEVICE")))
    device_count = staticmethod(lambda: 1)
    get_device_capability = staticmethod(lambda i: (9, 0))
    get_device_name = staticmethod(lambda i: "CDI test GPU")
    synchronize = staticmethod(lambda *a: None)
class backends:
    class cuda:
        class matmul:
            allow_tf32 = False
class Generator:
    def manual_seed(self, seed): return self
float32 = float64 = "dtype"
def randn(*a, **k): return _T()
def device(*a): return a
def empty_like(x): return _T()
def equal(a, b): return True
'''
TRITON = '''
__version__ = "0.0+cditest"
class _Kernel:
    def __getitem__(self, grid): return lambda *a, **k: None
def jit(fn): return _Kernel()
def cdiv(a, b): return -(-a // b)
'''
# What the test patch set changes: a module of the package that imports without CUDA.
TARGET = "vllm/hotfix_gpu_target.py"
PATCH = f"""--- a/{TARGET}
+++ b/{TARGET}
@@ -1 +1 @@
-ANSWER = 1
+ANSWER = 2
"""
CHECK = '''
import json
print(json.dumps({{"checks": [{{"name": "fake-gpu-check", "status": "pass", "detail": "stand-in check",
                               "ran_against": {ran_against!r}{stubs}}}]}}))
'''


@pytest.fixture(scope="module")
def fake_gpu_base(cdi_engine: Engine, cdi_base: str,  # noqa: F811
                  tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The 0.25.1 stand-in with the stand-in GPU stack, a torch-free ``vllm/__init__`` and the test target."""
    if shutil.which("gcc") is None:
        pytest.fail("gcc is needed to build the stand-in libcuda.so.1")
    tmp = tmp_path_factory.mktemp("libcuda")
    (tmp / "libcuda.c").write_text(LIBCUDA)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(tmp / "libcuda.so.1"), str(tmp / "libcuda.c")],
                   check=True)
    repo = f"hotfix-test/fakegpu-{unique_name()}"
    files = {"libcuda.so.1": (tmp / "libcuda.so.1").read_bytes(), "torch.py": TORCH.encode(),
             "triton.py": TRITON.encode(), "language.py": b"constexpr = int\n",
             "init.py": b"from .version import __version__, __version_tuple__\n",
             "target.py": b"ANSWER = 1\n"}
    body = (f"COPY libcuda.so.1 /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
            f"COPY torch.py {PYLIB}/torch/__init__.py\nCOPY triton.py {PYLIB}/triton/__init__.py\n"
            f"COPY language.py {PYLIB}/triton/language.py\n"
            f"COPY init.py {SITE}/vllm/__init__.py\nCOPY target.py {SITE}/{TARGET}\n"
            # The stand-in holds vLLM's Python files only: its RECORD keeps only what it holds, as a real
            # base's would (compiled files RECORD lists but the image lacks stop GPU-verified).
            f"RUN python3 -c \"import csv, glob, os; r = glob.glob('{SITE}/vllm-*.dist-info/RECORD')[0]; "
            f"rows = [x for x in csv.reader(open(r)) if x and os.path.lexists(os.path.join('{SITE}', x[0]))]; "
            f"csv.writer(open(r, 'w', newline='')).writerows(rows)\"\n")
    image_id = derive(cdi_engine, cdi_base, f"{repo}:v0.25.1", body, files)
    yield repo
    cdi_engine.remove_image(f"{repo}:v0.25.1")
    cdi_engine.remove_untagged(image_id, force=False)


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory, fake_gpu_base: str) -> Path:
    root = tmp_path_factory.mktemp("fakegpu") / "project"
    copy_tracked(REPO, ("images", "patches"), root)
    (root / "images" / "v0.25.1-fakegpu.toml").write_text(textwrap.dedent(f"""\
        [base]
        repository = "{fake_gpu_base}"
        tag = "v0.25.1"
        [package]
        name = "vllm"
        version = "0.25.1"
        [patches]
        set = "fakegpu"
        [output]
        suffix = "fakegpu"
        [variant]
        name = "fakegpu"
        """))
    folder = root / "patches" / "fakegpu"
    (folder / "checks").mkdir(parents=True)
    (folder / "series").write_text("0001-target.patch\n")
    (folder / "0001-target.patch").write_text(PATCH)
    return root


def build(engine: Engine, project: Path, base: str, repo: str | None = None) -> Iterator[str]:
    ref = f"hotfix-test/failclosed-{unique_name()}:built"
    args = ["image", "--definition", base, "--tag", ref, "--pull", "never", "--no-smoke"]
    r = cli(*args, *(["--base-repo", repo] if repo else []), root=project, env={"DOCKER_HOST": CDI_HOST})
    assert r.rc == 0, r.err
    yield ref
    engine.remove_image(ref)
    engine.remove_untagged(r.out.split()[-1], force=False)


def smoke(project: Path, ref: str, tmp: Path) -> tuple[int, str, dict[str, object]]:
    out = tmp / "report.json"
    r = cli("smoke", ref, "--gpu", "require", "--gpu-request", "cdi", "--report", str(out),
            root=project, env={"DOCKER_HOST": CDI_HOST})
    return r.rc, r.last_error, json.loads(out.read_text())


def set_check(project: Path, ran_against: str, stubs: list[str] | None = None) -> None:
    extra = f', "stubs": {stubs!r}' if stubs else ""
    (project / "patches" / "fakegpu" / "checks" / "fake_gpu_check.py").write_text(
        CHECK.format(ran_against=ran_against, stubs=extra))


@pytest.fixture(scope="module")
def fakegpu_built(cdi_engine: Engine, project: Path) -> Iterator[str]:  # noqa: F811
    yield from build(cdi_engine, project, "v0.25.1-fakegpu")


def test_a_check_that_ran_against_the_images_code_and_passed_is_gpu_verified(
        project: Path, fakegpu_built: str, tmp_path: Path) -> None:
    set_check(project, "vllm")
    rc, error, report = smoke(project, fakegpu_built, tmp_path)
    assert rc == 0, error
    assert report["gpu_verified"] is True and report["status"] == "pass"
    checks = {c["name"]: c for c in report["checks"]}  # type: ignore[union-attr]
    assert checks["model-imports"]["status"] == "pass" and "vllm.hotfix_gpu_target" in checks["model-imports"]["detail"]
    assert checks["fake-gpu-check"]["ran_against"] == "vllm"


def test_a_check_that_ran_against_a_stub_is_refused(project: Path, fakegpu_built: str, tmp_path: Path) -> None:
    set_check(project, "stub", ["vllm.models.minimax_m3: package shell, __init__ not run"])
    rc, error, report = smoke(project, fakegpu_built, tmp_path)
    assert rc == 7, error
    assert "fake-gpu-check" in error and "not GPU-verified" in error and "package shell" in error
    assert report["gpu_verified"] is False and report["status"] == "fail"
    checks = {c["name"]: c for c in report["checks"]}  # type: ignore[union-attr]
    assert checks["fake-gpu-check"]["status"] == "fail" and "ran against a stub" in checks["fake-gpu-check"]["detail"]


def test_an_image_whose_patched_model_modules_do_not_import_is_refused(
        cdi_engine: Engine, project: Path, fake_gpu_base: str, tmp_path: Path) -> None:  # noqa: F811
    # The real v0.25.1 patch set on the stand-in: vllm.models.minimax_m3 needs torch's real API.
    for ref in build(cdi_engine, project, "v0.25.1", fake_gpu_base):
        rc, error, report = smoke(project, ref, tmp_path)
        assert rc == 7, error
        assert "vllm.models.minimax_m3.common.indexer does not import" in error
        assert "in the base too: the base's deviation" in error
        assert report["gpu_verified"] is False
        checks = {c["name"]: c for c in report["checks"]}  # type: ignore[union-attr]
        assert checks["model-imports"]["status"] == "fail"
        assert checks["topk-layout"]["status"] == "fail" and checks["topk-layout"]["ran_against"] == "stub"
