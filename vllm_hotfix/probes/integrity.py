"""Probe run inside an image: are the installed distributions intact?

Usage: python3 integrity.py PACKAGE JSON
JSON maps files the pipeline patched on purpose (relative to the package's
parent) to their sha256; those are checked against that, not RECORD.

For PACKAGE and every installed distribution it requires (transitively, extras
left out), each file listed in RECORD with a hash must have that hash, and no
path may be claimed by two distributions with different content: the failure
mode of two sub-wheels unpacking the same paths in a race. Files RECORD lists
but the image lacks are counted; a missing .py fails, other missing files
(native libraries a slimmed image left out) are reported only.
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

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def required(dist: md.Distribution) -> list[str]:
    names = []
    for req in dist.requires or []:
        head, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        m = _NAME.match(head)
        if m:
            names.append(canonical(m.group(1)))
    return names


def closure(root: str) -> dict[str, md.Distribution]:
    installed: dict[str, md.Distribution] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            installed.setdefault(canonical(name), dist)
    todo, seen = [canonical(root)], {}
    while todo:
        name = todo.pop()
        if name in seen or name not in installed:
            continue
        seen[name] = installed[name]
        todo.extend(required(installed[name]))
    return seen


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def main(argv: list[str]) -> int:
    package, patched = argv[0], json.loads(argv[1])
    dists = closure(package)
    if canonical(package) not in dists:
        print(json.dumps({"checks": [{"name": "integrity", "status": "fail",
                                      "detail": f"{package} is not installed"}]}))
        return 1
    claims: dict[str, list[tuple[str, str]]] = {}
    mismatched: list[str] = []
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
            if file_hash(path) != want:
                mismatched.append(f"{name}: {rel}")
    shared = sorted(
        f"{os.path.basename(p)} claimed by " + " and ".join(sorted({n for n, _ in c}))
        for p, c in claims.items()
        if len({h for _, h in c}) > 1
    )
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} file(s) differ from RECORD, e.g. {mismatched[0]}")
    if shared:
        problems.append(f"{len(shared)} path(s) claimed with different content, e.g. {shared[0]}")
    if missing_py:
        problems.append(f"{len(missing_py)} .py file(s) missing, e.g. {missing_py[0]}")
    detail = "; ".join(problems) if problems else (
        f"{checked} files of {len(dists)} distribution(s) match RECORD"
        + (f" ({missing_other} non-Python files listed but absent)" if missing_other else "")
    )
    check = {
        "name": "integrity",
        "status": "fail" if problems else "pass",
        "detail": detail,
        "data": {
            "distributions": sorted(dists),
            "checked": checked,
            "mismatched": mismatched[:50],
            "conflicting_claims": shared[:50],
            "missing_py": missing_py[:50],
            "missing_other": missing_other,
        },
    }
    print(json.dumps({"checks": [check]}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
