"""Overlay volumes: a host folder a container sees whole but cannot change.

The engine's ``local`` volume driver mounts an overlay file system when the
container starts: ``lowerdir`` is the shared folder (read, never written),
``upperdir`` a private folder that takes every write, ``workdir`` the
overlay's own scratch on the upper's file system. The engine (root) does the
mount, so neither this tool nor the container needs a mount privilege.
A volume is labelled with its owner (host:pid) like the containers this
tool starts: one a killed run left is removed by the next run that makes one.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from . import labels
from .model import Seam

log = logging.getLogger(__name__)

ROLE = "compile-cache"


def _sweep(engine: Seam) -> None:
    """Remove the overlay volumes of this host's runs that are gone."""
    with engine.translating("listing overlay volumes"):
        found = engine.sdk.volumes.list(filters={"label": f"{labels.ROLE}={ROLE}"})
    for volume in found:
        if labels.owner_gone(str((volume.attrs.get("Labels") or {}).get(labels.OWNER, ""))):
            try:
                with engine.translating(f"removing volume {volume.name}"):
                    volume.remove(force=True)
            except Exception as exc:  # noqa: BLE001 - a volume still in use is left for a later sweep
                log.debug("overlay volume %s kept: %s", volume.name, exc)


@contextmanager
def overlay(engine: Seam, lower: Path, upper: Path, work: Path) -> Iterator[str]:
    """A volume of ``lower`` read-only under the writable ``upper`` (``work`` on the same file system), by name,
    for a container's mounts; removed on leaving. ``lower`` is never written through it."""
    _sweep(engine)
    name = f"vllm-hotfix-cache-{uuid.uuid4().hex[:16]}"
    options = {"type": "overlay", "device": "overlay",
               "o": f"lowerdir={lower},upperdir={upper},workdir={work}"}
    with engine.translating(f"making the overlay volume over {lower}"):
        volume = engine.sdk.volumes.create(name=name, driver="local", driver_opts=options,
                                           labels={**labels.for_container(ROLE)})
    try:
        yield name
    finally:
        try:
            with engine.translating(f"removing volume {name}"):
                volume.remove(force=True)
        except Exception as exc:  # noqa: BLE001 - removed by the next run's sweep
            log.warning("could not remove the overlay volume %s: %s", name, exc)
