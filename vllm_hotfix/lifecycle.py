"""After the build: what was made, judged and pushed, and moving a tag back.

Read from the journal (records.py): every build of a definition with the
newest verdict on its image and every push of it; rollback picks among all of
them and journals the move before making it. A verdict entry that cannot be
read and may be about a build's image leaves that build's verdict unknown:
``list`` shows the file, rollback never picks that build and refuses it by
name when asked for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import definitions, records
from .engine import Engine
from .errors import NothingToRollBack, Refused
from .verdicts import Status

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Build:
    """One image a definition produced, with what happened to it since."""

    image_id: str
    created: str
    output_ref: str
    record: str
    verdict: Status | None  # pass, fail, or None when never judged
    gpu_verified: bool
    incomplete_runs: int
    pushes: tuple[dict[str, str], ...]
    # Verdict entries that may be about this image but cannot be read: while
    # any is there, the image's verdict is not known (the unreadable one may be the newest).
    unreadable: tuple[records.Damaged, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        verdict = "unreadable" if self.unreadable else self.verdict.value if self.verdict else None
        return {
            "image_id": self.image_id, "created": self.created, "output_ref": self.output_ref,
            "record": self.record, "verdict": verdict,
            "gpu_verified": self.gpu_verified,
            "incomplete_runs": self.incomplete_runs, "pushes": list(self.pushes),
            "unreadable": [str(d.path) for d in self.unreadable],
        }


def builds(root: Path, definition: str) -> list[Build]:
    """Distinct images built for ``definition``, newest build first."""
    # Each kind of entry is read once, not once per build.
    all_verdicts, all_pushes = records.load_verdicts(root), records.load(root, "push")
    for d in all_verdicts.damaged:
        log.warning("journal entry %s %s", d.path, d.why)
    out: list[Build] = []
    seen: set[str] = set()
    for entry in records.builds(root, definition):
        if entry.image_id in seen:
            continue
        seen.add(entry.image_id)
        unreadable = tuple(all_verdicts.damaged_for(entry.image_id))
        judged, newer_incomplete = None, []
        if not unreadable:
            judged = records.judgement(root, entry.image_id, all_verdicts)
            newer_incomplete = [
                v for v in records.verdicts(root, entry.image_id, all_verdicts)
                if not v.verdict.judged and (judged is None or v.seq > judged.seq)
            ]
        out.append(Build(
            image_id=entry.image_id,
            created=entry.created,
            output_ref=str(entry.data.get("output_ref", "")),
            record=entry.path.name,
            verdict=judged.verdict.status if judged else None,
            gpu_verified=bool(judged and judged.verdict.gpu_verified),
            incomplete_runs=len(newer_incomplete),
            pushes=tuple(
                {"ref": str(p.data.get("ref")), "digest": str(p.data.get("digest")), "at": p.created}
                for p in records.pushes(root, entry.image_id, all_pushes)
            ),
            unreadable=unreadable,
        ))
    return out


def overview(root: Path) -> list[dict[str, Any]]:
    """Per definition: its base, patch set and every build (see :func:`builds`)."""
    rows = []
    for defn in definitions.load_all(root):
        series = root / "patches" / defn.patch_set / "series"
        names = [ln.split("#", 1)[0].strip() for ln in series.read_text(encoding="utf-8").splitlines()] \
            if series.is_file() else []
        rows.append({
            "definition": defn.tag,
            "base": defn.base_ref(),
            "patch_set": defn.patch_set,
            "patches": [n for n in names if n],
            "builds": [b.as_dict() for b in builds(root, defn.tag)],
        })
    return rows


@dataclass(frozen=True, slots=True)
class Moved:
    ref: str
    to: Build
    was: str | None
    direction: str  # "back", "forward" or "unchanged"


def rollback(engine: Engine, root: Path, base_tag: str, to_image: str | None = None,
             ref: str | None = None) -> Moved:
    """Point the definition's output tag at an earlier (or the chosen) build."""
    defn = definitions.load(root, base_tag)
    made = builds(root, defn.tag)
    if not made:
        raise NothingToRollBack(f"no build records for {defn.tag} under {records.records_dir(root)}",
                            hint="rollback needs recorded builds (python build.py list)")
    ref = ref or made[0].output_ref or defn.output_ref()
    current = engine.image(ref)
    current_id = current.id if current else None
    order = [b.image_id for b in made]  # newest first
    if to_image is not None:
        want = to_image.removeprefix("sha256:")
        match = [b for b in made if b.image_id.removeprefix("sha256:").startswith(want)]
        if not match:
            raise NothingToRollBack(f"{to_image}: no build record of {defn.tag} has that image ID")
        target = match[0]
        if engine.image(target.image_id) is None:
            raise NothingToRollBack(f"{target.image_id}: recorded but no longer in the engine")
        if target.unreadable:
            raise target.unreadable[0].error()
        if target.verdict is Status.FAIL:
            raise Refused(f"{target.image_id[:19]} failed its newest smoke run; refusing to tag it {ref}")
    else:
        start = order.index(current_id) + 1 if current_id in order else 0
        # A build whose verdict cannot be read is never picked: its newest verdict may be a fail.
        usable = [b for b in made[start:]
                  if b.image_id != current_id and b.verdict is not Status.FAIL and not b.unreadable
                  and engine.image(b.image_id)]
        if not usable:
            raise NothingToRollBack(
                f"no earlier build of {defn.tag} to roll {ref} back to "
                "(none older whose image is still in the engine and whose smoke did not fail)",
                hint="python build.py list shows every build (and any verdict entry it cannot read)",
            )
        target = usable[0]
    if target.image_id == current_id:
        return Moved(ref, target, current_id, "unchanged")
    direction = "back"
    if current_id in order and order.index(target.image_id) < order.index(current_id):
        direction = "forward"
    records.append(root, "tag", {"ref": ref, "image_id": target.image_id, "from": current_id,
                                 "why": f"rollback ({direction})"})
    engine.tag(target.image_id, ref)
    return Moved(ref, target, current_id, direction)
