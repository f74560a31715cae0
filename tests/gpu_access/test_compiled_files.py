"""An image without vLLM's compiled files is never GPU-verified, on the CDI test engine too.

The stand-in holds vLLM's Python sources only: its dist-info RECORD lists the
compiled libraries (``vllm/_C*.so`` and others) that it lacks.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import cli
from tests.gpu_access.test_gpu_access import CDI_HOST, cdi_base, cdi_built, cdi_engine

__all__ = ["cdi_base", "cdi_built", "cdi_engine"]


def test_sources_only_image_is_not_gpu_verified_and_names_the_compiled_files(
        cdi_built: tuple[Path, str], tmp_path: Path) -> None:
    project, ref = cdi_built
    out = tmp_path / "report.json"
    r = cli("smoke", ref, "--gpu", "require", "--gpu-request", "cdi", "--report", str(out),
            root=project, env={"DOCKER_HOST": CDI_HOST})
    assert r.rc != 0
    report = json.loads(out.read_text())
    assert report["gpu_verified"] is False and report["gpu"]["verified"] is False
    assert "vllm/_C_stable_libtorch.abi3.so (the base's)" in report["gpu"]["compiled_missing"]
    assert "compiled file(s) the installed RECORD lists are absent" in report["gpu"]["why_unverified"]
    compiled = next(c for c in report["checks"] if c["name"] == "compiled-files")
    assert "vllm/_C_stable_libtorch.abi3.so" in compiled["detail"]
    integrity = next(c for c in report["checks"] if c["name"] == "integrity")
    assert integrity["data"]["answered_by"] == "filesystem"
    assert "the base's, not the hotfix's" in integrity["detail"] and "compiled file(s)" in integrity["detail"]
