"""The sources of layers: an overlay folder, a tar stream (a layer blob, an engine's export, an engine's archive of
a folder) and the tool's own builder entries, each read into one :class:`~.entry.Layer`.

A tar is read in one pass: each regular file hashed block by block, the
bytes of those the caller names kept, a hard link given its target's hash
where the target came earlier in the same tar (else the flattener finds it
below). A path named twice in one layer is refused: which of the two an
engine shows depends on the engine, so the layer cannot be judged (Docker,
BuildKit and this tool write each path once). A whiteout of a path the
layer also holds is allowed (the OCI format: the whiteout hides the layers
below, the entry stays): a folder so named is an opaque one.

An overlay folder (the Docker engine's overlay2, podman's overlay) holds a
whiteout as a character device 0/0 and an opaque folder as an extended
attribute. Where that attribute cannot be read here (no permission, a
filesystem without them), the folder cannot be read as a layer at all:
:func:`from_folder` answers None and the caller reads the layer another way
(never "not opaque", which would leave the files of the layers below listed).
"""

from __future__ import annotations

import hashlib
import os
import stat
import tarfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import IO, Any, Literal

from ..errors import EngineError
from ..tarball import Entry, marker
from .entry import Layer, LayerEntry, absolute, ancestors

CHUNK = 1 << 20
OPAQUE_ATTRS = ("trusted.overlay.opaque", "user.overlay.opaque")
_NO_ATTR = (61, 95)  # ENODATA: no such attribute; EOPNOTSUPP: none on this filesystem

Keep = Callable[[str], bool]


def _never(_path: str) -> bool:
    return False


def _kind(member: tarfile.TarInfo) -> str:
    return ("dir" if member.isdir() else "file" if member.isreg() else "link" if member.issym()
            else "hardlink" if member.islnk() else "other")


def entry_of(member: tarfile.TarInfo, path: str, root: str = "/") -> LayerEntry:
    """A tar member's entry, its bytes not read (a file's hash is the reader's business)."""
    kind = _kind(member)
    target = member.linkname if kind == "link" else absolute(member.linkname, root) if kind == "hardlink" else ""
    return LayerEntry(path, kind, member.size if kind == "file" else 0, "", target, member.mode & 0o7777,
                      int(member.mtime), member.uid, member.gid)


def _hash(source: IO[bytes], want: bool) -> tuple[str, bytes | None]:
    digest = hashlib.sha256()
    parts: list[bytes] = []
    while block := source.read(CHUNK):
        digest.update(block)
        if want:
            parts.append(block)
    return digest.hexdigest(), b"".join(parts) if want else None


class Layered:
    """A layer being filled member by member; :meth:`done` settles whiteouts and opaque marks into its entries."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.entries: dict[str, LayerEntry] = {}
        self.kept: dict[str, bytes] = {}
        self.whiteouts: set[str] = set()
        self.opaque: set[str] = set()

    def put(self, entry: LayerEntry) -> None:
        if entry.path in self.entries:
            raise EngineError(f"{self.where} names {entry.path} twice: which one an engine shows is the engine's "
                              "choice, so the layer cannot be judged")
        self.entries[entry.path] = entry

    def mark(self, kind: str, path: str) -> None:
        seen = self.opaque if kind == "opaque" else self.whiteouts
        if path in seen:
            raise EngineError(f"{self.where} names the {kind} mark of {path} twice")
        seen.add(path)

    def layer(self) -> Layer:
        """The layer as read so far, its whiteouts and opaque marks settled into its entries (copies: a reader
        that looks at a layer half-way reads on into the same :class:`Layered`)."""
        entries = dict(self.entries)
        for path in self.whiteouts:
            here = entries.get(path)
            if here is None:
                entries[path] = LayerEntry(path, "whiteout")
            elif here.kind == "dir":
                entries[path] = replace(here, opaque=True)  # removed below, made anew here: opaque
        for path in self.opaque:
            here = entries.get(path)
            if here is None:
                entries[path] = LayerEntry(path, "dir", mode=0o755, opaque=True)
            elif here.kind != "dir":
                raise EngineError(f"{self.where} marks {path} opaque and holds it as a {here.kind}")
            else:
                entries[path] = replace(here, opaque=True)
        return Layer(entries, dict(self.kept))


Until = Callable[[str, Layered], bool]


def from_tar(stream: IO[bytes] | Any, *, root: str = "/", keep: Keep = _never, keep_max: int | None = None,
             markers: bool = True, mode: Literal["r|", "r|*"] = "r|*", where: str = "the layer",
             hash_all: bool = True, until: Until | None = None) -> Layer:
    """One layer tar read in one pass (member names relative to ``root``).

    ``keep``: the paths whose bytes are kept (files no larger than
    ``keep_max``, where given). ``markers``: ``.wh.`` names are whiteouts and
    opaque marks (a layer), else plain names (an engine's archive of a
    folder). ``hash_all`` False: only the files kept are hashed (a reader that
    wants a few files of a large layer spends no time on the rest).
    ``until``: asked with each member's path, and the layer read so far,
    before the member is read; True ends the read there (the stream is left
    where it stands). Raises EngineError for a path named twice; tarfile's
    errors for a stream that is not a tar."""
    layer = Layered(where)
    with tarfile.open(fileobj=stream, mode=mode) as tar:
        for member in tar:
            path = absolute(member.name, root)
            if path == "/":
                continue
            if until is not None and until(path, layer):
                break
            marks = marker(path) if markers else None
            if marks is not None:
                layer.mark(*marks)
                continue
            entry = entry_of(member, path, root)
            if entry.kind == "file":
                want = keep(path) and (keep_max is None or member.size <= keep_max)
                if want or hash_all:
                    body = tar.extractfile(member)
                    assert body is not None
                    digest, data = _hash(body, want)
                    entry = replace(entry, sha256=digest)
                    if data is not None:
                        layer.kept[path] = data
            elif entry.kind == "hardlink":
                first = layer.entries.get(entry.target)
                if first is not None:
                    entry = replace(entry, size=first.size, sha256=first.sha256)
                    if entry.target in layer.kept and keep(path):
                        layer.kept[path] = layer.kept[entry.target]
            layer.put(entry)
    return layer.layer()


# -- overlay folders ---------------------------------------------------------------


def is_whiteout(st: os.stat_result) -> bool:
    return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0


def opaque_state(path: str) -> bool | None:
    """Whether an overlay folder hides the layers below (None: its attributes cannot be read here)."""
    for name in OPAQUE_ATTRS:
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                return True
        except OSError as exc:
            if exc.errno not in _NO_ATTR:
                return None
    return False


def hash_file(path: str, want: bool) -> tuple[str, bytes | None]:
    with open(path, "rb") as fh:
        return _hash(fh, want)


def _folder_entry(full: str, path: str, keep: Keep, keep_max: int | None, kept: dict[str, bytes]
                  ) -> LayerEntry | None:
    """The entry at ``full``; None for a folder whose opaque mark cannot be read here."""
    st = os.lstat(full)
    mode = stat.S_IMODE(st.st_mode)
    if is_whiteout(st):
        return LayerEntry(path, "whiteout")
    if stat.S_ISDIR(st.st_mode):
        opaque = opaque_state(full)
        if opaque is None:
            return None
        return LayerEntry(path, "dir", mode=mode, mtime=int(st.st_mtime), uid=st.st_uid, gid=st.st_gid,
                          opaque=opaque)
    if stat.S_ISLNK(st.st_mode):
        return LayerEntry(path, "link", target=os.readlink(full), mode=mode, mtime=int(st.st_mtime),
                          uid=st.st_uid, gid=st.st_gid)
    if stat.S_ISREG(st.st_mode):
        digest, data = hash_file(full, keep(path) and (keep_max is None or st.st_size <= keep_max))
        if data is not None:
            kept[path] = data
        return LayerEntry(path, "file", st.st_size, digest, mode=mode, mtime=int(st.st_mtime), uid=st.st_uid,
                          gid=st.st_gid)
    return LayerEntry(path, "other", mode=mode, mtime=int(st.st_mtime), uid=st.st_uid, gid=st.st_gid)


def from_folder(folder: str, *, keep: Keep = _never, keep_max: int | None = None,
                under: str | None = None) -> Layer | None:
    """A layer as an overlay folder holds it; with ``under``, only what it says at or below that folder (and
    at each folder above it). None: an opaque mark this host cannot read (read the layer another way)."""
    entries: dict[str, LayerEntry] = {}
    kept: dict[str, bytes] = {}
    top = folder
    if under is not None:
        for path in ancestors(under):
            full = os.path.join(folder, path.lstrip("/"))
            if not os.path.lexists(full):
                return Layer(entries, kept)  # the layer holds nothing at or below ``under``
            entry = _folder_entry(full, path, keep, keep_max, kept)
            if entry is None:
                return None
            entries[path] = entry
            if entry.kind != "dir":
                return Layer(entries, kept)
        top = os.path.join(folder, under.lstrip("/"))
    for here, dirs, files in os.walk(top):
        for name in dirs + files:
            full = os.path.join(here, name)
            path = "/" + os.path.relpath(full, folder).replace(os.sep, "/")
            found = _folder_entry(full, path, keep, keep_max, kept)
            if found is None:
                return None
            entries[path] = found
    return Layer(entries, kept)


# -- the tool's own builder entries ---------------------------------------------------


def from_entries(entries: Iterable[Entry]) -> Layer:
    """A layer as the tool's builders write it (:class:`~vllm_hotfix.tarball.Entry` list), its files hashed."""
    layer = Layered("the builder's layer")
    for e in entries:
        path = absolute(e.name)
        marks = marker(path)
        if marks is not None:
            layer.mark(*marks)
        elif e.data is None:
            layer.put(LayerEntry(path, "dir", mode=e.mode & 0o7777, mtime=e.mtime, uid=e.uid, gid=e.gid))
        else:
            layer.put(LayerEntry(path, "file", len(e.data), hashlib.sha256(e.data).hexdigest(), mode=e.mode & 0o7777,
                                 mtime=e.mtime, uid=e.uid, gid=e.gid))
            layer.kept[path] = e.data
    return layer.layer()


# -- diff IDs ------------------------------------------------------------------------


class Hashing:
    """A reader that hashes what passes through it: a layer's diff ID is the sha256 of its uncompressed tar."""

    def __init__(self, inner: IO[bytes] | Any) -> None:
        self.inner = inner
        self._digest = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data: bytes = self.inner.read(n)
        self._digest.update(data)
        return data

    def diff_id(self) -> str:
        """The sha256 of every byte, once the rest (a tar's end padding) is read."""
        while self.read(CHUNK):
            pass
        return "sha256:" + self._digest.hexdigest()


def checked(stream: IO[bytes] | Any, diff_id: str, where: str, **read: Any) -> Layer:
    """:func:`from_tar` of an uncompressed layer stream, refused unless it hashes to ``diff_id`` (the config's)."""
    hashing = Hashing(stream)
    layer = from_tar(hashing, mode="r|", where=where, **read)
    got = hashing.diff_id()
    if got != diff_id:
        raise EngineError(f"{where}: its uncompressed tar hashes to {got[:19]}, not to the diff ID "
                          f"{diff_id[:19]} its image's config names")
    return layer


def from_export(blobs: Iterable[IO[bytes]], diff_ids: Sequence[str], count: int, where: str,
                **read: Any) -> list[Layer]:
    """The top ``count`` layers of an image from an engine's ``save`` export of it (every blob streams past; the
    ones wanted are told by their diff ID), bottom first."""
    wanted = list(diff_ids[len(diff_ids) - count:]) if count else []
    found: dict[str, Layer] = {}
    for blob in blobs:
        hashing = Hashing(blob)
        try:
            layer = from_tar(hashing, mode="r|*", where=f"a layer of {where}", **read)
        except tarfile.TarError:
            continue  # an OCI layout's config or manifest blob
        diff = hashing.diff_id()
        if diff in wanted:
            found[diff] = layer
    missing = [d for d in wanted if d not in found]
    if missing:
        raise EngineError(f"the export of {where} lacks layer {missing[0][:19]}")
    return [found[d] for d in wanted]
