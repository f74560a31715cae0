"""Rollback after a multi-platform build stays within each platform (an engine stand-in in memory)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from vllm_hotfix.building import definitions
from vllm_hotfix.engine import ImageInfo
from vllm_hotfix.errors import NothingToRollBack, Refused
from vllm_hotfix.journal import records
from vllm_hotfix.release import lifecycle


class Tags:
    """The two things rollback asks of an engine: what a name or ID is, and to move a tag."""

    def __init__(self, arch: dict[str, str]) -> None:
        self.arch = arch  # image ID -> architecture
        self.names: dict[str, str] = {}

    def image(self, ref: str) -> ImageInfo | None:
        image_id = self.names.get(ref, ref)
        if image_id not in self.arch:
            return None
        return ImageInfo(image_id, (), (), None, None, (), "", architecture=self.arch[image_id])

    def tag(self, image_id: str, ref: str) -> None:
        self.names[ref] = image_id


def _id(n: int) -> str:
    return "sha256:" + f"{n:x}" * 64


def _build(root: Path, definition: str, image_id: str, ref: str, plat: str) -> None:
    records.append(root, "build", {"image_id": image_id, "output_ref": ref, "platform": plat,
                                   "inputs": {"definition": definition}})


@pytest.fixture
def two_builds(project: Path) -> tuple[Path, Tags, str, Any]:
    """Two multi-platform builds of v0.25.1 (amd64 first, as `image` builds them), the tags on the newer."""
    defn = definitions.load(project, "v0.25.1")
    out = "r/vllm-openai:v0.25.1-m3patch"
    eng = Tags({_id(1): "amd64", _id(2): "arm64", _id(3): "amd64", _id(4): "arm64"})
    for a, b in ((1, 2), (3, 4)):
        _build(project, defn.tag, _id(a), f"{out}-x86_64", "linux/amd64")
        _build(project, defn.tag, _id(b), f"{out}-aarch64", "linux/arm64")
    eng.names = {f"{out}-x86_64": _id(3), f"{out}-aarch64": _id(4), out: _id(3)}
    return project, eng, out, defn


def _arch(eng: Tags, ref: str) -> str:
    info = eng.image(ref)
    assert info is not None
    return info.architecture


def test_rollback_moves_each_platform_to_its_own_previous_build(two_builds: tuple[Path, Tags, str, Any]) -> None:
    root, eng, out, _ = two_builds
    moved = lifecycle.rollback(eng, root, "v0.25.1")  # type: ignore[arg-type]
    assert {m.ref: m.to.image_id for m in moved} == {f"{out}-x86_64": _id(1), f"{out}-aarch64": _id(2),
                                                     out: _id(1)}
    assert (_arch(eng, f"{out}-x86_64"), _arch(eng, f"{out}-aarch64"), _arch(eng, out)) == \
        ("amd64", "arm64", "amd64")
    # Nothing older on either platform: refused, and nothing moved.
    with pytest.raises(NothingToRollBack):
        lifecycle.rollback(eng, root, "v0.25.1")  # type: ignore[arg-type]
    assert eng.names[f"{out}-aarch64"] == _id(2)


def test_one_platforms_tag_never_gets_another_platforms_image(two_builds: tuple[Path, Tags, str, Any]) -> None:
    root, eng, out, _ = two_builds
    arm = f"{out}-aarch64"
    moved = lifecycle.rollback(eng, root, "v0.25.1", ref=arm)  # type: ignore[arg-type]
    assert [(m.ref, m.to.image_id) for m in moved] == [(arm, _id(2))]
    with pytest.raises(NothingToRollBack):  # the amd64 builds are older, but not arm64
        lifecycle.rollback(eng, root, "v0.25.1", ref=arm)  # type: ignore[arg-type]
    with pytest.raises(Refused, match="linux/amd64, not linux/arm64"):
        lifecycle.rollback(eng, root, "v0.25.1", _id(1), ref=arm)  # type: ignore[arg-type]
    with pytest.raises(Refused, match="multi-platform"):
        lifecycle.rollback(eng, root, "v0.25.1", _id(1))  # type: ignore[arg-type]
    assert eng.names[arm] == _id(2)


def test_a_build_whose_image_contradicts_its_record_is_never_picked(two_builds: tuple[Path, Tags, str, Any]
                                                                    ) -> None:
    root, eng, out, _ = two_builds
    eng.arch[_id(2)] = "amd64"  # recorded as arm64, but the engine says otherwise
    with pytest.raises(NothingToRollBack):
        lifecycle.rollback(eng, root, "v0.25.1", ref=f"{out}-aarch64")  # type: ignore[arg-type]


def test_a_later_single_platform_build_of_the_tag_moves_the_tag_alone(
        two_builds: tuple[Path, Tags, str, Any]) -> None:
    """TAG built alone after two multi-platform builds: rollback moves TAG, not the stale children."""
    root, eng, out, defn = two_builds
    eng.arch[_id(5)] = "amd64"
    _build(root, defn.tag, _id(5), out, "linux/amd64")
    eng.names[out] = _id(5)
    moved = lifecycle.rollback(eng, root, "v0.25.1")  # type: ignore[arg-type]
    assert [(m.ref, m.to.image_id, m.was) for m in moved] == [(out, _id(3), _id(5))]
    assert (eng.names[f"{out}-x86_64"], eng.names[f"{out}-aarch64"]) == (_id(3), _id(4))


def test_rollback_to_a_single_platform_build_made_before_a_multi_platform_one(project: Path) -> None:
    """--to an earlier build of TAG itself (single-platform), TAG since the output of a two-platform build."""
    defn = definitions.load(project, "v0.25.1")
    out = "r/vllm-openai:v0.25.1-m3patch"
    eng = Tags({_id(1): "amd64", _id(2): "amd64", _id(3): "arm64"})
    _build(project, defn.tag, _id(1), out, "linux/amd64")
    _build(project, defn.tag, _id(2), f"{out}-x86_64", "linux/amd64")
    _build(project, defn.tag, _id(3), f"{out}-aarch64", "linux/arm64")
    eng.names = {out: _id(2), f"{out}-x86_64": _id(2), f"{out}-aarch64": _id(3)}
    moved = lifecycle.rollback(eng, project, "v0.25.1", _id(1))  # type: ignore[arg-type]
    assert [(m.ref, m.to.image_id, m.direction) for m in moved] == [(out, _id(1), "back")]
    assert eng.names == {out: _id(1), f"{out}-x86_64": _id(2), f"{out}-aarch64": _id(3)}
    # A child's build is still one platform's: name its tag.
    with pytest.raises(Refused, match="multi-platform"):
        eng.names[out] = _id(2)
        lifecycle.rollback(eng, project, "v0.25.1", _id(3))  # type: ignore[arg-type]
