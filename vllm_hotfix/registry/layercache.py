"""What a registry build learnt of a base layer, kept by the layer's digest: a repeat build reads none of it again.

A layer is content-addressed: what its bytes hold is true for as long as its
digest names it. So the listing :func:`.layerscan.read_layer` makes of a
layer (every path with its kind, mode, owner, time and link target; its
whiteouts and opaque folders; the bytes of the files the build wanted; the
header of a pyc of the package) is kept in the tool's cache under the
layer's digest, through the facts cache's storage (an index only this host
can have written, the bytes as blobs named by their hash). Kept:

* a layer read to its end, whose bytes were checked against its digest:
  reused by any later build on any base that holds it, for any patch set,
  as long as every file that build wants from it has its bytes kept;
* a layer left early, once past every path the build wanted (read in
  part): reused only for the same package and the same touched files (the
  next revision of a patch set), which lie before where it was left.

Anything else reads the layer again, and keeps what that read learnt.
"""

from __future__ import annotations

import base64
import logging
from collections.abc import Sequence
from pathlib import Path

from ..errors import EngineError
from ..journal.cache import Store, host_key
from ..layers import LayerEntry
from ..layers.read import Layered
from .layerscan import Listing, Wanted

log = logging.getLogger(__name__)

FORMAT = 1
NAME = "listing"


def _store(cache: Path, digest: str) -> Store | None:
    key = host_key(cache)
    hexed = digest.removeprefix("sha256:")
    if key is None or len(hexed) != 64 or not all(c in "0123456789abcdef" for c in hexed):
        return None
    return Store(cache / "registry-layers" / hexed, key)


def keep(cache: Path, digest: str, listing: Listing, wanted: Wanted) -> None:
    """Keep what one read of the layer ``digest`` learnt."""
    store = _store(cache, digest)
    if store is None:
        return
    entries = listing.layer.entries.values()
    body = {
        "format": FORMAT, "digest": digest, "whole": listing.whole, "package": wanted.package,
        "rels": sorted(wanted.rels),
        "entries": [[e.path, e.kind, e.mode, e.uid, e.gid, e.mtime, e.target] for e in entries
                    if e.kind != "whiteout"],
        # The layer's marks as it wrote them: read back through the layer reader's rules (Layered).
        "whiteouts": sorted(e.path for e in entries if e.kind == "whiteout"),
        "opaque": sorted(e.path for e in entries if e.kind == "dir" and e.opaque),
        "data": {path: store.put(data) for path, data in listing.layer.kept.items()},
        "hint": [listing.hint[0], base64.b64encode(listing.hint[1]).decode()] if listing.hint else None,
    }
    store.write(NAME, body)


def load(cache: Path, digest: str, wanted: Wanted) -> Listing | None:
    """The listing of layer ``digest`` as an earlier read kept it, when it answers this build; else None."""
    store = _store(cache, digest)
    body = store.read(NAME) if store is not None else None
    if store is None or body is None or body.get("format") != FORMAT or body.get("digest") != digest:
        return None
    whole = body.get("whole") is True
    if not whole and (body.get("package") != wanted.package or body.get("rels") != sorted(wanted.rels)):
        return None  # left early for other files: what this build wants may lie past where it was left
    layer = Layered(f"layer {digest[:19]} as kept")
    try:
        for row in body.get("entries") or []:
            layer.put(LayerEntry(str(row[0]), str(row[1]), mode=int(row[2]), uid=int(row[3]), gid=int(row[4]),
                                 mtime=int(row[5]), target=str(row[6])))
        for path in _strings(body.get("whiteouts")):
            layer.mark("whiteout", path)
        for path in _strings(body.get("opaque")):
            layer.mark("opaque", path)
        hint = body.get("hint")
        kept_hint = (str(hint[0]), base64.b64decode(hint[1])) if hint else None
    except (TypeError, ValueError, IndexError, EngineError):
        return None
    for path, hashed in (body.get("data") or {}).items():
        got = store.get(hashed, f"{path} of layer {digest[:19]}")
        if got is None:
            return None
        layer.kept[path] = got
    try:
        read = layer.layer()
    except EngineError:
        return None  # marks the reader refuses (an opaque mark on a file): read the layer again
    if any(e.kind == "file" and wanted.keep(p) and p not in read.kept for p, e in read.entries.items()):
        return None  # a file this build wants whose bytes the earlier read did not keep
    return Listing(read, kept_hint, whole)


def _strings(values: object) -> Sequence[str]:
    return [str(v) for v in values] if isinstance(values, list) else []


class LayerMemory:
    """:func:`keep` and :func:`load` under one cache folder (a :class:`~.layerscan.Memory`)."""

    def __init__(self, cache: Path) -> None:
        self.cache = cache

    def load(self, digest: str, wanted: Wanted) -> Listing | None:
        return load(self.cache, digest, wanted)

    def keep(self, digest: str, listing: Listing, wanted: Wanted) -> None:
        keep(self.cache, digest, listing, wanted)
