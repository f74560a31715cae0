"""Probe run inside an image: are the installed distributions intact?

Usage: python3 integrity.py PACKAGE JSON [--base BASE_DEVIATIONS_FILE] [ROOT ...]
JSON maps files the pipeline patched on purpose (relative to the package's
parent) to their sha256; those are checked against that, not RECORD. More
ROOTs (distributions a patch set pins) are checked with what they require.
BASE_DEVIATIONS_FILE holds the ``deviations`` this probe reported for the
image's base: a deviation the base already has (same file, same content) is
reported as the base's and does not fail the image, unless its kind is in
``KNOWN_BAD``; a deviation the base lacks fails it.

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
LIMIT = 2000  # deviations listed per kind; enough for any base worth patching

# Deviation kinds that fail an image even when its base already had them.
KNOWN_BAD = {
    "conflicting_claims": "two distributions claim one path with different content (sub-wheels unpacked at "
                          "the same time, or one distribution overwriting another's files): an inherited case "
                          "breaks the image all the same",
}
KINDS = ("mismatched", "conflicting_claims", "missing_py")
WORDS = {
    "mismatched": "file(s) differ from RECORD",
    "conflicting_claims": "path(s) claimed with different content",
    "missing_py": ".py file(s) missing",
}


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


def closure(roots: list[str]) -> tuple[dict[str, md.Distribution], dict[str, set[str]]]:
    """The installed distributions ``roots`` need (with the extras asked for), and each one's requirers."""
    installed: dict[str, md.Distribution] = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            installed.setdefault(canonical(name), dist)
    todo: list[tuple[str, set[str], str | None]] = [(canonical(r), set(), None) for r in roots]
    seen: dict[str, md.Distribution] = {}
    parents: dict[str, set[str]] = {}
    done: set[tuple[str, str]] = set()
    while todo:
        name, extras, parent = todo.pop()
        if name not in installed:
            continue
        if parent is not None:
            parents.setdefault(name, set()).add(parent)
        key = (name, ",".join(sorted(extras)))
        if key in done:
            continue
        done.add(key)
        seen[name] = installed[name]
        todo.extend((n, e, name) for n, e in required(installed[name], extras))
    return seen, parents


def judge_shared(claims: dict[str, list[tuple[str, str]]], on_disk: dict[str, str], parents: dict[str, set[str]]
                 ) -> tuple[dict[str, str], list[str], set[tuple[str, str]]]:
    """Shared paths: (failing path -> what is wrong, notes, (dist, path) pairs whose RECORD hash lost to another's).

    Sub-wheels of one distribution (all required by one parent) that ship the
    same paths pass when every such path holds the same one's content
    (installed one after the other); a mix (unpacked at the same time), a
    file that is neither's, or distributions that are not sub-wheels of one
    overwriting each other's files fail.
    """
    winners: dict[tuple[str, ...], dict[str, list[str]]] = {}
    failures: dict[str, str] = {}
    lost: set[tuple[str, str]] = set()
    for path, owners in claims.items():
        if len({h for _, h in owners}) < 2 or path not in on_disk:
            continue
        names = tuple(sorted({n for n, _ in owners}))
        holder = sorted({n for n, h in owners if h == on_disk[path]})
        if not holder:
            failures[path] = f"{os.path.basename(path)} claimed by {' and '.join(names)} matches neither"
            continue
        winners.setdefault(names, {}).setdefault(holder[0], []).append(path)
        lost.update((n, path) for n, h in owners if h != on_disk[path])
    notes = []
    for names, by_holder in sorted(winners.items()):
        count = sum(len(v) for v in by_holder.values())
        siblings = set.intersection(*(parents.get(n, set()) for n in names))
        if len(by_holder) > 1:
            split = ", ".join(f"{len(v)} hold {k}'s" for k, v in sorted(by_holder.items()))
            for path in (p for v in by_holder.values() for p in v):
                failures[path] = (f"{os.path.basename(path)}: the {count} path(s) claimed with different content "
                                  f"by {' and '.join(names)} are a mix ({split}): unpacked at the same time")
        elif not siblings:
            for path in next(iter(by_holder.values())):
                failures[path] = f"{os.path.basename(path)} claimed by {' and '.join(names)}"
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


def scan(package: str, patched: dict[str, str], roots: list[str]
         ) -> tuple[dict[str, dict[str, str]], int, int, list[str], list[str]]:
    """Deviations by kind (key -> observed content or detail), files checked, non-.py missing, dists, notes."""
    dists, parents = closure([package, *roots])
    claims: dict[str, list[tuple[str, str]]] = {}
    dev: dict[str, dict[str, str]] = {k: {} for k in KINDS}
    mismatched: list[tuple[str, str, str]] = []  # (dist, rel, path)
    on_disk: dict[str, str] = {}
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
                claims[path][-1] = (name, want)
            if path not in on_disk:
                on_disk[path] = file_hash(path)
            if on_disk[path] != want:
                mismatched.append((name, rel, path))
    dev["conflicting_claims"], notes, lost = judge_shared(claims, on_disk, parents)
    # A file that holds another claimant's content is judged as a shared path, not as a mismatch.
    for name, rel, path in mismatched:
        if (name, path) not in lost:
            # The observed hash is part of the deviation: a file the base already had
            # altered, altered again by the image, is a new deviation.
            dev["mismatched"][f"{name}: {rel}"] = on_disk[path]
    return dev, checked, missing_other, sorted(dists), notes


def _example(kind: str, key: str, value: str) -> str:
    return value if kind == "conflicting_claims" else key


def main(argv: list[str]) -> int:
    package, patched, rest = argv[0], json.loads(argv[1]), argv[2:]
    base_dev: dict[str, dict[str, str]] | None = None
    if rest[:1] == ["--base"]:
        with open(rest[1], encoding="utf-8") as fh:
            base_dev = json.load(fh)
        rest = rest[2:]
    if canonical(package) not in closure([package])[0]:
        print(json.dumps({"checks": [{"name": "integrity", "status": "fail",
                                      "detail": f"{package} is not installed"}]}))
        return 1
    dev, checked, missing_other, dists, shadowed = scan(package, patched, rest)
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
        if shadowed:
            detail += f"; {shadowed[0]}"
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
            "shadowed": shadowed[:50],
            "missing_other": missing_other,
        },
        # What a later run of this probe on an image built FROM this one compares against.
        "deviations": {k: dict(sorted(v.items())[:LIMIT]) for k, v in dev.items()},
    }
    print(json.dumps({"checks": [check]}))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
