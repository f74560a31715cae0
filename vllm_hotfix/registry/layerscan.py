"""Where a package lives in an image, and the few files a patch set needs, read from its layer blobs.

The engine path asks the base's own Python where it imports the package
from. Without an engine nothing of the image can run, so the answer comes
from the layers, read as the engine would stack them:

* newest layer first. The newest layer that says anything about a path
  decides it: an entry at the path (that entry is the file or folder the
  image shows), a whiteout ``.wh.NAME`` of it or of a folder above it, an
  opaque marker ``.wh..wh..opq`` in a folder above it, or a file or link in
  place of a folder above it (each of these: the path is gone, whatever the
  layers below hold);
* the package's folder is the one beside a ``<name>-<version>.dist-info``
  whose METADATA names the package and whose RECORD lists the package's
  ``__init__.py`` and every file the patches touch; the site folder is the
  folder holding both. Two installations found in the layers read, or two
  dist-infos of the package in one folder, stop the run (the engine path
  asks the image's Python which one it imports); smoke then asks the
  image's Python that it imports the package from this folder;
* each layer is a gzip stream read once, never stored. A layer lists its
  entries in path order (Docker, BuildKit and this tool's own layers do):
  once the stream is past every path still wanted, and the site folder is
  known, the rest of the layer is not read, and no layer below is opened
  once every wanted path is decided. A layer whose entries are not in path
  order is read to its end. A layer's digest is checked only when it was
  read to its end; one left early is trusted as the registry sent it.

What costs bytes is therefore every layer above the one that holds the
package's files, in full, and that layer up to those files and the
dist-info: a layout with the package in one of the newest layers reads a
few megabytes of a base of any size.
"""

from __future__ import annotations

import hashlib
import logging
import posixpath
import tarfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from email.parser import HeaderParser
from typing import Any, Protocol

from .. import dist_record
from ..errors import BaseImageError, PushError
from ..layers import Folder, LayerEntry, ancestors, hides
from ..layers.read import entry_of
from ..tarball import OPAQUE, WHITEOUT, marker
from .compression import STREAM_ERRORS, tar_stream

log = logging.getLogger(__name__)

UNKNOWN = object()  # a path the layers read say nothing about


class Blob(Protocol):
    """A layer blob opened as a stream (see :func:`open_stream`)."""

    def read(self, n: int = -1) -> bytes: ...

    def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class LayerRef:
    digest: str
    media_type: str
    size: int


@dataclass
class Listing:
    """What one layer holds that matters here: every folder, whiteout, opaque marker and non-folder path,
    and the bytes of the files asked for."""

    index: int  # in the manifest's order (0: the oldest)
    entries: dict[str, LayerEntry] = field(default_factory=dict)
    whiteouts: set[str] = field(default_factory=set)
    opaque: set[str] = field(default_factory=set)
    data: dict[str, bytes] = field(default_factory=dict)
    hint: tuple[str, bytes] | None = None  # (name, first 16 bytes) of a pyc of the package, any
    whole: bool = True  # read to its end (False: left once past every wanted path)

    def at(self, path: str) -> LayerEntry | None:
        """What this layer says at ``path``: its entry (opaque where marked so), a whiteout, or None."""
        if path in self.whiteouts:
            found = self.entries.get(path)
            return replace(found, opaque=True) if found is not None and found.kind == "dir" else \
                found or LayerEntry(path, "whiteout")
        found = self.entries.get(path)
        if path in self.opaque:
            return replace(found, opaque=True) if found is not None else LayerEntry(path, "dir", opaque=True)
        return found

    def cuts(self, path: str) -> bool:
        """Whether this layer removes ``path`` (and so hides what the layers below hold there): the flattener's
        rule (:func:`vllm_hotfix.layers.hides`)."""
        return hides(path, self.at)


def key(path: str) -> tuple[str, ...]:
    """A path's place in a layer's order: folder by folder, each level by name (what Go's Walk gives)."""
    return tuple(path.strip("/").split("/"))


def after_subtree(path: str) -> tuple[str, ...]:
    """The first key past ``path`` and everything below it."""
    k = key(path)
    return (*k[:-1], k[-1] + "\0")


class Stack:
    """The layers read so far, newest first, and what they decide."""

    def __init__(self) -> None:
        self.layers: list[Listing] = []

    def resolve(self, path: str) -> LayerEntry | None | object:
        """The entry the image shows at ``path``, None if it is gone, UNKNOWN if no layer read says."""
        for layer in self.layers:
            found = layer.entries.get(path)
            if found is not None:
                return found
            if layer.cuts(path):
                return None
        return UNKNOWN

    def data(self, path: str) -> bytes | None:
        for layer in self.layers:
            if path in layer.entries:
                return layer.data.get(path)
        return None

    def seen_under(self, folder: str, pred: Callable[[str], bool]) -> set[str]:
        """Paths directly in ``folder`` any layer read names (as entries or whiteouts) that ``pred`` accepts."""
        out = set()
        inside = folder.rstrip("/") + "/"
        for layer in self.layers:
            for path in [*layer.entries, *layer.whiteouts]:
                if path.startswith(inside) and posixpath.dirname(path) == folder and pred(posixpath.basename(path)):
                    out.add(path)
        return out


# -- what is wanted --------------------------------------------------------------


def dist_prefix(package: str) -> str:
    """The start of the package's dist-info folder name: ``vllm-`` (names normalised as wheels write them)."""
    return package.replace("-", "_").replace(".", "_").lower() + "-"


@dataclass
class Wanted:
    """The package and the files a patch set touches (relative to the site folder)."""

    package: str
    rels: Sequence[str]
    site: str | None = None  # known once an installation is found
    dist_info: str | None = None  # its dist-info folder

    def __post_init__(self) -> None:
        # The file names keep() can say yes to, besides bytecode.
        self._names = frozenset(["METADATA", "RECORD", *(posixpath.basename(rel) for rel in self.rels)])

    def keep(self, path: str) -> bool:
        """Whether a member's bytes are kept: a touched file, its pycs, a dist-info's METADATA or RECORD."""
        name = posixpath.basename(path)
        if not name.endswith(".pyc") and name not in self._names:
            return False  # most of a layer's members: no name this could keep
        folder = posixpath.dirname(path)
        if name in ("METADATA", "RECORD") and posixpath.basename(folder).lower().startswith(
                dist_prefix(self.package)) and folder.endswith(".dist-info"):
            return True
        for rel in self.rels:
            if path.endswith("/" + rel):
                return True
            stem = posixpath.basename(rel).removesuffix(".py") + "."
            if (folder.endswith("/" + posixpath.join(posixpath.dirname(rel), "__pycache__"))
                    and name.startswith(stem) and name.endswith(".pyc")):
                return True
        return False

    def needed(self) -> list[str]:
        """Every path the build must have decided, once the site folder is known."""
        assert self.site is not None
        files = [f"{self.site}/{self.package}/__init__.py", *(f"{self.site}/{rel}" for rel in self.rels)]
        if self.dist_info is not None:
            files += [f"{self.dist_info}/METADATA", f"{self.dist_info}/RECORD"]
        out: dict[str, None] = {}
        for f in files:
            for a in ancestors(f):
                out.setdefault(a, None)
        return list(out)

    def horizon(self) -> tuple[str, ...]:
        """A key past which a path-ordered layer holds nothing more that is wanted here."""
        assert self.site is not None
        ends: list[tuple[str, ...]] = []
        leaves = {f"{self.site}/{self.package}/__init__.py", *(f"{self.site}/{rel}" for rel in self.rels),
                  *([f"{self.dist_info}/METADATA", f"{self.dist_info}/RECORD"] if self.dist_info else [])}
        for path in self.needed():
            parent, name = posixpath.split(path)
            # A folder on the way matters for its own entry, a whiteout of it and its opaque marker, not for
            # all it holds; the first key past an entry k is k + ("",).
            ends.append(after_subtree(path) if path in leaves else (*key(path), ""))
            ends.append((*key(posixpath.join(parent, WHITEOUT + name)), ""))
            ends.append((*key(posixpath.join(path, OPAQUE)), ""))
        for rel in self.rels:
            ends.append(after_subtree(f"{self.site}/{posixpath.dirname(rel)}/__pycache__"))
        ends.append((*key(self.site), dist_prefix(self.package)[:-1] + "."))  # past every <name>-*.dist-info
        return max(ends)


# -- reading ---------------------------------------------------------------------


TICK_S = 5.0  # seconds between the progress lines of a long read
TICK_WORDS = "read so far"  # what every such line says (a caller printing JSON may leave them out)


class Counted:
    """A blob's bytes as they arrive: counted, hashed, never past the size its manifest gives; every few
    seconds of a long read, a line saying how far it got (``tick``)."""

    def __init__(self, blob: Blob, layer: LayerRef, where: str,
                 tick: Callable[[str], None] | None = None) -> None:
        self._blob = blob
        self.layer = layer
        self.where = where
        self.read_bytes = 0
        self._hash = hashlib.sha256()
        self._tick = tick
        self._next_tick = time.monotonic() + TICK_S

    def read(self, n: int = -1) -> bytes:
        try:
            data = self._blob.read(n)
        except Exception as exc:
            # The connection cut mid-blob, or stalled past its read timeout (urllib3's and requests' errors are
            # neither OSError nor a tar's): the registry's failure, in one line.
            if isinstance(exc, BaseImageError):
                raise
            from ..engine import registry_errors

            raise PushError(f"{self.where}: the registry's answer broke off after {self.read_bytes} of "
                            f"{self.layer.size} bytes ({registry_errors.in_words(exc)})",
                            hint="run it again once the registry answers steadily") from exc
        self.read_bytes += len(data)
        if self.read_bytes > self.layer.size:
            raise BaseImageError(f"{self.where}: the registry sent more than the {self.layer.size} bytes its "
                                 "manifest gives")
        self._hash.update(data)
        if self._tick is not None and time.monotonic() >= self._next_tick:
            self._next_tick = time.monotonic() + TICK_S
            self._tick(f"    {self.where}: {self.read_bytes / 2**20:.1f} of {self.layer.size / 2**20:.1f} MiB "
                       f"{TICK_WORDS}")
        return data

    def close(self) -> None:
        self._blob.close()

    def finish(self) -> None:
        """Read what is left (the tar's end padding, the gzip trailer) and check the digest."""
        while self.read(1 << 20):
            pass
        got = "sha256:" + self._hash.hexdigest()
        if got != self.layer.digest:
            raise BaseImageError(f"{self.where}: its bytes hash to {got}, not to the digest the manifest names")


def read_layer(stream: Counted, listing: Listing, wanted: Wanted, on_metadata: Callable[[], None]) -> None:
    """Fill ``listing`` from one layer's stream; left early where its order allows (``listing.whole`` False)."""
    last: tuple[str, ...] = ()
    ordered = True
    horizon: tuple[str, ...] | None = None
    in_package = f"/{wanted.package}/"
    source, mode = tar_stream(stream, stream.layer.media_type)
    try:
        with tarfile.open(fileobj=source, mode=mode) as tar:
            for member in tar:
                path = posixpath.normpath("/" + member.name)
                if path == "/":
                    continue
                here = key(path)
                ordered = ordered and here > last
                last = here
                if ordered and horizon is None and wanted.site is not None:
                    horizon = wanted.horizon()
                if ordered and horizon is not None and here >= horizon:
                    listing.whole = False
                    break
                marks = marker(path)
                if marks is not None:
                    seen = listing.opaque if marks[0] == "opaque" else listing.whiteouts
                    if marks[1] in seen:
                        raise BaseImageError(f"{stream.where} names the {marks[0]} mark of {marks[1]} twice")
                    seen.add(marks[1])
                    continue
                name = posixpath.basename(path)
                if path in listing.entries:
                    raise BaseImageError(f"{stream.where} names {path} twice: which one an engine shows is the "
                                         "engine's choice, so the layer cannot be read")
                listing.entries[path] = entry_of(member, path)
                if not member.isreg():
                    continue
                if wanted.keep(path):
                    source = tar.extractfile(member)
                    assert source is not None
                    listing.data[path] = source.read()
                    if wanted.site is None and name == "METADATA":
                        on_metadata()
                elif listing.hint is None and name.endswith(".pyc") and in_package in path:
                    source = tar.extractfile(member)
                    assert source is not None
                    listing.hint = (name, source.read(16))
            if listing.whole:
                stream.finish()
    except STREAM_ERRORS as exc:
        raise BaseImageError(f"{stream.where} is not a readable tar: {exc}") from None


def open_stream(opener: Callable[[LayerRef], Blob], layer: LayerRef, where: str,
                tick: Callable[[str], None] | None = None) -> Counted:
    return Counted(opener(layer), layer, where, tick)


# -- the answer --------------------------------------------------------------------


@dataclass(frozen=True)
class Located:
    """Where the package lives, what the image holds of the touched files, and what was read to know it."""

    site_dir: str
    package_dir: str
    version: str | None
    dist_info: str
    folders: tuple[Folder, ...]  # "/" excluded, down to site_dir included
    files: dict[str, dict[str, Any]]  # rel -> kind, mode, real, data (bytes or None), pycs
    pycs: dict[str, dict[str, bytes]]  # rel -> {pyc path relative to site_dir: bytes} the image shows
    hint_pyc: tuple[str, bytes] | None  # (name, first 16 bytes) of a pyc of the package, when no touched file has one
    record: bytes
    layers_read: int
    bytes_read: int
    notes: tuple[str, ...] = ()


def _candidates(stack: Stack, wanted: Wanted) -> dict[str, str]:
    """site folder -> dist-info folder of each installation the layers read show (both parts present)."""
    found: dict[str, str] = {}
    prefix = dist_prefix(wanted.package)
    for layer in stack.layers:
        for path in layer.data:
            folder, name = posixpath.split(path)
            if name != "METADATA" or not posixpath.basename(folder).lower().startswith(prefix):
                continue
            site = posixpath.dirname(folder)
            meta = stack.resolve(path)
            init = stack.resolve(f"{site}/{wanted.package}/__init__.py")
            if isinstance(meta, LayerEntry) and isinstance(init, LayerEntry) and init.kind == "file":
                text = (stack.data(path) or b"").decode("utf-8", "replace")
                named = HeaderParser().parsestr(text).get("Name") or ""
                if _canonical(named) == _canonical(wanted.package):
                    if site in found and found[site] != folder:
                        raise BaseImageError(f"{site} holds two dist-infos of {wanted.package} "
                                             f"({posixpath.basename(found[site])}, {posixpath.basename(folder)})",
                                             hint="build from the engine: its Python says which one it reads")
                    found[site] = folder
    return found


def _canonical(name: str) -> str:
    return name.replace("_", "-").replace(".", "-").lower()


class Memory(Protocol):
    """What earlier reads learnt of layers, by digest (:mod:`.layercache`)."""

    def load(self, digest: str, wanted: Wanted, index: int) -> Listing | None: ...

    def keep(self, digest: str, listing: Listing, wanted: Wanted) -> None: ...


def locate(layers: Sequence[LayerRef], opener: Callable[[LayerRef], Blob], package: str, rels: Sequence[str],
           where: str, say: Callable[[str], None] = lambda _l: None, memory: Memory | None = None) -> Located:
    """Read ``layers`` (manifest order) newest first until the package and every file of ``rels`` are decided;
    a layer ``memory`` knows is not read again."""
    wanted = Wanted(package, rels)
    stack = Stack()
    read = 0
    chosen: dict[str, str] = {}

    def settle() -> None:
        nonlocal chosen
        chosen = _candidates(stack, wanted)
        if len(chosen) > 1:
            raise BaseImageError(f"{where}: {package} is installed in {' and '.join(sorted(chosen))}",
                                 hint="build from the engine: its Python says which one it imports")
        if chosen:
            wanted.site, wanted.dist_info = next(iter(chosen.items()))

    for index in range(len(layers) - 1, -1, -1):
        layer = layers[index]
        label = f"layer {index + 1}/{len(layers)} ({layer.digest[:19]}) of {where}"
        known = memory.load(layer.digest, wanted, index) if memory is not None else None
        if known is not None:
            stack.layers.append(known)
            say(f"    {label}: known from an earlier read (0 of {layer.size} bytes read)")
            settle()
        else:
            stream = open_stream(opener, layer, label, say)
            listing = Listing(index)
            stack.layers.append(listing)  # filled as it streams: a site found half-way can end this very layer
            try:
                read_layer(stream, listing, wanted, settle)
            finally:
                read += stream.read_bytes
                stream.close()
            say(f"    read {label}: {stream.read_bytes} of {layer.size} bytes"
                f"{'' if listing.whole else ' (left once past the files wanted)'}")
            settle()
            if memory is not None:
                memory.keep(layer.digest, listing, wanted)
        if wanted.site is not None and all(stack.resolve(p) is not UNKNOWN for p in wanted.needed()):
            break
    if wanted.site is None:
        raise BaseImageError(f"{where}: no layer holds an installed {package} (a {package}/__init__.py beside a "
                             f"{dist_prefix(package)}*.dist-info whose METADATA names it)")
    return _answer(stack, wanted, chosen[wanted.site], len(stack.layers), read)


def _answer(stack: Stack, wanted: Wanted, dist_info: str, layers_read: int, read: int) -> Located:
    site = wanted.site
    assert site is not None
    folders = []
    for path in ancestors(site):
        got = stack.resolve(path)
        if not isinstance(got, LayerEntry) or got.kind != "dir":
            what = "nothing any layer read states" if got is UNKNOWN else "not a folder"
            raise BaseImageError(f"{path} above {site} is {what}: cannot restate it in the new layer")
        folders.append(Folder(path, got.mode, got.uid, got.gid, got.mtime))
    record = stack.data(f"{dist_info}/RECORD") or b""
    listed = _record_paths(record)
    meta = HeaderParser().parsestr((stack.data(f"{dist_info}/METADATA") or b"").decode("utf-8", "replace"))
    files: dict[str, dict[str, Any]] = {}
    pycs: dict[str, dict[str, bytes]] = {}
    notes = []
    for rel in wanted.rels:
        files[rel] = _file_info(stack, site, rel)
        if files[rel]["kind"] == "file" and rel not in listed:
            notes.append(f"{rel} is not listed in {posixpath.basename(dist_info)}/RECORD")
        pycs[rel] = _pycs(stack, site, rel)
    hint = None
    if not any(pycs.values()):
        hint = _any_pyc(stack)
    return Located(site, f"{site}/{wanted.package}", meta.get("Version"), dist_info, tuple(folders), files, pycs,
                   hint, record, layers_read, read, tuple(notes))


def _record_paths(record: bytes) -> set[str]:
    return dist_record.read(record).paths()


def _file_info(stack: Stack, site: str, rel: str) -> dict[str, Any]:
    """What the locate probe says of a touched file: kind, mode, whether reached without links, its bytes."""
    path = f"{site}/{rel}"
    for above in ancestors(path)[:-1]:
        got = stack.resolve(above)
        if isinstance(got, LayerEntry) and got.kind == "link":
            return {"kind": "file", "real": False, "mode": 0, "data": None}
    got = stack.resolve(path)
    if got is UNKNOWN or got is None:
        return {"kind": "missing", "real": True, "mode": 0, "data": None}
    assert isinstance(got, LayerEntry)
    kind = {"file": "file", "dir": "dir", "link": "symlink"}.get(got.kind, "other")
    data = stack.data(path) if kind == "file" else None
    if got.kind == "hardlink":
        raise BaseImageError(f"{path} is a hard link in the base's layers, which a registry read cannot follow",
                             hint="build from the engine (image without --in-registry)")
    return {"kind": kind, "real": True, "mode": got.mode, "data": data}


def _pycs(stack: Stack, site: str, rel: str) -> dict[str, bytes]:
    """The bytecode files the image shows for a touched source, by path relative to the site folder."""
    folder = f"{site}/{posixpath.dirname(rel)}/__pycache__"
    stem = posixpath.basename(rel).removesuffix(".py") + "."
    out = {}
    for path in sorted(stack.seen_under(folder, lambda n: n.startswith(stem) and n.endswith(".pyc"))):
        got = stack.resolve(path)
        if isinstance(got, LayerEntry):
            out[posixpath.relpath(path, site)] = stack.data(path) or b""
    return out


def _any_pyc(stack: Stack) -> tuple[str, bytes] | None:
    return next((layer.hint for layer in stack.layers if layer.hint is not None), None)


def layer_refs(descriptors: Iterable[dict[str, Any]]) -> list[LayerRef]:
    return [LayerRef(str(d["digest"]), str(d.get("mediaType") or ""), int(d["size"])) for d in descriptors]
