"""After the build: what was made, judged and pushed, and moving a tag back.

Read from the journal (records.py): every build of a definition with the
newest verdict on its image and every push of it; rollback picks among all of
them and journals the move before making it. A verdict entry that cannot be
read and may be about a build's image leaves that build's verdict unknown:
``list`` shows the file, rollback never picks that build and refuses it by
name when asked for it.

Rollback stays within one platform: a tag moves only among builds whose
image is of its platform (by the image's own config, which must agree with
the journal's record of the build). The output of a multi-platform build
(``TAG-x86_64``, ``TAG-aarch64`` and TAG on the engine's own platform's image)
is rolled back as a whole: each child tag to its own platform's previous
build, and TAG with its platform's child, or nothing moves.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..building import definitions, platforms
from ..building.platforms import Platform
from ..engine import Engine
from ..errors import NothingToRollBack, Refused
from ..journal import records
from ..verdicts import Status

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
    platform: str | None = None  # as the journal recorded it (None: built before it was kept)
    # Verdict entries that may be about this image but cannot be read: while
    # any is there, the image's verdict is not known (the unreadable one may be the newest).
    unreadable: tuple[records.Damaged, ...] = ()

    def as_dict(self) -> dict[str, Any]:
        verdict = "unreadable" if self.unreadable else self.verdict.value if self.verdict else None
        return {
            "image_id": self.image_id, "created": self.created, "output_ref": self.output_ref,
            "record": self.record, "verdict": verdict, "platform": self.platform,
            "gpu_verified": self.gpu_verified,
            "incomplete_runs": self.incomplete_runs, "pushes": list(self.pushes),
            "unreadable": [str(d.path) for d in self.unreadable],
        }


def builds(root: Path, definition: str) -> list[Build]:
    """Distinct images built for ``definition``, newest build first."""
    # Each kind of entry is read once, not once per build.
    all_verdicts, all_pushes = records.load_verdicts(root), records.load(root, "push")
    for d in all_verdicts.damaged:
        records.warn(d)
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
            platform=_recorded_platform(entry.data),
        ))
    return out


def _recorded_platform(data: Any) -> str | None:
    plat = data.get("platform") or (data.get("base") or {}).get("platform")
    return str(plat) if plat else None


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
             ref: str | None = None) -> tuple[Moved, ...]:
    """Point the definition's output tag at an earlier (or the chosen) build of the same platform.

    The output of a multi-platform build moves as a whole (see the module's
    words); every move is planned, and refused, before the first is made.
    """
    defn = definitions.load(root, base_tag)
    made = builds(root, defn.tag)
    if not made:
        raise NothingToRollBack(f"no build records for {defn.tag} under {records.records_dir(root)}",
                            hint="rollback needs recorded builds (python build.py list)")
    if to_image is not None and not any(b.image_id.removeprefix("sha256:").startswith(to_image.removeprefix("sha256:"))
                                        for b in made):
        # Answered from the journal alone, before the engine is asked anything.
        raise NothingToRollBack(f"{to_image}: no build record of {defn.tag} has that image ID",
                                hint=f"python build.py list shows the builds of {defn.tag} and their image IDs")
    if ref is None:
        ref = made[0].output_ref or defn.output_ref()
        parent = platforms.parent_ref(ref)
        if parent is not None and any(b.output_ref == ref for b in made):
            ref = parent[0]  # the newest build was one platform of a multi-platform output: roll all of it
    kids = [] if platforms.parent_ref(ref) is not None else [
        (plat, platforms.child_ref(ref, plat)) for plat in _BOTH
        if any(b.output_ref == platforms.child_ref(ref, plat) for b in made)]
    if kids and not _names_a_child(engine, made, ref, kids, to_image):
        kids = []  # TAG was built alone since its multi-platform build (or --to names such a build): it moves alone
    if not kids:
        return (_move(engine, root, _plan(engine, defn.tag, made, ref, _platform_of_ref(engine, made, ref),
                                          to_image)),)
    if to_image is not None:
        raise Refused(f"{ref} is the output of a multi-platform build ({', '.join(k for _, k in kids)}); "
                      "--to names one platform's image",
                      hint=f"roll one platform back: python build.py rollback --definition {base_tag} --tag "
                           f"{kids[0][1]} --to ID")
    plans = {plat: _plan(engine, defn.tag, made, kid, plat, None) for plat, kid in kids}
    current = engine.image(ref)
    follow = next((pl for pl in plans.values() if current is not None and pl.was == current.id), None)
    moved = [_move(engine, root, pl) for pl in plans.values()]
    if follow is not None:
        # TAG named its platform's child: it follows that child, as `image` left it.
        moved.append(_move(engine, root, Moved(ref, follow.to, follow.was, follow.direction)))
    elif current is not None:
        log.warning("%s names %s, none of its platforms' images; left as it is", ref, current.id[:19])
    return tuple(moved)


_BOTH = (Platform("linux", "amd64"), Platform("linux", "arm64"))


def _names_a_child(engine: Engine, made: list[Build], ref: str, kids: list[tuple[Platform, str]],
                   to_image: str | None) -> bool:
    """Whether ``ref`` is (still) the output of a multi-platform build, to be rolled back with its children.

    Not when it names an image none of the children names (a single-platform build of TAG came later), nor
    when ``--to`` names a build made under TAG itself.
    """
    if to_image is not None:
        want = to_image.removeprefix("sha256:")
        target = next((b for b in made if b.image_id.removeprefix("sha256:").startswith(want)), None)
        if target is not None and target.output_ref == ref:
            return False
    current = engine.image(ref)
    if current is None:
        return True
    return any((info := engine.image(kid)) is not None and info.id == current.id for _, kid in kids)


def _platform_of_ref(engine: Engine, made: list[Build], ref: str) -> Platform | None:
    """The platform a tag is about: its suffix's, else its image's, else its newest build's (None: unknown)."""
    named = platforms.of_tag(ref)
    if named is not None:
        return named
    info = engine.image(ref)
    if info is not None:
        return platforms.of(info.os, info.architecture)
    recorded = next((b.platform for b in made if b.output_ref == ref and b.platform), None)
    return platforms.parse_one(recorded) if recorded else None


def _platform_of_build(engine: Engine, build: Build) -> Platform | None:
    """The platform of a build's image by its own config; None when it is gone or contradicts the journal."""
    info = engine.image(build.image_id)
    if info is None:
        return None
    plat = platforms.of(info.os, info.architecture)
    if plat is None or (build.platform is not None and build.platform != str(plat)):
        log.warning("build %s (%s) is %s/%s, but the journal recorded %s; never picked", build.image_id[:19],
                    build.record, info.os, info.architecture, build.platform)
        return None
    return plat


def _plan(engine: Engine, definition: str, made: list[Build], ref: str, plat: Platform | None,
          to_image: str | None) -> Moved:
    """Where ``ref`` would move: the chosen build, or the newest older one of ``plat`` that may be picked."""
    current = engine.image(ref)
    current_id = current.id if current else None
    order = [b.image_id for b in made]  # newest first
    of_plat = f" of {plat}" if plat is not None else ""
    if to_image is not None:
        want = to_image.removeprefix("sha256:")
        match = [b for b in made if b.image_id.removeprefix("sha256:").startswith(want)]
        if not match:
            raise NothingToRollBack(f"{to_image}: no build record of {definition} has that image ID",
                                    hint=f"python build.py list shows the builds of {definition} and their image IDs")
        target = match[0]
        if engine.image(target.image_id) is None:
            raise NothingToRollBack(f"{target.image_id}: recorded but no longer in the engine",
                                    hint="it was removed (prune, docker rmi): roll to another build (python build.py "
                                         "list), or build it again")
        if target.unreadable:
            raise target.unreadable[0].error()
        if target.verdict is Status.FAIL:
            raise Refused(f"{target.image_id[:19]} failed its newest smoke run; refusing to tag it {ref}")
        got = _platform_of_build(engine, target)
        if plat is not None and got != plat:
            raise Refused(f"{target.image_id[:19]} is {got or 'of no platform the journal agrees on'}, not "
                          f"{plat}; refusing to tag it {ref}")
    else:
        start = order.index(current_id) + 1 if current_id in order else 0
        # A build whose verdict cannot be read is never picked: its newest verdict may be a fail.
        usable = [b for b in made[start:]
                  if b.image_id != current_id and b.verdict is not Status.FAIL and not b.unreadable
                  and engine.image(b.image_id) and (plat is None or _platform_of_build(engine, b) == plat)]
        if not usable:
            raise NothingToRollBack(
                f"no earlier build of {definition} to roll {ref} back to "
                f"(none older{of_plat} whose image is still in the engine and whose smoke did not fail)",
                hint="python build.py list shows every build (and any verdict entry it cannot read)",
            )
        target = usable[0]
    if target.image_id == current_id:
        return Moved(ref, target, current_id, "unchanged")
    direction = "back"
    if current_id in order and order.index(target.image_id) < order.index(current_id):
        direction = "forward"
    return Moved(ref, target, current_id, direction)


def _move(engine: Engine, root: Path, plan: Moved) -> Moved:
    """Journal the move, then make it."""
    if plan.direction != "unchanged":
        records.append(root, "tag", {"ref": plan.ref, "image_id": plan.to.image_id, "from": plan.was,
                                     "why": f"rollback ({plan.direction})"})
        engine.tag(plan.to.image_id, plan.ref)
    return plan
