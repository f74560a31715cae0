"""`new-patchset` against the real releases' files: an upstream PR becomes a patch.

The PR is served by tests/github_api.py; the files its diff is checked against
are the real vLLM wheels' (downloaded from PyPI into build/cache) and the
stand-in base's.
"""

from __future__ import annotations

from pathlib import Path

from conftest import REPO, STANDIN_REPO, cli, fails, snapshot
from github_api import PRS, SLUG, TITLE
from vllm_hotfix.building import definitions
from vllm_hotfix.engine import Engine

CACHE = {"VLLM_HOTFIX_CACHE": str(REPO / "build" / "cache")}


def test_new_patchset_from_pr_for_a_new_base(engine: Engine, base_v0251: str, fresh: Path, api: str) -> None:
    r = cli(
        "new-patchset",
        "--definition",
        "v0.25.1",
        "--from-pr",
        "49149",
        "--api-url",
        api,
        # The run's own stand-in, never whatever the engine holds as vllm/vllm-openai.
        "--base-repo",
        STANDIN_REPO,
        "--pull",
        "never",
        root=fresh,
        env=CACHE,
    )
    assert r.rc == 0, r.err
    patch = fresh / "patches/v0.25.1" / SLUG
    text = patch.read_text()
    assert "Upstream-PR: https://github.com/vllm-project/vllm/pull/49149" in text
    assert f"Title: {TITLE}" in text
    assert "Dropped-from-PR: tests/models/test_minimax_m3_topk.py, docs/models.md" in text
    assert "+++ b/tests/" not in text and "docs/models.md\n+++" not in text  # only the package's files
    assert "leaving out 2 file(s)" in r.err
    assert (fresh / "patches/v0.25.1/series").read_text().splitlines()[-1] == SLUG
    assert 'set = "v0.25.1"' in (fresh / "images/v0.25.1.toml").read_text()
    # The base it read is pinned by image ID: a moved tag is refused from now on.
    read = engine.image(f"{STANDIN_REPO}:v0.25.1")
    assert read is not None
    assert definitions.load(fresh, "v0.25.1").base_digests == {f"{read.os}/{read.architecture}": read.id}
    # The new set is the real fix: 0.26.0 still needs it, 0.27.0 ships it.
    for tag, word in (("v0.25.1", "needed"), ("v0.26.0", "needed"), ("v0.27.0", "included")):
        c = cli(
            "check-upstream", "--patches", "v0.25.1", "--base", tag, "--from-wheel", root=fresh, env=CACHE
        )
        assert c.out.startswith(f"{SLUG}: {word}"), (tag, c.out, c.err)
    # And `image` accepts the set and definition it wrote.
    rendered = cli("render", "--definition", "v0.25.1", "--pull", "never", root=fresh)
    assert rendered.rc == 0, rendered.err
    assert f"io.vllm-hotfix.patch.{SLUG}" in rendered.out


def test_new_patchset_from_pr_url_and_from_file_against_the_wheel(
    fresh: Path, api: str, tmp_path: Path
) -> None:
    url = "https://github.com/vllm-project/vllm/pull/49149"
    r = cli(
        "new-patchset",
        "--definition",
        "v0.25.1",
        "--from-pr",
        url,
        "--api-url",
        api,
        "--from-wheel",
        root=fresh,
        env=CACHE,
    )
    assert r.rc == 0, r.err
    assert (fresh / "patches/v0.25.1" / SLUG).is_file()
    # The same change again: the set already carries it, so nothing is added.
    before = snapshot(fresh)
    diff = tmp_path / "minimax-topk.diff"
    diff.write_text(PRS[49149][1])
    r = cli(
        "new-patchset", "--definition", "v0.25.1", "--from-file", str(diff), "--from-wheel", root=fresh, env=CACHE
    )
    fails(r, "patch set v0.25.1 already holds this change")
    assert snapshot(fresh) == before
    # From a file on a second base: numbered 0001 there, named from the file.
    r = cli(
        "new-patchset", "--definition", "v0.26.0", "--from-file", str(diff), "--from-wheel", root=fresh, env=CACHE
    )
    assert r.rc == 0, r.err
    assert (fresh / "patches/v0.26.0/series").read_text().splitlines()[-1] == "0001-minimax-topk.patch"
    assert "Source: minimax-topk.diff" in (fresh / "patches/v0.26.0/0001-minimax-topk.patch").read_text()


def test_new_patchset_on_a_release_that_ships_it(fresh: Path, api: str) -> None:
    before = snapshot(fresh)
    r = cli(
        "new-patchset",
        "--definition",
        "v0.27.0",
        "--from-pr",
        "49149",
        "--api-url",
        api,
        "--from-wheel",
        root=fresh,
        env=CACHE,
    )
    fails(r, "pull/49149", "vllm 0.27.0 wheel already carries this change")
    assert snapshot(fresh) == before


def test_new_patchset_with_context_no_release_has_writes_nothing(project: Path, api: str) -> None:
    before = snapshot(project)
    r = cli(
        "new-patchset", "--definition", "v0.25.1", "--from-pr", "50001", "--api-url", api, "--from-wheel", root=project,
        env=CACHE,
    )
    fails(
        r,
        "0002-broken-context.patch",
        "hunk #1 (@@ -424,6 +424,9 @@)",
        "vllm/models/minimax_m3/common/indexer.py",
        "does not apply",
    )
    assert snapshot(project) == before
