"""Platform lists, index media types and the emulator check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli, fails
from vllm_hotfix.building import platforms
from vllm_hotfix.building.platforms import Platform
from vllm_hotfix.errors import BaseImageError, PushError, UsageError
from vllm_hotfix.registry import client as registry
from vllm_hotfix.release import push

AMD64, ARM64 = Platform("linux", "amd64"), Platform("linux", "arm64")


def test_platform_lists_parse_and_refuse() -> None:
    assert platforms.parse("linux/amd64,linux/arm64") == [AMD64, ARM64]
    assert platforms.parse("linux/arm64/v8, linux/arm64") == [ARM64]
    assert platforms.parse("all") is None and platforms.parse(None) is None
    assert [p.suffix for p in (AMD64, ARM64)] == ["x86_64", "aarch64"]
    for bad in ("linux/s390x", "windows/amd64", "arm64", "linux/amd64,,linux/arm64"):
        with pytest.raises(UsageError):
            platforms.parse(bad)


def test_index_media_type_follows_the_children_and_skips_attestations() -> None:
    docker_kids = [registry.Child("sha256:" + "a" * 64, registry.DOCKER_MANIFEST, 10, "linux", "amd64")]
    media, body = registry.index_body(docker_kids)
    assert media == registry.DOCKER_LIST and json.loads(body)["mediaType"] == media
    oci_kids = [registry.Child("sha256:" + "b" * 64, registry.OCI_MANIFEST, 10, "linux", "arm64")]
    media, body = registry.index_body(oci_kids)
    assert media == registry.OCI_INDEX
    doc = json.loads(body)
    doc["manifests"].append({"mediaType": registry.OCI_MANIFEST, "digest": "sha256:" + "c" * 64, "size": 5,
                             "platform": {"architecture": "unknown", "os": "unknown"}})
    index = registry.Manifest(registry.OCI_INDEX, "sha256:x", json.dumps(doc).encode())
    assert [(c.architecture, c.digest) for c in registry.children(index)] == [("arm64", "sha256:" + "b" * 64)]


def test_emulator_check_reads_the_hosts_binfmt_table(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_HOTFIX_BINFMT_DIR", str(tmp_path))
    platforms.check_runnable(AMD64, "amd64", True)  # native: nothing to emulate
    with pytest.raises(BaseImageError, match="no emulator for aarch64"):
        platforms.check_runnable(ARM64, "amd64", True)
    (tmp_path / "qemu-aarch64").write_text("disabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\n")
    with pytest.raises(BaseImageError):
        platforms.check_runnable(ARM64, "amd64", True)
    (tmp_path / "qemu-aarch64").write_text("enabled\ninterpreter /usr/libexec/qemu-binfmt/aarch64-binfmt-P\n")
    platforms.check_runnable(ARM64, "amd64", True)


def test_unknown_platform_is_a_usage_error() -> None:
    r = cli("image", "--definition", "v0.25.1", "--platform", "linux/s390x")
    fails(r, "linux/s390x")
    assert r.rc == 64


def test_a_tag_suffix_names_its_platform() -> None:
    assert platforms.of_tag("r/vllm-openai:v1-m3patch-x86_64") == AMD64
    assert platforms.of_tag("r/vllm-openai:v1-m3patch-aarch64") == ARM64
    assert platforms.of_tag("host:5000/r/x:v1-arm64") == ARM64
    for plain in ("r/x:v1-m3patch", "r/x:v1-sm100", "r/x:aarch64", "r/x@sha256:" + "a" * 64):
        assert platforms.of_tag(plain) is None
    assert platforms.parent_ref("r/x:v1-m3patch-aarch64") == ("r/x:v1-m3patch", ARM64)
    assert platforms.parent_ref("r/x:v1-m3patch") is None
    assert platforms.child_ref("r/x:v1", ARM64) == "r/x:v1-aarch64"


def test_an_architecture_its_tag_or_record_contradicts_is_named() -> None:
    ok = platforms.mismatch
    assert ok("r/x:v1-aarch64", "linux", "arm64") is None
    assert ok("r/x:v1-aarch64", "linux", "arm64", "v8", "linux/arm64") is None
    assert ok("r/x:v1-x86_64", "linux", "amd64", "", "linux/amd64") is None
    assert ok("r/x:v1", "linux", "amd64", "", "linux/amd64") is None
    bad = ok("r/x:v1-aarch64", "linux", "amd64")
    assert bad is not None and "r/x:v1-aarch64" in bad and "linux/amd64" in bad and "linux/arm64" in bad
    assert "suffix" in (ok("r/x:v1-x86_64", "linux", "arm64") or "")
    assert "journal" in (ok("r/x:v1", "linux", "amd64", "", "linux/arm64") or "")
    assert "journal" in (ok("r/x:v1-aarch64", "linux", "arm64", "", "linux/amd64") or "")
    assert ok("r/x:v1", "windows", "amd64") is not None
    assert ok("r/x:v1", "linux", "s390x") is not None
    assert ok("r/x:v1-aarch64", "linux", "arm64", "v7") is not None


def _kid(plat: Platform, image: str, family: str = "f") -> push.Child:
    return push.Child(plat, f"r/x:v1-{plat.suffix}", image, family)


def test_a_plain_push_pushes_every_platform_image_built() -> None:
    both = [_kid(AMD64, "sha256:a"), _kid(ARM64, "sha256:b")]
    # Single-platform build: no children, the tag alone.
    assert push.plain_platforms("r/x:v1", "sha256:a", []) is None
    # Multi-platform build: TAG on the engine's own platform's child -> every child and an index.
    assert push.plain_platforms("r/x:v1", "sha256:a", both) == [AMD64, ARM64]
    assert push.plain_platforms("r/x:v1", "sha256:b", both) == [AMD64, ARM64]
    # Only one other platform built (TAG not made): that child, under an index.
    assert push.plain_platforms("r/x:v1", None, [_kid(ARM64, "sha256:b")]) == [ARM64]
    # TAG rebuilt single-platform since: it alone, not the older children.
    assert push.plain_platforms("r/x:v1", "sha256:c", both) is None
    # Children of another build (other inputs) are left out; with no TAG to tell, refused.
    mixed = [_kid(AMD64, "sha256:a", "f"), _kid(ARM64, "sha256:b", "g")]
    assert push.plain_platforms("r/x:v1", "sha256:a", mixed) == [AMD64]
    with pytest.raises(PushError, match="different definitions"):
        push.plain_platforms("r/x:v1", None, mixed)


def test_the_family_ignores_each_platforms_base() -> None:
    a = {"definition": "v1", "patches": {"p": "1"}, "base_id": "sha256:a", "base_ref": "r@sha256:1",
         "platform": "linux/amd64", "output_ref": "r/x:v1-x86_64"}
    b = {**a, "base_id": "sha256:b", "base_ref": "r@sha256:2", "platform": "linux/arm64",
         "output_ref": "r/x:v1-aarch64"}
    assert push.family(a) == push.family(b)
    assert push.family(a) != push.family({**a, "patches": {"p": "2"}})
