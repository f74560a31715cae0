"""list --registry and rollback --registry: the team's builds and verdicts read from the registry, from a host
whose journal knows nothing of them; a tag moved back in the registry only onto an image with a signed pass."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import requests

from conftest import RegistryPlace, cli, key_pair
from vllm_hotfix.engine import Engine


def test_another_host_sees_the_builds_and_rolls_the_registry_tag_back(
        engine: Engine, built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    project, ref, first = built
    private, public, _ = key_pair(tmp_path, "team")
    where = f"{registry.place}/ops"
    repo = f"{where}/{ref.rsplit('/', 1)[-1].split(':')[0]}"
    tag = ref.rsplit(":", 1)[1]
    # Build host: two builds of the definition, each smoked, signed and pushed under the same tag.
    r = cli("smoke", ref, "--sign-key", str(private), root=project)
    assert r.rc == 0, r.err
    r = cli("push", ref, "--registry", where, "--allow-gpu-unverified", root=project)
    assert r.rc == 0, r.err
    first_digest = r.out.split()[-1]
    r = cli("image", "--definition", "v0.25.1", "--tag", ref, "--pull", "never", "--rebuild", "--builder",
            "assemble", root=project)
    assert r.rc == 0, r.err
    second = r.out.split()[-1]
    try:
        assert second != first
        r = cli("smoke", ref, "--sign-key", str(private), root=project)
        assert r.rc == 0, r.err
        r = cli("push", ref, "--registry", where, "--allow-gpu-unverified", "--replace", root=project)
        assert r.rc == 0, r.err
        # Another host: the same definitions, an empty journal.
        other = tmp_path / "other"
        for folder in ("images", "patches"):
            shutil.copytree(project / folder, other / folder)
        r = cli("list", "--registry", repo, "--json", root=other)
        assert r.rc == 0, r.err
        rows = {b["image_id"]: b for b in json.loads(r.out)["builds"]}
        assert rows[first]["digest"] == first_digest
        second_digest = rows[second]["digest"]
        # The first build is found although its tag moved on (its verdict's tag names it).
        assert set(rows) >= {first, second}
        assert rows[second]["tags"] == [tag] and rows[first]["tags"] == []
        assert rows[first]["definition"] == "v0.25.1" and rows[first]["verdicts_found"] == 1
        assert rows[first]["verdict"] is None  # no key given: counted, not checked
        r = cli("list", "--registry", repo, "--key", str(public), root=other)
        assert r.rc == 0, r.err
        assert f"{first}  v0.25.1  linux/amd64  {repo}@{first_digest}  tags none  smoke pass, signed " in r.out
        # Rolled back in the registry, from the other host: the tag names the first image's manifest again.
        r = cli("rollback", "--definition", "v0.25.1", "--registry", repo, "--tag", f"{repo}:{tag}", root=other)
        assert r.rc == 13 and "needs --key" in r.last_error, r.err
        r = cli("rollback", "--definition", "v0.25.1", "--registry", repo, "--tag", f"{repo}:{tag}", "--key",
                str(public), root=other)
        assert r.rc == 0, r.err
        assert f"rolled back {repo}:{tag} in its registry to {first} ({first_digest}" in r.out
        assert f"was {second_digest}" in r.out
        host, path = repo.split("/", 1)
        res = requests.head(f"http://{host}/v2/{path}/manifests/{tag}", timeout=10, headers={
            "Accept": "application/vnd.docker.distribution.manifest.v2+json"})
        assert res.headers["Docker-Content-Digest"] == first_digest
        # Nothing earlier with a signed pass: refused, the tag left where it is.
        r = cli("rollback", "--definition", "v0.25.1", "--registry", repo, "--tag", f"{repo}:{tag}", "--key",
                str(public), root=other)
        assert r.rc != 0 and "no earlier image of v0.25.1" in r.last_error, r.err
    finally:
        engine.tag(first, ref)
        if engine.image(second) is not None:
            engine.remove_image(second)


def test_a_registry_path_without_its_repository_and_a_missing_tag_say_what_is_there(
        built: tuple[Path, str, str], registry: RegistryPlace, tmp_path: Path) -> None:
    project, ref, _image_id = built
    where = f"{registry.place}/ops"
    name, tag = ref.rsplit("/", 1)[-1].split(":")
    r = cli("push", ref, "--registry", where, "--allow-gpu-unverified", root=project)
    assert r.rc == 0, r.err
    # The folder above the repository: no repository of that name, said so (it said "no image", exit 0).
    r = cli("list", "--registry", where, root=project)
    assert r.rc == 8, r.err
    assert f"{where}: the registry {registry.addr} has no repository {registry.ns}/ops" in r.last_error, r.err
    assert f"hint: --registry names one image repository, HOST[:PORT]/PATH/NAME; under {where} the registry has " \
           f"{where}/{name}" in r.err
    # A tag the repository lacks: still no signed verdict (21), with the tags it has.
    _private, public, _ = key_pair(tmp_path, "team")
    r = cli("verify", "--definition", "v0.25.1", f"{where}/{name}:no-such-tag", "--key", str(public), root=project)
    assert r.rc == 21 and f"has no {registry.ns}/ops/{name}:no-such-tag" in r.last_error, r.err
    assert f"hint: {where}/{name} has the tags {tag} (`python build.py list --registry {where}/{name}`" in r.err
    r = cli("verify", "--definition", "v0.25.1", f"{where}/absent:{tag}", "--key", str(public), root=project)
    assert r.rc == 21 and f"hint: the registry has no image under {where}/absent" in r.err, r.err
