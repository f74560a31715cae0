"""The ``image`` job: definition -> patched files -> Dockerfile -> image.

Each step lives in its own module; this one only puts them in order, keeps
the build records, and makes sure a failure leaves nothing tagged.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import __version__, base, definitions, records, render, sources
from . import patches as patchlib
from .engine import Engine
from .errors import PipelineError

log = logging.getLogger(__name__)

SmokeRunner = Callable[[Engine, str, dict[str, Any]], dict[str, Any]]
BUILDERS = ("dockerfile", "assemble")


@dataclass
class Plan:
    """Everything known before the engine is touched."""

    root: Path
    definition: definitions.ImageDefinition
    patches: list[patchlib.Patch]
    base_ref: str
    output_ref: str
    template: str


@dataclass
class BuildResult:
    output_ref: str
    image_id: str
    reused: bool
    record: records.Record
    smoke: dict[str, Any] | None = field(default=None)


def plan(root: Path, base_tag: str, base_repo: str | None = None, output_ref: str | None = None) -> Plan:
    """Load and validate the definition and every patch (no engine needed)."""
    defn = definitions.load(root, base_tag)
    patches = patchlib.load_series(root, defn.patch_set, defn.package)
    return Plan(
        root=root,
        definition=defn,
        patches=patches,
        base_ref=defn.base_ref(base_repo),
        output_ref=output_ref or defn.output_ref(base_repo),
        template=render.template_path(root).read_text(encoding="utf-8"),
    )


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
        "output_ref": p.output_ref,
    }


def render_only(
    engine: Engine,
    p: Plan,
    pull: str = "missing",
    progress: Callable[[str], None] | None = None,
    *,
    skip_included: bool = False,
) -> str:
    """The Dockerfile ``image`` would build; builds nothing."""
    info = engine.resolve(p.base_ref, pull, progress)
    facts, files, applied = base.prepare(
        engine, p.definition, p.base_ref, info, p.patches, skip_included=skip_included,
        cache=sources.cache_dir(p.root),
    )
    return render.render(p.template, p.definition, facts, files, applied)


def build_image(
    engine: Engine,
    p: Plan,
    *,
    pull: str = "missing",
    rebuild: bool = False,
    skip_included: bool = False,
    smoke: SmokeRunner | None = None,
    progress: Callable[[str], None] | None = None,
    builder: str = "dockerfile",
) -> BuildResult:
    say = progress or (lambda _line: None)
    if builder not in BUILDERS:
        raise PipelineError(f"unknown builder {builder!r} (one of {', '.join(BUILDERS)})")
    say(f"==> resolving base {p.base_ref} (pull policy: {pull})")
    info = engine.resolve(p.base_ref, pull, say)
    say(f"    base {p.base_ref} is {info.id}")
    key_inputs = inputs(p, info.id, info.digest)
    if skip_included:
        # Kept out of the key when off, so older records still match.
        key_inputs["skip_included"] = True
    if builder != "dockerfile":
        # Equal content, other image ID: a build reuses only its own builder's records.
        key_inputs["builder"] = builder
    key = records.inputs_key(key_inputs)

    if not rebuild:
        for rec in records.find_by_inputs(p.root, key):
            if engine.image(rec.image_id) is not None and rec.data.get("smoke_status") != "fail":
                say(f"==> inputs unchanged since {rec.path.name}: reusing {rec.image_id} (--rebuild forces a build)")
                if smoke is not None and rec.data.get("smoke_status") != "pass":
                    # Built earlier with --no-smoke: smoke it now, before it gets the tag.
                    say(f"==> smoke-testing {rec.image_id[:19]} (no smoke result recorded yet)")
                    report = smoke(engine, rec.image_id, rec.data)
                    rec.data["smoke"] = report
                    rec.data["smoke_status"] = report.get("status")
                    rec.save()
                    if report.get("status") == "fail":
                        raise PipelineError(
                            f"smoke checks failed for the recorded image {rec.image_id[:19]}: "
                            + ", ".join(c["name"] for c in report.get("checks", []) if c.get("status") == "fail"),
                            hint="fix the cause, then build with --rebuild",
                        )
                engine.tag(rec.image_id, p.output_ref)
                return BuildResult(p.output_ref, rec.image_id, True, rec, rec.data.get("smoke"))

    say(f"==> checking {p.definition.package} in the base and applying {len(p.patches)} patch(es)")
    facts, files, applied = base.prepare(
        engine, p.definition, p.base_ref, info, p.patches, skip_included=skip_included,
        cache=sources.cache_dir(p.root),
    )
    skipped = [pt.name for pt in p.patches if pt not in applied]
    if skipped:
        say(f"    skipping {', '.join(skipped)}: the base already carries them (upstream shipped them)")
    say(f"    {p.definition.package} {facts.version} imported from {facts.package_dir}")
    image_id = tagged = None
    if builder == "assemble":
        from . import assemble

        say(f"==> assembling {p.output_ref} ({len(files)} patched file(s)) and loading it")
        try:
            # Without smoke tests the tag follows at once: let the load set it.
            tagged = p.output_ref if smoke is None else None
            image_id = assemble.build(engine, facts, files, render.labels(p.definition, facts, files, applied),
                                      f"vllm-hotfix: {p.definition.tag} patched files and bytecode into "
                                      f"{facts.site_dir}", tag=tagged)
            say(f"    loaded {image_id}")
        except assemble.Unsupported as exc:
            say(f"    {exc}: building from the Dockerfile instead")
            builder = "dockerfile"
    if image_id is None:
        dockerfile = render.render(p.template, p.definition, facts, files, applied)
        ctx = render.context(dockerfile, facts, files)
        say(f"==> building {p.output_ref} ({len(files)} patched file(s), context {len(ctx)} bytes)")
        image_id = engine.build(ctx, lambda line: say("    " + line))
    meta = {
        "kind": "build",
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
            "package_version": facts.version,
        },
        "files": {f.rel: {"sha256": f.sha256, "original_sha256": f.original_sha256} for f in files},
        "smoke": None,
        "smoke_status": None,
        "pushes": [],
        "patches_applied": {pt.name: pt.sha256 for pt in applied},
        "patches_included_upstream": skipped,
    }
    try:
        smoke_report = None
        if smoke is not None:
            say(f"==> smoke-testing {image_id[:19]}")
            smoke_report = smoke(engine, image_id, meta)
            meta["smoke"] = smoke_report
            meta["smoke_status"] = smoke_report.get("status")
            if smoke_report.get("status") == "fail":
                failed = [c["name"] for c in smoke_report.get("checks", []) if c.get("status") == "fail"]
                raise PipelineError(
                    f"smoke checks failed for the image built from {p.base_ref}: {', '.join(failed)}",
                    hint="see the report above; the image was removed and nothing was tagged",
                )
        if tagged is None:
            engine.tag(image_id, p.output_ref)
    except BaseException:
        # The engine's layer cache can hand back an image that is already
        # tagged elsewhere: only remove what this build alone produced.
        engine.remove_untagged(image_id)
        raise
    record = records.new(p.root, meta)
    return BuildResult(p.output_ref, image_id, False, record, smoke_report)
