"""One way to read what a reference names in its registry (``registry_client.look_up``), against a real registry on
loopback: by tag, by digest, another reference of the same repository, absent, and a name with no registry."""

from __future__ import annotations

import json

import pytest

from conftest import RegistryPlace
from vllm_hotfix.engine import Engine
from vllm_hotfix.errors import PushError
from vllm_hotfix.registry import client as registry_client
from vllm_hotfix.registry.write import Repo, Writer


def test_look_up_gives_the_client_the_repository_path_and_the_manifest_or_none(
        engine: Engine, registry: RegistryPlace) -> None:
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}})
    name = f"{registry.place}/ops/looked-up"
    path = name.split("/", 1)[1]
    writer = Writer(Repo(registry_client.client_for(engine, registry.addr), path))
    writer.put_blob(config.encode(), "the config")
    body = json.dumps({"schemaVersion": 2, "mediaType": registry_client.OCI_MANIFEST, "layers": [],
                       "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                                  "digest": registry_client.sha256(config.encode()), "size": len(config)}}).encode()
    digest = writer.put_manifest("v1", registry_client.OCI_MANIFEST, body)
    config_digest = registry_client.sha256(config.encode())

    for ref, reference in ((f"{name}:v1", None), (f"{name}@{digest}", None), (f"{name}:other", "v1"),
                           (f"{name}:other", digest)):
        client, found_path, manifest = registry_client.look_up(engine, ref, reference)
        assert client.host == registry.addr and found_path == path
        assert manifest is not None and manifest.digest == digest and manifest.body == body
        assert (manifest.json()["config"]["digest"], manifest.is_index) == (config_digest, False)
    # A tag or digest the registry lacks is None, for the caller to word; the client and path still come back.
    for ref, reference in ((f"{name}:absent", None), (f"{name}@sha256:{'0' * 64}", None), (f"{name}:v1", "nope")):
        client, found_path, manifest = registry_client.look_up(engine, ref, reference)
        assert manifest is None and client.host == registry.addr and found_path == path
    # A name that names no registry is refused before anything is asked.
    with pytest.raises(PushError, match="expected HOST"):
        registry_client.look_up(engine, "ops/looked-up:v1")
