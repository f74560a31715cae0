"""`new-patchset`: an upstream PR, served by a local HTTP server, becomes a patch.

The server speaks the two GitHub API forms the tool uses: the PR as JSON and
the PR as a diff (Accept: application/vnd.github.v3.diff). The diffs are the
real fix (from patches/v0.25.1) in GitHub's shape, plus files outside the
package; the files they are checked against are the real releases'.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from conftest import REPO, cli, fails
from vllm_hotfix.engine import Engine

CACHE = {"VLLM_HOTFIX_CACHE": str(REPO / "build" / "cache")}
FIX = (REPO / "patches/v0.25.1/0001-minimax-m3-topk-buffer-layout.patch").read_text()
TITLE = "[Bugfix] MiniMax-M3: fix token-major top-k buffer read head-major by Triton"
SLUG = "0001-bugfix-minimax-m3-fix-token-major-top-k-buffer.patch"


def github_diff(patch_text: str) -> str:
    """The patch's diff as GitHub serves a PR diff (diff --git + index lines)."""
    body = patch_text[patch_text.index("--- a/") :]
    out = []
    for block in body.split("--- a/")[1:]:
        path = block.split("\n", 1)[0]
        out.append(f"diff --git a/{path} b/{path}\nindex 1111111..2222222 100644\n--- a/{block}")
    return "".join(out)


OUTSIDE = (
    "diff --git a/tests/models/test_minimax_m3_topk.py b/tests/models/test_minimax_m3_topk.py\n"
    "new file mode 100644\nindex 0000000..3333333\n--- /dev/null\n"
    "+++ b/tests/models/test_minimax_m3_topk.py\n"
    "@@ -0,0 +1,2 @@\n+def test_layout():\n+    assert True\n"
    "diff --git a/docs/models.md b/docs/models.md\nindex 4444444..5555555 100644\n--- a/docs/models.md\n"
    "+++ b/docs/models.md\n@@ -1,1 +1,2 @@\n # Models\n+MiniMax-M3 works at concurrency >= 2.\n"
)
PRS: dict[int, tuple[str, str]] = {
    49149: (TITLE, github_diff(FIX) + OUTSIDE),
    # Context that no release has: does not apply.
    50001: (
        "Broken context",
        github_diff(
            FIX.replace(
                "         buf = self.topk_indices_buffer\n", "         buf = self.topk_indices_buf\n", 1
            )
        ),
    ),
    50002: ("Docs only", OUTSIDE),
}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        number = self.path.rsplit("/", 1)[-1]
        if (
            not self.path.startswith("/repos/vllm-project/vllm/pulls/")
            or not number.isdigit()
            or int(number) not in PRS
        ):
            self.send_error(404)
            return
        title, diff = PRS[int(number)]
        if "diff" in self.headers.get("Accept", ""):
            body, kind = diff.encode(), "text/plain"
        else:
            page = f"https://github.com/vllm-project/vllm/pull/{number}"
            body, kind = (
                json.dumps({"title": title, "html_url": page, "number": int(number)}).encode(),
                "application/json",
            )
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def api() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture
def fresh(project: Path) -> Path:
    """A root with no definition and no patch set for v0.25.1."""
    (project / "images/v0.25.1.toml").unlink()
    for p in sorted((project / "patches/v0.25.1").rglob("*"), reverse=True):
        p.rmdir() if p.is_dir() else p.unlink()
    (project / "patches/v0.25.1").rmdir()
    return project


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.engine
def test_new_patchset_from_pr_for_a_new_base(engine: Engine, base_v0251: str, fresh: Path, api: str) -> None:
    r = cli(
        "new-patchset",
        "--base",
        "v0.25.1",
        "--from-pr",
        "49149",
        "--api-url",
        api,
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
    # The new set is the real fix: 0.26.0 still needs it, 0.27.0 ships it.
    for tag, word in (("v0.25.1", "needed"), ("v0.26.0", "needed"), ("v0.27.0", "included")):
        c = cli(
            "check-upstream", "--patches", "v0.25.1", "--base", tag, "--from-wheel", root=fresh, env=CACHE
        )
        assert c.out.startswith(f"{SLUG}: {word}"), (tag, c.out, c.err)
    # And `image` accepts the set and definition it wrote.
    rendered = cli("render", "--base", "v0.25.1", "--pull", "never", root=fresh)
    assert rendered.rc == 0, rendered.err
    assert f"io.vllm-hotfix.patch.{SLUG}" in rendered.out


def test_new_patchset_from_pr_url_and_from_file_against_the_wheel(
    fresh: Path, api: str, tmp_path: Path
) -> None:
    url = "https://github.com/vllm-project/vllm/pull/49149"
    r = cli(
        "new-patchset",
        "--base",
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
        "new-patchset", "--base", "v0.25.1", "--from-file", str(diff), "--from-wheel", root=fresh, env=CACHE
    )
    fails(r, "patch set v0.25.1 already holds this change")
    assert snapshot(fresh) == before
    # From a file on a second base: numbered 0001 there, named from the file.
    r = cli(
        "new-patchset", "--base", "v0.26.0", "--from-file", str(diff), "--from-wheel", root=fresh, env=CACHE
    )
    assert r.rc == 0, r.err
    assert (fresh / "patches/v0.26.0/series").read_text().splitlines()[-1] == "0001-minimax-topk.patch"
    assert "Source: minimax-topk.diff" in (fresh / "patches/v0.26.0/0001-minimax-topk.patch").read_text()


def test_new_patchset_on_a_release_that_ships_it(fresh: Path, api: str) -> None:
    before = snapshot(fresh)
    r = cli(
        "new-patchset",
        "--base",
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


@pytest.mark.parametrize(
    "args, needles",
    [
        (
            ("--from-pr", "50001"),
            (
                "0002-broken-context.patch",
                "hunk #1 (@@ -424,6 +424,9 @@)",
                "vllm/models/minimax_m3/common/indexer.py",
                "does not apply",
            ),
        ),
        (("--from-pr", "50002"), ("touches no file under vllm/", "docs/models.md")),
        (("--from-pr", "404"), ("PR #404", "HTTP 404")),
        (("--from-pr", "not-a-pr"), ("'not-a-pr'", "neither a PR number")),
        (("--from-file", "/nonexistent/x.diff"), ("/nonexistent/x.diff", "cannot read")),
        ((), ("exactly one of --from-pr",)),
    ],
)
def test_new_patchset_bad_input_writes_nothing(
    project: Path, api: str, args: tuple[str, ...], needles: tuple[str, ...]
) -> None:
    before = snapshot(project)
    r = cli(
        "new-patchset", "--base", "v0.25.1", *args, "--api-url", api, "--from-wheel", root=project, env=CACHE
    )
    fails(r, *needles)
    assert snapshot(project) == before


def test_new_patchset_offline(fresh: Path) -> None:
    before = snapshot(fresh)
    # Port 9 (discard) on loopback: nothing listens, the connection is refused.
    r = cli(
        "new-patchset",
        "--base",
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
