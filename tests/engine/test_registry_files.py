"""File facts read from a registry's blobs: what a Kubernetes Job's verdict is judged on.

Real engine, real registry. The image a cluster pulls is read layer by layer
from the registry, each blob checked against its digest, whiteouts applied.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import Registry, cli, derive, docker_cli
from vllm_hotfix import blobs, registry
from vllm_hotfix import smoke as smokelib
from vllm_hotfix.engine import Engine

SITE = "/usr/local/lib/python3.12/dist-packages"
INDEXER = "vllm/models/minimax_m3/common/indexer.py"


def pushed(project: Path, ref: str, reg: Registry) -> dict[str, str]:
    r = cli("push", ref, "--registry", f"{reg.addr}/ops", "--allow-gpu-unverified", "--json", root=project)
    assert r.rc == 0, r.err
    data = json.loads(r.out)
    name = data["ref"].rpartition(":")[0]
    return {"name": name, "by_digest": f"{name}@{data['digest']}", "digest": data["digest"]}


def by_status(facts: smokelib.FileFacts) -> dict[str, str]:
    return {c["name"]: c["status"] for c in facts.checks}


def source(engine: Engine, ref: str) -> blobs.RegistryFiles:
    return blobs.for_reference(lambda host: registry.client_for(engine, host), ref)


def test_registry_blobs_give_the_facts_the_engine_gives(engine: Engine, built: tuple[Path, str, str],
                                                        registry: Registry) -> None:
    project, ref, image_id = built
    where = pushed(project, ref, registry)
    files = source(engine, where["by_digest"])
    info = files.image(where["digest"])
    assert info is not None and info.id == image_id  # the config digest is the image ID the engine gives
    from_registry = smokelib.file_facts(project, info, files, engine)
    local = engine.image(image_id)
    assert local is not None
    from_engine = smokelib.file_facts(project, local, engine, engine)
    assert by_status(from_registry) == by_status(from_engine) == {
        "patch-landed": "pass", "package-version": "pass", "integrity": "pass"}
    landed = {c["name"]: c for c in from_registry.checks}["patch-landed"]
    assert landed["data"]["files"] == {c["name"]: c for c in from_engine.checks}["patch-landed"]["data"]["files"]

    # The Job a cluster runs carries these checks: it cannot pass without them.
    job_yaml = project / "job.yaml"
    r = cli("smoke", where["by_digest"], "--launcher", "kubernetes", "--emit", str(job_yaml), root=project)
    assert r.rc == 0, r.err
    config_map = json.loads(job_yaml.read_text().split("---\n")[1])
    job = json.loads(config_map["data"]["job.json"])
    assert {c["name"]: c["status"] for c in job["checks"]}["patch-landed"] == "pass"
    assert job["image_id"] == image_id


def test_a_file_removed_in_a_later_layer_is_gone_and_a_bad_blob_is_named(
    engine: Engine, built: tuple[Path, str, str], registry: Registry, unique: str
) -> None:
    project, ref, image_id = built
    # A later layer deletes the patched file (a whiteout entry in the layer tar).
    removed = f"hotfix-test/removed-{unique}:x"
    derive(engine, image_id, removed, f"RUN rm {SITE}/{INDEXER}")
    target = f"{registry.addr}/ops/removed-{unique}:x"
    try:
        engine.tag(removed, target)
        docker_cli("push", target)
        digest = docker_cli("inspect", "--format", "{{index .RepoDigests 0}}", target).strip()
        files = source(engine, digest)
        info = files.image(digest.partition("@")[2])
        assert info is not None
        facts = by_status(smokelib.file_facts(project, info, files, engine))
        assert facts["patch-landed"] == "fail"

        # The registry's copy of the top layer altered on disk: the read stops and names the layer.
        top = json.loads(registry_manifest(registry, digest))["layers"][-1]["digest"]
        data = registry.config.parent / "data/docker/registry/v2/blobs/sha256" / top[7:9] / top[7:] / "data"
        body = bytearray(data.read_bytes())
        body[-1] ^= 0xFF  # the gzip trailer's last byte: the tar inside still reads, only the digest tells
        data.write_bytes(bytes(body))
        found = smokelib.file_facts(project, info, source(engine, digest), engine)
        assert by_status(found)["patch-landed"] == "incomplete"
        assert f"layer {top[:19]}" in found.checks[0]["detail"] and "hash" in found.checks[0]["detail"]
    finally:
        engine.remove_image(target)
        engine.remove_image(removed)


def registry_manifest(reg: Registry, by_digest: str) -> bytes:
    import requests

    name, _, digest = by_digest.partition("@")
    path = name.split("/", 1)[1]
    accept = ", ".join((registry.OCI_MANIFEST, registry.DOCKER_MANIFEST))
    return requests.get(f"http://{reg.addr}/v2/{path}/manifests/{digest}", headers={"Accept": accept},
                        timeout=10).content
