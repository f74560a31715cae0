"""Probe run inside an image: are the pinned distributions what pins.txt says?

Usage: python3 pins_check.py SPEC_FILE
SPEC_FILE holds JSON: {"pins": [{"name": N, "version": V, "record": {rel: hash} or null}]}
where ``record`` is the RECORD of the wheel whose sha256 pins.txt lists (when
the caller has it), so the installed files are compared with the pinned
wheel, not only with the RECORD the image itself carries.

Checks:
* ``pin:<name>``: installed exactly once, at the pinned version, and every file
  of the pinned wheel is there with the wheel's hash;
* ``import:<module>``: each top-level module the pinned distributions provide
  imports. A module that cannot be imported only because it needs a module no
  installed distribution provides (e.g. torch in an image without it) is a
  ``skip`` naming that module: a gap of the image, which ``pip check`` at build
  time tells apart from one the pins made.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import re
import sys

_SKIP_IN_RECORD = ("RECORD", "INSTALLER", "REQUESTED", "direct_url.json")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return base64.urlsafe_b64encode(h.digest()).rstrip(b"=").decode()


def copies(name: str) -> list[md.Distribution]:
    seen, out = set(), []
    for dist in md.distributions():
        if canonical(dist.metadata["Name"] or "") == name:
            key = str(getattr(dist, "_path", id(dist)))
            if key not in seen:
                seen.add(key)
                out.append(dist)
    return out


def top_modules(dist: md.Distribution) -> list[str]:
    text = dist.read_text("top_level.txt")
    if text is not None:
        return sorted({m.strip() for m in text.split() if m.strip() and not m.startswith("_")})
    found = set()
    for row in csv.reader((dist.read_text("RECORD") or "").splitlines()):
        if not row:
            continue
        first = row[0].split("/")[0]
        if first.endswith((".dist-info", ".data")) or first in ("..", "__pycache__") or first.endswith(".pth"):
            continue
        if "/" in row[0] or first.endswith(".py"):
            found.add(first[:-3] if first.endswith(".py") else first)
    return sorted(m for m in found if m.isidentifier() and not m.startswith("_"))


def check_pin(pin: dict) -> tuple[dict, md.Distribution | None]:
    name, version, record = canonical(pin["name"]), pin["version"], pin.get("record")
    found = copies(name)
    label = f"pin:{pin['name']}"
    if len(found) != 1 or found[0].version != version:
        have = ", ".join(d.version for d in found) or "not installed"
        return {"name": label, "status": "fail", "detail": f"want {version}, image has {have}"}, None
    dist = found[0]
    if record is None:
        return {"name": label, "status": "pass",
                "detail": f"{version} (the pinned wheel was not at hand: files not compared with it)"}, dist
    base = str(dist.locate_file(""))
    wrong = []
    for rel, want in sorted(record.items()):
        if rel.split("/")[-1] in _SKIP_IN_RECORD and ".dist-info/" in rel:
            continue
        path = os.path.join(base, rel)
        if not os.path.isfile(path):
            wrong.append(f"{rel} missing")
        elif file_hash(path) != want:
            wrong.append(f"{rel} differs")
    if wrong:
        return {"name": label, "status": "fail",
                "detail": f"{len(wrong)} file(s) are not the pinned wheel's, e.g. {wrong[0]}"}, dist
    return {"name": label, "status": "pass",
            "detail": f"{version}; {len(record)} file(s) as in the pinned wheel"}, dist


def provided() -> set[str]:
    try:
        return set(md.packages_distributions())
    except Exception:  # noqa: BLE001
        return set()


def check_import(module: str, known: set[str]) -> dict:
    label = f"import:{module}"
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if missing and missing != module and missing not in known and importlib.util.find_spec(missing) is None:
            return {"name": label, "status": "skip",
                    "detail": f"needs {missing}, which no installed distribution provides"}
        return {"name": label, "status": "fail", "detail": f"ModuleNotFoundError: {exc}"}
    except BaseException as exc:  # noqa: BLE001  (whatever import raises is the answer)
        return {"name": label, "status": "fail", "detail": f"{type(exc).__name__}: {exc}"[:400]}
    return {"name": label, "status": "pass", "detail": "imports"}


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as fh:
        spec = json.load(fh)
    checks, modules = [], []
    for pin in spec["pins"]:
        check, dist = check_pin(pin)
        checks.append(check)
        if dist is not None:
            modules += [m for m in top_modules(dist) if m not in modules]
    known = provided()
    for module in modules:
        checks.append(check_import(module, known))
    print(json.dumps({"checks": checks}))
    return 1 if any(c["status"] == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
