"""An image that lives only in a registry, pulled by digest for smoke or push.

``image --in-registry`` leaves nothing in any engine: its image is in the
registry, and the journal names its manifest digest. ``smoke REF`` (and
``push REF``) of an image the engine lacks pulls exactly that digest: the
one the journal recorded for REF, else, where no journal entry names it
(the GPU host is another machine), the digest the registry gives REF now
(for an index, this engine's platform's). The pulled image keeps REF as
its local tag, as ``docker pull REF`` would, so that the commands that
follow find it by name. A reference that names no registry host (a Docker
Hub name) is never pulled here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from . import platforms, records, registry
from .engine import Engine, split_reference
from .errors import BaseImageError, PipelineError, PushError

log = logging.getLogger(__name__)


def recorded_digest(root: Path, ref: str) -> str | None:
    """The manifest digest the journal's newest registry build of ``ref`` names (by its tag or its digest)."""
    name, tag = split_reference(ref)
    for entry in records.builds(root):
        where = entry.data.get("registry")
        if not isinstance(where, dict) or not str(where.get("digest") or "").startswith("sha256:"):
            continue
        built = str(entry.data.get("output_ref") or "")
        if built == ref or (tag.startswith("sha256:") and tag == where["digest"]
                            and split_reference(built)[0] == name):
            return str(where["digest"])
    return None


def _named_host(name: str) -> str | None:
    first = name.split("/", 1)[0] if "/" in name else ""
    return first if ("." in first or ":" in first or first == "localhost") and first != "docker.io" else None


def pull_missing(engine: Engine, root: Path, ref: str, say: Callable[[str], None], *, index: bool = True
                 ) -> str | None:
    """Pull ``ref`` by digest if the engine lacks it and a registry holds it; the reference pulled, else None.

    ``index``: an index in the registry stands for this engine's platform's image (smoke of one platform);
    False refuses it (a push of one image must not stand for an index over several).
    """
    if engine.image(ref) is not None:
        return None
    name, tag = split_reference(ref)
    host = _named_host(name)
    if host is None:
        return None
    digest = recorded_digest(root, ref)
    source = "the journal's build"
    if digest is None:
        digest, source = _asked(engine, host, name, tag, index), "the registry"
    if digest is None:
        return None
    pinned = f"{name}@{digest}"
    say(f"==> {ref} is not in the engine: pulling {pinned} (the digest {source} names)")
    engine.pull(pinned, say)
    info = engine.image(pinned)
    if info is None:
        raise BaseImageError(f"pulled {pinned} but the engine does not list it")
    if not tag.startswith("sha256:"):
        engine.tag(info.id, ref)
    return pinned


def _asked(engine: Engine, host: str, name: str, tag: str, index: bool) -> str | None:
    path = name.split("/", 1)[1]
    try:
        found = registry.client_for(engine, host).manifest(path, tag)
    except PipelineError as exc:
        log.info("cannot ask %s for %s:%s: %s", host, name, tag, exc)
        return None
    if found is None:
        return None
    if not found.is_index:
        return found.digest
    if not index:
        raise PushError(f"{name}:{tag} is an index in its registry, over one image per platform",
                        hint=f"smoke each platform's image ({name}:{tag}-<machine>) and push them with --platform")
    own = platforms.native(engine)
    for child in registry.children(found):
        if platforms.of(child.os, child.architecture, child.variant) == own:
            return child.digest
    raise BaseImageError(f"{name}:{tag} is an index with no {own} image for this engine")
