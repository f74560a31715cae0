"""Report pages opened in a headless Chromium (Debian's package): every chart drawn, each with its table.

The pages come from the committed GPU record (real reports: a passing
patched image, the failing unpatched base) and from one failing report
alone; screenshots are kept under build/test-artifacts/report-page/ for a
person to look at.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import pytest

from conftest import REPO, cli

RECORD = REPO / "gpu-runs" / "h100-2026-12-05-oracle"
ARTIFACTS = REPO / "build" / "test-artifacts" / "report-page"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None and not os.environ.get("VLLM_HOTFIX_REQUIRE_PLATFORM_ENGINE"),
                                    reason="no chromium here (.ci/services install puts Debian's there)")


class Figures(HTMLParser):
    """Each <figure>'s id, whether it holds an <svg> with drawn paths, and the rows of its table."""

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[str, dict[str, int]] = {}
        self._in: str | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "figure":
            self._in = dict(attrs).get("id") or "?"
            self.found[self._in] = {"svg": 0, "paths": 0, "rows": 0}
        elif self._in is not None and tag in ("svg", "path", "tr"):
            self.found[self._in][{"svg": "svg", "path": "paths", "tr": "rows"}[tag]] += 1

    def handle_endtag(self, tag: str) -> None:
        if tag == "figure":
            self._in = None


def open_in_chromium(page: Path, shot: Path) -> tuple[str, str]:
    """The DOM Chromium built from ``page`` and what it logged; a screenshot kept at ``shot``."""
    assert CHROMIUM is not None, "chromium is required here (VLLM_HOTFIX_REQUIRE_PLATFORM_ENGINE set)"
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--enable-logging=stderr",
             "--v=0", f"--user-data-dir={page.parent / 'chromium-profile'}"]
    shot.parent.mkdir(parents=True, exist_ok=True)
    taken = subprocess.run([CHROMIUM, *flags, "--window-size=1200,4000", f"--screenshot={shot}", page.as_uri()],
                           capture_output=True, text=True, timeout=120)
    assert shot.is_file() and shot.stat().st_size > 10_000, taken.stderr[-2000:]
    dom = subprocess.run([CHROMIUM, *flags, "--dump-dom", page.as_uri()], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    return dom.stdout, taken.stderr + dom.stderr


def check_page(page: Path, name: str, want: set[str]) -> Figures:
    assert page.stat().st_size < 2_000_000
    dom, log = open_in_chromium(page, ARTIFACTS / f"{name}.png")
    # No script, nothing fetched: the console says nothing about the page.
    assert not re.search(r"CONSOLE|Uncaught|Failed to load resource", log), log[-2000:]
    figures = Figures()
    figures.feed(dom)
    assert set(figures.found) == want, figures.found
    for ident, seen in figures.found.items():
        assert seen["svg"] == 1 and seen["paths"] > 10, (ident, seen)  # a chart was drawn
        assert seen["rows"] > 1, (ident, seen)  # and its numbers are beside it
    return figures


@needs_chromium
def test_the_gpu_records_page_draws_every_chart_with_its_numbers(tmp_path: Path) -> None:
    out = tmp_path / "record.html"
    r = cli("report", str(RECORD), "--out", str(out))
    assert r.rc == 0, r.err
    assert "chart(s)" in r.out
    check_page(out, "gpu-record", {"outcomes", "deviation", "speed", "phases"})
    text = out.read_text()
    # The verdict and its reasons first: the failing base names its failing checks.
    assert text.index("unpatched: fail") < text.index('id="outcomes"')
    assert "topk-layout" in text and "patched_passes_every_level" in text
    # The signed envelope beside each report: its key and subject, as the envelope says.
    assert "signed verdict patched.dsse.json: key" in text


@needs_chromium
def test_a_failing_report_alone_and_two_side_by_side(tmp_path: Path) -> None:
    alone = tmp_path / "unpatched.json"
    shutil.copy(RECORD / "unpatched.json", alone)
    out = tmp_path / "alone.html"
    r = cli("report", str(alone), "--out", str(out))
    assert r.rc == 0, r.err
    check_page(out, "failing-alone", {"outcomes", "deviation", "speed", "phases"})
    report = json.loads(alone.read_text())
    wrong = report["sweep"]["levels"][0]["wrong_answers"]
    assert f"<td>unpatched</td><td>1</td><td>0</td><td>{wrong}</td>" in out.read_text()
    both = tmp_path / "both.html"
    r = cli("report", str(RECORD / "patched.json"), str(alone), "--out", str(both))
    assert r.rc == 0, r.err
    check_page(both, "side-by-side", {"outcomes", "deviation", "speed", "phases"})


def test_what_is_not_a_smoke_report_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"hello": 1}')
    r = cli("report", str(bad), "--out", str(tmp_path / "x.html"))
    assert r.rc == 64 and "is not a smoke report" in r.last_error
    assert not (tmp_path / "x.html").exists()
