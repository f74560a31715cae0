"""image, render, standin: build the patched image, show its Dockerfile, make a stand-in base."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..building.builders import BUILDERS
from ..engine import Engine
from ..errors import UsageError
from .app import (
    TAG,
    Ctx,
    base_option,
    one_platform,
    platform_option,
    print_json,
    progress,
    pull_option,
    repo_option,
)

if TYPE_CHECKING:
    from ..building import pipeline


@click.command()
@base_option
@repo_option
@click.option("--tag", "output_ref", type=TAG, default=None, help="Output reference (default REPO:TAG-<suffix>).")
@pull_option
@click.option("--no-smoke", is_flag=True, help="Skip the smoke tests after the build.")
@click.option("--rebuild", is_flag=True, help="Build even if a recorded build has the same inputs.")
@click.option("--skip-included", is_flag=True,
              help="Leave out patches the base already carries (upstream shipped them) instead of stopping.")
@click.option("--force", is_flag=True, help="Move --tag even if it names the base or an image this tool did not make.")
@click.option("--builder", type=click.Choice(BUILDERS), default="dockerfile", show_default=True,
              help="dockerfile: the engine builds the rendered Dockerfile; assemble: write the same image's "
                   "layer and config and load them (reproducible image ID).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of the last line.")
@click.option("--wheelhouse", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of wheels for the patch set's pins.txt (default: download them into the cache).")
@platform_option
@click.option("--in-registry", is_flag=True,
              help="Make the image in the registry that holds the base (--base-repo HOST/PATH) and push it to "
                   "--tag's: no engine, no pull; read only the layers holding the patched files. Not smoke-tested "
                   "here: smoke it where the GPUs are (it is pulled by digest), then push it.")
@click.option("--bytecode", type=click.Choice(("auto", "compile", "whiteout")), default=None,
              help="--in-registry: compile the patched sources with a Python of the image's version on this host "
                   "(auto: when one is here), or white out the base's stale pycs.")
@click.pass_obj
def image(obj: Ctx, base_tag: str, base_repo: str | None, output_ref: str | None,
          pull: str, no_smoke: bool, rebuild: bool, skip_included: bool, force: bool, builder: str, as_json: bool,
          wheelhouse: Path | None, platform_text: str | None, in_registry: bool, bytecode: str | None) -> None:
    """Build the patched image of definition NAME (one per platform of the base, tagged OUTPUT-<machine>)."""
    if builder == "assemble" and not in_registry and bytecode is None:
        # Before the build code is imported: the engine starts on the load meanwhile (engine/pending_load.py).
        obj.engine.expect_load()
    from ..building import pipeline, platforms

    wanted = platforms.parse(platform_text)
    plan = pipeline.plan(obj.root, base_tag, base_repo, output_ref)
    if in_registry or bytecode is not None:
        from .registry_build import image_in_registry

        image_in_registry(plan, wanted, platform_text is not None, in_registry=in_registry, bytecode=bytecode,
                          pull=pull, builder=builder, wheelhouse=wheelhouse, rebuild=rebuild,
                          skip_included=skip_included, force=force, as_json=as_json)
        return
    def smoke(engine: Engine, image_id: str, want: Any) -> Any:
        # Imported when a build is smoked, not for one that is reused (the sweep's HTTP stack is ~0.1 s).
        from ..checking import smoke as smokelib

        return smokelib.runner(obj.root, progress)(engine, image_id, want)

    options = pipeline.BuildOptions(pull=pull, rebuild=rebuild, skip_included=skip_included, force=force,
                                    builder=builder, wheelhouse=wheelhouse, smoke=None if no_smoke else smoke,
                                    progress=progress)
    result = pipeline.build(obj.engine, plan, options, wanted, asked=platform_text is not None)
    if isinstance(result, pipeline.NoHotfix):
        _report_no_hotfix(result, as_json)
        return
    if isinstance(result, list):
        _report_platforms(plan, result, as_json)
        return
    how = "reused" if result.reused else "built"
    _say_moved(result, base_tag)
    if as_json:
        print_json({"result": how, "ref": result.output_ref, "image_id": result.image_id, "was": result.was,
                    "record": result.record.path.name, **_smoke_facts(result)})
        return
    click.echo(f"{how} {result.output_ref} {result.image_id}")


def _say_moved(result: pipeline.BuildResult, base_tag: str) -> None:
    """A tag moved off another image is never silent: a reused older build takes it back from a newer one."""
    if result.was is not None:
        progress(f"==> {result.output_ref} moved to {result.image_id[:19]} (was {result.was}); moving it back: "
                 f"python build.py rollback --definition {base_tag} --tag {result.output_ref} --to {result.was[:19]}")


def _smoke_facts(result: pipeline.BuildResult) -> dict[str, Any]:
    verdict = result.smoke
    return {"smoke": verdict.status.value if verdict else None,
            "gpu_verified": bool(verdict and verdict.gpu_verified)}


def _report_no_hotfix(result: pipeline.NoHotfix, as_json: bool) -> None:
    """Not a failure: nothing to build, nothing tagged."""
    if as_json:
        print_json({"result": "no-hotfix-needed", "base": result.base_ref, "patches": list(result.patches)})
        return
    click.echo(result.message())


def _report_platforms(plan: pipeline.Plan, results: list[pipeline.BuildResult], as_json: bool) -> None:
    for r in results:
        _say_moved(r, plan.definition.tag)
    if as_json:
        print_json({"result": "built" if any(not r.reused for r in results) else "reused", "ref": plan.output_ref,
               "platforms": [{"platform": r.platform, "ref": r.output_ref, "image_id": r.image_id,
                              "reused": r.reused, "was": r.was, "record": r.record.path.name, **_smoke_facts(r)}
                             for r in results]})
        return
    for r in results:
        click.echo(f"{'reused' if r.reused else 'built'} {r.output_ref} {r.image_id} {r.platform}")
    names = ",".join(str(r.platform) for r in results)
    click.echo(f"platforms {plan.output_ref} {names} "
               f"(push them with an index: push {plan.output_ref} --platform {names} --registry HOST[:PORT]/PATH)")


@click.command()
@base_option
@repo_option
@pull_option
@click.option("--wheelhouse", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Folder of wheels for the patch set's pins.txt (default: download them into the cache).")
@click.option("--platform", "platform_text", default=None, metavar="PLATFORM",
              help="Render for this platform of the base's index (linux/amd64 or linux/arm64).")
@click.pass_obj
def render(obj: Ctx, base_tag: str, base_repo: str | None, pull: str, wheelhouse: Path | None,
           platform_text: str | None) -> None:
    """Print the Dockerfile `image` would build; build nothing.

    Its COPY reads a files/ folder (the patched files and their bytecode) that
    `image` sends to the engine as the build context; render writes no context,
    so `docker build` of this text alone fails: build with `image`.
    """
    from ..building import pipeline, seen_bases, sources
    from ..errors import EngineError, EngineLost

    plan = pipeline.plan(obj.root, base_tag, base_repo)
    plat = one_platform(platform_text)
    options = pipeline.BuildOptions(pull=pull, wheelhouse=wheelhouse, progress=progress)
    engine: Any = obj.engine
    seen = None
    try:
        engine.ping()
    except EngineLost:
        raise
    except EngineError as exc:
        # No engine: the base as this host last saw it, and the facts cache of that image, or the engine's error.
        found = seen_bases.recall(sources.cache_dir(obj.root), plan.base_ref)
        if found is None or plat is not None:
            raise EngineError(f"{exc}; and this host has no cached description of {plan.base_ref} to render from"
                              + (" (--platform needs the engine's index)" if plat is not None else ""),
                              hint="render it once where an engine answers; after that it renders without one"
                              ) from None
        seen, when = found
        progress(f"==> no engine answers: rendering from this host's description of {plan.base_ref} "
                 f"({seen.id[:19]}, seen {when}) and its cached files")
        engine = seen_bases.NoEngine(exc, plan.base_ref)
    dockerfile = pipeline.render_only(engine, plan, options, plat, seen=seen)
    if isinstance(dockerfile, pipeline.NoHotfix):
        progress(dockerfile.message())
        return
    click.echo(dockerfile, nl=False)
    progress("==> its COPY needs the files/ context that `image` sends with it; `docker build` of this text "
             "alone has none (build with `image`)")


@click.command("standin")
@click.option("--version", "version", required=True, help="vLLM release, e.g. 0.25.1.")
@click.option("--ref", type=TAG, default=None, help="Image reference (default vllm/vllm-openai:v<version>).")
@click.option("--sources-version", default=None, help="Use another release's wheel (for tests).")
# Spelled out here (standin.DEPS_MODES) so that the CLI does not import standin at start.
@click.option("--deps", type=click.Choice(("race", "serial")), default=None,
              help="Add nvidia-cutlass-dsl 4.5.2 (sub-wheels unpacked serially or as in a race) and "
                   "quack-kernels 0.6.5, as on an SM100 host.")
@click.option("--platform", "platform_text", default=None, metavar="LIST",
              help="linux/amd64, linux/arm64, or both comma-separated (default: the engine's own).")
@click.option("--publish", default=None, metavar="HOST[:PORT]/PATH",
              help="Push the stand-ins of every --platform and an index over them to "
                   "HOST[:PORT]/PATH/vllm-openai:v<version>, as upstream publishes its images.")
@click.pass_obj
def standin_cmd(obj: Ctx, version: str, ref: str | None, sources_version: str | None, deps: str | None,
                platform_text: str | None, publish: str | None) -> None:
    """Make a stand-in vLLM base image from the real wheel."""
    from ..building import platforms, standin
    from ..registry import refs

    plats = platforms.parse(platform_text)
    if publish is not None:
        if deps is not None:
            raise UsageError("--deps is for a local stand-in; --publish makes plain ones")
        where = refs.check_registry(publish)
        target = refs.check_reference(f"{where}/vllm-openai:v{version}", "--publish", tag_only=True)
        chosen = plats or [platforms.Platform("linux", "amd64"), platforms.Platform("linux", "arm64")]
        digest, children = standin.publish(obj.engine, obj.root, version, target, chosen, progress)
        for plat, child in children.items():
            click.echo(f"platform {plat} {child}")
        click.echo(f"published {target} {digest}")
        return
    if plats is not None and len(plats) > 1:
        raise UsageError("--platform with several platforms needs --publish (a local tag names one image)")
    ref = refs.check_reference(ref or f"vllm/vllm-openai:v{version}", "--ref", tag_only=True)
    info = standin.make(obj.engine, obj.root, version, ref, progress, sources_version=sources_version,
                        plat=plats[0] if plats else None, deps=deps)
    click.echo(f"stand-in {ref} {info.id} {info.os}/{info.architecture}")
