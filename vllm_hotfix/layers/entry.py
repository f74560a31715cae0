"""One entry of an image layer, and a layer as the host reads it.

Every reader of layers (an overlay folder, a tar stream, a registry blob,
an engine's export or archive) gives the same :class:`LayerEntry`, and the
flattener (:mod:`.flatten`) lays them over each other. A layer keeps its
whiteouts and opaque folders as entries (``kind`` "whiteout", ``opaque``
True): they are what it says about the layers below; the filesystem an
image shows (a flattened stack) holds neither.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

KINDS = ("file", "dir", "link", "hardlink", "whiteout", "other")


@dataclass(frozen=True, slots=True)
class LayerEntry:
    """What a layer holds at one path (or, flattened, what the image shows there).

    The first seven fields are in the order the facts cache keeps them
    (:mod:`vllm_hotfix.sitefacts.layer_facts`)."""

    path: str  # absolute, normalised: "/usr/lib/x"
    kind: str  # one of KINDS; "link" is a symbolic link, "hardlink" a second name of a file
    size: int = 0
    sha256: str = ""  # hex, of a file's bytes (a hard link's: its target's, once known)
    target: str = ""  # a symbolic link's target as written; a hard link's target path (absolute)
    mode: int = 0  # permission bits
    mtime: int = 0
    uid: int = 0
    gid: int = 0
    opaque: bool = False  # a folder that hides everything the layers below hold in it


@dataclass(frozen=True, slots=True)
class Layer:
    """The entries of one layer by path, and the bytes of the files its reader was asked to keep."""

    entries: dict[str, LayerEntry] = field(default_factory=dict)
    kept: dict[str, bytes] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Folder:
    """A folder above the site folder as the image shows it: what a layer writing below it must restate."""

    path: str
    mode: int
    uid: int
    gid: int
    mtime: int


def in_words(entry: LayerEntry) -> str:
    """What an entry is, as a verdict names it."""
    if entry.kind in ("file", "hardlink"):
        return f"a file, mode {entry.mode:o}, sha256 {entry.sha256[:12]}"
    if entry.kind == "dir":
        return f"a folder, mode {entry.mode:o}" + (", opaque" if entry.opaque else "")
    if entry.kind == "link":
        return f"a link to {entry.target}"
    if entry.kind == "whiteout":
        return "removed"
    return "a device, socket or fifo"


def ancestors(path: str) -> list[str]:
    """``/a/b/c`` -> [/a, /a/b, /a/b/c]."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[:i]) for i in range(1, len(parts) + 1)] if parts != [""] else []


def within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or lies below it."""
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def absolute(name: str, root: str = "/") -> str:
    """A member name as an absolute, normalised path (``./a//b/`` -> ``/a/b``; ``..`` never climbs past /)."""
    path = posixpath.normpath("/" + name)
    if path.startswith("//"):  # the one double slash normpath keeps
        path = "/" + path.lstrip("/")
    return path if root == "/" else posixpath.normpath(posixpath.join(root, path.lstrip("/")))
