"""`new-patchset` input it refuses before reading any release.

The PR is served by a local HTTP server speaking the GitHub API forms the tool
uses (tests/github_api.py); none of these cases gets as far as a release's
files, so nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import REPO, cli, fails, snapshot

CACHE = {"VLLM_HOTFIX_CACHE": str(REPO / "build" / "cache")}


def test_new_patchset_offline(fresh: Path) -> None:
    before = snapshot(fresh)
    # Port 9 (discard) on loopback: nothing listens, the connection is refused.
    r = cli(
        "new-patchset",
        "--definition",
        "v0.25.1",
        "--from-pr",
        "49149",
        "--from-wheel",
        root=fresh,
        env={**CACHE, "VLLM_HOTFIX_GITHUB_API": "http://127.0.0.1:9"},
    )
    fails(r, "cannot fetch PR #49149", "http://127.0.0.1:9/repos/vllm-project/vllm/pulls/49149")
    assert "--from-file" in r.err
    assert snapshot(fresh) == before


@pytest.mark.parametrize(
    "args, needles",
    [
        (("--from-pr", "50002"), ("touches no file under vllm/", "docs/models.md")),
        (("--from-pr", "404"), ("PR #404", "HTTP 404")),
        (("--from-pr", "not-a-pr"), ("'not-a-pr'", "neither a PR number")),
        (("--from-file", "/nonexistent/x.diff"), ("/nonexistent/x.diff", "does not exist")),
        ((), ("exactly one of --from-pr",)),
    ],
)
def test_new_patchset_bad_input_writes_nothing(
    project: Path, api: str, args: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    before = snapshot(project)
    r = cli(
        "new-patchset", "--definition", "v0.25.1", *args, "--api-url", api, "--from-wheel", root=project, env=CACHE
    )
    fails(r, *needles)
    assert snapshot(project) == before
