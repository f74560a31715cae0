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
* each layer is a gzip stream read once, never stored, by the one layer
  reader (:func:`vllm_hotfix.layers.read.from_tar`), and the layers read are
  squashed into one (:func:`vllm_hotfix.layers.squash`), which says of each
  path whether they decide it. A layer lists its
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
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from typing import Any, Protocol

from .. import dist_record
from ..errors import BaseImageError, EngineError, PushError
from ..layers import Folder, Layer, LayerEntry, ancestors, said, squash
from ..layers.read import Layered, from_tar
from ..tarball import OPAQUE, WHITEOUT
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
    """What one read of a layer learnt: the layer as far as it was read (every entry, whiteouts and opaque
    folders among them, and the bytes of the files asked for), the first bytes of a pyc of the package, and
    whether it was read to its end."""

    layer: Layer
    hint: tuple[str, bytes] | None = None  # (name, first 16 bytes) of a pyc of the package, any
    whole: bool = True  # read to its end (False: left once past every wanted path)


def key(path: str) -> tuple[str, ...]:
    """A path's place in a layer's order: folder by folder, each level by name (what Go's Walk gives)."""
    return tuple(path.strip("/").split("/"))


def after_subtree(path: str) -> tuple[str, ...]:
    """The first key past ``path`` and everything below it."""
    k = key(path)
    return (*k[:-1], k[-1] + "\0")


def shown(top: Layer, path: str) -> LayerEntry | None | object:
    """The entry the image shows at ``path`` by what the layers read (squashed into ``top``) say: None if it is
    gone, UNKNOWN if they say nothing of it."""
    found = said(top, path)
    if found is None:
        return UNKNOWN
    return None if found.kind == "whiteout" else found


class Stack:
    """The layers read so far, newest first, squashed into one (``top``), and the pyc hints they gave."""

    def __init__(self) -> None:
        self.top = Layer()
        self.count = 0
        self.hints: list[tuple[str, bytes]] = []

    def beneath(self, layer: Layer) -> Layer:
        """The layers read with ``layer`` (older than all of them) read under them."""
        return squash([layer, self.top])

    def add(self, listing: Listing) -> None:
        self.top = self.beneath(listing.layer)
        self.count += 1
        if listing.hint is not None:
            self.hints.append(listing.hint)


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


class Reading:
    """How one layer is read: the bytes kept (:meth:`Wanted.keep`, and the first pyc of the package as a hint of
    the image's Python), and where the read ends (:meth:`until`: past the horizon of a layer in path order)."""

    def __init__(self, wanted: Wanted, settle: Callable[[Layer], None]) -> None:
        self.wanted = wanted
        self.settle = settle  # asked with the layer read so far, once it holds a METADATA of the package
        self.in_package = f"/{wanted.package}/"
        self.hint: str | None = None
        self.metadata = False  # a METADATA kept since the last look
        self.last: tuple[str, ...] = ()
        self.ordered = True
        self.horizon: tuple[str, ...] | None = None
        self.left = False

    def keep(self, path: str) -> bool:
        if self.wanted.keep(path):
            self.metadata = self.metadata or path.endswith("/METADATA")
            return True
        if self.hint is None and path.endswith(".pyc") and self.in_package in path:
            self.hint = path
            return True
        return False

    def until(self, path: str, so_far: Layered) -> bool:
        if self.metadata and self.wanted.site is None:
            self.settle(so_far.layer())  # a site found half-way can end this very layer
        self.metadata = False
        here = key(path)
        self.ordered = self.ordered and here > self.last
        self.last = here
        if self.ordered and self.horizon is None and self.wanted.site is not None:
            self.horizon = self.wanted.horizon()
        self.left = self.ordered and self.horizon is not None and here >= self.horizon
        return self.left


def read_layer(stream: Counted, wanted: Wanted, settle: Callable[[Layer], None]) -> Listing:
    """What one layer's stream holds that matters here; left early where its order allows (``whole`` False)."""
    reading = Reading(wanted, settle)
    source, mode = tar_stream(stream, stream.layer.media_type)
    try:
        layer = from_tar(source, mode=mode, keep=reading.keep, hash_all=False, until=reading.until,
                         where=stream.where)
        if not reading.left:
            stream.finish()
    except EngineError as exc:
        raise BaseImageError(str(exc)) from None
    except STREAM_ERRORS as exc:
        raise BaseImageError(f"{stream.where} is not a readable tar: {exc}") from None
    hint = None
    if reading.hint is not None and reading.hint in layer.kept:
        hint = (posixpath.basename(reading.hint), layer.kept.pop(reading.hint)[:16])
    return Listing(layer, hint, not reading.left)


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


def _candidates(top: Layer, wanted: Wanted) -> dict[str, str]:
    """site folder -> dist-info folder of each installation the layers read show (both parts present)."""
    found: dict[str, str] = {}
    prefix = dist_prefix(wanted.package)
    for path, data in top.kept.items():
        folder, name = posixpath.split(path)
        if name != "METADATA" or not posixpath.basename(folder).lower().startswith(prefix):
            continue
        site = posixpath.dirname(folder)
        meta = shown(top, path)
        init = shown(top, f"{site}/{wanted.package}/__init__.py")
        if isinstance(meta, LayerEntry) and isinstance(init, LayerEntry) and init.kind == "file":
            named = HeaderParser().parsestr(data.decode("utf-8", "replace")).get("Name") or ""
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

    def load(self, digest: str, wanted: Wanted) -> Listing | None: ...

    def keep(self, digest: str, listing: Listing, wanted: Wanted) -> None: ...


def locate(layers: Sequence[LayerRef], opener: Callable[[LayerRef], Blob], package: str, rels: Sequence[str],
           where: str, say: Callable[[str], None] = lambda _l: None, memory: Memory | None = None) -> Located:
    """Read ``layers`` (manifest order) newest first until the package and every file of ``rels`` are decided;
    a layer ``memory`` knows is not read again."""
    wanted = Wanted(package, rels)
    stack = Stack()
    read = 0
    chosen: dict[str, str] = {}

    def settle(reading: Layer | None = None) -> None:
        nonlocal chosen
        chosen = _candidates(stack.top if reading is None else stack.beneath(reading), wanted)
        if len(chosen) > 1:
            raise BaseImageError(f"{where}: {package} is installed in {' and '.join(sorted(chosen))}",
                                 hint="build from the engine: its Python says which one it imports")
        if chosen:
            wanted.site, wanted.dist_info = next(iter(chosen.items()))

    for index in range(len(layers) - 1, -1, -1):
        layer = layers[index]
        label = f"layer {index + 1}/{len(layers)} ({layer.digest[:19]}) of {where}"
        listing = memory.load(layer.digest, wanted) if memory is not None else None
        if listing is not None:
            say(f"    {label}: known from an earlier read (0 of {layer.size} bytes read)")
        else:
            stream = open_stream(opener, layer, label, say)
            try:
                listing = read_layer(stream, wanted, settle)
            finally:
                read += stream.read_bytes
                stream.close()
            say(f"    read {label}: {stream.read_bytes} of {layer.size} bytes"
                f"{'' if listing.whole else ' (left once past the files wanted)'}")
            if memory is not None:
                memory.keep(layer.digest, listing, wanted)
        stack.add(listing)
        settle()
        if wanted.site is not None and all(shown(stack.top, p) is not UNKNOWN for p in wanted.needed()):
            break
    if wanted.site is None:
        raise BaseImageError(f"{where}: no layer holds an installed {package} (a {package}/__init__.py beside a "
                             f"{dist_prefix(package)}*.dist-info whose METADATA names it)")
    return _answer(stack, wanted, chosen[wanted.site], stack.count, read)


def _answer(stack: Stack, wanted: Wanted, dist_info: str, layers_read: int, read: int) -> Located:
    site = wanted.site
    assert site is not None
    top = stack.top
    folders = []
    for path in ancestors(site):
        got = shown(top, path)
        if not isinstance(got, LayerEntry) or got.kind != "dir":
            what = "nothing any layer read states" if got is UNKNOWN else "not a folder"
            raise BaseImageError(f"{path} above {site} is {what}: cannot restate it in the new layer")
        folders.append(Folder(path, got.mode, got.uid, got.gid, got.mtime))
    record = top.kept.get(f"{dist_info}/RECORD") or b""
    listed = _record_paths(record)
    meta = HeaderParser().parsestr((top.kept.get(f"{dist_info}/METADATA") or b"").decode("utf-8", "replace"))
    files: dict[str, dict[str, Any]] = {}
    pycs: dict[str, dict[str, bytes]] = {}
    notes = []
    for rel in wanted.rels:
        files[rel] = _file_info(top, site, rel)
        if files[rel]["kind"] == "file" and rel not in listed:
            notes.append(f"{rel} is not listed in {posixpath.basename(dist_info)}/RECORD")
        pycs[rel] = _pycs(top, site, rel)
    hint = None
    if not any(pycs.values()):
        hint = next(iter(stack.hints), None)
    return Located(site, f"{site}/{wanted.package}", meta.get("Version"), dist_info, tuple(folders), files, pycs,
                   hint, record, layers_read, read, tuple(notes))


def _record_paths(record: bytes) -> set[str]:
    return dist_record.read(record).paths()


def _file_info(top: Layer, site: str, rel: str) -> dict[str, Any]:
    """What the locate probe says of a touched file: kind, mode, whether reached without links, its bytes."""
    path = f"{site}/{rel}"
    for above in ancestors(path)[:-1]:
        got = shown(top, above)
        if isinstance(got, LayerEntry) and got.kind == "link":
            return {"kind": "file", "real": False, "mode": 0, "data": None}
    got = shown(top, path)
    if got is UNKNOWN or got is None:
        return {"kind": "missing", "real": True, "mode": 0, "data": None}
    assert isinstance(got, LayerEntry)
    kind = {"file": "file", "dir": "dir", "link": "symlink"}.get(got.kind, "other")
    data = top.kept.get(path) if kind == "file" else None
    if got.kind == "hardlink":
        raise BaseImageError(f"{path} is a hard link in the base's layers, which a registry read cannot follow",
                             hint="build from the engine (image without --in-registry)")
    return {"kind": kind, "real": True, "mode": got.mode, "data": data}


def _pycs(top: Layer, site: str, rel: str) -> dict[str, bytes]:
    """The bytecode files the image shows for a touched source, by path relative to the site folder."""
    folder = f"{site}/{posixpath.dirname(rel)}/__pycache__"
    stem = posixpath.basename(rel).removesuffix(".py") + "."
    named = sorted(p for p in top.entries if posixpath.dirname(p) == folder
                   and posixpath.basename(p).startswith(stem) and p.endswith(".pyc"))
    return {posixpath.relpath(p, site): top.kept.get(p) or b"" for p in named if isinstance(shown(top, p), LayerEntry)}


def layer_refs(descriptors: Iterable[dict[str, Any]]) -> list[LayerRef]:
    return [LayerRef(str(d["digest"]), str(d.get("mediaType") or ""), int(d["size"])) for d in descriptors]
