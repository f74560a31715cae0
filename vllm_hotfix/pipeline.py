"""The ``image`` job: definition -> patched files -> Dockerfile -> image.

Each step lives in its own module; this one only puts them in order, keeps
the build records, and makes sure a failure leaves nothing tagged.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import __version__, base, definitions, leftovers, platforms, records, refs, render, sources
from . import patches as patchlib
from .assemble import BUILDERS
from .engine import Engine, ImageInfo, labels, split_reference
from .errors import BaseImageError, PipelineError, SmokeError, SmokeIncomplete
from .platforms import Platform
from .pulling import resolve

if TYPE_CHECKING:
    from . import expected, pins

log = logging.getLogger(__name__)

# (engine, image ID, the build's own expectation or None) -> smoke report
SmokeRunner = Callable[[Engine, str, "expected.Expected | None"], dict[str, Any]]


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


@dataclass(slots=True)
class BuildResult:
    output_ref: str
    image_id: str
    reused: bool
    record: records.Entry
    smoke: dict[str, Any] | None = field(default=None)
    platform: str | None = None


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
    package = Path(__file__).resolve().parent
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


def render_only(
    engine: Engine,
    p: Plan,
    pull: str = "missing",
    progress: Callable[[str], None] | None = None,
    *,
    skip_included: bool = False,
    wheelhouse: Path | None = None,
    platform: Platform | None = None,
    builder: str = "dockerfile",
) -> str:
    """The Dockerfile ``image`` would build (for one ``platform`` of the base); builds nothing.

    Pinned wheels are fetched: they are inputs.
    """
    _check_builder(p, builder)
    if platform is not None:
        platforms.require_engine(engine, platform)
        bases = platform_bases(engine, p, [platform], pull, asked=True, local=engine.image(p.base_ref),
                               progress=progress)
        assert bases is not None
        p = replace(p, base_ref=bases[platform])
    info = resolve(engine, p.base_ref, pull, progress, str(platform) if platform else None)
    facts, files, applied = base.prepare(
        engine, p.definition, p.base_ref, info, p.patches, skip_included=skip_included,
        cache=sources.cache_dir(p.root),
    )
    pinned = _pins(engine, p, facts, wheelhouse, progress or (lambda _line: None))
    return render.render(p.template, p.definition, facts, files, applied, pinned)


def _serve(pinned: pins.Prepared | None) -> AbstractContextManager[dict[str, str]]:
    """The pinned wheels on loopback for the build (its build arguments); nothing to serve without pins."""
    if pinned is None:
        return nullcontext({})
    from . import pins

    return pins.serve(pinned)


def check_output_ref(engine: Engine, p: Plan, base: ImageInfo, force: bool) -> None:
    """Refuse to move a tag that names the base or an image this tool did not make."""
    if force:
        return
    if p.output_ref == p.base_ref:
        raise PipelineError(f"--tag {p.output_ref} is the base's own reference; refusing to overwrite the base",
                            hint="choose another --tag (or --force)")
    existing = engine.image(p.output_ref)
    if existing is None:
        return
    if existing.id == base.id:
        raise PipelineError(f"--tag {p.output_ref} names the base image {base.id[:19]}; refusing to move it",
                            hint="choose another --tag (or --force)")
    ours = existing.id in records.known_images(p.root) or labels.DEFINITION in existing.labels
    if not ours:
        raise PipelineError(
            f"--tag {p.output_ref} names image {existing.id[:19]}, which this tool did not build; refusing to move it",
            hint="choose another --tag, or pass --force to move it anyway",
        )


def _smoke_and_judge(engine: Engine, p: Plan, image_id: str, smoke: SmokeRunner,
                     want: expected.Expected | None, say: Callable[[str], None]) -> dict[str, Any]:
    """Run smoke, append its verdict, and raise unless it passed."""
    say(f"==> smoke-testing {image_id[:19]}")
    report = smoke(engine, image_id, want)
    records.append(p.root, "verdict", report)
    status = report.get("status")
    if status == records.FAIL:
        failed = [c["name"] for c in report.get("checks", []) if c.get("status") == "fail"]
        raise SmokeError(
            f"smoke checks failed for {image_id[:19]} (built from {p.base_ref}): {', '.join(failed)}",
            hint="see the report above; nothing was tagged",
        )
    if status == records.INCOMPLETE:
        raise SmokeIncomplete(
            f"smoke of {image_id[:19]} is incomplete: {'; '.join(report.get('incomplete') or [])}",
            hint="the host, not the image, stopped a check; nothing was tagged",
        )
    return report


def _move_tag(engine: Engine, p: Plan, image_id: str, why: str) -> None:
    """Journal first, then the tag: an unrecordable move does not happen."""
    records.append(p.root, "tag", {"ref": p.output_ref, "image_id": image_id, "why": why})
    engine.tag(image_id, p.output_ref)


def build_image(
    engine: Engine,
    p: Plan,
    *,
    pull: str = "missing",
    rebuild: bool = False,
    skip_included: bool = False,
    force: bool = False,
    smoke: SmokeRunner | None = None,
    progress: Callable[[str], None] | None = None,
    wheelhouse: Path | None = None,
    builder: str = "dockerfile",
    platform: Platform | None = None,
    base_info: ImageInfo | None = None,
) -> BuildResult:
    """Build (or reuse), smoke-test and tag one image; ``platform``: the one its base must be.

    ``base_info``: the base as the caller just found it in the engine (not asked
    again unless ``pull`` is ``always``).
    """
    say = progress or (lambda _line: None)
    if builder not in BUILDERS:
        raise PipelineError(f"unknown builder {builder!r} (one of {', '.join(BUILDERS)})")
    # Before any work: a patch set with pins needs pip in a RUN step, which only the Dockerfile build has.
    _check_builder(p, builder)
    records.ensure_writable(p.root)
    say(f"==> resolving base {p.base_ref} (pull policy: {pull}{', ' + str(platform) if platform else ''})")
    if base_info is not None and pull != "always":
        info = base_info
    else:
        info = resolve(engine, p.base_ref, pull, say, str(platform) if platform else None)
    say(f"    base {p.base_ref} is {info.id} ({info.os}/{info.architecture})")
    if platform is not None and platforms.of(info.os, info.architecture) != platform:
        raise BaseImageError(f"base {p.base_ref} is {info.os}/{info.architecture}, not {platform}")
    check_output_ref(engine, p, info, force)
    key_inputs = inputs(p, info.id, info.digest)
    if platform is not None:
        # Kept out of the key when not asked for, so older records still match.
        key_inputs["platform"] = str(platform)
    if skip_included:
        # Kept out of the key when off, so older records still match.
        key_inputs["skip_included"] = True
    if builder != "dockerfile":
        # Equal content, other image ID: a build reuses only its own builder's records.
        key_inputs["builder"] = builder
    key = records.inputs_key(key_inputs)

    if not rebuild:
        for rec in records.builds_with_inputs(p.root, key):
            if engine.image(rec.image_id) is None:
                continue
            judged = records.judgement(p.root, rec.image_id)
            if judged is not None and judged.data.get("status") == records.FAIL:
                say(f"    not reusing {rec.image_id[:19]} from {rec.path.name}: its newest smoke verdict "
                    f"({judged.created}) failed; building again")
                continue
            say(f"==> inputs unchanged since {rec.path.name}: reusing {rec.image_id} (--rebuild forces a build)")
            report = judged.data if judged is not None else None
            if smoke is not None and judged is None:
                # Built earlier with --no-smoke (or only incomplete runs): smoke it before it gets the tag.
                say("    no smoke verdict on it yet")
                report = _smoke_and_judge(engine, p, rec.image_id, smoke, None, say)
            _move_tag(engine, p, rec.image_id, "reused")
            return BuildResult(p.output_ref, rec.image_id, True, rec, dict(report) if report else None,
                               str(platform) if platform else None)

    say(f"==> checking {p.definition.package} in the base and applying {len(p.patches)} patch(es)")
    facts, files, applied = base.prepare(
        engine, p.definition, p.base_ref, info, p.patches, skip_included=skip_included,
        cache=sources.cache_dir(p.root),
    )
    skipped = [pt.name for pt in p.patches if pt not in applied]
    if skipped:
        say(f"    skipping {', '.join(skipped)}: the base already carries them (upstream shipped them)")
    say(f"    {p.definition.package} {facts.version} imported from {facts.package_dir}")
    pinned = _pins(engine, p, facts, wheelhouse, say)
    image_id = None
    pending = leftovers.pending(p.root)
    # On failure the engine removes the steps it made; what it cannot (engine
    # lost, process killed) stays noted in `pending` for the next run to sweep.
    if builder == "assemble":
        from . import assemble

        say(f"==> assembling {p.output_ref} ({len(files)} patched file(s)) and loading it")
        try:
            image_id = assemble.build(engine, facts, files, render.labels(p.definition, facts, files, applied),
                                      f"vllm-hotfix: {p.definition.tag} patched files and bytecode into "
                                      f"{facts.site_dir}", on_image=pending.add)
            say(f"    loaded {image_id}")
        except assemble.Unsupported as exc:
            say(f"    {exc}: building from the Dockerfile instead")
            builder = "dockerfile"
    if image_id is None:
        dockerfile = render.render(p.template, p.definition, facts, files, applied, pinned)
        ctx = render.context(dockerfile, facts, files)
        say(f"==> building {p.output_ref} ({len(files)} patched file(s), context {len(ctx)} bytes)")
        # Pins: the wheels are served on loopback for the RUN step, which needs the
        # host's network to reach them; nothing else in the build uses a network.
        with _serve(pinned) as buildargs:
            image_id = engine.build(ctx, lambda line: say("    " + line), on_image=pending.add,
                                    buildargs=buildargs, network="host" if pinned is not None else None)
    meta = {
        "builder": builder,
        "inputs": key_inputs,
        "inputs_key": key,
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
        "patches_included_upstream": skipped,
    }
    try:
        if pinned is not None:
            from . import pins

            say(f"==> checking the pins in {image_id[:19]}")
            meta["pins"] = pins.verify(engine, image_id, pinned, facts.python, say)
        smoke_report = None
        if smoke is not None:
            from . import expected  # here: only a smoked build states what its image must hold

            want = expected.from_build(p.definition, info.id, facts.version, {f.rel: f.sha256 for f in files})
            smoke_report = _smoke_and_judge(engine, p, image_id, smoke, want, say)
        record = records.append(p.root, "build", meta)
        _move_tag(engine, p, image_id, "built")
    except BaseException:
        # The engine's layer cache can hand back an image that is already
        # tagged elsewhere: only remove what this build alone produced.
        removed = True
        try:
            engine.remove_untagged(image_id)
        except PipelineError as exc:
            removed = False
            log.debug("left for the next run to sweep: %s", exc)
        if removed:
            pending.clear()
        raise
    pending.clear()
    return BuildResult(p.output_ref, image_id, False, record, smoke_report, str(platform) if platform else None)


def child_ref(ref: str, plat: Platform) -> str:
    """Upstream's naming: ``TAG-x86_64`` / ``TAG-aarch64`` beside the index ``TAG``."""
    repo, tag = split_reference(ref)
    return refs.check_reference(f"{repo}:{tag}-{plat.suffix}", "platform tag", tag_only=True)


def platform_bases(
    engine: Engine, p: Plan, wanted: list[Platform] | None, pull: str, *, asked: bool,
    local: ImageInfo | None, progress: Callable[[str], None] | None = None,
) -> dict[Platform, str] | None:
    """Each platform's base, by digest in the base's index; None: the single-platform build of old.

    Without ``--platform`` (``asked`` False) a base already in the engine is
    built for the engine's platform alone, as before; otherwise the
    registry's answer decides: every platform of an index (or those
    ``wanted``), or the one image a plain manifest names. ``local``: the
    base as the engine has it (``engine.image``), None if it has not.
    """
    say = progress or (lambda _line: None)
    if not asked and (pull == "never" or (local is not None and pull != "always")):
        return None
    if not asked and engine.api_version < platforms.MIN_API:
        # An engine that loses other platforms still builds its own, as it always did.
        say(f"    the engine ({engine.version_text}) builds for its own platform only; "
            "--platform all needs Docker 26.1 or newer")
        return None
    from . import registry  # here: an ordinary build never asks a registry (nor imports requests)

    try:
        found = registry.read_index(engine, p.base_ref) if pull != "never" else None
    except PipelineError as exc:
        if asked and wanted is not None and local is None:
            raise BaseImageError(f"cannot read {p.base_ref} from its registry to find its platforms: {exc}") \
                from exc
        say(f"    cannot read {p.base_ref} from its registry ({exc}); building for one platform")
        found = None
    if found is None or not found.is_index:
        return _single(engine, p, wanted, local, found is not None)
    repo, _ = split_reference(p.base_ref)
    offered: dict[Platform, str] = {}
    for child in registry.children(found):
        plat = platforms.of(child.os, child.architecture, child.variant)
        if plat is not None and plat not in offered:
            offered[plat] = f"{repo}@{child.digest}"
    chosen = wanted if wanted is not None else list(offered)
    lacking = [str(w) for w in chosen if w not in offered]
    if lacking:
        raise BaseImageError(f"base {p.base_ref} is an index over {', '.join(map(str, offered)) or 'nothing'}; "
                             f"it has no {', '.join(lacking)} image")
    say(f"    base {p.base_ref} is an index ({found.digest}); building for {', '.join(map(str, chosen))}")
    return {plat: offered[plat] for plat in chosen}


def _single(engine: Engine, p: Plan, wanted: list[Platform] | None, local: ImageInfo | None,
            in_registry: bool) -> dict[Platform, str] | None:
    """A base that is one image: build for its platform, if that is what was asked."""
    if wanted is None:
        return None
    if len(wanted) > 1:
        where = "a single image in its registry" if in_registry else "not an index in a registry"
        raise BaseImageError(f"base {p.base_ref} is {where}: it has no image for each of "
                             f"{', '.join(map(str, wanted))}",
                             hint="build one platform at a time from per-platform bases (--base-repo), "
                                  "or publish an index")
    if local is not None and platforms.of(local.os, local.architecture) != wanted[0]:
        raise BaseImageError(f"base {p.base_ref} in the engine is {local.os}/{local.architecture}, "
                             f"not {wanted[0]}")
    return {wanted[0]: p.base_ref}


def build_platforms(
    engine: Engine,
    p: Plan,
    bases: dict[Platform, str],
    *,
    progress: Callable[[str], None] | None = None,
    **options: Any,
) -> list[BuildResult]:
    """One hotfix image per platform, each from that platform's base, tagged ``OUTPUT-<machine>``.

    The plain output tag then names the engine's own platform's image (an
    engine's local tag names one image; the registry's index names them all).
    """
    say = progress or (lambda _line: None)
    for plat in bases:
        platforms.require_engine(engine, plat)
    results = []
    for plat, ref in bases.items():
        say(f"==> platform {plat}")
        child = replace(p, base_ref=ref, output_ref=child_ref(p.output_ref, plat))
        results.append(build_image(engine, child, progress=progress, platform=plat, **options))
    own = next((r for plat, r in zip(bases, results, strict=True) if plat == platforms.native(engine)), None)
    if own is not None and len(results) > 1:
        _move_tag(engine, p, own.image_id, f"platform {own.platform} of a multi-platform build")
    return results
