"""One self-contained HTML page of smoke reports: the verdict and its reasons first, then the sweep drawn.

``report FILE...`` (and ``smoke --html FILE``) render one smoke report, a GPU
record folder (its ``record.json`` and the reports it names), or several
reports side by side (patched against unpatched) as one HTML file that needs
no network to be read: the charts are SVG drawn by matplotlib and put into
the page, no script runs. Every chart has its numbers in a table beside it,
so the page reads without the pictures too:

- per level, the requests that passed, were answered wrongly (the oracle) or
  failed by status;
- per reply, its deviation from its basis (zero: bitwise the basis); above
  concurrency 1 a measurement, never a judgement, with each level's
  distribution in the table (bitwise equal, beyond the basis's top-k, median
  and max in nats, first differing positions); a recording run shows the
  same measured on the trusted image at concurrency 16;
- latency (p50, p95) and tokens per second against concurrency;
- the phases of the smoke time;
- for a signed verdict beside the report (``NAME.dsse.json`` next to
  ``NAME.json``), or given among the files (paired with the report whose
  image its subject names), the key it was signed with and the subject it
  names, as the envelope says (``verify`` checks the signature).

A pass that was not GPU-verified is shown as such, not as a plain pass, and
every skipped check says why it was skipped.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import UsageError
from .journal.atomic import opened_regular

MAX_BYTES = 2_000_000  # a page stays an attachment an incident tracker takes
COLOURS = ("#2b6cb0", "#c05621", "#2f855a", "#805ad5", "#b7791f", "#c53030")
# The phases of a smoke run, each its own colour (there are more phases than COLOURS); the time no phase
# accounts for is grey.
PHASE_COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22",
                 "#17becf", "#393b79", "#637939", "#843c39")
OUTSIDE = "outside the phases"


@dataclass(frozen=True, slots=True)
class Shown:
    """One report on the page: its name, the report, and the signed envelope beside it (decoded, if any)."""

    name: str
    report: Mapping[str, Any]
    envelope: Mapping[str, Any] | None = None


@dataclass
class Page:
    title: str
    shown: list[Shown]
    record: Mapping[str, Any] | None = None
    figures: list[str] = field(default_factory=list)  # ids of the figures drawn, in order


def _read_json(path: Path, what: str) -> Any:
    try:
        with opened_regular(str(path)) as (fh, _st):
            return json.loads(fh.read().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise UsageError(f"{what} {path}: not a readable JSON file ({exc})") from None


def _is_envelope(doc: object) -> bool:
    return isinstance(doc, Mapping) and "payload" in doc and "signatures" in doc


def _envelope(path: Path, doc: object = None) -> Mapping[str, Any] | None:
    """The signed envelope beside a report, decoded (keyid, subjects, signed time); None where there is none."""
    if doc is None:
        if not path.is_file():
            return None
        doc = _read_json(path, "signed verdict")
    try:
        assert isinstance(doc, Mapping)
        statement = json.loads(base64.b64decode(doc["payload"]))
        keys = [str(s.get("keyid", "")) for s in doc.get("signatures") or []]
    except (KeyError, TypeError, ValueError, AssertionError):
        return {"file": path.name, "unreadable": True}
    predicate = statement.get("predicate") or {}
    return {"file": path.name, "keyids": keys, "subjects": statement.get("subject") or [],
            "signed_at": predicate.get("signed_at"), "status": predicate.get("status")}


def load(paths: Sequence[Path]) -> Page:
    """The reports named: report files, or a GPU record folder (its record.json and the reports beside it)."""
    shown: list[Shown] = []
    given: list[tuple[Path, Any]] = []  # signed verdicts named among the files
    record = None
    for path in paths:
        if path.is_dir():
            record = _read_json(path / "record.json", "GPU record")
            for report in sorted(path.glob("*.json")):
                if report.name in ("record.json", "answers.json", "verified-elsewhere.json") or \
                        report.name.startswith("source-") or report.name.endswith(".dsse.json"):
                    continue
                shown.append(Shown(report.stem, _read_json(report, "smoke report"),
                                   _envelope(report.with_suffix(".dsse.json"))))
        else:
            doc = _read_json(path, "smoke report")
            if _is_envelope(doc):
                given.append((path, doc))
                continue
            shown.append(Shown(path.stem, doc, _envelope(path.with_name(path.stem + ".dsse.json"))))
    if not shown:
        raise UsageError("report: no smoke report among the files given")
    for s in shown:
        if not isinstance(s.report, Mapping) or "status" not in s.report or "checks" not in s.report:
            raise UsageError(f"report: {s.name} is not a smoke report (no status and checks)")
    shown = _paired(shown, given)
    if record is not None:
        title = f"GPU record {paths[0].name}"
    elif len(shown) == 1 and shown[0].report.get("image"):
        title = f"{shown[0].report.get('image')} ({shown[0].name})"
    else:
        title = ", ".join(s.name for s in shown)
    return Page(title, shown, record)


def _paired(shown: list[Shown], given: list[tuple[Path, Any]]) -> list[Shown]:
    """Each signed verdict given among the files beside the report whose image its subject names."""
    out = list(shown)
    for path, doc in given:
        env = _envelope(path, doc)
        assert env is not None
        digests = {f"sha256:{(x.get('digest') or {}).get('sha256', '')}" for x in env.get("subjects") or []
                   if isinstance(x, Mapping)}
        match = [i for i, s in enumerate(out) if s.report.get("image_id") in digests]
        if not match:
            raise UsageError(f"report: the signed verdict {path} names no report given (its subject: "
                             f"{', '.join(sorted(digests)) or 'none'})",
                             hint="give the smoke report of that image beside it")
        for i in match:
            out[i] = Shown(out[i].name, out[i].report, env)
    return out


# -- charts -----------------------------------------------------------------------------------------------


def _svg(fig: Any) -> str:
    out = io.StringIO()
    # No date, and element IDs from a fixed salt: the same reports draw the same page.
    fig.savefig(out, format="svg", bbox_inches="tight", metadata={"Date": None})
    fig.clf()
    text = out.getvalue()
    return text[text.index("<svg"):]


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise UsageError("report pages draw their charts with matplotlib: pip install 'vllm-hotfix[report]'") \
            from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "font.size": 9, "svg.hashsalt": "vllm-hotfix"})
    plt.close("all")
    return plt


def _levels(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return list((report.get("sweep") or {}).get("levels") or [])


def chart_outcomes(shown: Sequence[Shown]) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 2.8), squeeze=False)
    for ax, s in zip(axes[0], shown, strict=True):
        levels = _levels(s.report)
        xs = [str(lv["concurrency"]) for lv in levels]
        wrong = [int(lv.get("wrong_answers") or 0) for lv in levels]
        failed = [int(lv.get("failures") or 0) - w for lv, w in zip(levels, wrong, strict=True)]
        passed = [int(lv.get("successes") or 0) for lv in levels]
        ax.bar(xs, passed, color="#2f855a", label="passed")
        ax.bar(xs, wrong, bottom=passed, color="#c53030", label="wrong answer")
        ax.bar(xs, failed, bottom=[p + w for p, w in zip(passed, wrong, strict=True)], color="#718096",
               label="failed by status")
        ax.set_title(s.name)
        ax.set_xlabel("concurrency")
        ax.set_ylabel("requests")
    axes[0][0].legend(fontsize=7)
    return _svg(fig)


# The checks that judge a reply's answer: bit for bit (exact), by its form above concurrency 1 (form; "noise" in
# reports made while a tolerance judged it there).
JUDGED = ("exact", "form", "noise")


def _movement_row(name: str, concurrency: object, found: Mapping[str, Any]) -> tuple[object, ...]:
    """One row of the movement table: a level's (or a recording's) measured distribution."""
    nats = found.get("deviation_nats") if isinstance(found.get("deviation_nats"), Mapping) else {}
    first = found.get("first_difference") if isinstance(found.get("first_difference"), Mapping) else {}
    return (name, concurrency, found.get("replies", found.get("requests")), found.get("identical"),
            found.get("token_divergences"), found.get("beyond_top_k"), (nats or {}).get("median"),
            (nats or {}).get("max"), (first or {}).get("min"), (first or {}).get("median"))


def movement_rows(shown: Sequence[Shown]) -> list[tuple[object, ...]]:
    """Per report, each level's movement above concurrency 1, and a recording's at concurrency 16."""
    rows = []
    for s in shown:
        for lv in _levels(s.report):
            if isinstance(lv.get("movement"), Mapping):
                rows.append(_movement_row(s.name, lv["concurrency"], lv["movement"]))
        recorded = ((s.report.get("sweep") or {}).get("recorded") or {}).get("noise")
        if isinstance(recorded, Mapping) and "replies" in recorded:
            rows.append(_movement_row(f"{s.name} (recorded)", recorded.get("concurrency"), recorded))
    return rows


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def golden_rows(shown: Sequence[Shown]) -> list[tuple[object, ...]]:
    """Per report, its ``golden`` check: what it judged against the model's forward, where it was confident, the
    first disagreement, the noise it judged at (or recorded), and what the forward took."""
    rows: list[tuple[object, ...]] = []
    for s in shown:
        found = next((c for c in s.report.get("checks") or [] if c.get("name") == "golden"), None)
        if not isinstance(found, Mapping):
            continue
        data = _mapping(found.get("data"))
        noise, timing, first = _mapping(data.get("noise")), _mapping(data.get("timing")), \
            _mapping(data.get("first_disagreement"))
        said = (f"{first.get('reply')}, position {first.get('position')}: golden {first.get('golden')}, served "
                f"{first.get('served')}, margin {_number(first.get('margin_nats'))}" if first else
                ("" if data else str(found.get("detail") or "")))
        rows.append((s.name, found.get("status"), data.get("replies"), data.get("positions"), data.get("confident"),
                     data.get("agreeing"), said, noise.get("median_nats"), noise.get("max_nats"),
                     timing.get("device"), timing.get("score_s")))
    return rows


def chart_deviation(shown: Sequence[Shown]) -> str:
    plt = _plt()
    fig, axes = plt.subplots(1, len(shown), figsize=(4.2 * len(shown), 2.8), squeeze=False)
    for ax, s in zip(axes[0], shown, strict=True):
        for i, lv in enumerate(_levels(s.report)):
            devs = [(ev.get("deviation_nats") if ev.get("deviation_nats") is not None else 0.0, bool(ev.get("passed")))
                    for ev in lv.get("per_request") or [] if ev.get("judged_by") in JUDGED]
            ax.scatter([i + 0.05 * (k % 7 - 3) for k in range(len(devs))], [d for d, _ in devs], s=8,
                       c=["#2f855a" if ok else "#c53030" for _, ok in devs])
        levels = _levels(s.report)
        ax.set_xticks(range(len(levels)), [str(lv["concurrency"]) for lv in levels])
        ax.set_title(s.name)
        ax.set_xlabel("concurrency (red: a reply that failed)")
        ax.set_ylabel("deviation from basis (nats)")
    return _svg(fig)


def chart_speed(shown: Sequence[Shown]) -> str:
    plt = _plt()
    fig, (left, right) = plt.subplots(1, 2, figsize=(8.4, 2.8))
    for n, s in enumerate(shown):
        levels = [lv for lv in _levels(s.report) if lv.get("p50_s") is not None]
        xs = [lv["concurrency"] for lv in levels]
        colour = COLOURS[n % len(COLOURS)]
        left.plot(xs, [lv["p50_s"] * 1000 for lv in levels], marker="o", color=colour, label=f"{s.name} p50")
        left.plot(xs, [(lv.get("p95_s") or 0) * 1000 for lv in levels], marker="x", linestyle="dotted",
                  color=colour, label=f"{s.name} p95")
        right.plot(xs, [lv.get("output_tokens_per_s") or 0 for lv in levels], marker="o", color=colour, label=s.name)
    for ax, label in ((left, "latency (ms)"), (right, "output tokens per second")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
        ax.set_ylabel(label)
        ax.legend(fontsize=7)
    return _svg(fig)


def phases_of(report: Mapping[str, Any]) -> dict[str, float]:
    """The report's phases, and the time of its run that none of them accounts for (so they add up to it)."""
    phases = {str(k): float(v or 0) for k, v in (report.get("phases") or {}).items()}
    rest = float(report.get("seconds") or 0) - sum(phases.values())
    if rest >= 0.001:
        phases[OUTSIDE] = round(rest, 3)
    return phases


def chart_phases(shown: Sequence[Shown]) -> str:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8.4, 0.6 + 0.5 * len(shown)))
    timed = [phases_of(s.report) for s in shown]
    names = sorted({p for t in timed for p in t if p != OUTSIDE}) + ([OUTSIDE] if any(OUTSIDE in t for t in timed)
                                                                     else [])
    for row, phases in enumerate(timed):
        left = 0.0
        for k, phase in enumerate(names):
            took = phases.get(phase, 0.0)
            colour = "#a0aec0" if phase == OUTSIDE else PHASE_COLOURS[k % len(PHASE_COLOURS)]
            ax.barh(row, took, left=left, color=colour, label=phase if row == 0 else None)
            left += took
    ax.set_yticks(range(len(shown)), [s.name for s in shown])
    ax.set_xlabel("seconds")
    # Beside the bars, never over the axis and its label.
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    return _svg(fig)


# -- tables and the page ------------------------------------------------------------------------------------


def _number(value: object) -> str:
    """A number as a person reads it: floats to four significant digits (7.768176555633545: 7.768)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _words(value: object, depth: int = 0) -> str:
    """A finding's fields as ``key: value`` phrases, numbers rounded, not raw JSON."""
    if isinstance(value, Mapping):
        inner = "; ".join(f"{k}: {_words(v, depth + 1)}" for k, v in sorted(value.items()))
        return f"({inner})" if depth else inner
    if isinstance(value, (list, tuple)):
        return ", ".join(_words(v, depth + 1) for v in value)
    return _number(value)


def _e(value: object) -> str:
    return html.escape(str(value))


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(_number(c))}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{cells}</tr></thead><tbody>{body}</tbody></table>"


def _figure(page: Page, ident: str, caption: str, svg: str, table: str) -> str:
    page.figures.append(ident)
    return (f'<figure id="{ident}" class="chart"><figcaption>{_e(caption)}</figcaption>'
            f'<div class="svg">{svg}</div><div class="numbers">{table}</div></figure>')


def _verdict(s: Shown) -> str:
    r = s.report
    failed = [c for c in r.get("checks") or [] if c.get("status") in ("fail", "incomplete")]
    skipped = [c for c in r.get("checks") or [] if c.get("status") == "skip"]
    reasons = "".join(f"<li><b>{_e(c.get('name'))}</b> ({_e(c.get('status'))}): {_e(c.get('detail'))}</li>"
                      for c in failed) or f"<li>every check passed{' or was skipped' if skipped else ''}</li>"
    # Each skipped check with why: a pass over checks that did not run says which, and why not.
    reasons += "".join(f"<li class='skipped'><b>{_e(c.get('name'))}</b> (skipped): {_e(c.get('detail'))}</li>"
                       for c in skipped)
    gpu = "GPU-verified" if r.get("gpu_verified") else "GPU-unverified"
    status = str(r.get("status"))
    shown_status = f"{status}, GPU-unverified" if status == "pass" and not r.get("gpu_verified") else status
    css = "unverified" if status == "pass" and not r.get("gpu_verified") else status
    devices = ", ".join(map(str, (r.get("gpu") or {}).get("devices") or [])) or "no GPU"
    env = s.envelope
    signed = ""
    if env is not None:
        subjects = "; ".join(f"{x.get('name')} sha256:{(x.get('digest') or {}).get('sha256', '')}"
                             for x in env.get("subjects") or [])
        keys = ", ".join(env.get("keyids") or [])
        signed = (f"<p class='signed'>signed verdict {_e(env.get('file'))}: key {_e(keys)}, signed "
                  f"{_e(env.get('signed_at'))}, status {_e(env.get('status'))}; subject {_e(subjects)} "
                  "(as the envelope says; <code>verify</code> checks the signature)</p>")
    return (f'<section class="verdict {_e(css)}"><h2>{_e(s.name)}: {_e(shown_status)}</h2>'
            f"<p>{_e(r.get('image'))} {_e(r.get('image_id'))}: {gpu} ({_e(devices)}), {_e(r.get('seconds'))} s, "
            f"started {_e(r.get('started'))}</p><ul>{reasons}</ul>{_answers(r)}{signed}</section>")


def _answers(report: Mapping[str, Any]) -> str:
    """What the run's answers were judged against or recorded into, and what they prove, as the verdict says."""
    sweep = report.get("sweep") or {}
    parts = []
    for key, what in (("reference", "answers judged against"), ("recorded", "answers recorded into")):
        ref = sweep.get(key)
        if not isinstance(ref, Mapping) or not ref.get("sha256"):
            continue
        signature = ref.get("signature") if isinstance(ref.get("signature"), Mapping) else {}
        line = (f"{what} {ref.get('file')} (sha256 {ref.get('sha256')}), recorded from image "
                f"{ref.get('image_id') or 'not named'}; signature: {(signature or {}).get('state', 'not named')}")
        if key == "reference":
            line += f"; they prove: {ref.get('proves') or 'nothing (a check of the answers did not pass)'}"
        parts.append(f"<p class='answers'>{_e(line)}</p>")
    return "".join(parts)


def render(page: Page) -> str:
    """The page's HTML (charts inline, no script)."""
    parts = [f"<h1>{_e(page.title)}</h1>"]
    rows: list[tuple[object, ...]] = []
    if page.record is not None:
        findings = page.record.get("findings") or {}
        for name, found in findings.items():
            if not isinstance(found, Mapping):
                continue
            rest = {k: v for k, v in found.items() if k not in ("met", "detail")}
            rows.append((name, "met" if found.get("met") else "not met", found.get("detail") or _words(rest)))
        devices = ", ".join(map(str, page.record.get("gpu_devices") or [])) or "no GPU named"
        parts.append(f"<section><h2>record of {_e(page.record.get('date', ''))} on {_e(devices)}</h2>"
                     f"{_table(('finding', 'state', 'detail'), rows)}</section>")
    parts += [_verdict(s) for s in page.shown]
    checks = sorted({c.get("name") for s in page.shown for c in s.report.get("checks") or []})
    by = [{c.get("name"): c.get("status") for c in s.report.get("checks") or []} for s in page.shown]
    parts.append("<section><h2>checks</h2>" + _table(("check", *(s.name for s in page.shown)),
                                                        [(n, *(b.get(n, "") for b in by)) for n in checks])
                 + "</section>")
    golden = golden_rows(page.shown)
    if golden:
        parts.append("<section id='golden'><h2>Replies against the golden forward of the model (concurrency 1 and "
                     "every fixed-batch level)</h2>"
                     + _table(("report", "status", "replies", "positions", "confident", "agreeing",
                               "first disagreement (or why not run)", "noise median (nats)", "noise max (nats)",
                               "device", "scoring (s)"), golden) + "</section>")
    swept = [s for s in page.shown if _levels(s.report)]
    if swept:
        rows = [(s.name, lv["concurrency"], lv.get("successes"), lv.get("wrong_answers"),
                 int(lv.get("failures") or 0) - int(lv.get("wrong_answers") or 0), lv.get("requests"))
                for s in swept for lv in _levels(s.report)]
        parts.append(_figure(page, "outcomes", "Per level: passed, answered wrongly, failed by status",
                             chart_outcomes(swept), _table(("report", "concurrency", "passed", "wrong",
                                                            "failed by status", "requests"), rows)))
        rows = [(s.name, lv["concurrency"], lv.get("identical"), lv.get("deviated"), lv.get("wrong_answers"),
                 lv.get("widest_deviation_nats")) for s in swept for lv in _levels(s.report)]
        parts.append(_figure(page, "deviation", "Per reply: deviation from its basis (above concurrency 1 measured, "
                             "not judged)", chart_deviation(swept),
                             _table(("report", "concurrency", "identical", "moved", "wrong", "widest (nats)"), rows)))
        moved = movement_rows(page.shown)
        if moved:
            parts.append("<section id='movement'><h2>How far replies moved from the same image's concurrency-1 "
                         "reply (measured, never judged)</h2>"
                         + _table(("report", "concurrency", "replies", "bitwise equal", "token divergences",
                                   "beyond top-k", "median (nats)", "max (nats)", "first difference (min)",
                                   "first difference (median)"), moved) + "</section>")
        rows = [(s.name, lv["concurrency"], lv.get("p50_s"), lv.get("p95_s"), lv.get("output_tokens_per_s"))
                for s in swept for lv in _levels(s.report)]
        parts.append(_figure(page, "speed", "Latency and tokens per second against concurrency", chart_speed(swept),
                             _table(("report", "concurrency", "p50 (s)", "p95 (s)", "tokens/s"), rows)))
    timed = [s for s in page.shown if s.report.get("phases")]
    if timed:
        rows = [(s.name, phase, _number(took)) for s in timed for phase, took in phases_of(s.report).items()]
        for s in timed:
            total = float(s.report.get("seconds") or 0)
            over = sum(float(v or 0) for v in (s.report.get("phases") or {}).values()) > total + 0.001
            rows.append((s.name, "total, the run's seconds" + (" (phases that ran side by side overlap)" if over
                                                                 else ""), _number(total)))
        parts.append(_figure(page, "phases", "Where the smoke time went", chart_phases(timed),
                             _table(("report", "phase", "seconds"), rows)))
    style = ("body{font-family:sans-serif;max-width:1100px;margin:auto;padding:1em}table{border-collapse:collapse;"
             "font-size:12px}td,th{border:1px solid #ccc;padding:2px 6px}figure{border:1px solid #ddd;padding:.5em}"
             ".svg svg{max-width:100%;height:auto}.numbers{max-height:20em;overflow:auto}"
             ".verdict.fail h2{color:#c53030}.verdict.pass h2{color:#2f855a}.verdict.unverified h2{color:#b7791f}"
             ".verdict.incomplete h2{color:#718096}.skipped{color:#4a5568}")
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{_e(page.title)}</title>"
            f"<style>{style}</style></head><body>{''.join(parts)}</body></html>\n")


def write(paths: Sequence[Path], out: Path) -> Page:
    """Render the reports at ``paths`` into ``out``; the page as drawn."""
    return write_page(load(paths), out)


def write_verdict(report: Mapping[str, Any], name: str, envelope: Path | None, out: Path) -> Page:
    """The page of one smoke run just judged (``smoke --html``), its signed envelope beside it where there is one."""
    return write_page(Page(name, [Shown(name, report, _envelope(envelope) if envelope is not None else None)]), out)


def write_page(page: Page, out: Path) -> Page:
    from .journal.atomic import write_atomic

    text = render(page)
    if len(text.encode()) > MAX_BYTES:
        raise UsageError(f"report: the page of {page.title} would be {len(text.encode())} bytes, over "
                         f"{MAX_BYTES}: render fewer reports at once")
    write_atomic(out, text)
    return page
