"""The unix-socket transport against the real engine: ping, kept-alive calls, load and inspect."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

import pytest

from vllm_hotfix import tarball
from vllm_hotfix.building import assemble
from vllm_hotfix.engine import Engine, labels
from vllm_hotfix.engine.transport import UnixHTTPConnection, UnixTransport, local_socket


@pytest.fixture
def socket_path(engine: Engine) -> str:
    path = local_socket(engine.address)
    if path is None:
        pytest.skip(f"the engine at {engine.address} is not reached through a local unix socket")
    return path


def test_http_client_connection_over_the_socket_pings(socket_path: str) -> None:
    conn = UnixHTTPConnection(socket_path, timeout=10)
    try:
        conn.request("GET", "/_ping")
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, b"OK")
    finally:
        conn.close()


def test_one_kept_alive_connection_serves_many_calls(socket_path: str) -> None:
    transport = UnixTransport(socket_path, timeout=10)
    try:
        for _ in range(3):
            assert transport.request("GET", "/_ping") == (200, b"OK")
        status, body = transport.request("GET", "/version")
        assert status == 200 and json.loads(body)["ApiVersion"]
        assert transport.request("GET", "/images/hotfix-test/absent-image:x/json")[0] == 404
    finally:
        transport.close()


@pytest.fixture
def loaded(engine: Engine, unique: str) -> Iterator[tuple[str, bytes]]:
    """A one-file image of this test's own (no base), as a save-format archive, removed after."""
    layer = tarball.write([tarball.Entry(f"hotfix-test-{unique}", unique.encode(), 0o644)])
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = assemble.image_config({"Architecture": engine.arch, "Os": "linux"}, [], diff_id,
                                   [(f"{labels.PREFIX}.test", unique)], "transport test")
    image_id, archive = assemble.archive(config, [], layer)
    yield image_id, archive
    engine.remove_image(image_id)


def test_load_and_inspect_through_the_socket(engine: Engine, loaded: tuple[str, bytes], unique: str) -> None:
    image_id, archive = loaded
    assert engine.load(archive) == [image_id]
    info = engine.image(image_id)
    assert info is not None and info.id == image_id
    assert info.labels[f"{labels.PREFIX}.test"] == unique
    assert [h.get("CreatedBy") for h in engine.history(image_id)][-1] == "transport test"

