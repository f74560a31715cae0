"""The assembled image has the same ID on a Docker 26.1 engine as on 20.10."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from conftest import cli
from vllm_hotfix.engine import Engine

SITE = "/usr/local/lib/python3.12/dist-packages"
# A Docker 26.1 engine beside the 20.10 one (`.ci/services start-cdi-engine`).
NEWER_HOST = os.environ.get("CDI_DOCKER_HOST", "unix:///run/vllm-hotfix-cdi/docker.sock")


def test_same_image_id_on_a_docker_26_engine(
    engine: Engine, base_v0251: str, project: Path, unique: str, tmp_path: Path
) -> None:
    newer_env = {"DOCKER_HOST": NEWER_HOST}
    version = subprocess.run(["docker", "version", "-f", "{{.Server.Version}}"], capture_output=True, text=True,
                             env={**os.environ, **newer_env})
    if version.returncode != 0:
        pytest.fail(f"no Docker engine on {NEWER_HOST}: run `.ci/services start-cdi-engine`")
    assert version.stdout.startswith("26."), version.stdout
    old_env = {"DOCKER_HOST": os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"}
    # The same base in both engines, by ID, under a name only this test uses.
    repo = f"hotfix-test/base-{unique}"
    had_base = subprocess.run(["docker", "image", "inspect", base_v0251], capture_output=True,
                              env={**os.environ, **newer_env}).returncode == 0
    saved = tmp_path / "base.tar"
    subprocess.run(["docker", "save", "-o", str(saved), base_v0251], check=True, capture_output=True,
                   env={**os.environ, **old_env})
    subprocess.run(["docker", "load", "-i", str(saved)], check=True, capture_output=True,
                   env={**os.environ, **newer_env})
    saved.unlink()
    out = f"hotfix-test/as-{unique}:t"
    ids = {}
    try:
        for name, env in (("20.10", old_env), ("26.1", newer_env)):
            subprocess.run(["docker", "tag", base_v0251, f"{repo}:v0.25.1"], check=True, env={**os.environ, **env})
            r = cli("image", "--definition", "v0.25.1", "--base-repo", repo, "--tag", out, "--pull", "never",
                    "--no-smoke", "--builder", "assemble", root=project,
                    env={**env, "VLLM_HOTFIX_CACHE": str(tmp_path / f"cache-{name}")})
            assert r.rc == 0, r.err
            ids[name] = r.out.strip().splitlines()[-1].split()[-1]
        assert ids["20.10"] == ids["26.1"]
        # And it works there: the image's Python sees the patched file.
        check = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "--entrypoint", "python3", out, "-c",
             f"import hashlib; print(hashlib.sha256(open('{SITE}/vllm/models/minimax_m3/common/indexer.py', "
             "'rb').read()).hexdigest())"],
            capture_output=True, text=True, env={**os.environ, **newer_env})
        assert check.returncode == 0, check.stderr
        labels = engine.image(ids["20.10"])
        assert labels is not None
        assert check.stdout.strip() == json.loads(labels.labels["io.vllm-hotfix.files"])[
            "vllm/models/minimax_m3/common/indexer.py"]
    finally:
        for env in (old_env, newer_env):
            subprocess.run(["docker", "rmi", out, f"{repo}:v0.25.1"], capture_output=True, env={**os.environ, **env})
        if not had_base:
            subprocess.run(["docker", "rmi", ids.get("26.1", "none"), base_v0251], capture_output=True,
                           env={**os.environ, **newer_env})
