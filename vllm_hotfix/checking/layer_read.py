"""A layer's entries as the host reads them: from an overlay folder, a layer tar, or the builder's own entries.

What :mod:`.identity` compares: each path a layer adds, changes or removes,
with its kind, permission bits, sha256 (a file) or target (a link); a
whiteout for a removed path and the opaque mark of a folder that hides the
layers below. Owners and times are left out (they are the builder's
business). The bytes of a small file in a ``bin`` folder are kept with its
entry (a launcher pip writes, judged by :mod:`.pin_layer`). Layers are read
where the image is: the engine's overlay2 folders (podman's overlay ones)
where this host can read them, else a ``save`` export of the image, every
layer streaming past and the ones wanted told by their diff ID.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import IO

from ..engine import Engine, ImageInfo
from ..errors import EngineError
from ..tarball import Entry, marker
from .layer_facts import hash_file, is_whiteout, layer_folders, opaque_state

CHUNK = 1 << 20
SCRIPT_MAX = 1 << 16


@dataclass(frozen=True, slots=True)
class Node:
    """One entry of a layer: what it adds, changes or removes at its path."""

    kind: str  # file, dir, link, whiteout, other
    mode: int = 0
    sha256: str = ""
    target: str = ""
    opaque: bool = False  # a folder that hides everything the layers below had in it
    data: bytes | None = field(default=None, compare=False, repr=False)  # a small file in a bin folder

    def same(self, other: Node) -> bool:
        if self.kind != other.kind:
            return False
        if self.kind == "file":
            return (self.sha256, self.mode) == (other.sha256, other.mode)
        if self.kind == "dir":
            return (self.mode, self.opaque) == (other.mode, other.opaque)
        if self.kind == "link":
            return self.target == other.target
        return self.kind == "whiteout"

    def show(self) -> str:
        if self.kind == "file":
            return f"a file, mode {self.mode:o}, sha256 {self.sha256[:12]}"
        if self.kind == "dir":
            return f"a folder, mode {self.mode:o}" + (", opaque" if self.opaque else "")
        if self.kind == "link":
            return f"a link to {self.target}"
        if self.kind == "whiteout":
            return "removed"
        return "a device, socket or fifo"


Layer = dict[str, Node]  # path (no leading "/") -> what the layer holds there


def _sha256(fh: IO[bytes]) -> str:
    digest = hashlib.sha256()
    while block := fh.read(CHUNK):
        digest.update(block)
    return digest.hexdigest()


def _small_script(path: str, size: int) -> bool:
    """Whether a file's bytes are kept with its entry: a launcher pip may write (a file in a ``bin`` folder)."""
    return posixpath.basename(posixpath.dirname(path)) == "bin" and size <= SCRIPT_MAX


def from_folder(folder: str) -> Layer:
    """A layer as an overlay2 folder holds it (a whiteout is a character device 0/0)."""
    out: Layer = {}
    for top, dirs, files in os.walk(folder):
        for name in dirs + files:
            full = os.path.join(top, name)
            rel = os.path.relpath(full, folder).replace(os.sep, "/")
            st = os.lstat(full)
            mode = stat.S_IMODE(st.st_mode)
            if is_whiteout(st):
                out[rel] = Node("whiteout")
            elif stat.S_ISDIR(st.st_mode):
                # An attribute that cannot be read counts as no opaque mark, as it always did here.
                out[rel] = Node("dir", mode, opaque=opaque_state(full) is True)
            elif stat.S_ISLNK(st.st_mode):
                out[rel] = Node("link", target=os.readlink(full))
            elif stat.S_ISREG(st.st_mode):
                digest, data = hash_file(full, _small_script(rel, st.st_size))
                out[rel] = Node("file", mode, digest, data=data)
            else:
                out[rel] = Node("other", mode)
    return out


def from_tar(fh: IO[bytes]) -> Layer:
    """A layer as its tar holds it (``.wh.NAME`` removes NAME, ``.wh..wh..opq`` makes its folder opaque)."""
    out: Layer = {}
    with tarfile.open(fileobj=fh, mode="r|*") as tar:
        for member in tar:
            name = posixpath.normpath("/" + member.name).lstrip("/")
            if not name:
                continue
            marks = marker(name)
            if marks is not None and marks[0] == "opaque":
                out[marks[1]] = replace(out.get(marks[1], Node("dir", 0o755)), opaque=True)
            elif marks is not None:
                out[marks[1]] = Node("whiteout")
            elif member.isdir():
                out[name] = Node("dir", member.mode & 0o7777, opaque=out.get(name, Node("dir")).opaque)
            elif member.issym():
                out[name] = Node("link", target=member.linkname)
            elif member.islnk():
                target = out.get(posixpath.normpath("/" + member.linkname).lstrip("/"))
                out[name] = Node("file", member.mode & 0o7777, target.sha256 if target else "")
            elif member.isreg():
                body = tar.extractfile(member)
                data = body.read() if body is not None and _small_script(name, member.size) else None
                digest = hashlib.sha256(data).hexdigest() if data is not None else _sha256(body) if body else ""
                out[name] = Node("file", member.mode & 0o7777, digest, data=data)
            else:
                out[name] = Node("other", member.mode & 0o7777)
    return out


def from_entries(entries: Iterable[Entry]) -> Layer:
    """A layer as the tool's own builders write it (:class:`~vllm_hotfix.tarball.Entry` list)."""
    out: Layer = {}
    for e in entries:
        marks = marker(e.name)
        if marks is not None and marks[0] == "whiteout":
            out[marks[1]] = Node("whiteout")
        elif e.data is None:
            out[e.name] = Node("dir", e.mode & 0o7777)
        else:
            out[e.name] = Node("file", e.mode & 0o7777, hashlib.sha256(e.data).hexdigest())
    return out


LayerSource = Callable[[int], list[Layer]]  # the top N layers of the image judged, bottom first


def layers_above(engine: Engine, image: ImageInfo, count: int) -> list[Layer]:
    """The top ``count`` layers of ``image``, bottom first: from the engine's overlay2 folders where this host
    can read them, else from the engine's export of the image."""
    folders = layer_folders(image)
    if folders is not None:
        return [from_folder(f) for f in folders[len(folders) - count:]]
    return from_export(engine.export_layers(image.id), image, count)


class _Hashing:
    """A reader that hashes what passes through it (a layer's diff ID is the sha256 of its tar)."""

    def __init__(self, inner: IO[bytes]) -> None:
        self.inner = inner
        self.digest = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.inner.read(n)
        self.digest.update(data)
        return data


def from_folders_or(export: Callable[[], Iterable[IO[bytes]]]) -> Callable[[ImageInfo, int], list[Layer]]:
    """A reader of an image's top layers: its overlay folders where this host can read them (the Docker engine's
    overlay2, podman's overlay), else ``export`` (a ``save`` of the image, every layer streaming past)."""
    def read(image: ImageInfo, count: int) -> list[Layer]:
        folders = layer_folders(image, ("overlay2", "overlay"))
        if folders is not None:
            return [from_folder(f) for f in folders[len(folders) - count:]]
        return from_export(export(), image, count)
    return read


def from_export(blobs: Iterable[IO[bytes]], image: ImageInfo, count: int) -> list[Layer]:
    """The top ``count`` layers from a ``save`` export of the image (every layer streams past; the ones wanted
    are told by their diff ID, the sha256 of the uncompressed tar)."""
    diff_ids = [str(d) for d in ((image.attrs or {}).get("RootFS") or {}).get("Layers") or []]
    wanted = set(diff_ids[len(diff_ids) - count:])
    found: dict[str, Layer] = {}
    for blob in blobs:
        hashing = _Hashing(blob)
        try:
            layer = from_tar(hashing)  # type: ignore[arg-type]
        except tarfile.TarError:
            continue  # an OCI layout's config or manifest blob
        while hashing.read(CHUNK):
            pass
        diff = "sha256:" + hashing.digest.hexdigest()
        if diff in wanted:
            found[diff] = layer
    missing = [d for d in diff_ids[len(diff_ids) - count:] if d not in found]
    if missing:
        raise EngineError(f"the engine's export of {image.id[:19]} lacks layer {missing[0][:19]}")
    return [found[d] for d in diff_ids[len(diff_ids) - count:]]
