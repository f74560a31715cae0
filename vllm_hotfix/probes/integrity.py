"""Probe run inside an image: are the installed distributions intact?

Usage: python3 integrity.py PACKAGE JSON [BASE_DEVIATIONS_FILE]
JSON maps files the pipeline patched on purpose (relative to the package's
parent) to their sha256; those are checked against that, not RECORD.
BASE_DEVIATIONS_FILE holds the ``deviations`` this probe reported for the
image's base: a deviation the base already has (same file, same content) is
reported as the base's and does not fail the image, unless its kind is in
``KNOWN_BAD``; a deviation the base lacks fails it.

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
LIMIT = 2000  # deviations listed per kind; enough for any base worth patching

# Deviation kinds that fail an image even when its base already had them.
KNOWN_BAD = {
    "conflicting_claims": "two distributions claim one path with different content: the sub-wheel unpack "
                          "race that breaks vLLM's JIT; an inherited case breaks the image all the same",
}
KINDS = ("mismatched", "conflicting_claims", "missing_py")
WORDS = {
    "mismatched": "file(s) differ from RECORD",
    "conflicting_claims": "path(s) claimed with different content",
    "missing_py": ".py file(s) missing",
}


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


def scan(package: str, patched: dict[str, str]) -> tuple[dict[str, dict[str, str]], int, int, list[str]]:
    """Deviations by kind (key -> observed content or detail), files checked, non-.py missing, dists."""
    dists = closure(package)
    claims: dict[str, list[tuple[str, str]]] = {}
    dev: dict[str, dict[str, str]] = {k: {} for k in KINDS}
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
                    dev["missing_py"][f"{name}: {rel}"] = ""
                else:
                    missing_other += 1
                continue
            checked += 1
            if rel in patched:
                want = base64.urlsafe_b64encode(bytes.fromhex(patched[rel])).rstrip(b"=").decode()
            got = file_hash(path)
            if got != want:
                # The observed hash is part of the deviation: a file the base already had
                # altered, altered again by the image, is a new deviation.
                dev["mismatched"][f"{name}: {rel}"] = got
    for p, c in claims.items():
        if len({h for _, h in c}) > 1:
            dev["conflicting_claims"][p] = " and ".join(sorted({n for n, _ in c}))
    return dev, checked, missing_other, sorted(dists)


def _example(kind: str, key: str, value: str) -> str:
    if kind == "conflicting_claims":
        return f"{os.path.basename(key)} claimed by {value}"
    return key


def main(argv: list[str]) -> int:
    package, patched = argv[0], json.loads(argv[1])
    base_dev: dict[str, dict[str, str]] | None = None
    if len(argv) > 2:
        with open(argv[2], encoding="utf-8") as fh:
            base_dev = json.load(fh)
    if canonical(package) not in closure(package):
        print(json.dumps({"checks": [{"name": "integrity", "status": "fail",
                                      "detail": f"{package} is not installed"}]}))
        return 1
    dev, checked, missing_other, dists = scan(package, patched)
    new: dict[str, list[str]] = {}
    inherited: dict[str, list[str]] = {}
    for kind in KINDS:
        before = (base_dev or {}).get(kind) or {}
        for key, value in sorted(dev[kind].items()):
            same = key in before and before[key] == value
            (inherited if same else new).setdefault(kind, []).append(_example(kind, key, value))
    problems = [f"{len(v)} {WORDS[k]}, e.g. {v[0]}" for k, v in new.items()]
    if base_dev is not None and new:
        problems[0] = "new in this image (the base lacks them): " + problems[0]
    bad_inherited = {k: v for k, v in inherited.items() if k in KNOWN_BAD}
    problems += [f"inherited from the base but known-bad: {len(v)} {WORDS[k]}, e.g. {v[0]} ({KNOWN_BAD[k]})"
                 for k, v in bad_inherited.items()]
    notes = [f"{len(v)} {WORDS[k]} already in the base, e.g. {v[0]}"
             for k, v in inherited.items() if k not in KNOWN_BAD]
    if problems:
        detail = "; ".join(problems)
    else:
        detail = f"{checked} files of {len(dists)} distribution(s) match RECORD"
        if notes:
            detail = f"{checked} files of {len(dists)} distribution(s) checked, no deviation of this image's own"
        if missing_other:
            detail += f" ({missing_other} non-Python files listed but absent)"
    if notes:
        detail += "; the base's, not the hotfix's: " + "; ".join(notes)
    check = {
        "name": "integrity",
        "status": "fail" if problems else "pass",
        "detail": detail,
        "data": {
            "distributions": dists,
            "checked": checked,
            "relative_to_base": base_dev is not None,
            "new": {k: v[:50] for k, v in new.items()},
            "inherited": {k: v[:50] for k, v in inherited.items()},
            "missing_other": missing_other,
        },
        # What a later run of this probe on an image built FROM this one compares against.
        "deviations": {k: dict(sorted(v.items())[:LIMIT]) for k, v in dev.items()},
    }
    print(json.dumps({"checks": [check]}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
