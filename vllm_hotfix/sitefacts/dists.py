"""The distributions installed in an image's site folder, read from their dist-info in the files read of it.

Each dist-info's METADATA gives a distribution's name, version and
requirements, its RECORD the files it installed with their hashes (read
once, into typed rows: :mod:`vllm_hotfix.dist_record`).
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from email.parser import HeaderParser

from packaging.utils import canonicalize_name

from .. import dist_record
from ..engine import Tree


def canonical(name: str) -> str:
    return str(canonicalize_name(name))


@dataclass(frozen=True, slots=True)
class Dist:
    name: str  # canonical
    version: str
    info_dir: str
    requires: tuple[str, ...]
    rows: tuple[tuple[str, str], ...]  # (absolute path, RECORD sha256 or "")
    record_problems: tuple[str, ...] = ()  # rows of its RECORD left out for their shape ("line N: why")


def distributions(tree: Tree, site_dir: str) -> dict[str, Dist]:
    """Each distribution whose dist-info sits directly in ``site_dir``, by canonical name."""
    found: dict[str, Dist] = {}
    for path in sorted(tree.kept):
        folder, name = posixpath.split(path)
        if name != "METADATA" or posixpath.dirname(folder) != posixpath.normpath(site_dir):
            continue
        meta = HeaderParser().parsestr(tree.kept[path].decode("utf-8", "replace"))
        dist_name = meta.get("Name")
        if not dist_name:
            continue
        record = dist_record.read(tree.kept.get(posixpath.join(folder, "RECORD")) or b"")
        rows = tuple((row.under(site_dir), row.digest if row.algorithm == "sha256" else "") for row in record.rows)
        found.setdefault(canonical(dist_name), Dist(canonical(dist_name), meta.get("Version") or "", folder,
                                                    tuple(meta.get_all("Requires-Dist") or ()), rows,
                                                    record.problems))
    return found


def copies(tree: Tree, site_dir: str) -> list[tuple[str, str]]:
    """(canonical name, version) of every dist-info (or egg-info) directly in ``site_dir``: two of one name both
    counted, as :func:`distributions` (one per name) cannot show."""
    found = []
    for path in sorted(tree.kept):
        folder, name = posixpath.split(path)
        if name != "METADATA" or posixpath.dirname(folder) != posixpath.normpath(site_dir):
            continue
        meta = HeaderParser().parsestr(tree.kept[path].decode("utf-8", "replace"))
        if meta.get("Name"):
            found.append((canonical(meta["Name"]), meta.get("Version") or ""))
    return found
