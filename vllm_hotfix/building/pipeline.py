"""The ``image`` and ``render`` jobs: definition -> patched files -> Dockerfile -> image.

Each step lives in its own module; this one only puts them in order, keeps
the build records, and makes sure a failure leaves nothing tagged. Both jobs
start from one prepare step (:func:`prepare`); :func:`build` decides between
one image and one per platform of the base. How a job is built is a
:class:`BuildOptions` value; which builder makes the image is chosen by name
in :func:`.builders.builder`.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import __version__, interrupts
from ..engine import Engine, ImageInfo, labels
from ..errors import AssembleUnsupported, BaseImageError, PipelineError, Refused, UsageError
from ..journal import leftovers, records
from ..registry import refs
from ..registry.pulling import PULL_POLICIES, resolve
from ..verdicts import Status, Verdict, require_pass
from . import base, definitions, platforms, render, seen_bases, sources
from . import patches as patchlib
from .builders import BuildJob, builder, known_builder
from .platforms import Platform, child_ref

if TYPE_CHECKING:
    from . import expected, pins

log = logging.getLogger(__name__)


# (engine, image ID, the build's own expectation or None) -> the run's verdict
SmokeRunner = Callable[[Engine, str, "expected.Expected | None"], Verdict]


def _quiet(_line: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class BuildOptions:
    """How `image` builds, the same for every platform of one run."""

    pull: str = "missing"
    rebuild: bool = False  # build even when a recorded build has the same inputs
    skip_included: bool = False  # leave out patches the base already carries
    force: bool = False  # move the output tag even if it names the base or a foreign image
    builder: str = "dockerfile"
    wheelhouse: Path | None = None  # wheels for the set's pins.txt (None: download into the cache)
    smoke: SmokeRunner | None = None  # None: --no-smoke
    progress: Callable[[str], None] | None = None

    def __post_init__(self) -> None:
        if self.pull not in PULL_POLICIES:
            raise UsageError(f"pull policy {self.pull!r} is not one of {', '.join(PULL_POLICIES)}")
        known_builder(self.builder)

    @property
    def say(self) -> Callable[[str], None]:
        return self.progress or _quiet


@dataclass(slots=True)
class Plan:
    """Everything known before the engine is touched."""

    root: Path
    definition: definitions.ImageDefinition
    patches: list[patchlib.Patch]
    base_ref: str
    output_ref: str
    template: str
    pinset: pins.PinSet | None = None


@dataclass(frozen=True, slots=True)
class BuildResult:
    output_ref: str
    image_id: str
    reused: bool
    record: records.Entry
    smoke: Verdict | None = None
    platform: str | None = None
    was: str | None = None  # the image the output tag named before, if it moved off another one


@dataclass(frozen=True, slots=True)
class NoHotfix:
    """Not a failure: the base already carries every patch of the set, so nothing was built or tagged."""

    base_ref: str
    patch_set: str
    patches: tuple[str, ...]

    def message(self) -> str:
        return (f"{self.base_ref} needs no hotfix: it already carries every patch of {self.patch_set} "
                f"({', '.join(self.patches)}); nothing built")


def plan(root: Path, base_tag: str, base_repo: str | None = None, output_ref: str | None = None) -> Plan:
    """Load and validate the definition and every patch (no engine needed)."""
    if base_repo is not None:
        refs.check_reference(base_repo, "--base-repo")
    if output_ref is not None:
        refs.check_reference(output_ref, "--tag", tag_only=True)
    defn = definitions.load(root, base_tag)
    patches = patchlib.load_series(root, defn.patch_set, defn.package)
    return Plan(
        root=root,
        definition=defn,
        patches=patches,
        base_ref=refs.check_reference(defn.base_ref(base_repo), "base"),
        output_ref=refs.check_reference(output_ref or defn.output_ref(base_repo), "--tag", tag_only=True),
        template=render.template_path(root).read_text(encoding="utf-8"),
        pinset=_load_pins(root, defn),
    )


def _load_pins(root: Path, defn: definitions.ImageDefinition) -> pins.PinSet | None:
    # Most sets pin nothing: then the pins module is not even imported.
    if not patchlib.pins_path(root, defn.patch_set).is_file():
        return None
    from . import pins

    return pins.load(root, defn.patch_set, defn.package)


def _check_builder(p: Plan, builder: str) -> None:
    if p.pinset is not None:
        from . import pins

        pins.check_builder(p.pinset, builder)


def tool_fingerprint() -> str:
    """sha256 over the tool's own code and probe scripts.

    The version string does not change between commits; a changed probe or
    build step must not reuse an image made by the old one.
    """
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def inputs(p: Plan, base_id: str, base_digest: str | None) -> dict[str, Any]:
    return {
        "definition": p.definition.tag,
        "definition_sha256": hashlib.sha256(p.definition.path.read_bytes()).hexdigest(),
        "base_ref": p.base_ref,
        "base_id": base_id,
        "base_digest": base_digest,
        "patches": {pt.name: pt.sha256 for pt in p.patches},
        "template_sha256": hashlib.sha256(p.template.encode()).hexdigest(),
        "tool_version": __version__,
        "tool_sha256": tool_fingerprint(),
        "output_ref": p.output_ref,
        # Only when there are pins, so that records of sets without them still match.
        **({"pins_sha256": p.pinset.sha256} if p.pinset is not None else {}),
    }


def _pins(engine: Engine, p: Plan, facts: base.BaseFacts, wheelhouse: Path | None, say: Callable[[str], None]
          ) -> pins.Prepared | None:
    if p.pinset is None:
        return None
    from . import pins

    return pins.prepare(engine, p.pinset, facts.image.id, facts.python, wheelhouse=wheelhouse,
                        cache=pins.cache(p.root), say=say)


@dataclass(frozen=True, slots=True)
class Patched:
    """The prepare step's result: the base's facts, its patched files, the patches applied, the pins fetched."""

    facts: base.BaseFacts
    files: list[base.PatchedFile]
    applied: list[patchlib.Patch]
    pinned: pins.Prepared | None


def prepare(engine: Engine, p: Plan, info: ImageInfo, opts: BuildOptions) -> Patched | NoHotfix:
    """Read the base, patch its files and fetch the pinned wheels: what ``render`` and ``image`` both start from.

    A base that already carries every patch gives :class:`NoHotfix`.
    """
    say = opts.say
    say(f"==> checking {p.definition.package} in the base and applying {len(p.patches)} patch(es)")
    facts, files, applied = base.prepare(
        engine, p.definition, p.base_ref, info, p.patches, skip_included=opts.skip_included,
        cache=sources.cache_dir(p.root),
    )
    if p.patches and not applied:
        return NoHotfix(p.base_ref, p.definition.patch_set, tuple(pt.name for pt in p.patches))
    skipped = [pt.name for pt in p.patches if pt not in applied]
    if skipped:
        say(f"    skipping {', '.join(skipped)}: the base already carries them (upstream shipped them)")
    say(f"    {p.definition.package} {facts.version} imported from {facts.package_dir}")
    return Patched(facts, files, applied, _pins(engine, p, facts, opts.wheelhouse, say))


def render_only(engine: Engine, p: Plan, opts: BuildOptions | None = None, platform: Platform | None = None,
                seen: ImageInfo | None = None) -> str | NoHotfix:
    """The Dockerfile ``image`` would build (for one ``platform`` of the base); builds nothing.

    Pinned wheels are fetched: they are inputs. ``seen``: the base as this host last saw it
    (:mod:`.seen_bases`), for a render with no engine reachable.
    """
    opts = opts or BuildOptions()
    _check_builder(p, opts.builder)
    if seen is not None:
        done = prepare(engine, p, seen, opts)
        if isinstance(done, NoHotfix):
            return done
        return render.render(p.template, p.definition, done.facts, done.files, done.applied, done.pinned)
    if platform is not None:
        platforms.require_engine(engine, platform)
        chosen = platforms.bases(engine, p.base_ref, [platform], opts.pull, asked=True,
                                 local=engine.image(p.base_ref), progress=opts.progress)
        assert chosen is not None
        p = replace(p, base_ref=chosen[platform])
    info = _resolve_base(engine, p, opts, platform, None, opts.say)
    done = prepare(engine, p, info, opts)
    if isinstance(done, NoHotfix):
        return done
    interrupts.checkpoint()  # between steps: an interrupt a finalizer swallowed stops the run before the build
    return render.render(p.template, p.definition, done.facts, done.files, done.applied, done.pinned)


def check_output_ref(engine: Engine, p: Plan, base: ImageInfo, force: bool) -> None:
    """Refuse to move a tag that names the base or an image this tool did not make."""
    if force:
        return
    if p.output_ref == p.base_ref:
        raise Refused(f"--tag {p.output_ref} is the base's own reference; refusing to overwrite the base",
                      hint="choose another --tag (or --force)")
    existing = engine.image(p.output_ref)
    if existing is None:
        return
    if existing.id == base.id:
        raise Refused(f"--tag {p.output_ref} names the base image {base.id[:19]}; refusing to move it",
                      hint="choose another --tag (or --force)")
    ours = existing.id in records.known_images(p.root) or labels.DEFINITION in existing.labels
    if not ours:
        raise Refused(
            f"--tag {p.output_ref} names image {existing.id[:19]}, which this tool did not build; refusing to move it",
            hint="choose another --tag, or pass --force to move it anyway",
        )


def _smoke(engine: Engine, p: Plan, image_id: str, smoke: SmokeRunner,
           want: expected.Expected | None, say: Callable[[str], None]) -> Verdict:
    """Run smoke, append its verdict, and raise unless it passed."""
    say(f"==> smoke-testing {image_id[:19]}")
    verdict = smoke(engine, image_id, want)
    records.append_verdict(p.root, verdict)
    require_pass(verdict, f"{image_id[:19]} (built from {p.base_ref})",
                 fail_hint="see the report above; nothing was tagged",
                 incomplete_hint="the host, not the image, stopped a check; nothing was tagged")
    return verdict


def _move_tag(engine: Engine, p: Plan, image_id: str, why: str) -> str | None:
    """Journal first, then the tag: an unrecordable move does not happen. The image the tag named before,
    if another (a reused build can move it back from a newer one: the caller says so, as rollback does)."""
    now = engine.image(p.output_ref)
    was = now.id if now is not None and now.id != image_id else None
    records.append(p.root, "tag", {"ref": p.output_ref, "image_id": image_id, "why": why,
                                   **({"from": was} if was else {})})
    engine.tag(image_id, p.output_ref)
    return was


def _resolve_base(engine: Engine, p: Plan, opts: BuildOptions, platform: Platform | None,
                  base_info: ImageInfo | None, say: Callable[[str], None]) -> ImageInfo:
    say(f"==> resolving base {p.base_ref} (pull policy: {opts.pull}{', ' + str(platform) if platform else ''})")
    if base_info is not None and opts.pull != "always":
        info = base_info
    else:
        info = resolve(engine, p.base_ref, opts.pull, say, str(platform) if platform else None)
        if platform is None:
            # What a later render with no engine reachable starts from (the platform's own base is another ref).
            seen_bases.remember(sources.cache_dir(p.root), p.base_ref, info)
    say(f"    base {p.base_ref} is {info.id} ({info.os}/{info.architecture})")
    if platform is not None and platforms.of(info.os, info.architecture) != platform:
        raise BaseImageError(f"base {p.base_ref} is {info.os}/{info.architecture}, not {platform}")
    # A tag names whatever was pushed under it last: the definition's pin says which base it must be.
    p.definition.check_base(info.id, definitions.platform_text(info.os, info.architecture, info.variant),
                            p.base_ref)
    return info


def _key_inputs(p: Plan, info: ImageInfo, opts: BuildOptions, platform: Platform | None) -> dict[str, Any]:
    """The inputs a build is recorded (and found again) under."""
    key_inputs = inputs(p, info.id, info.digest)
    # Each of these is kept out of the key when off, so older records still match.
    if platform is not None:
        key_inputs["platform"] = str(platform)
    if opts.skip_included:
        key_inputs["skip_included"] = True
    if opts.builder != "dockerfile":
        # Equal content, other image ID: a build reuses only its own builder's records.
        key_inputs["builder"] = opts.builder
    return key_inputs


def _reuse(engine: Engine, p: Plan, key: str, opts: BuildOptions, platform: Platform | None,
           say: Callable[[str], None]) -> BuildResult | None:
    """A recorded build of the same inputs whose image is still there and did not fail, tagged again."""
    for rec in records.builds_with_inputs(p.root, key):
        if engine.image(rec.image_id) is None:
            continue
        judged = records.judgement(p.root, rec.image_id)
        if judged is not None and judged.verdict.status is Status.FAIL:
            say(f"    not reusing {rec.image_id[:19]} from {rec.path.name}: its newest smoke verdict "
                f"({judged.created}) failed; building again")
            continue
        say(f"==> inputs unchanged since {rec.path.name}: reusing {rec.image_id} (--rebuild forces a build)")
        verdict = judged.verdict if judged is not None else None
        if opts.smoke is not None and judged is None:
            # Built earlier with --no-smoke (or only incomplete runs): smoke it before it gets the tag.
            say("    no smoke verdict on it yet")
            verdict = _smoke(engine, p, rec.image_id, opts.smoke, None, say)
        was = _move_tag(engine, p, rec.image_id, "reused")
        return BuildResult(p.output_ref, rec.image_id, True, rec, verdict, str(platform) if platform else None, was)
    return None


def _make_image(engine: Engine, job: BuildJob, name: str) -> tuple[str, str]:
    """The new image's ID and the builder that made it (assemble falls back to the Dockerfile)."""
    try:
        return builder(name).build(engine, job), name
    except AssembleUnsupported as exc:
        job.say(f"    {exc}: building from the Dockerfile instead")
        return builder("dockerfile").build(engine, job), "dockerfile"


def _build_meta(p: Plan, info: ImageInfo, facts: base.BaseFacts, files: list[base.PatchedFile],
                applied: list[patchlib.Patch], key_inputs: dict[str, Any], made_by: str, image_id: str,
                platform: Platform | None) -> dict[str, Any]:
    """The build entry of the journal."""
    return {
        "builder": made_by,
        "inputs": key_inputs,
        "inputs_key": records.inputs_key(key_inputs),
        "image_id": image_id,
        "output_ref": p.output_ref,
        "base": {
            "ref": p.base_ref,
            "id": info.id,
            "digest": info.digest,
            "site_dir": facts.site_dir,
            "python": facts.python_version,
            "machine": facts.machine,
            "package_version": facts.version,
            "platform": f"{info.os}/{info.architecture}",
        },
        "platform": str(platform) if platform else f"{info.os}/{info.architecture}",
        "files": {f.rel: {"sha256": f.sha256, "original_sha256": f.original_sha256} for f in files},
        "patches_applied": {pt.name: pt.sha256 for pt in applied},
        "patches_included_upstream": [pt.name for pt in p.patches if pt not in applied],
    }


def build_image(
    engine: Engine,
    p: Plan,
    opts: BuildOptions | None = None,
    *,
    platform: Platform | None = None,
    base_info: ImageInfo | None = None,
) -> BuildResult | NoHotfix:
    """Build (or reuse), smoke-test and tag one image; ``platform``: the one its base must be.

    ``base_info``: the base as the caller just found it in the engine (not asked
    again unless the pull policy is ``always``). A base that already carries
    every patch gives :class:`NoHotfix`: nothing built, nothing tagged.
    """
    opts = opts or BuildOptions()
    say = opts.say
    # Before any work: a patch set with pins needs pip in a RUN step, which only the Dockerfile build has.
    _check_builder(p, opts.builder)
    records.ensure_writable(p.root)
    info = _resolve_base(engine, p, opts, platform, base_info, say)
    check_output_ref(engine, p, info, opts.force)
    key_inputs = _key_inputs(p, info, opts, platform)
    if not opts.rebuild:
        reused = _reuse(engine, p, records.inputs_key(key_inputs), opts, platform, say)
        if reused is not None:
            return reused

    done = prepare(engine, p, info, opts)
    if isinstance(done, NoHotfix):
        return done
    interrupts.checkpoint()  # between steps: an interrupt a finalizer swallowed stops the run before the build
    facts, files, applied, pinned = done.facts, done.files, done.applied, done.pinned
    pending = leftovers.pending(p.root)
    # On failure the engine removes the steps it made; what it cannot (engine
    # lost, process killed) stays noted in `pending` for the next run to sweep.
    job = BuildJob(p.definition, facts, files, applied, p.template, p.output_ref, pinned, pending.add, say,
                   nocache=opts.rebuild)
    image_id, made_by = _make_image(engine, job, opts.builder)
    meta = _build_meta(p, info, facts, files, applied, key_inputs, made_by, image_id, platform)
    try:
        if pinned is not None:
            from . import pins

            say(f"==> checking the pins in {image_id[:19]}")
            meta["pins"] = pins.verify(engine, image_id, pinned, facts.python, say)
        verdict = None
        if opts.smoke is not None:
            from . import expected  # here: only a smoked build states what its image must hold

            want = expected.from_build(p.definition, info.id, facts.version, {f.rel: f.sha256 for f in files},
                                       facts.site_dir, facts.cache_tag)
            interrupts.checkpoint()
            verdict = _smoke(engine, p, image_id, opts.smoke, want, say)
        interrupts.checkpoint()  # the last step before the build is journalled and its tag moved
        record = records.append(p.root, "build", meta)
        was = _move_tag(engine, p, image_id, "built")
    except BaseException:
        _remove_unfinished(engine, image_id, pending)
        raise
    pending.clear()
    return BuildResult(p.output_ref, image_id, False, record, verdict, str(platform) if platform else None, was)


def _remove_unfinished(engine: Engine, image_id: str, pending: leftovers.Pending) -> None:
    """Remove an image whose build did not finish; left noted for the next run if that fails."""
    # The engine's layer cache can hand back an image that is already
    # tagged elsewhere: only remove what this build alone produced.
    try:
        engine.remove_untagged(image_id)
    except PipelineError as exc:
        log.debug("left for the next run to sweep: %s", exc)
        return
    pending.clear()


def build(engine: Engine, p: Plan, opts: BuildOptions | None = None, wanted: list[Platform] | None = None,
          *, asked: bool = False) -> BuildResult | list[BuildResult] | NoHotfix:
    """The ``image`` step: one image, or one per platform of the base (a list).

    ``asked``: the platforms were named (``wanted``, or every platform of the
    base's index when ``wanted`` is None); otherwise a base already in the
    engine is built for the engine's platform alone (see :func:`platforms.bases`).
    """
    opts = opts or BuildOptions()
    local = engine.image(p.base_ref)
    chosen = platforms.bases(engine, p.base_ref, wanted, opts.pull, asked=asked, local=local,
                             progress=opts.progress)
    if chosen is None:
        return build_image(engine, p, opts, base_info=local)
    return build_platforms(engine, p, chosen, opts)


def build_platforms(
    engine: Engine,
    p: Plan,
    bases: dict[Platform, str],
    opts: BuildOptions | None = None,
) -> list[BuildResult] | NoHotfix:
    """One hotfix image per platform, each from that platform's base, tagged ``OUTPUT-<machine>``.

    The plain output tag then names the engine's own platform's image (an
    engine's local tag names one image; the registry's index names them all).
    A base that needs no hotfix on one platform ends the run there.
    """
    opts = opts or BuildOptions()
    for plat in bases:
        platforms.require_engine(engine, plat)
    results = []
    for plat, ref in bases.items():
        opts.say(f"==> platform {plat}")
        child = replace(p, base_ref=ref, output_ref=child_ref(p.output_ref, plat))
        result = build_image(engine, child, opts, platform=plat)
        if isinstance(result, NoHotfix):
            return result
        results.append(result)
    own = next((r for plat, r in zip(bases, results, strict=True) if plat == platforms.native(engine)), None)
    if own is not None:
        # Also for an index of one platform: OUTPUT names the engine's own platform's image, as the runbook says.
        _move_tag(engine, p, own.image_id, f"platform {own.platform} of a multi-platform build")
    return results
