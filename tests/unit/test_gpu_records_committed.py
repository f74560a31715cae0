"""Records under gpu-runs/ say exactly what ran: from 2026-12-04T17:30 on, every record of images names the clean
commit that ran it, and that commit's tree is the one computed from the files on the GPU host."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO

SINCE = "2026-12-04T17:30"


def problems(path: Path, data: Any, repo: Path = REPO) -> list[str]:
    """What keeps a record from naming what ran (nothing for records before SINCE or of no images)."""
    if not isinstance(data, dict) or "images" not in data or str(data.get("date", "")) < SINCE:
        return []
    src = data.get("source") or {}
    found = []
    if not re.fullmatch(r"[0-9a-f]{40}", str(src.get("commit", ""))):
        found.append(f"{path}: source.commit {src.get('commit')!r} is not a 40-hex commit")
    if src.get("clean") is not True:
        found.append(f"{path}: source.clean is {src.get('clean')!r}, not true")
    if not found:
        tree = subprocess.run(["git", "-C", str(repo), "rev-parse", f"{src['commit']}^{{tree}}"],
                              capture_output=True, text=True)
        if tree.returncode != 0:
            found.append(f"{path}: commit {src['commit']} is not in this repository")
        elif tree.stdout.strip() != src.get("tree"):
            found.append(f"{path}: the tree that ran ({src.get('tree')}) is not commit {src['commit'][:12]}'s "
                         f"({tree.stdout.strip()})")
    return found


def test_every_new_record_names_the_clean_commit_that_ran() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    found = []
    for path in sorted((REPO / "gpu-runs").rglob("*.json")):
        found += problems(path.relative_to(REPO), json.loads(path.read_text(encoding="utf-8")))
    assert not found, "\n".join(found)


def test_the_rule_refuses_what_it_must() -> None:
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD", "HEAD^{tree}"], capture_output=True,
                          text=True, check=True).stdout.split()
    good = {"images": {}, "date": "2026-12-05T10:00:00Z",
            "source": {"commit": head[0], "tree": head[1], "clean": True}}
    assert problems(Path("r.json"), good) == []
    assert problems(Path("r.json"), {**good, "date": "2026-12-04T12:00:00Z", "source": {}}) == []  # before
    assert problems(Path("r.json"), {"date": "2026-12-05", "result": {}}) == []  # not a record of images
    assert "not a 40-hex commit" in problems(Path("r.json"), {**good, "source": {"clean": True}})[0]
    assert "not true" in problems(Path("r.json"), {**good, "source": {**good["source"], "clean": False}})[0]
    assert "is not commit" in problems(Path("r.json"), {**good, "source": {**good["source"], "tree": "0" * 40}})[0]
    assert "not in this repository" in problems(Path("r.json"),
                                                {**good, "source": {**good["source"], "commit": "f" * 40}})[0]
