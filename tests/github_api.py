"""A stand-in for the two GitHub API forms `new-patchset` uses.

The PR as JSON and the PR as a diff (Accept: application/vnd.github.v3.diff).
The diffs are the real fix (from patches/v0.25.1) in GitHub's shape, plus
files outside the package.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
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


@contextmanager
def serve() -> Iterator[str]:
    """The API in a process of its own on a free loopback port; yields its base URL.

    A process, not a thread: the unit tier forks the CLI from the test process,
    which it does only while that process has no other thread.
    """
    proc = subprocess.Popen([sys.executable, __file__], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def main() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    print(f"http://127.0.0.1:{server.server_address[1]}", flush=True)  # listening already
    server.serve_forever()


if __name__ == "__main__":
    main()
