"""Deterministic tar archives: build contexts, files put into containers, image layers.

The same entries always give the same bytes: sorted names, fixed owners and
times, no user or group names, nothing read from the host's clock or
accounts. Build contexts lean on that for the engine's layer cache; an
assembled image leans on it for its layer's diff ID, and so its image ID.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Entry:
    """One member of an archive; ``data`` None is a directory."""

    name: str  # relative, "/"-separated, no leading or trailing "/"
    data: bytes | None
    mode: int
    uid: int = 0
    gid: int = 0
    mtime: int = 0


def write(entries: Iterable[Entry]) -> bytes:
    """An archive of ``entries``, parents before children, sorted by path."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for e in sorted(entries, key=lambda e: e.name.split("/")):
            info = tarfile.TarInfo(e.name)
            info.mode = e.mode
            info.uid, info.gid = e.uid, e.gid
            info.mtime = e.mtime
            if e.data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(e.data)
                tar.addfile(info, io.BytesIO(e.data))
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
