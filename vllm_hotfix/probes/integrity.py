"""Probe run inside an image: are the installed distributions intact?

Usage: python3 integrity.py PACKAGE JSON [ROOT ...]
JSON maps files the pipeline patched on purpose (relative to the package's
parent) to their sha256; those are checked against that, not RECORD. More
ROOTs (distributions a patch set pins) are checked with what they require.

For PACKAGE and every installed distribution it requires (transitively, with
the extras a requirement names, e.g. ``nvidia-cutlass-dsl[cu13]``), each file
listed in RECORD with a hash must have that hash. A path claimed by two
distributions with different content is the mark of sub-wheels that ship the
same files: it fails when the file on disk is neither's, or when between the
same two distributions some shared paths hold one's content and others the
other's (two unpacks that ran at once: the JIT then loads a mix). When every
shared path holds the same one's content (installed one after the other, the
later one wins, as upstream's workaround did), it passes and is reported.
Files RECORD lists but the image lacks are counted; a missing .py fails, other
missing files (native libraries a slimmed image left out) are reported only.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.metadata as md
import json
import os
import re
import sys

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[([^\]]*)\])?")
_EXTRA = re.compile(r"""extra\s*==\s*['"]([^'"]+)['"]""")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def required(dist: md.Distribution, extras: set[str]) -> list[tuple[str, set[str]]]:
    """(name, extras it asks for) of each requirement, with those of the given extras."""
    out = []
    for req in dist.requires or []:
        head, _, marker = req.partition(";")
        if "extra" in marker:
            m = _EXTRA.search(marker)
            if not m or canonical(m.group(1)) not in extras:
                continue
        m = _NAME.match(head)
        if m:
            wanted = {canonical(e) for e in (m.group(2) or "").split(",") if e.strip()}
            out.append((canonical(m.group(1)), wanted))
    return out


def closure(roots: list[str]) -> dict[str, md.Distribution]:
    installed: dict[str, md.Distribution] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            installed.setdefault(canonical(name), dist)
    todo: list[tuple[str, set[str]]] = [(canonical(r), set()) for r in roots]
    seen: dict[str, md.Distribution] = {}
    done: set[tuple[str, str]] = set()
    while todo:
        name, extras = todo.pop()
        if name not in installed:
            continue
        key = (name, ",".join(sorted(extras)))
        if key in done:
            continue
        done.add(key)
        seen[name] = installed[name]
        todo.extend(required(installed[name], extras))
    return seen


def judge_shared(claims: dict[str, list[tuple[str, str]]], on_disk: dict[str, str]
                 ) -> tuple[list[str], list[str], set[tuple[str, str]]]:
    """(failures, notes, (dist, path) pairs whose RECORD hash lost to another's) for shared paths."""
    winners: dict[tuple[str, ...], dict[str, list[str]]] = {}
    torn: list[str] = []
    lost: set[tuple[str, str]] = set()
    for path, owners in claims.items():
        if len({h for _, h in owners}) < 2 or path not in on_disk:
            continue
        names = tuple(sorted({n for n, _ in owners}))
        holder = sorted({n for n, h in owners if h == on_disk[path]})
        if not holder:
            torn.append(f"{os.path.basename(path)} (claimed by {' and '.join(names)}) matches neither")
            continue
        winners.setdefault(names, {}).setdefault(holder[0], []).append(path)
        lost.update((n, path) for n, h in owners if h != on_disk[path])
    failures, notes = list(torn), []
    for names, by_holder in sorted(winners.items()):
        count = sum(len(v) for v in by_holder.values())
        if len(by_holder) > 1:
            split = ", ".join(f"{len(v)} hold {k}'s" for k, v in sorted(by_holder.items()))
            example = sorted(next(iter(by_holder.values())))[0]
            failures.append(f"{count} path(s) claimed with different content by {' and '.join(names)} are a mix "
                            f"({split}; e.g. {os.path.basename(example)}): unpacked at the same time")
        else:
            winner = next(iter(by_holder))
            notes.append(f"{count} path(s) claimed by {' and '.join(names)} consistently hold {winner}'s content "
                         "(installed after the other)")
    return failures, notes, lost


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def main(argv: list[str]) -> int:
    package, patched, roots = argv[0], json.loads(argv[1]), argv[2:]
    dists = closure([package, *roots])
    if canonical(package) not in dists:
        print(json.dumps({"checks": [{"name": "integrity", "status": "fail",
                                      "detail": f"{package} is not installed"}]}))
        return 1
    claims: dict[str, list[tuple[str, str]]] = {}
    mismatched: list[tuple[str, str, str]] = []  # (dist, rel, path)
    on_disk: dict[str, str] = {}
    missing_py: list[str] = []
    missing_other = 0
    checked = 0
    for name, dist in sorted(dists.items()):
        base = str(dist.locate_file(""))
        record = dist.read_text("RECORD")
        if record is None:
            continue
        for row in csv.reader(record.splitlines()):
            if len(row) < 2 or not row[1].startswith("sha256="):
                continue
            rel, want = row[0], row[1][len("sha256="):]
            path = os.path.normpath(os.path.join(base, rel))
            claims.setdefault(path, []).append((name, want))
            if not os.path.exists(path):
                if path.endswith(".py"):
                    missing_py.append(f"{name}: {rel}")
                else:
                    missing_other += 1
                continue
            checked += 1
            if rel in patched:
                want = base64.urlsafe_b64encode(bytes.fromhex(patched[rel])).rstrip(b"=").decode()
                claims[path][-1] = (name, want)
            if path not in on_disk:
                on_disk[path] = file_hash(path)
            if on_disk[path] != want:
                mismatched.append((name, rel, path))
    shared_failures, shared_notes, lost = judge_shared(claims, on_disk)
    # A file that holds another claimant's content is judged as a shared path above, not as a mismatch.
    differ = [f"{n}: {rel}" for n, rel, path in mismatched if (n, path) not in lost]
    problems = []
    if differ:
        problems.append(f"{len(differ)} file(s) differ from RECORD, e.g. {differ[0]}")
    if shared_failures:
        problems.append(f"{len(shared_failures)} problem(s) with paths claimed with different content: "
                        f"{shared_failures[0]}")
    if missing_py:
        problems.append(f"{len(missing_py)} .py file(s) missing, e.g. {missing_py[0]}")
    detail = "; ".join(problems) if problems else (
        f"{checked} files of {len(dists)} distribution(s) match RECORD"
        + (f" ({missing_other} non-Python files listed but absent)" if missing_other else "")
        + (f"; {shared_notes[0]}" if shared_notes else "")
    )
    check = {
        "name": "integrity",
        "status": "fail" if problems else "pass",
        "detail": detail,
        "data": {
            "distributions": sorted(dists),
            "checked": checked,
            "mismatched": differ[:50],
            "conflicting_claims": shared_failures[:50],
            "shadowed": shared_notes[:50],
            "missing_py": missing_py[:50],
            "missing_other": missing_other,
        },
    }
    print(json.dumps({"checks": [check]}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
