"""The pull policy: when a base image is taken from the engine and when it is pulled."""

from __future__ import annotations

from collections.abc import Callable

from ..engine import Engine, ImageInfo
from ..errors import BaseImageError

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
