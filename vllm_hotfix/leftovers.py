"""What a run that died leaves in the engine, found and removed by the next run.

Every container the tool starts is labelled with its owner (``host:pid``), and
every image a build commits is noted, before the build goes on, in a small
file under ``build/runs/`` named for the process. A run that ends normally
removes what it made (or tags it) and deletes its note. A run that was killed,
or that lost the engine, cannot; so each run first sweeps: containers whose
owner process on this host is gone are removed, and the untagged images noted
by dead processes are removed once the engine answers again.
"""

from __future__ import annotations

import json
import logging
import os
import socket
from collections.abc import Callable
from pathlib import Path

from .engine import Engine, owner
from .errors import PipelineError

log = logging.getLogger(__name__)


def runs_dir(root: Path) -> Path:
    return root / "build" / "runs"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_here(owner_label: str) -> bool:
    host, _, pid = owner_label.rpartition(":")
    return host == socket.gethostname() and pid.isdigit() and not _alive(int(pid))


class Pending:
    """This process's note of images it made and has not yet tagged or removed."""

    def __init__(self, root: Path) -> None:
        self.path = runs_dir(root) / f"{owner().replace(':', '-')}.json"
        self.images: list[str] = []

    def add(self, image_id: str) -> None:
        self.images.append(image_id)
        self._write()

    def settle(self, image_id: str) -> None:
        """The image was tagged or removed: no longer this run's to clean up."""
        self.images = [i for i in self.images if i != image_id and not image_id.removeprefix("sha256:")
                       .startswith(i.removeprefix("sha256:"))]
        self._write()

    def clear(self) -> None:
        self.images = []
        self._write()

    def _write(self) -> None:
        try:
            if not self.images:
                self.path.unlink(missing_ok=True)
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"owner": owner(), "images": self.images}) + "\n", encoding="utf-8")
            os.replace(tmp, self.path)
        except OSError as exc:
            # Cleanup bookkeeping must never fail the run itself.
            log.debug("cannot write %s: %s", self.path, exc)


def sweep(engine: Engine, root: Path, say: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Remove containers and untagged images of dead runs; return how many of each."""
    containers = images = 0
    try:
        for label, ids in engine.containers_by_owner().items():
            if _dead_here(label):
                for cid in ids:
                    engine.remove_container(cid)
                    containers += 1
        folder = runs_dir(root)
        for note in sorted(folder.glob("*.json")) if folder.is_dir() else []:
            try:
                data = json.loads(note.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                continue
            if not _dead_here(str(data.get("owner", ""))):
                continue
            for image_id in reversed(data.get("images") or []):
                if engine.image(image_id) is not None:
                    engine.remove_untagged(str(image_id), force=False)
                    images += engine.image(image_id) is None
            note.unlink(missing_ok=True)
    except PipelineError as exc:
        log.debug("sweep of leftovers stopped: %s", exc)
    if say is not None and (containers or images):
        say(f"removed leftovers of interrupted runs: {containers} container(s), {images} image(s)")
    return containers, images
