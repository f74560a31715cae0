"""smoke --launcher podman of an image only the Docker engine holds: the tool moves it into podman's store (the
same image ID), then judges podman's copy."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import cli, site_key

pytestmark = pytest.mark.skipif(shutil.which("podman") is None,
                                reason="podman is not installed (`.ci/services install` installs it)")


def _podman_id(image: str) -> str:
    done = subprocess.run(["podman", "image", "inspect", "--format", "{{.Id}}", image], capture_output=True,
                          text=True, check=False)
    return done.stdout.strip() if done.returncode == 0 else ""


def test_podman_gets_the_image_from_the_docker_engine(built: tuple[Path, str, str]) -> None:
    project, ref, image_id = built
    subprocess.run(["podman", "rmi", "--force", ref], capture_output=True, check=False)
    assert _podman_id(ref) == ""
    try:
        r = cli("smoke", ref, "--launcher", "podman", "--gpu", "off", root=project)
        assert r.rc == 0, r.err
        assert f"==> podman has no {ref}: moving it from the Docker engine ({image_id[:19]}) into podman's store" \
            in r.err
        assert "sha256:" + _podman_id(ref).removeprefix("sha256:") == image_id
        # Already there: nothing moved again.
        r = cli("smoke", ref, "--launcher", "podman", "--gpu", "off", root=project)
        assert r.rc == 0 and "moving it from the Docker engine" not in r.err, r.err
    finally:
        subprocess.run(["podman", "rmi", "--force", image_id.removeprefix("sha256:")], capture_output=True,
                       check=False)


def test_podmans_own_localhost_name_is_no_registry(built: tuple[Path, str, str], tmp_path: Path) -> None:
    # Loaded from the Docker engine, the image is localhost/NAME in podman's store, with a repo digest under that
    # name: the store's own namespace, where no signed verdict can be attached and none is tried.
    project, ref, image_id = built
    key = tmp_path / "site.key"
    site_key(key)
    try:
        r = cli("smoke", ref, "--launcher", "podman", "--gpu", "off", "--sign-key", str(key), root=project)
        assert r.rc == 0, r.err
        assert "==> signed verdict: " in r.err, r.err
        assert "localhost/" not in r.err and "cannot reach" not in r.err, r.err
    finally:
        subprocess.run(["podman", "rmi", "--force", image_id.removeprefix("sha256:")], capture_output=True,
                       check=False)
