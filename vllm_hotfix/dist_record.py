"""A distribution's RECORD read on the host: typed rows, and every row of the wrong shape named.

RECORD (the wheel and installed-project formats) is a CSV file of three
columns: the path (relative to the folder holding the ``.dist-info``),
``ALGORITHM=DIGEST`` (urlsafe base64, no padding) or nothing, and the size in
bytes or nothing. Only RECORD itself (and its signatures) may go unhashed in
a wheel; pip leaves the bytecode it compiles unhashed too, so an empty hash
is a row of its own kind, never a wrong one. Like pypa/installer's
``records.py``, a row is taken only in that shape: a row with another number
of columns, an empty path, a hash without ``=``, a digest that is not
urlsafe base64 or a size that is not a number is named in
:attr:`Record.problems` with its line, and left out of :attr:`Record.rows`,
so a caller decides (integrity fails the image, a wheel is refused). The
probes that run inside the image keep their own stdlib reading: nothing of
the host's package is imported there.
"""

from __future__ import annotations

import base64
import binascii
import csv
import posixpath
from dataclasses import dataclass

__all__ = ["Record", "RecordRow", "read"]


@dataclass(frozen=True, slots=True)
class RecordRow:
    path: str  # as written: relative to the folder holding the .dist-info, "/"-separated
    algorithm: str = ""  # "sha256", ...; "" for an unhashed row
    digest: str = ""  # urlsafe base64 without padding, as written
    size: int | None = None

    def sha256_hex(self) -> str:
        """The row's sha256 as hex ("" where it has none)."""
        if self.algorithm != "sha256" or not self.digest:
            return ""
        return base64.urlsafe_b64decode(self.digest + "=" * (-len(self.digest) % 4)).hex()

    def under(self, folder: str) -> str:
        """Its absolute path, ``folder`` being the one that holds the ``.dist-info``."""
        return posixpath.normpath(posixpath.join(folder, self.path))


@dataclass(frozen=True, slots=True)
class Record:
    rows: tuple[RecordRow, ...]
    problems: tuple[str, ...] = ()  # "line N: why", one per row left out

    def paths(self) -> set[str]:
        return {row.path for row in self.rows}

    def sha256s(self) -> dict[str, str]:
        """path -> urlsafe base64 sha256 of every row hashed with sha256."""
        return {row.path: row.digest for row in self.rows if row.algorithm == "sha256" and row.digest}


def _row(cells: list[str]) -> RecordRow | str:
    """One row, or why it is not one."""
    if len(cells) != 3:
        return f"{len(cells)} column(s), not 3 (path, hash, size)"
    path, hashed, size = cells
    if not path:
        return "an empty path"
    algorithm = digest = ""
    if hashed:
        algorithm, eq, digest = hashed.partition("=")
        if not eq or not algorithm or not digest:
            return f"hash {hashed!r} is not ALGORITHM=DIGEST"
        try:
            base64.b64decode(digest + "=" * (-len(digest) % 4), altchars=b"-_", validate=True)
        except (binascii.Error, ValueError):
            return f"digest {digest!r} is not urlsafe base64"
        if any(c in "+/=" for c in digest):
            return f"digest {digest!r} is not urlsafe base64 without padding"
    length: int | None = None
    if size:
        if not size.isdigit():
            return f"size {size!r} is not a number of bytes"
        length = int(size)
    return RecordRow(path, algorithm, digest, length)


def read(data: bytes | str) -> Record:
    """The rows of a RECORD file's bytes (blank lines skipped), and what is wrong with the rest."""
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    rows: list[RecordRow] = []
    problems: list[str] = []
    try:
        for number, cells in enumerate(csv.reader(text.splitlines()), 1):
            if not cells or cells == [""]:
                continue
            got = _row(cells)
            if isinstance(got, str):
                problems.append(f"line {number}: {got}")
            else:
                rows.append(got)
    except csv.Error as exc:
        problems.append(f"not CSV: {exc}")
    return Record(tuple(rows), tuple(problems))
