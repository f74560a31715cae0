"""Build records: one JSON file per build under ``build/records/``.

A record holds a build's inputs (base reference and ID, patch hashes,
template hash, tool version), the image it produced, its smoke results and its
pushes. Records make rebuilds free (same inputs, image still there), gate the
push (only smoke-tested images), and tell ops what to roll back to.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def records_dir(root: Path) -> Path:
    return root / "build" / "records"


def inputs_key(inputs: dict[str, Any]) -> str:
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass
class Record:
    path: Path
    data: dict[str, Any]

    @property
    def image_id(self) -> str:
        return str(self.data.get("image_id", ""))

    def save(self) -> None:
        _write_json(self.path, self.data)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: a crash never leaves half a record."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(data, fh, indent=2, sort_keys=True)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def new(root: Path, data: dict[str, Any]) -> Record:
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    short = str(data.get("image_id", "")).removeprefix("sha256:")[:12]
    path = records_dir(root) / f"{stamp}-{short}.json"
    n = 1
    while path.exists():
        n += 1
        path = records_dir(root) / f"{stamp}-{short}-{n}.json"
    data = {"created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **data}
    record = Record(path, data)
    record.save()
    return record


def load_all(root: Path) -> list[Record]:
    """Every record, oldest first."""
    out: list[Record] = []
    folder = records_dir(root)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        try:
            out.append(Record(path, json.loads(path.read_text(encoding="utf-8"))))
        except (OSError, ValueError):
            continue  # a foreign or damaged file is not a record
    return sorted(out, key=lambda r: (str(r.data.get("created", "")), r.path.name))


def find_by_inputs(root: Path, key: str) -> list[Record]:
    return [r for r in reversed(load_all(root)) if r.data.get("inputs_key") == key]


def find_by_image(root: Path, image_id: str) -> list[Record]:
    return [r for r in reversed(load_all(root)) if r.image_id == image_id]


def builds_for(root: Path, definition: str) -> list[Record]:
    """Build records of one image definition, newest first."""
    return [
        r
        for r in reversed(load_all(root))
        if r.data.get("kind", "build") == "build"
        and (r.data.get("inputs") or {}).get("definition") == definition
    ]


def rollback_target(builds: list[Record], current_id: str | None, present: set[str]) -> Record | None:
    """The newest build, older than the one ``current_id`` names, still usable.

    Usable: its image is still in the engine (``present``) and its smoke
    checks did not fail. With no current image, the newest usable build.
    """
    ids = [r.image_id for r in builds]
    start = ids.index(current_id) + 1 if current_id in ids else 0
    for rec in builds[start:]:
        if rec.image_id != current_id and rec.image_id in present and rec.data.get("smoke_status") != "fail":
            return rec
    return None
