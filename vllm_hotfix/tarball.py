"""Deterministic tar archives: build contexts, files put into containers, image layers.

The same entries always give the same bytes: sorted names, fixed owners and
times, no user or group names, nothing read from the host's clock or
accounts. Build contexts lean on that for the engine's layer cache; an
assembled image leans on it for its layer's diff ID, and so its image ID.

The archive is written here, not by :mod:`tarfile`: the format is a few
fixed fields (POSIX ustar headers, and a pax ``path`` record before a name
longer than 100 bytes), so its bytes, and with them an assembled image's ID,
do not depend on the Python release that writes them; ``tarfile``'s output is
not promised to stay the same across releases. Today the bytes equal what
``tarfile`` writes in its pax format for the same entries
(tests/unit/test_pure.py checks).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

BLOCK = 512
RECORD = 20 * BLOCK  # archives are padded to whole records, as tar (and tarfile) write them
_MAGIC = b"ustar\x0000"  # POSIX ustar magic and version "00"


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


def _octal(value: int, width: int, what: str) -> bytes:
    if not 0 <= value < 8 ** (width - 1):
        raise ValueError(f"tar header: {what} {value} does not fit in {width - 1} octal digits")
    return b"%0*o\0" % (width - 1, value)


def _text(value: bytes, width: int) -> bytes:
    return value[:width] + b"\0" * (width - len(value[:width]))


def _header(name: bytes, size: int, mode: int, uid: int, gid: int, mtime: int, kind: bytes) -> bytes:
    fields = b"".join((
        _text(name, 100),
        _octal(mode & 0o7777, 8, "mode"),
        _octal(uid, 8, "uid"),
        _octal(gid, 8, "gid"),
        _octal(size, 12, "size"),
        _octal(mtime, 12, "mtime"),
        b" " * 8,  # the checksum counts its own field as spaces
        kind,
        _text(b"", 100),  # link name
        _MAGIC,
        _text(b"", 32),  # user name
        _text(b"", 32),  # group name
        _text(b"", 8),  # device major
        _text(b"", 8),  # device minor
        _text(b"", 155),  # name prefix (unused: long names go in a pax record)
    ))
    block = fields + b"\0" * (BLOCK - len(fields))
    checksum = b"%06o\0" % sum(block)
    return block[:148] + checksum + block[155:]


def _padded(data: bytes) -> bytes:
    return data + b"\0" * (-len(data) % BLOCK)


def _pax_path(name: bytes) -> bytes:
    """A pax extended header carrying ``path``: the record's length counts its own digits."""
    body = b" path=" + name + b"\n"
    length = len(body)
    while len(b"%d" % length) + len(body) != length:
        length = len(b"%d" % length) + len(body)
    record = b"%d" % length + body
    return _header(b"././@PaxHeader", len(record), 0, 0, 0, 0, b"x") + _padded(record)


def member(e: Entry) -> bytes:
    """The bytes of one member: its header (after a pax record for a long or non-ASCII name), then its data."""
    name = e.name + "/" if e.data is None else e.name
    lead = _pax_path(name.encode("utf-8")) if len(name) > 100 or not name.isascii() else b""
    # The ustar field holds what fits of the name in ASCII; the pax record, when there is one, the whole name.
    field = name.encode("ascii", "replace")
    if e.data is None:
        return lead + _header(field, 0, e.mode, e.uid, e.gid, e.mtime, b"5")
    return lead + _header(field, len(e.data), e.mode, e.uid, e.gid, e.mtime, b"0") + _padded(e.data)


def write(entries: Iterable[Entry]) -> bytes:
    """An archive of ``entries``, parents before children, sorted by path."""
    body = b"".join(member(e) for e in sorted(entries, key=lambda e: e.name.split("/")))
    return body + end(len(body))


def end(length: int) -> bytes:
    """What ends an archive whose members take ``length`` bytes: two zero blocks, then zeros to a whole record."""
    return b"\0" * (2 * BLOCK + -(length + 2 * BLOCK) % RECORD)


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
