"""Commands that say what they would do: `render` with no engine reachable (from this host's description of a
base it saw before), and `push --dry-run` (the gate and the re-check, then nothing pushed, tagged or recorded)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import requests

from conftest import RegistryPlace, cli
from vllm_hotfix.engine import Engine
from vllm_hotfix.journal import records

NO_ENGINE = {"DOCKER_HOST": "unix:///nonexistent/docker.sock"}


def test_render_without_an_engine_from_the_base_seen_before(engine: Engine, base_v0251: str, project: Path) -> None:
    online = cli("render", "--definition", "v0.25.1", "--pull", "never", root=project)
    assert online.rc == 0, online.err
    offline = cli("render", "--definition", "v0.25.1", "--pull", "never", root=project, env=NO_ENGINE)
    assert offline.rc == 0, offline.err
    assert offline.out == online.out  # the same Dockerfile, byte for byte
    assert "==> no engine answers: rendering from this host's description of " in offline.err
    assert f"({base_v0251[:19]}, seen 20" in offline.err
    described = list((project / "build" / "cache" / "refs").glob("*/index/description.json"))
    assert len(described) == 1
    # A description this host did not write (its MAC no longer matches) is not one to render from.
    outer = json.loads(described[0].read_text())
    body = json.loads(outer["body"])
    body["inspect"]["Id"] = "sha256:" + "0" * 64
    outer["body"] = json.dumps(body, sort_keys=True, separators=(",", ":"))
    described[0].write_text(json.dumps(outer))
    forged = cli("render", "--definition", "v0.25.1", "--pull", "never", root=project, env=NO_ENGINE)
    assert forged.rc == 5, forged.err
    assert "no Docker engine answers" in forged.last_error
    assert "this host has no cached description of " in forged.last_error
    assert "hint: render it once where an engine answers" in forged.err
    # The description alone is not enough: without the facts cache of that image the run says what is missing.
    shutil.rmtree(project / "build" / "cache" / "refs")
    assert cli("render", "--definition", "v0.25.1", "--pull", "never", root=project).rc == 0
    for folder in (project / "build" / "cache" / "bases").iterdir():
        shutil.rmtree(folder / "index")
    partial = cli("render", "--definition", "v0.25.1", "--pull", "never", root=project, env=NO_ENGINE)
    assert partial.rc == 5, partial.err
    assert "the cache of this host lacks part of what render needs" in partial.last_error


def test_push_dry_run_judges_and_pushes_nothing(built: tuple[Path, str, str], registry: RegistryPlace) -> None:
    project, ref, image_id = built
    target = f"{registry.place}/ops"
    pushes_before = len(records.pushes(project))
    r = cli("push", ref, "--registry", target, "--dry-run", root=project)
    # The gate judges as a push does: a GPU-unverified pass is refused without --allow-gpu-unverified.
    assert r.rc != 0 and "GPU" in r.last_error, r.err
    r = cli("push", ref, "--registry", target, "--allow-gpu-unverified", "--dry-run", root=project)
    assert r.rc == 0, r.err
    name = ref.rsplit("/", 1)[-1]
    assert f"would push {image_id} as {target}/{name} (let through by " in r.out
    assert "GPU-unverified) and attach 0 signed verdict(s)" in r.out
    assert r.out.strip().endswith("dry run: nothing was pushed, tagged, attached or recorded")
    assert "re-checking the files" in r.err  # the files were judged again, read from the layers
    repo = f"{registry.ns}/ops/{name.split(':')[0]}"
    listed = requests.get(f"http://{registry.addr}/v2/{repo}/tags/list", timeout=10)
    assert listed.status_code == 404 or not listed.json().get("tags"), listed.text
    assert len(records.pushes(project)) == pushes_before
    r = cli("push", ref, "--registry", target, "--allow-gpu-unverified", "--dry-run", "--json", root=project)
    assert r.rc == 0 and json.loads(r.out)["dry_run"] is True and json.loads(r.out)["image_id"] == image_id
