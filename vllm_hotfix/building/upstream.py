"""``check-upstream``: which patches of a set does a newer release still need?

For each patch of patch set TAG, against the files of base NEWTAG, one of:

* ``needed``: it applies forward with zero fuzz, so NEWTAG lacks it;
* ``included``: every hunk is already there (NEWTAG ships the fix: drop it);
* ``conflicts``: neither; the patch must be rewritten, or the file moved.

The answer rests on :func:`patches.classify`, which avoids the GNU patch trap
(``patch -R --dry-run --batch`` says "applied" of a file that lacks the patch).
A wrong "included" would tell ops to drop a fix they still need.

The files come either from the release's image (read by the image's own
Python, without the version check ``image`` makes) or from the release's PyPI
wheel, which holds the same ``vllm/**/*.py`` and is a fraction of the size.
"""

from __future__ import annotations

import functools
import logging
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import Engine, split_reference
from ..errors import PipelineError, UpstreamError
from ..registry import client as registry
from ..registry.pulling import resolve
from . import base, definitions, pins, platforms, sources, wheels
from . import patches as patchlib
from .platforms import Platform

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Verdict:
    patch: str
    verdict: str  # patches.NEEDED, INCLUDED or CONFLICTS
    files: tuple[str, ...]
    detail: str = ""


@dataclass(frozen=True)
class Report:
    patch_set: str
    base: str
    source: str  # where the files came from, in words
    package: str
    package_version: str | None
    verdicts: tuple[Verdict, ...]
    pins: tuple[dict[str, str], ...] = ()

    def by_verdict(self, verdict: str) -> list[str]:
        return [v.patch for v in self.verdicts if v.verdict == verdict]

    def pins_by_verdict(self, verdict: str) -> list[str]:
        return [p["pin"] for p in self.pins if p.get("verdict") == verdict]

    @property
    def carries_every_patch(self) -> bool:
        return bool(self.verdicts) and len(self.by_verdict(patchlib.INCLUDED)) == len(self.verdicts)

    @property
    def needs_hotfix(self) -> bool:
        """False only when the release carries every patch and requires every pinned version itself.

        A pin the release merely allows, or does not constrain, is still work
        the set does; one it contradicts needs a person: neither is "no hotfix".
        """
        return not self.carries_every_patch or any(p.get("verdict") != "included" for p in self.pins)

    def as_dict(self) -> dict[str, Any]:
        return {
            "patch_set": self.patch_set,
            "base": self.base,
            "source": self.source,
            "package": self.package,
            "package_version": self.package_version,
            "patches": [
                {"name": v.patch, "verdict": v.verdict, "files": list(v.files), "detail": v.detail}
                for v in self.verdicts
            ],
            "pins": list(self.pins),
        }


@dataclass(frozen=True)
class SetContext:
    """What a patch set's image definition says: package, Python, repository."""

    package: str
    python: str
    repository: str


def set_context(root: Path, patch_set: str, base_tag: str | None = None) -> SetContext:
    """The package and Python of the definition that uses ``patch_set``.

    The base repository comes from NEWTAG's own definition when there is one,
    else from the patch set's; a patch set no definition uses gets defaults.
    """
    package, python, repository = "vllm", "python3", definitions.DEFAULT_REPOSITORY
    for defn in definitions.load_all(root):
        if defn.patch_set == patch_set:
            package, python, repository = defn.package, defn.python, defn.base_repository
            break
    if base_tag is not None and definitions.definition_path(root, base_tag).is_file():
        repository = definitions.load(root, base_tag).base_repository
    return SetContext(package, python, repository)


def classify_series(
    patches: list[patchlib.Patch], files: dict[str, bytes | None], where: str
) -> list[Verdict]:
    """Judge each patch in order against copies of ``files`` in a scratch folder.

    A needed patch is applied before the next is judged, as a rebase would:
    a later patch may build on an earlier one.
    """
    out: list[Verdict] = []
    with sources.scratch_tree(files) as work:
        for patch in patches:
            missing = [rel for rel in patch.files if files.get(rel) is None]
            if missing:
                out.append(
                    Verdict(
                        patch.name,
                        patchlib.CONFLICTS,
                        patch.files,
                        f"{where} has no regular file {', '.join(missing)}",
                    )
                )
                continue
            verdict, raw = patchlib.classify(patch, work)
            detail = ""
            if verdict == patchlib.NEEDED:
                patchlib.apply_series([patch], work)
                detail = "applies with zero fuzz"
            elif verdict == patchlib.INCLUDED:
                detail = f"{where} already carries every hunk"
            else:
                err = patchlib.explain_failure(patch, work, raw)
                detail = str(err).removeprefix(f"{patch.name}: ")
            out.append(Verdict(patch.name, verdict, patch.files, detail))
    return out


def platform_base(engine: Engine, ref: str, plat: Platform, pull: str) -> str:
    """``ref``'s image for ``plat``: its index entry by digest, or ``ref`` itself when it is not an index."""
    platforms.require_engine(engine, plat)
    if pull == "never":
        return ref
    try:
        found = registry.read_index(engine, ref)
    except PipelineError as exc:
        if engine.image(ref) is None:
            raise UpstreamError(f"cannot read {ref} from its registry: {exc}") from exc
        return ref
    if found is None or not found.is_index:
        return ref
    repo, _ = split_reference(ref)
    for child in registry.children(found):
        if platforms.of(child.os, child.architecture, child.variant) == plat:
            return f"{repo}@{child.digest}"
    raise UpstreamError(f"{ref} is an index without a {plat} image")


def check(
    root: Path,
    patch_set: str,
    base_tag: str,
    *,
    engine: Callable[[], Engine] | None = None,
    base_repo: str | None = None,
    pull: str = "missing",
    from_wheel: bool = False,
    progress: Progress | None = None,
    platform: Platform | None = None,
) -> Report:
    """Classify every patch of ``patch_set`` against release ``base_tag`` (its ``platform`` image or wheel).

    ``engine`` is a factory, so that ``from_wheel`` never needs a Docker engine.
    """
    say = progress or log.info
    ctx = set_context(root, patch_set, base_tag)
    patches = patchlib.load_series(root, patch_set, ctx.package)
    rels = base.touched_files(patches)
    if from_wheel:
        version = definitions.version_from_tag(base_tag)
        wheel = wheels.release(root, version, say, platform)
        found, files = sources.wheel_files(wheel, ctx.package, rels)
        if found is not None and found != version:
            raise UpstreamError(f"{wheel}: holds {ctx.package} {found}, not {version}")
        source = f"wheel {wheel.name}"
        where = f"{ctx.package} {version} (wheel)"
        requires_of = functools.partial(wheel_requires, wheel, ctx.package)
    else:
        if engine is None:
            raise UpstreamError("check-upstream needs a Docker engine unless --from-wheel")
        ref = f"{base_repo or ctx.repository}:{base_tag}"
        eng = engine()
        if platform is not None:
            ref = platform_base(eng, ref, platform, pull)
        info = resolve(eng, ref, pull, say, str(platform) if platform else None)
        if platform is not None and platforms.of(info.os, info.architecture) != platform:
            raise UpstreamError(f"{ref} is {info.os}/{info.architecture}, not {platform}")
        if definitions.definition_path(root, base_tag).is_file():
            # NEWTAG's own definition pins its base: a release judged is the one it pins, never a moved tag.
            definitions.load(root, base_tag).check_base(
                info.id, definitions.platform_text(info.os, info.architecture, info.variant), ref)
        facts, files = sources.image_files(eng, ctx.package, ctx.python, ref, info, rels, sources.cache_dir(root))
        found = facts.version
        source = f"image {ref} ({info.id})"
        where = ref
        requires_of = functools.partial(image_requires, eng, info.id, ctx)
    say(f"==> {len(patches)} patch(es) of {patch_set} against {ctx.package} {found or '?'} from {source}")
    verdicts = classify_series(patches, files, where)
    pinset = pins.load(root, patch_set, ctx.package)
    judged: list[dict[str, str]] = []
    if pinset is not None:
        judged = pins.judge_release(pinset, requires_of(), f"{ctx.package} {found or base_tag}")
    return Report(patch_set, base_tag, source, ctx.package, found, tuple(verdicts), tuple(judged))


def wheel_requires(wheel: Path, package: str) -> list[str]:
    """The ``Requires-Dist`` lines of a release's wheel."""
    with zipfile.ZipFile(wheel) as zf:
        meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if meta is None:
            raise UpstreamError(f"{wheel.name}: no METADATA")
        text = zf.read(meta).decode("utf-8", "replace")
    return [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Requires-Dist:")]


def image_requires(engine: Engine, image_id: str, ctx: SetContext) -> list[str]:
    """The requirements the release's installed package declares, read by the image's own Python."""
    import json

    code = f"import importlib.metadata as m, json; print(json.dumps(m.requires({ctx.package!r}) or []))"
    res = engine.run(image_id, [ctx.python, "-c", code], timeout=120)
    try:
        found = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise UpstreamError(f"{image_id[:19]}: cannot read {ctx.package}'s requirements") from None
    return [str(x) for x in found]
