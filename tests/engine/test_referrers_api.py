"""Signed verdicts against a registry that offers the OCI referrers API, and the same registry without it.

Debian's docker-registry (test_referrers.py) has no referrers API, so there
only the fallback tag is used; here a small registry that speaks the API
(tests/oci_registry.py) shows each branch of referrers.py: the registry
indexing an artifact by its subject (no fallback tag written, the list read
from ``/v2/<name>/referrers/<digest>``), and, with the API off, the
``sha256-<digest>`` tag.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.asymmetric import ec

from oci_registry import Store, serving
from vllm_hotfix.errors import PushError
from vllm_hotfix.registry.client import OCI_MANIFEST, Client, sha256
from vllm_hotfix.registry.write import Repo, Writer
from vllm_hotfix.trust import referrers, signing

REPO = "ops/vllm-openai"


def _image(client: Client) -> referrers.Subject:
    """A one-layer image put under ``REPO:t``, as its manifest's descriptor."""
    config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}})
    layer = b"layer bytes"
    for blob in (config.encode(), layer):
        Writer(Repo(client, REPO)).put_blob(blob, "a blob")
    manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                           "digest": sha256(config.encode()), "size": len(config)},
                "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": sha256(layer),
                            "size": len(layer)}]}
    body = json.dumps(manifest).encode()
    Writer(Repo(client, REPO)).put_manifest("t", OCI_MANIFEST, body)
    return referrers.Subject(sha256(body), OCI_MANIFEST, len(body))


@pytest.fixture(params=[True, False], ids=["referrers-api", "fallback-tag"])
def registry(request: pytest.FixtureRequest) -> Iterator[tuple[Client, Store, referrers.Subject]]:
    with serving(referrers_api=request.param) as (addr, store):
        client = Client(addr, secure=False, credentials=None)
        yield client, store, _image(client)


def _envelope(subject: referrers.Subject, status: str) -> bytes:
    doc = signing.statement({f"{REPO}:t": "sha256:" + "c" * 64}, {"status": status})
    return signing.sign(doc, ec.generate_private_key(ec.SECP256R1()))


def _with_verdicts(addr: str, statuses: list[str]) -> tuple[Client, referrers.Subject, list[bytes]]:
    """The test image on the registry at ``addr``, with a signed verdict of each of ``statuses`` attached."""
    client = Client(addr, secure=False, credentials=None)
    subject = _image(client)
    made = [_envelope(subject, status) for status in statuses]
    for envelope in made:
        referrers.attach(client, REPO, subject, envelope)
    return client, subject, made


def test_verdicts_attach_and_read_back_by_the_registrys_way(registry: tuple[Client, Store, referrers.Subject]
                                                             ) -> None:
    client, store, subject = registry
    first, second = _envelope(subject, "pass"), _envelope(subject, "fail")
    digest = referrers.attach(client, REPO, subject, first)
    assert referrers.attach(client, REPO, subject, first) == digest  # the same verdict again adds nothing
    referrers.attach(client, REPO, subject, second)
    store.log.clear()
    found = [e for _d, e in referrers.envelopes(client, REPO, subject.digest)]
    assert sorted(found) == sorted([first, second]) and len(found) == 2
    asked = [(method, path, status) for method, path, status in store.log if "/referrers/" in path
             or path.endswith("/manifests/" + referrers.fallback_tag(subject.digest))]
    fallback = (REPO, referrers.fallback_tag(subject.digest))
    if store.referrers_api:
        # The registry indexes the artifacts itself: no fallback tag written; readers take the union, so it is
        # asked for all the same.
        assert fallback not in store.tags
        assert asked == [("GET", f"/v2/{REPO}/referrers/{subject.digest}", 200),
                         ("GET", f"/v2/{REPO}/manifests/{fallback[1]}", 404)]
    else:
        index = json.loads(store.manifests[(REPO, store.tags[fallback])][1])
        assert len(index["manifests"]) == 2
        assert asked == [("GET", f"/v2/{REPO}/referrers/{subject.digest}", 404),
                         ("GET", f"/v2/{REPO}/manifests/{fallback[1]}", 200)]


def test_readers_take_the_union_of_the_api_the_fallback_index_and_the_own_tags() -> None:
    with serving(referrers_api=False) as (addr, store):
        client = Client(addr, secure=False, credentials=None)
        subject = _image(client)
        # A fail attached while the registry had no referrers API: the fallback index and its own tag hold it.
        before = _envelope(subject, "fail")
        old = referrers.attach(client, REPO, subject, before)
        # The registry gains the API, which does not list what was pushed before it indexed subjects.
        store.referrers_api = True
        store.unindexed.add(old)
        after = _envelope(subject, "pass")
        referrers.attach(client, REPO, subject, after)
        assert [e["digest"] for e in store.referrers(REPO, subject.digest, None)] != []
        assert sorted(e for _d, e in referrers.envelopes(client, REPO, subject.digest)) == sorted([before, after])
        # Dropped from the fallback index too: its own tag still holds it.
        del store.tags[(REPO, referrers.fallback_tag(subject.digest))]
        assert sorted(e for _d, e in referrers.envelopes(client, REPO, subject.digest)) == sorted([before, after])


def test_an_image_without_verdicts_has_none(registry: tuple[Client, Store, referrers.Subject]) -> None:
    client, _store, subject = registry
    assert referrers.envelopes(client, REPO, subject.digest) == []


def test_a_referrer_listed_for_another_subject_is_left_out() -> None:
    with serving() as (addr, store):
        client = Client(addr, secure=False, credentials=None)
        subject = _image(client)
        ours = _envelope(subject, "pass")
        referrers.attach(client, REPO, subject, ours)
        # An artifact about another image, which this registry (wrongly) lists for ours.
        stranger = referrers.Subject("sha256:" + "e" * 64, OCI_MANIFEST, 10)
        other = referrers.attach(client, REPO, stranger, _envelope(stranger, "pass"))
        store.extra_referrers[subject.digest] = [{"mediaType": OCI_MANIFEST, "digest": other, "size": 1,
                                                  "artifactType": signing.PAYLOAD_TYPE}]
        assert len(referrers.listed(client, REPO, subject.digest)) == 2
        assert [e for _d, e in referrers.envelopes(client, REPO, subject.digest)] == [ours]


def test_a_referrers_answer_that_is_not_json_is_one_line() -> None:
    with serving() as (addr, store):
        client = Client(addr, secure=False, credentials=None)
        subject = _image(client)
        store.referrers_body = b"not json"
        with pytest.raises(PushError, match="answered the referrers of .* with something that is not an index"):
            referrers.listed(client, REPO, subject.digest)


def test_every_page_of_the_referrers_api_is_read() -> None:
    """A registry that pages its referrers (a Link header to the next page): a verdict on the last page counts
    (it was left out, and with it the newest fail)."""
    with serving() as (addr, store):
        client, subject, made = _with_verdicts(addr, ["pass"] * 4 + ["fail"])
        store.page_size = 2
        store.log.clear()
        found = [e for _d, e in referrers.envelopes(client, REPO, subject.digest)]
        assert sorted(found) == sorted(made)
        pages = [path for method, path, _status in store.log if "/referrers/" in path]
        assert len(pages) == 3, pages


def test_every_page_of_the_tag_list_is_read_and_a_later_page_that_fails_is_named() -> None:
    """The verdicts' own tags are found in the tag list: a tag on a later page counts, and a later page the
    registry does not answer is an error (its tags would go unseen), for the tag list as for the referrers."""
    with serving(referrers_api=False) as (addr, store):
        client, _subject, _made = _with_verdicts(addr, ["pass"] * 3 + ["fail"])
        store.page_size = 2
        every = referrers.tags(client, REPO)
        assert sorted(every) == sorted(tag for repo, tag in store.tags if repo == REPO) and len(every) >= 6
        store.broken_pages = True
        with pytest.raises(PushError, match=f"answered 500 for a later page of the tag list of {REPO}"):
            referrers.tags(client, REPO)
    with serving() as (addr, store):
        client, subject, _made = _with_verdicts(addr, ["pass", "fail", "pass"])
        store.page_size, store.broken_pages = 2, True
        with pytest.raises(PushError, match="answered 500 for a later page of the referrers of"):
            referrers.listed(client, REPO, subject.digest)
