"""What a run that died leaves in the engine, found and removed by the next run.

Every container the tool starts is labelled with its owner (``host:pid``).
Before a run starts a container, and before a build commits an image, the
run says so in a small note under ``build/runs/`` named for the process; it
updates the note as it removes containers and tags or removes images, and
deletes it once nothing is left. A run that ends normally therefore leaves no
note. A run that was killed, or that lost the engine, leaves its note behind;
so each run first looks for notes of processes on this host that are gone,
and only then asks the engine: it removes the containers whose owner process
is gone and the untagged images those notes name (waiting a few seconds for
a container a note counts that the engine does not show yet: one still in the
making). A run that finds no such note does not ask the engine at all.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..engine import Engine, labels
from ..engine.labels import owner
from ..errors import PipelineError
from .atomic import write_atomic

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


# The folder a launcher stages the runner in (the job, the probes, the patch set's checks).
STAGING = "vllm-hotfix-runner-"
# A build's scratch tree (the base's files and the patch applied to them: building/sources.py).
SCRATCH = "vllm-hotfix-scratch-"


def staging_prefix(kind: str = STAGING) -> str:
    """A staging (or, with ``kind`` :data:`SCRATCH`, scratch) folder's name prefix: the run ID (tests set one)
    and this process's ID, so that the folder of a run that was killed can be told from a live run's and
    removed by the next one."""
    run_id = os.environ.get("VLLM_HOTFIX_RUN_ID", "")
    return f"{kind}{run_id + '-' if run_id else ''}{os.getpid()}-"


def sweep_staging(folder: Path | None = None, *, own: bool = False) -> int:
    """Remove the staging and scratch folders in ``folder`` (the temporary folder) of this user's processes
    that are gone, or with ``own`` those of this process: an interrupted run's last step, for a folder the
    interrupt caught between its making and the code that would have removed it."""
    import re
    import shutil
    import tempfile

    where = Path(folder or tempfile.gettempdir())
    pattern = re.compile(rf"^(?:{re.escape(STAGING)}|{re.escape(SCRATCH)})(?:.+-)?(\d+)-[A-Za-z0-9_]+$")
    removed = 0
    try:
        entries = list(os.scandir(where))
    except OSError:
        return 0
    for entry in entries:
        found = pattern.match(entry.name)
        try:
            if found is None or not entry.is_dir(follow_symlinks=False) or entry.stat().st_uid != os.getuid():
                continue
        except OSError:
            continue
        if (int(found.group(1)) == os.getpid()) if own else not _alive(int(found.group(1))):
            shutil.rmtree(entry.path, ignore_errors=True)
            removed += 1
    return removed


def _dead_here(owner_label: str) -> bool:
    return labels.owner_gone(owner_label)


class Pending:
    """This process's note: images it made and has not yet tagged or removed, containers not yet removed.

    One per process and root (:func:`pending`), shared by every build and
    container of the run, since they all write the same file.
    """

    def __init__(self, root: Path) -> None:
        self.path = runs_dir(root) / f"{owner().replace(':', '-')}.json"
        self.images: list[str] = []
        self.containers = 0  # started and not known to be removed
        self.tags: list[tuple[str, str]] = []  # (reference, image ID): tags made only to name a push

    def add(self, image_id: str) -> None:
        self.images.append(image_id)
        self._write()

    def settle(self, image_id: str) -> None:
        """The image was tagged or removed: no longer this run's to clean up."""
        self.images = [i for i in self.images if i != image_id and not image_id.removeprefix("sha256:")
                       .startswith(i.removeprefix("sha256:"))]
        self._write()

    def clear(self) -> None:
        """Every image noted so far was tagged or removed."""
        self.images = []
        self._write()

    def tag(self, ref: str, image_id: str) -> None:
        """``ref`` is about to be put on ``image_id`` for a while (a push's target): a dead run's is removed."""
        self.tags.append((ref, image_id))
        self._write()

    def untag(self, ref: str) -> None:
        """The temporary tag ``ref`` was removed (or put back as it was)."""
        self.tags = [t for t in self.tags if t[0] != ref]
        self._write()

    def container(self, change: int) -> None:
        """+1 before a container is created, -1 once it is removed (:attr:`Engine.on_container`)."""
        self.containers = max(0, self.containers + change)
        self._write()

    def _write(self) -> None:
        try:
            if not self.images and not self.containers and not self.tags:
                self.path.unlink(missing_ok=True)
                return
            write_atomic(self.path, json.dumps({"owner": owner(), "images": self.images,
                                                "containers": self.containers,
                                                "tags": [list(t) for t in self.tags]}) + "\n")
        except (OSError, PipelineError) as exc:
            # Cleanup bookkeeping must never fail the run itself.
            log.debug("cannot write %s: %s", self.path, exc)


_NOTES: dict[tuple[Path, str], Pending] = {}


def pending(root: Path) -> Pending:
    """This process's note for ``root`` (made on first use)."""
    key = (root, owner())  # the owner too: a forked child is another process
    if key not in _NOTES:
        _NOTES[key] = Pending(root)
    return _NOTES[key]


def watch(engine: Engine, root: Path) -> None:
    """Note in ``root`` every container ``engine`` starts until it is removed."""
    engine.on_container = pending(root).container


def dead_notes(root: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Notes left by processes of this host that are gone (unreadable ones included, as empty)."""
    folder = runs_dir(root)
    try:
        names = sorted(folder.glob("*.json")) if folder.is_dir() else []
    except OSError:
        return []
    found = []
    for note in names:
        try:
            data = json.loads(note.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and _dead_here(str(data.get("owner", ""))):
            found.append((note, data))
    return found


def sweep(engine: Engine, root: Path, say: Callable[[str], None] | None = None) -> tuple[int, int]:
    """Remove containers, push target tags and untagged images of dead runs; return how many containers and images.

    Asks the engine only when a dead run's note is found. A noted tag is
    removed only while it still names the image it was put on.
    """
    containers = images = tags = 0
    notes = dead_notes(root)
    if not notes:
        return 0, 0
    try:
        # A note without the count was written before containers were counted: look anyway.
        if any(data.get("containers", 1) for _note, data in notes):
            containers = _remove_dead_containers(engine, notes)
        for note, data in notes:
            for ref, image_id in _noted_tags(data):
                found = engine.image(ref)
                if found is not None and found.id == image_id:
                    engine.untag(ref)
                    tags += 1
            for image_id in reversed(data.get("images") or []):
                if engine.image(image_id) is not None:
                    engine.remove_untagged(str(image_id), force=False)
                    images += engine.image(image_id) is None
            note.unlink(missing_ok=True)
    except PipelineError as exc:
        log.debug("sweep of leftovers stopped: %s", exc)
    if say is not None and (containers or images or tags):
        say(f"removed leftovers of interrupted runs: {containers} container(s), {images} image(s)"
            + (f", {tags} push tag(s)" if tags else ""))
    return containers, images


# Seconds a sweep waits for containers a dead run counted and the engine does not show yet, looking
# again every LOOK_AGAIN seconds.
IN_THE_MAKING = 5.0
LOOK_AGAIN = 0.5


def _remove_dead_containers(engine: Engine, notes: list[tuple[Path, dict[str, Any]]]) -> int:
    """Remove the containers of dead owners; how many.

    A run that lost an engine frozen mid-create counted a container that the
    engine makes only once it runs again, and a run started at that moment can
    look before it exists: while the notes count more containers than were
    found, look again for up to :data:`IN_THE_MAKING` seconds.
    """
    counted: dict[str, int] = {}
    for _note, data in notes:
        n, who = data.get("containers", 0), str(data.get("owner", ""))
        if isinstance(n, int) and n > 0:
            counted[who] = counted.get(who, 0) + n
    removed: dict[str, int] = {}
    done: set[str] = set()  # asked to remove: one the engine is still removing is listed for a while
    deadline = time.monotonic() + IN_THE_MAKING
    while True:
        for label, ids in engine.containers_by_owner().items():
            if _dead_here(label):
                for cid in ids:
                    if cid not in done:
                        engine.remove_container(cid)
                        done.add(cid)
                        removed[label] = removed.get(label, 0) + 1
        if all(removed.get(owner_label, 0) >= n for owner_label, n in counted.items()) \
                or time.monotonic() > deadline:
            return sum(removed.values())
        time.sleep(LOOK_AGAIN)


def _noted_tags(data: dict[str, Any]) -> list[tuple[str, str]]:
    """The (reference, image ID) pairs a note lists; anything of another shape is skipped."""
    found = data.get("tags")
    if not isinstance(found, list):
        return []
    return [(str(t[0]), str(t[1])) for t in found if isinstance(t, list) and len(t) == 2
            and all(isinstance(x, str) for x in t)]
