"""What the tool's builds, rollbacks and stand-ins leave on an engine, and removing it (``prune``).

Removed, where no container uses them:

- untagged images the tool built (they carry its ``io.vllm-hotfix.definition``
  label): a rollback or a rebuild moved their tag to another image. The
  journal still lists them; a later ``rollback --to`` one of them then
  answers that it is no longer in the engine;
- untagged stand-in steps (a stand-in made again left its old image);
- the stand-ins' root file system images (``vllm-hotfix/standin-rootfs:*``,
  about 200 MB each), a cache the next ``standin`` imports again from
  ``build/cache`` in seconds;
- podman's copies of the tool's builds (where podman is installed): ``smoke
  --launcher podman`` moved them into podman's store from the Docker engine
  (or pulled them by digest), and does so again when next asked.

Kept: every other tagged image (a build under its tag, a stand-in base made
on purpose), and the journal.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..building import standin
from ..engine import Engine
from ..engine import labels as L

if TYPE_CHECKING:
    from ..checking.launchers.podman import PodmanLauncher

ROOTFS_REPOSITORY = standin.ROOTFS_REF.partition(":")[0]


@dataclass(frozen=True, slots=True)
class Removable:
    image_id: str
    what: str  # why it may go, in a few words
    size: int  # bytes, as the engine counts them (shared layers counted in each)
    ref: str = ""  # the tag to remove it by (the rootfs cache); empty for an untagged image


def removable(engine: Engine) -> list[Removable]:
    """What :func:`prune` would remove from ``engine``, oldest first."""
    found: dict[str, Removable] = {}
    for label, what in ((L.DEFINITION, "untagged build (a rollback or rebuild moved its tag)"),
                        (L.STANDIN, "untagged stand-in (made again since)")):
        for image in engine.images_listed(label=label, dangling=True):
            found.setdefault(image["Id"], Removable(image["Id"], what, int(image.get("Size") or 0)))
    for image in engine.images_listed(repository=ROOTFS_REPOSITORY):
        for ref in image.get("RepoTags") or ():
            if ref.startswith(f"{ROOTFS_REPOSITORY}:"):
                found.setdefault(image["Id"], Removable(image["Id"], "stand-ins' root file system cache",
                                                        int(image.get("Size") or 0), ref))
    return list(found.values())


def podman_copies(launcher: PodmanLauncher) -> list[Removable]:
    """The tool's builds in podman's store (none where podman is not installed)."""
    if shutil.which(launcher.podman) is None:
        return []
    return [Removable(image_id, "podman's copy of a build (smoke --launcher podman moves it again)", size,
                      ", ".join(names))
            for image_id, names, size in launcher.images_labelled(L.DEFINITION)]


def prune(engine: Engine, say: Callable[[str], None], *, dry_run: bool = False) -> list[Removable]:
    """Remove what :func:`removable` and :func:`podman_copies` list (an image a container still uses stays);
    what was removed."""
    from ..checking.launchers.podman import PodmanLauncher

    podman = PodmanLauncher()
    gone = []
    for item in podman_copies(podman):
        if not dry_run and not podman.remove_image(item.image_id):
            say(f"    kept podman's {item.image_id[:19]}: a container still uses it")
            continue
        say(f"    {'would remove' if dry_run else 'removed'} podman's {item.ref or item.image_id[:19]}: "
            f"{item.what} ({item.size / 1e6:.0f} MB)")
        gone.append(item)
    for item in removable(engine):
        if not dry_run:
            if item.ref:
                engine.remove_image(item.ref, force=False)
            else:
                engine.remove_untagged(item.image_id, force=False)
            if engine.image(item.image_id) is not None and (not item.ref or engine.image(item.ref) is not None):
                say(f"    kept {item.image_id[:19]}: a container or another image still uses it")
                continue
        say(f"    {'would remove' if dry_run else 'removed'} {item.ref or item.image_id[:19]}: {item.what} "
            f"({item.size / 1e6:.0f} MB)")
        gone.append(item)
    return gone
