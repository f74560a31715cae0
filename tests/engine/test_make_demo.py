"""Integration tier: `make demo` runs again after the runbook's signed push.

The runbook pushes under ``REGISTRY`` and signs; a tag there that names an
image with a signed pass moves only with ``--replace``, which the demo does
not pass. The demo's own push goes to a place of its own
(``DEMO_REGISTRY``), so a second run pushes as the first did. The push line
is the one make prints for the demo, run as make would, with the test's
image in place of the demo's own name (which the test does not take on a
shared engine) and ``--root`` for the test's copy of the project.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from conftest import REPO, RegistryPlace, cli, site_key
from vllm_hotfix.engine import Engine

DEMO_IMAGE = "vllm/vllm-openai:v0.25.1-m3patch"  # what `make demo` builds and pushes


def _demo_push(image: str, registry: RegistryPlace) -> list[str]:
    """The demo's push command, as make prints it with the test's registry places, pushing ``image``."""
    done = subprocess.run(["make", "-n", "-o", "setup", "demo", f"PYTHON={sys.executable}",
                           f"REGISTRY={registry.place}/ops", f"DEMO_REGISTRY={registry.place}/demo"],
                          cwd=REPO, capture_output=True, text=True, check=True)
    line = next(line for line in done.stdout.splitlines() if " build.py push " in line)
    argv = shlex.split(line)
    assert argv.count(DEMO_IMAGE) == 1, argv
    return [image if arg == DEMO_IMAGE else arg for arg in argv]


def test_demo_pushes_again_after_the_runbooks_signed_push(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, unique: str, tmp_path: Path) -> None:
    project, ref, image_id = built
    key = tmp_path / "site.key"
    site_key(key)
    # The runbook's signed journey: smoke with the site key, push under REGISTRY.
    assert cli("smoke", ref, "--sign-key", str(key), root=project).rc == 0
    r = cli("push", ref, "--registry", f"{registry.place}/ops", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0 and len(json.loads(r.out)["attestations"]) == 1, r.err
    # The demo's image: the same patch set built again (another builder, another image), under the same name
    # in another repository, so that under REGISTRY its push would land on the signed image's tag.
    demo = f"hotfix-test/{unique}/{ref.split('/')[-1]}"
    r = cli("image", "--definition", "v0.25.1", "--tag", demo, "--pull", "never", "--builder", "assemble",
            root=project)
    assert r.rc == 0, r.err
    try:
        assert r.out.split()[-1] != image_id
        argv = [*_demo_push(demo, registry), "--root", str(project)]
        for run in (1, 2):
            done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=600)
            assert done.returncode == 0, f"demo push, run {run}: {done.stderr}"
            assert f"{registry.place}/demo/" in done.stdout and "replacing" not in done.stdout, done.stdout
    finally:
        engine.remove_image(demo)
