"""The pull policy: when a base image is taken from the engine and when it is pulled; and an image that
only its registry holds, pulled by digest for smoke or push."""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..engine import Engine, ImageInfo, split_reference
from ..errors import BaseImageError, PipelineError, PushError

log = logging.getLogger(__name__)

PULL_POLICIES = ("missing", "always", "never")


def resolve(engine: Engine, ref: str, policy: str = "missing", progress: Callable[[str], None] | None = None,
            platform: str | None = None) -> ImageInfo:
    """Find ``ref`` in the engine, pulling only as ``policy`` says (``missing``, ``always``, ``never``)."""
    if policy not in PULL_POLICIES:
        raise BaseImageError(f"unknown pull policy {policy!r}")
    local = engine.image(ref)
    if local is not None and policy != "always":
        return local
    if policy == "never":
        raise BaseImageError(
            f"base image {ref} is not in the engine and --pull never forbids pulling",
            hint=f"load it (docker pull/load {ref}) or use --pull missing",
        )
    engine.pull(ref, progress, platform)
    pulled = engine.image(ref)
    if pulled is None:
        raise BaseImageError(f"pulled {ref} but the engine does not list it")
    return pulled


# -- an image only its registry holds, pulled by digest --------------------------------------------------


def _named_host(name: str) -> str | None:
    first = name.split("/", 1)[0] if "/" in name else ""
    return first if ("." in first or ":" in first or first == "localhost") and first != "docker.io" else None


def pull_missing(engine: Engine, ref: str, recorded: str | None, say: Callable[[str], None], *,
                 index: bool = True) -> str | None:
    """Pull ``ref`` by digest when the engine lacks it and its registry holds it; the reference pulled, else None.

    ``image --in-registry`` leaves its image in the registry only, the
    journal naming its manifest digest (``recorded``). That digest is pulled;
    where no journal entry names one (the GPU host is another machine), the
    digest the registry gives ``ref`` now (for an index, this engine's
    platform's image; ``index`` False refuses an index instead: a push of one
    image must not stand for an index over several). The image keeps ``ref``
    as its local tag, as ``docker pull REF`` would. A reference that names no
    registry host (a Docker Hub name) is never pulled here.
    """
    if engine.image(ref) is not None:
        return None
    name, tag = split_reference(ref)
    host = _named_host(name)
    if host is None:
        return None
    digest, source = recorded, "the journal's build"
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


_MACHINES = {"x86_64": "amd64", "aarch64": "arm64"}


def _asked(engine: Engine, host: str, name: str, tag: str, index: bool) -> str | None:
    """The digest ``name:tag`` resolves to in its registry (None: it has no such tag, or cannot be asked)."""
    from . import client  # here: a pull policy alone never needs requests

    try:
        found = client.client_for(engine, host).manifest(name.split("/", 1)[1], tag)
    except PipelineError as exc:
        # Not "not in the engine - build it": the engine lacks it and where it may be cannot be asked.
        raise BaseImageError(f"{name}:{tag} is not in the engine, and its registry {host} cannot be asked for it: "
                             f"{exc}", hint=f"check that {host} answers (and the login), or pull the image first") \
            from exc
    if found is None or not found.is_index:
        return found.digest if found is not None else None
    if not index:
        raise PushError(f"{name}:{tag} is an index in its registry, over one image per platform",
                        hint=f"smoke each platform's image ({name}:{tag}-<machine>) and push them with --platform")
    own = _MACHINES.get(engine.arch, engine.arch)
    for child in client.children(found):
        if child.os == "linux" and _MACHINES.get(child.architecture, child.architecture) == own:
            return child.digest
    raise BaseImageError(f"{name}:{tag} is an index with no linux/{own} image for this engine")
