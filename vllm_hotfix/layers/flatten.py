"""Layers laid over each other: the one flattener every reader of an image's files goes through.

What a layer says about the layers below it (the OCI layer format, as
go-containerregistry's ``mutate.Extract`` applies it):

* a whiteout (``.wh.NAME``, an overlay character device 0/0) removes the
  path and everything below it;
* an opaque folder (``.wh..wh..opq``, an overlay ``trusted.overlay.opaque``
  mark) keeps the folder and hides everything below it;
* any entry that is not a folder (a file, a link) replaces what was at its
  path *and everything below it*: a file over a folder leaves none of the
  folder's files behind;
* a folder over a file replaces the file; a folder over a folder changes
  only the folder's own entry, its contents stay;
* a hard link whose target lies in a lower layer gets that file's hash.

The result is the filesystem the image shows: no whiteouts, no opaque
marks. :func:`squash` lays layers over each other the same way but keeps what
they say of the layers under them, and :func:`said` asks it of one path: the
registry scan reads layers newest first and stops once every path it wants
is decided, so it squashes the layers read and asks which paths they decide.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from .entry import Layer, LayerEntry, ancestors, within


def hides(path: str, at: Callable[[str], LayerEntry | None]) -> bool:
    """Whether a layer hides what the layers below hold at ``path`` (an entry of its own at ``path`` aside):
    ``at`` gives the layer's entry at a path (whiteouts and opaque folders included), None where it has none."""
    for above in ancestors(path):
        found = at(above)
        if found is None:
            continue
        if found.kind == "whiteout":
            return True
        if above != path and (found.kind != "dir" or found.opaque):
            return True
    return False


def apply(layer: Layer, entries: dict[str, LayerEntry], kept: dict[str, bytes], under: str | None = None,
          *, marks: bool = False) -> None:
    """Lay one layer over ``entries`` (and the bytes ``kept`` of them), in place; with ``under``, only the
    entries at or below that folder are kept (``entries`` holds no others).

    With ``marks``, ``entries`` is not an image but the layers below squashed into one (:func:`squash`), and
    what the layers say of those under them stays: a whiteout stays an entry, and a folder that replaces a
    removed path or a non-folder, or lies over an opaque one, is opaque."""
    gone: list[str] = []  # the path and everything below it
    emptied: list[str] = []  # everything below it
    hiding: set[str] = set()  # folders that, squashed, hide what lies under the layers below
    for path, entry in layer.entries.items():
        if entry.kind == "whiteout":
            gone.append(path)
        elif entry.kind == "dir":
            if entry.opaque:
                emptied.append(path)
            lower = entries.get(path)
            if lower is not None and lower.kind != "dir":
                gone.append(path)
            if lower is not None and (lower.kind != "dir" or lower.opaque):
                hiding.add(path)
        else:
            gone.append(path)
    if gone or emptied:
        exact = set(gone)
        below = tuple(p.rstrip("/") + "/" for p in [*gone, *emptied])
        for path in [p for p in entries if p in exact or p.startswith(below)]:
            del entries[path]
            kept.pop(path, None)
    for path, entry in layer.entries.items():
        if under is not None and not within(path, under):
            continue
        if entry.kind == "whiteout":
            if marks:
                entries[path] = entry
            continue
        if entry.kind == "dir":
            opaque = marks and (entry.opaque or path in hiding)
            entries[path] = entry if entry.opaque == opaque else replace(entry, opaque=opaque)
            continue
        if entry.kind == "hardlink" and not entry.sha256:
            first = entries.get(entry.target)
            if first is not None and first.kind in ("file", "hardlink"):
                entry = replace(entry, size=first.size, sha256=first.sha256)
        entries[path] = entry
        if path in layer.kept:
            kept[path] = layer.kept[path]


def flatten(layers: Iterable[Layer], below: Mapping[str, LayerEntry] | None = None,
            below_kept: Mapping[str, bytes] | None = None, under: str | None = None) -> Layer:
    """The filesystem ``layers`` (bottom first) make over ``below`` (the flattened layers under them, if any);
    with ``under``, only what lies at or below that folder."""
    entries = {p: e for p, e in (below or {}).items() if under is None or within(p, under)}
    kept = {p: b for p, b in (below_kept or {}).items() if p in entries}
    for layer in layers:
        apply(layer, entries, kept, under)
    return Layer(entries, kept)


def squash(layers: Iterable[Layer]) -> Layer:
    """``layers`` (bottom first) as one layer: what they say together of the layers under them (whiteouts and
    opaque folders kept). Squashed layers are layers: ``squash([lower, squash(upper)])`` is
    ``squash([lower, *upper])``, so a reader that reads newest first lays each layer read under the rest."""
    entries: dict[str, LayerEntry] = {}
    kept: dict[str, bytes] = {}
    for layer in layers:
        if not entries:  # laid over nothing, a layer says what it says (and a large one is copied, not walked)
            entries, kept = dict(layer.entries), dict(layer.kept)
            continue
        apply(layer, entries, kept, marks=True)
    return Layer(entries, kept)


def said(layer: Layer, path: str) -> LayerEntry | None:
    """What ``layer`` (one, or several squashed) says of ``path``: its entry; a whiteout entry where it removes
    what the layers under it hold there (a whiteout of the path or a folder above it, an opaque folder or a
    non-folder above it); None where it says nothing (the layers under it decide)."""
    found = layer.entries.get(path)
    if found is not None:
        return found
    return LayerEntry(path, "whiteout") if hides(path, layer.entries.get) else None
