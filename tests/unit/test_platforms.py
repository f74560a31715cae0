"""Platform lists, index media types and the emulator check."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import cli, fails
from vllm_hotfix import platforms, registry
from vllm_hotfix.errors import BaseImageError, UsageError
from vllm_hotfix.platforms import Platform

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
    r = cli("image", "--base", "v0.25.1", "--platform", "linux/s390x")
    fails(r, "linux/s390x")
    assert r.rc == 64
