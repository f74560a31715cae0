"""Signed verdicts stored in a real registry beside the image, read back with plain HTTP."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from cryptography.hazmat.primitives.asymmetric import ec
from securesystemslib.dsse import Envelope
from securesystemslib.signer import SSlibKey

from conftest import RegistryPlace
from vllm_hotfix.registry.client import OCI_MANIFEST, Client, sha256
from vllm_hotfix.registry.write import Repo, Writer
from vllm_hotfix.trust import referrers, signing

REGISTRY = "127.0.0.1:5000"


@pytest.fixture
def pushed(unique: str) -> Iterator[tuple[str, str]]:
    """(repository path, tag) of a one-file image pushed to the local registry; its local tag removed after."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("hello")
        info.size = len(unique)
        tar.addfile(info, io.BytesIO(unique.encode()))
    path, tag = f"hotfix-test/referrers-{unique}", "t"
    ref = f"{REGISTRY}/{path}:{tag}"
    subprocess.run(["docker", "import", "-", ref], input=buf.getvalue(), check=True, capture_output=True)
    try:
        subprocess.run(["docker", "push", "-q", ref], check=True, capture_output=True)
    finally:
        subprocess.run(["docker", "rmi", ref], check=True, capture_output=True)
    yield path, tag


def test_a_signed_verdict_lands_beside_the_image_and_reads_back_with_plain_http(pushed: tuple[str, str]) -> None:
    path, tag = pushed
    client = Client(REGISTRY, secure=False, credentials=None)
    image = client.manifest(path, tag)
    assert image is not None
    config = image.json()["config"]["digest"]
    key = ec.generate_private_key(ec.SECP256R1())
    envelope = signing.sign(signing.statement({f"{path}:{tag}": config}, {"status": "pass"}), key)
    subject = referrers.Subject(image.digest, image.media_type, image.size)
    first = referrers.attach(client, path, subject, envelope)
    # Attaching the same verdict again adds nothing; a second one is listed beside it.
    assert referrers.attach(client, path, subject, envelope) == first
    second = signing.sign(signing.statement({f"{path}:{tag}": config}, {"status": "fail"}), key)
    referrers.attach(client, path, subject, second)
    assert [e for _d, e in referrers.envelopes(client, path, image.digest)] == [envelope, second]

    # The same, by hand: the fallback tag's index, the artifact, its layer.
    base = f"http://{REGISTRY}/v2/{path}"
    index = requests.get(f"{base}/manifests/{image.digest.replace(':', '-')}", timeout=10,
                         headers={"Accept": "application/vnd.oci.image.index.v1+json"}).json()
    assert [m["artifactType"] for m in index["manifests"]] == ["application/vnd.in-toto+json"] * 2
    artifact = requests.get(f"{base}/manifests/{index['manifests'][0]['digest']}", timeout=10,
                            headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    assert artifact["subject"]["digest"] == image.digest
    blob = requests.get(f"{base}/blobs/{artifact['layers'][0]['digest']}", timeout=10).content
    public = SSlibKey.from_crypto(key.public_key(), keyid=signing.key_id(key.public_key()),
                                  scheme="ecdsa-sha2-nistp256")
    dsse = Envelope.from_dict(json.loads(blob))
    dsse.verify([public], 1)
    assert json.loads(dsse.payload)["subject"][0]["digest"]["sha256"] == config.removeprefix("sha256:")


def test_an_image_without_verdicts_has_none(pushed: tuple[str, str]) -> None:
    path, tag = pushed
    client = Client(REGISTRY, secure=False, credentials=None)
    image = client.manifest(path, tag)
    assert image is not None
    assert referrers.envelopes(client, path, image.digest) == []


def test_two_hosts_attaching_at_once_both_land_and_a_rewritten_index_hides_neither(
        pushed: tuple[str, str], caplog: pytest.LogCaptureFixture) -> None:
    """Each verdict also stands under a tag of its own, which no other writer writes: verdicts attached side by
    side all land, and one dropped from the fallback index (by a racing writer, or by hand) is still read."""
    from concurrent.futures import ThreadPoolExecutor

    path, tag = pushed
    image = Client(REGISTRY, secure=False, credentials=None).manifest(path, tag)
    assert image is not None
    config = image.json()["config"]["digest"]
    subject = referrers.Subject(image.digest, image.media_type, image.size)
    key = ec.generate_private_key(ec.SECP256R1())
    made = [signing.sign(signing.statement({f"{path}:{tag}": config}, {"status": "pass", "n": i}), key)
            for i in range(8)]

    def attach(envelope: bytes) -> str:  # a host of its own: its own client and connection
        return referrers.attach(Client(REGISTRY, secure=False, credentials=None), path, subject, envelope)

    with ThreadPoolExecutor(len(made)) as pool:
        digests = list(pool.map(attach, made))
    client = Client(REGISTRY, secure=False, credentials=None)
    assert sorted(e for _d, e in referrers.envelopes(client, path, image.digest)) == sorted(made)
    # Someone who may push rewrites the index to list one verdict only: every other is still read, and named.
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
             "manifests": [e for e in referrers.tagged(client, path, image.digest) if e["digest"] == digests[0]]}
    Writer(Repo(client, path)).put_manifest(referrers.fallback_tag(image.digest),
                                            "application/vnd.oci.image.index.v1+json", json.dumps(index).encode())
    with caplog.at_level("WARNING"):
        assert sorted(e for _d, e in referrers.envelopes(client, path, image.digest)) == sorted(made)
    assert "the fallback index" in caplog.text and "lacks it (the index was rewritten)" in caplog.text


def test_a_look_the_registry_answers_with_a_server_error_is_asked_again(pushed: tuple[str, str]) -> None:
    """Debian's registry answers 500 to a look at a blob or tag another writer is linking at that moment (two hosts
    attaching at once meet it): a read so answered is asked again; one that keeps failing is named."""
    import registry_proxy
    from vllm_hotfix.errors import PushError

    path, tag = pushed
    with registry_proxy.serve(REGISTRY) as (proxy, switches):
        client = Client(proxy, secure=False, credentials=None)
        image = client.manifest(path, tag)
        assert image is not None
        config = image.json()["config"]["digest"]
        subject = referrers.Subject(image.digest, image.media_type, image.size)
        envelope = signing.sign(signing.statement({f"{path}:{tag}": config}, {"status": "pass"}),
                                ec.generate_private_key(ec.SECP256R1()))
        switches.fail_reads = 2
        referrers.attach(client, path, subject, envelope)
        assert switches.fail_reads == 0
        assert [e for _d, e in referrers.envelopes(client, path, image.digest)] == [envelope]
        switches.fail_reads = 10
        with pytest.raises(PushError, match=r"500"):
            referrers.envelopes(client, path, image.digest)


# A link in the registry's own files, caught by a manifest PUT (the verdict's, or the fallback index's) as the
# case says: ``True``: emptied by another writer finishing its upload of that blob (or its put of that manifest)
# and written again as the registry answers; ``False``: gone, as a registry that lost the blob has it.
LINK_CASES = {
    "config-half-written": ("verdict", True),  # the empty config, the one blob every verdict of an image shares
    "config-gone": ("verdict", False),
    "index-entry-half-written": ("index", True),  # the verdict's own manifest, which the fallback index lists
}


@pytest.mark.parametrize("case", list(LINK_CASES))
def test_a_verdict_put_while_another_writer_links_what_it_names_lands(registry: RegistryPlace, case: str,
                                                                      caplog: pytest.LogCaptureFixture) -> None:
    """Debian's registry empties a repository's link to a blob and writes it again each time a writer finishes
    uploading that blob; a manifest put in that instant is refused (DIGEST_INVALID, MANIFEST_BLOB_UNKNOWN), as
    two hosts attaching at once met under load. The seam: the real registry's link file, emptied during the
    PUT. Refused for what the registry shows again, the manifest is put again and the verdict lands; a blob the
    registry has lost is one refusal, said at once."""
    from vllm_hotfix.errors import PushError

    which, half_written = LINK_CASES[case]
    path = f"{registry.ns}/verdicts"
    client = Client(registry.addr, secure=False, credentials=None)
    writer = Writer(Repo(client, path))
    body = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}})
    config = writer.put_blob(body.encode(), "the config")
    image = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "layers": [],
                        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config,
                                   "size": len(body)}})
    digest = writer.put_manifest("t", OCI_MANIFEST, image.encode())
    subject = referrers.Subject(digest, OCI_MANIFEST, len(image))
    writer.put_blob(referrers.EMPTY, "the empty config")
    repository = registry.storage / "docker/registry/v2/repositories" / path
    puts: list[str] = []
    real = client.request

    def caught(where: str, data: object) -> Path | None:
        """The link this PUT catches half-written or gone; None for every other request."""
        if which == "verdict" and "/manifests/sha256:" in where:
            return repository / "_layers/sha256" / sha256(referrers.EMPTY)[7:] / "link"
        if which == "index" and where.endswith(f"/manifests/{referrers.fallback_tag(digest)}"):
            listed = json.loads(data)["manifests"][0]["digest"]  # type: ignore[arg-type]
            return repository / "_manifests/revisions/sha256" / listed[7:] / "link"
        return None

    def request(method: str, where: str, scope: str, **kwargs: object) -> requests.Response:
        link = caught(where, kwargs.get("data")) if method == "PUT" else None
        if link is None:
            return real(method, where, scope, **kwargs)
        puts.append(where)
        if len(puts) > 1:
            return real(method, where, scope, **kwargs)
        kept = link.read_bytes()
        if half_written:
            link.write_bytes(b"")  # the other writer has opened the link to write it...
        else:
            link.unlink()
        try:
            return real(method, where, scope, **kwargs)
        finally:
            if half_written:
                link.write_bytes(kept)  # ...and finishes as the registry answers this writer

    client.request = request  # type: ignore[method-assign]
    envelope = signing.sign(signing.statement({f"{path}:t": config}, {"status": "pass"}),
                            ec.generate_private_key(ec.SECP256R1()))
    if not half_written:
        with pytest.raises(PushError, match=r"refused the signed verdict .*MANIFEST_BLOB_UNKNOWN") as refused:
            referrers.attach(client, path, subject, envelope)
        assert len(puts) == 1 and "\n" not in str(refused.value), puts
        return
    with caplog.at_level("INFO"):
        referrers.attach(client, path, subject, envelope)
    # Put again at once by the writer, not left to a later rewrite of the fallback index.
    assert len(puts) == 2 and "another writer was linking it" in caplog.text, puts
    assert "trying again" not in caplog.text, caplog.text
    assert [e for _d, e in referrers.envelopes(client, path, digest)] == [envelope]
    index = client.manifest(path, referrers.fallback_tag(digest))
    assert index is not None and len(index.json()["manifests"]) == 1
