"""The project copies the tests build in hold the project's own definitions and patch sets, never a user's.

`new-patchset` writes a user's patch set and definition into the checkout,
untracked; `make test` must pass the same with them there (issue 54: a user's
patch set for v0.26.0 made the new-patchset test refuse "already holds this
change").
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from conftest import REPO, STANDIN_REPO, project_copy


def _git(where: Path, *args: str) -> None:
    subprocess.run(["git", "-C", str(where), *args], check=True, capture_output=True)


def _checkout(where: Path) -> Path:
    """A git checkout holding one tracked definition and patch set, and a user's own (untracked) beside them."""
    (where / "images").mkdir(parents=True)
    (where / "patches/v0.25.1").mkdir(parents=True)
    (where / "images/v0.25.1.toml").write_text('[base]\nrepository = "vllm/vllm-openai"\n')
    (where / "patches/v0.25.1/series").write_text("0001-fix.patch\n")
    (where / "patches/v0.25.1/0001-fix.patch").write_text("--- a/x\n+++ b/x\n")
    _git(where, "init", "-q")
    _git(where, "add", "images", "patches")
    # What `new-patchset --base v0.26.0 ...` leaves in a user's checkout.
    (where / "images/v0.26.0.toml").write_text('[base]\nrepository = "vllm/vllm-openai"\n')
    (where / "patches/v0.26.0").mkdir()
    (where / "patches/v0.26.0/series").write_text("0001-mine.patch\n")
    (where / "patches/v0.26.0/0001-mine.patch").write_text("--- a/y\n+++ b/y\n")
    # A user's own patch added to the project's set, not tracked either.
    (where / "patches/v0.25.1/0002-mine.patch").write_text("--- a/z\n+++ b/z\n")
    return where


def _files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


def test_a_users_own_patch_sets_and_definitions_never_reach_the_tests_copy(tmp_path: Path) -> None:
    source = _checkout(tmp_path / "checkout")
    copy = project_copy(tmp_path / "copy", source)
    assert _files(copy) == {"images/v0.25.1.toml", "patches/v0.25.1/series", "patches/v0.25.1/0001-fix.patch"}
    assert f'"{STANDIN_REPO}"' in (copy / "images/v0.25.1.toml").read_text()


def test_a_tracked_file_the_user_edited_is_copied_as_it_is_now(tmp_path: Path) -> None:
    """Tracked files come from the working tree: a change to the project's own set is what its tests test."""
    source = _checkout(tmp_path / "checkout")
    (source / "patches/v0.25.1/series").write_text("0001-fix.patch\n# edited\n")
    (source / "patches/v0.25.1/0001-fix.patch").unlink()  # deleted, not yet staged: gone from the copy too
    copy = project_copy(tmp_path / "copy", source)
    assert (copy / "patches/v0.25.1/series").read_text().endswith("# edited\n")
    assert not (copy / "patches/v0.25.1/0001-fix.patch").exists()


def test_an_unpacked_archive_of_the_project_is_copied_whole(tmp_path: Path) -> None:
    """Without git there is no user's own file to tell apart: everything is the project's."""
    source = tmp_path / "archive"
    (source / "images").mkdir(parents=True)
    (source / "patches/v0.25.1").mkdir(parents=True)
    (source / "images/v0.25.1.toml").write_text("[base]\n")
    (source / "patches/v0.25.1/series").write_text("\n")
    copy = project_copy(tmp_path / "copy", source)
    assert _files(copy) == {"images/v0.25.1.toml", "patches/v0.25.1/series"}


def test_the_copy_of_this_checkout_holds_exactly_what_git_tracks(tmp_path: Path) -> None:
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "images", "patches"], capture_output=True,
                            text=True, check=True).stdout.split()
    copy = project_copy(tmp_path / "copy")
    assert _files(copy) == {name for name in listed if (REPO / name).is_file()}


def test_no_test_or_benchmark_copies_the_checkouts_folders_whole() -> None:
    """Every copy of images/ or patches/ goes through the tracked files (conftest.copy_tracked, bench's
    copy_definitions): a whole-folder copy would take a user's own sets along."""
    import re

    whole = re.compile(r"copytree\(\s*REPO\b")
    files = [p for folder in ("tests", "bench") for p in sorted((REPO / folder).rglob("*.py"))]
    found = [f"{p.relative_to(REPO)}:{n}" for p in files for n, line in enumerate(p.read_text().splitlines(), 1)
             if whole.search(line)]
    assert not found, found
