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


def _cpu_pass(tmp_path: Path) -> Path:
    """The committed patched report as a CPU host's smoke writes it: GPU-unverified, its GPU checks skipped."""
    report = json.loads((RECORD / "patched.json").read_text())
    report["gpu_verified"] = False
    for check in report["checks"]:
        if check["name"].startswith("gpu-") or check["name"] == "topk-layout":
            check["status"], check["detail"] = "skip", "no GPU on this host (--gpu auto): the image is GPU-unverified"
    report["seconds"], report["phases"] = 0.647, {"checks": 0.2, "files": 0.14}
    path = tmp_path / "smoke.json"
    path.write_text(json.dumps(report))
    return path


def test_a_report_and_the_signed_verdict_given_beside_it_make_one_page(tmp_path: Path) -> None:
    """`report out/smoke.json out/verdict.dsse.json`: the page is titled by the image, and shows the signature
    (was: titled "smoke", no signature, and the envelope refused as "not a smoke report", 64)."""
    report = tmp_path / "smoke.json"
    shutil.copy(RECORD / "patched.json", report)
    shutil.copy(RECORD / "patched.dsse.json", tmp_path / "verdict.dsse.json")
    out = tmp_path / "page.html"
    r = cli("report", str(report), str(tmp_path / "verdict.dsse.json"), "--out", str(out))
    assert r.rc == 0, r.err
    text = out.read_text()
    image = json.loads(report.read_text())["image"]
    assert f"<title>{image} (smoke)</title>" in text
    assert "signed verdict verdict.dsse.json: key" in text
    # An envelope about another image than any report given is named, not attached.
    r = cli("report", str(RECORD / "unpatched.json"), str(tmp_path / "verdict.dsse.json"), "--out", str(out))
    assert r.rc == 64 and "verdict.dsse.json names no report given" in r.last_error, r.err


def test_a_cpu_pass_says_gpu_unverified_and_why_each_check_was_skipped(tmp_path: Path) -> None:
    out = tmp_path / "cpu.html"
    r = cli("report", str(_cpu_pass(tmp_path)), "--out", str(out))
    assert r.rc == 0, r.err
    text = out.read_text()
    assert '<section class="verdict unverified"><h2>smoke: pass, GPU-unverified</h2>' in text
    assert "<b>gpu-kernel</b> (skipped): no GPU on this host (--gpu auto)" in text
    # The phases add up to the run's seconds: the time no phase accounts for is its own row.
    assert "<td>smoke</td><td>outside the phases</td><td>0.307</td>" in text
    assert "<td>smoke</td><td>total, the run&#x27;s seconds</td><td>0.647</td>" in text


def test_the_phase_chart_gives_each_phase_its_own_colour_and_keeps_its_legend_off_the_axis() -> None:
    from vllm_hotfix import report_page

    report = json.loads((RECORD / "patched.json").read_text())
    phases = report_page.phases_of(report)
    assert len(phases) <= len(report_page.PHASE_COLOURS)  # checks and sweep no longer share a colour
    svg = report_page.chart_phases([report_page.Shown("patched", report)])
    used = [c for c in report_page.PHASE_COLOURS if c in svg]
    assert len(used) == len([p for p in phases if p != report_page.OUTSIDE])


def test_findings_read_as_words_with_rounded_numbers(tmp_path: Path) -> None:
    folder = tmp_path / "record"
    shutil.copytree(RECORD, folder)
    record = json.loads((folder / "record.json").read_text())
    record["findings"]["warm_smoke_seconds"]["seconds"]["patched"] = 7.768176555633545
    (folder / "record.json").write_text(json.dumps(record))
    out = tmp_path / "record.html"
    assert cli("report", str(folder), "--out", str(out)).rc == 0
    text = out.read_text()
    findings = text[text.index("<h2>record of"):].split("</section>")[0]
    assert "patched: 7.768;" in findings and "{&quot;" not in findings  # words, not raw JSON
    # Every table's numbers are rounded (a tolerance read 7.768176555633545; the deviations' widest, unrounded too).
    assert "7.768176555633545" not in text and "1.873805284500122" not in text
