"""The engine's typed calls through the Docker SDK, against the real engine: answers, absences, refusals."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest

from vllm_hotfix import tarball
from vllm_hotfix.building import assemble
from vllm_hotfix.engine import Engine, labels
from vllm_hotfix.engine.pending_load import PendingLoad
from vllm_hotfix.errors import EngineError


def test_ping_version_and_absent_things(engine: Engine, unique: str) -> None:
    fresh = Engine.connect(timeout=10, base_url=engine.address)
    try:
        for _ in range(3):  # one kept-alive session serves many calls
            fresh.ping()
        assert fresh.api_version >= (1, 41) and fresh.arch
        assert fresh.image(f"hotfix-test/absent-{unique}:x") is None
        # An absent image or container is no error to remove or untag.
        fresh.untag(f"hotfix-test/absent-{unique}:x")
        fresh.remove_image(f"hotfix-test/absent-{unique}:x")
        fresh.remove_container(f"absent-{unique}")
        with pytest.raises(EngineError, match=f"hotfix-test/absent-{unique}:x: no such image"):
            fresh.history(f"hotfix-test/absent-{unique}:x")
        # A refusal is the operation's one line, in the engine's words.
        with pytest.raises(EngineError) as caught:
            fresh.tag(f"hotfix-test/absent-{unique}:x", "hotfix-test/x:y")
        assert str(caught.value).startswith(f"tagging hotfix-test/absent-{unique}:x as hotfix-test/x:y: ")
        assert "\n" not in str(caught.value)
    finally:
        fresh.close()


@pytest.fixture
def loaded(engine: Engine, unique: str) -> Iterator[tuple[str, bytes]]:
    """A one-file image of this test's own (no base), as a save-format archive, removed after."""
    layer = tarball.write([tarball.Entry(f"hotfix-test-{unique}", unique.encode(), 0o644)])
    diff_id = "sha256:" + hashlib.sha256(layer).hexdigest()
    config = assemble.image_config({"Architecture": engine.arch, "Os": "linux"}, [], diff_id,
                                   [(f"{labels.PREFIX}.test", unique)], "engine calls test")
    image_id, archive = assemble.archive(config, [], layer)
    yield image_id, archive
    engine.remove_image(image_id)


def test_load_inspect_tag_and_untag(engine: Engine, loaded: tuple[str, bytes], unique: str) -> None:
    image_id, archive = loaded
    assert engine.load(archive) == [image_id]
    info = engine.image(image_id)
    assert info is not None and info.id == image_id
    assert info.labels[f"{labels.PREFIX}.test"] == unique
    assert [h.get("CreatedBy") for h in engine.history(image_id)][-1] == "engine calls test"
    ref = f"hotfix-test/calls-{unique}"  # no tag: the engine's own grammar makes it :latest
    engine.tag(image_id, ref)
    engine.tag(image_id, f"{ref}:kept")
    tagged = engine.image(image_id)
    assert tagged is not None and sorted(tagged.tags) == [f"{ref}:kept", f"{ref}:latest"]
    engine.untag(ref)
    untagged = engine.image(image_id)
    assert untagged is not None and untagged.tags == (f"{ref}:kept",)


def test_a_refused_load_is_one_line(engine: Engine) -> None:
    with pytest.raises(Exception) as caught:
        engine.load(tarball.write([tarball.Entry("manifest.json", b"[{]", 0o644)]))
    assert type(caught.value).__name__ == "BuildError"
    assert str(caught.value).startswith("the engine refused to load the image: ") and "\n" not in str(caught.value)


def test_a_containers_shared_memory_is_what_it_is_given(engine: Engine, base_v0251: str) -> None:
    """The engine's default /dev/shm is 64 MB; a tensor-parallel server's container is given 16 GiB."""
    def shm_kib(size: str | None) -> int:
        done = engine.run(base_v0251, ["df", "-k", "/dev/shm"], shm_size=size, timeout=60)
        assert done.exit_code == 0, done.stderr
        return int(done.stdout.splitlines()[-1].split()[1])

    assert shm_kib(None) == 64 * 1024
    assert shm_kib("16g") == 16 * 1024 * 1024


def test_a_load_opened_before_its_archive_loads_that_archive(engine: Engine, loaded: tuple[str, bytes]) -> None:
    """expect_load opens the load; the engine's other calls go on meanwhile; load() completes it."""
    image_id, archive = loaded
    fresh = Engine.connect(timeout=30, base_url=engine.address)
    try:
        fresh.expect_load()
        assert fresh.image(image_id) is None
        assert fresh.load(archive) == [image_id]
        info = fresh.image(image_id)
        assert info is not None and info.id == image_id
        # Only the first load was opened ahead; the next is a load of its own.
        assert fresh.load(archive) == [image_id]
    finally:
        fresh.close()


def test_a_load_opened_and_never_given_an_archive_loads_nothing(engine: Engine) -> None:
    fresh = Engine.connect(timeout=30, base_url=engine.address)
    try:
        pending = PendingLoad(fresh.api)
        pending.cancel(wait=30)
        answer = pending.answer(wait=30)
        # The engine answered: it unpacked the lead and an empty manifest, and loaded nothing.
        assert answer is not None
        assert not [m for m in answer if "Loaded image" in str(m.get("stream", ""))], answer
    finally:
        fresh.close()


def test_a_refused_load_opened_ahead_is_one_line(engine: Engine) -> None:
    fresh = Engine.connect(timeout=30, base_url=engine.address)
    try:
        fresh.expect_load()
        with pytest.raises(Exception) as caught:
            fresh.load(tarball.write([tarball.Entry("manifest.json", b"[{]", 0o644)]))
        assert type(caught.value).__name__ == "BuildError"
        assert str(caught.value).startswith("the engine refused to load the image: ") and "\n" not in str(caught.value)
    finally:
        fresh.close()
