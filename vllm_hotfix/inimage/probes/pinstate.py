"""Probe run inside an image: its pip, its wheel tags, and the state of some distributions.

Usage: python3 pinstate.py NAMES_JSON [PATHS_FILE]
NAMES_JSON is a JSON list of distribution names. PATHS_FILE (optional) holds a
JSON list of absolute paths; the answer says which of them exist.

Prints one JSON object: the Python version, pip's version (null without pip),
the wheel tags this interpreter accepts, best first (from pip's own copy of
``packaging``, so they are exactly what pip in this image will accept), and per
name every installed copy found on sys.path: version, where its metadata
lives, and the absolute paths its RECORD lists. Never imports the
distributions themselves.
"""

from __future__ import annotations

import csv
import importlib.metadata as md
import json
import os
import re
import sys


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pip_facts() -> tuple[str | None, list[str]]:
    try:
        import pip  # noqa: F401  (only its version and vendored packaging are used)
        from pip._vendor.packaging import tags
    except Exception:  # noqa: BLE001  (no pip, or a pip without a vendored packaging)
        return None, []
    return str(getattr(sys.modules["pip"], "__version__", "?")), [str(t) for t in tags.sys_tags()]


def copies(wanted: set[str]) -> dict[str, list[dict[str, object]]]:
    found: dict[str, list[dict[str, object]]] = {name: [] for name in wanted}
    seen: set[str] = set()
    for dist in md.distributions():
        name = canonical(dist.metadata["Name"] or "")
        if name not in wanted:
            continue
        meta_dir = str(getattr(dist, "_path", ""))
        if meta_dir in seen:
            continue
        seen.add(meta_dir)
        base = str(dist.locate_file(""))
        files = []
        record = dist.read_text("RECORD") or ""
        for row in csv.reader(record.splitlines()):
            if row:
                files.append(os.path.normpath(os.path.join(base, row[0])))
        found[name].append({"version": dist.version, "metadata": meta_dir, "files": files})
    return found


def main(argv: list[str]) -> int:
    names = {canonical(n) for n in json.loads(argv[0])}
    pip_version, tag_list = pip_facts()
    out: dict[str, object] = {
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "implementation": sys.implementation.name,
        "pip": pip_version,
        "tags": tag_list,
        "dists": copies(names),
    }
    if len(argv) > 1:
        with open(argv[1], encoding="utf-8") as fh:
            paths = json.load(fh)
        out["existing"] = sorted(p for p in paths if os.path.lexists(p))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
