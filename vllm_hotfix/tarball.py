"""Deterministic tar archives: build contexts, files put into containers, image layers (and the markers a
layer's readers meet).

The same entries always give the same bytes: sorted names, fixed owners and
times, no user or group names, nothing read from the host's clock or
accounts. Build contexts lean on that for the engine's layer cache; an
assembled image leans on it for its layer's diff ID, and so its image ID.

:mod:`tarfile` writes them, in its POSIX pax format: ustar headers, with a
pax record before a member whose name is longer than 100 bytes or not ASCII
(or whose owner or time does not fit a ustar field). Python does not promise
that format's bytes stay the same across releases, and an assembled image's
ID would change with them: tests/unit/test_tarball.py holds the sha256 of
fixed archives, so a Python whose ``tarfile`` writes other bytes fails there
first.
"""

from __future__ import annotations

import io
import posixpath
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

# An image layer's own markers (the OCI layer format): ``.wh.NAME`` removes NAME from the layers below it,
# ``.wh..wh..opq`` in a folder hides all the layers below hold there.
WHITEOUT = ".wh."
OPAQUE = ".wh..wh..opq"


def marker(path: str) -> tuple[str, str] | None:
    """What a layer member named ``path`` marks rather than holds: ``("opaque", its folder)``,
    ``("whiteout", the path it removes)``, or None for an entry of its own."""
    folder, name = posixpath.split(path)
    if name == OPAQUE:
        return "opaque", folder
    if name.startswith(WHITEOUT):
        return "whiteout", posixpath.join(folder, name[len(WHITEOUT):])
    return None


@dataclass(frozen=True, slots=True)
class Entry:
    """One member of an archive; ``data`` None is a directory."""

    name: str  # relative, "/"-separated, no leading or trailing "/"
    data: bytes | None
    mode: int
    uid: int = 0
    gid: int = 0
    mtime: int = 0

    def __repr__(self) -> str:
        size = "dir" if self.data is None else f"{len(self.data)} B"
        return f"Entry({self.name!r}, {size}, {self.mode:o})"

    def info(self) -> tarfile.TarInfo:
        """Its tar header as :mod:`tarfile` takes it: no user or group names, nothing of the host."""
        info = tarfile.TarInfo(self.name)
        info.type = tarfile.DIRTYPE if self.data is None else tarfile.REGTYPE
        info.size = 0 if self.data is None else len(self.data)
        info.mode, info.uid, info.gid, info.mtime = self.mode & 0o7777, self.uid, self.gid, self.mtime
        info.uname = info.gname = ""
        return info


def write(entries: Iterable[Entry]) -> bytes:
    """An archive of ``entries``, parents before children, sorted by path."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in sorted(entries, key=lambda e: e.name.split("/")):
            tar.addfile(e.info(), io.BytesIO(e.data) if e.data is not None else None)
    return buf.getvalue()


def tar_bytes(files: Mapping[str, bytes], modes: Mapping[str, int] | None = None) -> bytes:
    """Files (relative path -> bytes) with their folders: root-owned, 0755 folders, time 0."""
    modes = modes or {}
    entries: dict[str, Entry] = {}
    for name, data in files.items():
        parts = name.split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            entries.setdefault(folder, Entry(folder, None, 0o755))
        entries[name] = Entry(name, data, modes.get(name, 0o644))
    return write(entries.values())
