"""`list` and `rollback`, run for real on builds of the stand-in base."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import STANDIN_REPO, Result, cli
from vllm_hotfix.engine import Engine

PATCH = "0001-minimax-m3-topk-buffer-layout.patch"


def _build(project: Path, out: str) -> str:
    r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", root=project)
    assert r.rc == 0, r.err
    return r.out.strip().split()[-1]


def _fails(r: Result, *needles: str) -> None:
    assert r.rc != 0, r.err
    for needle in needles:
        assert needle in r.last_error, f"{needle!r} not in {r.last_error!r}"


def test_list_and_rollback(engine: Engine, base_v0251: str, project: Path, unique: str) -> None:
    out = f"hotfix-test/rollback:{unique}"
    r = cli("list", root=project)
    assert r.rc == 0, r.err
    assert r.out.startswith(
        f"v0.25.1  base {STANDIN_REPO}:v0.25.1  patch set v0.25.1 (1 patch(es))  never built"
    )
    first = _build(project, out)
    # A second, different build: a changed patch header changes the labels.
    path = project / "patches/v0.25.1" / PATCH
    path.write_text("Rebuilt for the rollback test.\n" + path.read_text())
    second = _build(project, out)
    assert first != second
    try:
        r = cli("list", root=project)
        assert r.rc == 0, r.err
        assert "2 build(s)" in r.out
        assert f"{second}  {out}  smoke not judged  push none" in r.out
        assert f"{first}  {out}  smoke not judged  push none" in r.out
        rows = json.loads(cli("list", "--json", root=project).out)
        assert [b["image_id"] for b in rows[0]["builds"]] == [second, first]

        r = cli("rollback", "--definition", "v0.25.1", root=project)
        assert r.rc == 0, r.err
        assert r.out.startswith(f"rolled back {out} to {first}")
        assert f"python build.py push {out} --registry" in r.err
        info = engine.image(out)
        assert info is not None and info.id == first
        # Nothing older than the first build: one clear error, tag unchanged.
        r = cli("rollback", "--definition", "v0.25.1", root=project)
        _fails(r, "no earlier build of v0.25.1")
        assert engine.image(out).id == first  # type: ignore[union-attr]
        # Forward again, by ID, as `list --json` shows it: called forward, not back.
        r = cli("rollback", "--definition", "v0.25.1", "--to", second.removeprefix("sha256:")[:12], root=project)
        assert r.rc == 0, r.err
        assert r.out.startswith(f"moved forward {out} to {second}")
        assert engine.image(out).id == second  # type: ignore[union-attr]
        # To the image it already names: nothing moves, and it says so.
        r = cli("rollback", "--definition", "v0.25.1", "--to", second, root=project)
        assert r.rc == 0 and r.out.strip() == f"{out} already points at {second}; nothing moved", r.out
        # A well-formed ID no build record names; a malformed one is a usage error before any work.
        r = cli("rollback", "--definition", "v0.25.1", "--to", "sha256:" + "0123abcd" * 8, root=project)
        _fails(r, "sha256:0123abcd", "no build record")
        r = cli("rollback", "--definition", "v0.25.1", "--to", "sha256:0123abcd", root=project)
        assert r.rc == 64, r.err
    finally:
        engine.remove_image(out)
        for image_id in (first, second):
            engine.remove_untagged(image_id)


def test_image_that_moves_the_tag_back_to_an_older_build_says_so(engine: Engine, base_v0251: str, project: Path,
                                                                 unique: str) -> None:
    """A plain `image` after `--rebuild --builder assemble` reuses the older Dockerfile build: "(was NEWER)"."""
    out = f"hotfix-test/moved-back:{unique}"
    first = _build(project, out)
    r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", "--rebuild",
            "--builder", "assemble", root=project)
    assert r.rc == 0, r.err
    newer = r.out.split()[-1]
    assert newer != first
    try:
        r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", root=project)
        assert r.rc == 0 and r.out.split() == ["reused", out, first], r.out + r.err
        assert f"(was {newer})" in r.err, r.err
        assert f"rollback --definition v0.25.1 --tag {out} --to {newer[:19]}" in r.err
        r = cli("image", "--definition", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", "--json",
                root=project)
        assert json.loads(r.out)["was"] is None  # the tag already named it: nothing moved, nothing said
        assert "(was " not in r.err
    finally:
        engine.remove_image(out)
        for image_id in (first, newer):
            engine.remove_untagged(image_id)
