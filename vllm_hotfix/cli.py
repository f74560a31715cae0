"""The command line: parse, call the library, map its errors to exit codes.

Only this module ends the process or prints errors.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

import click

from . import __version__, pipeline, standin
from .engine import PULL_POLICIES, Engine
from .errors import BuildError, NoHotfixNeeded, PipelineError

REPO_ROOT = Path(__file__).resolve().parent.parent


def progress(line: str) -> None:
    click.echo(line, err=True)


def fail(exc: PipelineError) -> NoReturn:
    if isinstance(exc, BuildError) and exc.log_tail:
        click.echo("last lines of the build output:", err=True)
        for line in exc.log_tail:
            click.echo("  | " + line, err=True)
    click.secho(f"error: {exc}", fg="red", err=True)
    if exc.hint:
        click.echo(f"hint: {exc.hint}", err=True)
    sys.exit(exc.exit_code)


class Ctx:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._engine: Engine | None = None

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            self._engine = Engine.connect()
        return self._engine


def guarded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Turn library errors into one red line and the error's exit code."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except PipelineError as exc:
            fail(exc)
        except KeyboardInterrupt:
            click.secho("error: interrupted", fg="red", err=True)
            sys.exit(130)

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--root",
    type=click.Path(file_okay=False, path_type=Path),
    default=REPO_ROOT,
    show_default="the repository",
    help="Folder holding images/ and patches/ (and build/ records).",
)
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
@click.version_option(__version__)
@click.pass_context
def main(ctx: click.Context, root: Path, verbose: bool) -> None:
    """Turn a published vLLM image into a patched, tested, pushed image."""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    ctx.obj = Ctx(root.resolve())


base_option = click.option("--base", "base_tag", required=True, help="Base image tag, e.g. v0.25.1.")
repo_option = click.option("--base-repo", default=None, help="Base repository (default: the definition's).")
pull_option = click.option(
    "--pull", type=click.Choice(PULL_POLICIES), default="missing", show_default=True,
    help="When to pull the base from its registry.",
)


@main.command()
@base_option
@repo_option
@click.option("--tag", "output_ref", default=None, help="Output reference (default REPO:TAG-<suffix>).")
@pull_option
@click.option("--no-smoke", is_flag=True, help="Skip the smoke tests after the build.")
@click.option("--rebuild", is_flag=True, help="Build even if a recorded build has the same inputs.")
@click.option("--skip-included", is_flag=True,
              help="Leave out patches the base already carries (upstream shipped them) instead of stopping.")
@click.pass_obj
@guarded
def image(obj: Ctx, base_tag: str, base_repo: str | None, output_ref: str | None,
          pull: str, no_smoke: bool, rebuild: bool, skip_included: bool) -> None:
    """Build the patched image for base TAG."""
    plan = pipeline.plan(obj.root, base_tag, base_repo, output_ref)
    smoke = None
    if not no_smoke:
        from . import smoke as smokelib

        smoke = smokelib.runner(obj.root, progress)
    try:
        result = pipeline.build_image(
            obj.engine, plan, pull=pull, rebuild=rebuild, skip_included=skip_included, smoke=smoke,
            progress=progress,
        )
    except NoHotfixNeeded as exc:
        # Not a failure: nothing to build, nothing tagged.
        click.echo(f"{plan.base_ref} needs no hotfix: it already carries every patch of "
                   f"{plan.definition.patch_set} ({', '.join(exc.patches)}); nothing built")
        return
    how = "reused" if result.reused else "built"
    click.echo(f"{how} {result.output_ref} {result.image_id}")


@main.command()
@base_option
@repo_option
@pull_option
@click.pass_obj
@guarded
def render(obj: Ctx, base_tag: str, base_repo: str | None, pull: str) -> None:
    """Print the Dockerfile `image` would build; build nothing."""
    plan = pipeline.plan(obj.root, base_tag, base_repo)
    click.echo(pipeline.render_only(obj.engine, plan, pull, progress), nl=False)


@main.command("standin")
@click.option("--version", "version", required=True, help="vLLM release, e.g. 0.25.1.")
@click.option("--ref", default=None, help="Image reference (default vllm/vllm-openai:v<version>).")
@click.option("--sources-version", default=None, help="Use another release's wheel (for tests).")
@click.pass_obj
@guarded
def standin_cmd(obj: Ctx, version: str, ref: str | None, sources_version: str | None) -> None:
    """Make a stand-in vLLM base image from the real wheel."""
    ref = ref or f"vllm/vllm-openai:v{version}"
    info = standin.make(obj.engine, obj.root, version, ref, progress, sources_version=sources_version)
    click.echo(f"stand-in {ref} {info.id}")


def _smoke_options(gpu: str, serve_model: Path | None, serve_args: tuple[str, ...], concurrency: str,
                   requests_n: int, gpu_request: str = "auto", definition: str | None = None) -> Any:
    from . import smoke as smokelib
    from . import sweep

    return smokelib.SmokeOptions(gpu=gpu, gpu_request=gpu_request, definition=definition,
                                 serve_model=serve_model, serve_args=serve_args,
                                 levels=sweep.parse_levels(concurrency), requests=requests_n)


def _gpu_request_option(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    from . import gpu_access
    from .errors import SmokeError

    try:
        return gpu_access.parse_request(value)
    except SmokeError as exc:
        raise click.BadParameter(str(exc)) from exc


sweep_options = [
    click.option("--concurrency", default="1,2,4,8,16", show_default=True, help="Concurrency levels."),
    click.option("--requests", "requests_n", type=click.IntRange(1), default=32, show_default=True,
                 help="Requests per level."),
]


def with_options(options: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def apply(fn: Any) -> Any:
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return apply


@main.command()
@click.argument("image_ref", metavar="IMAGE")
@click.option("--gpu", type=click.Choice(["auto", "require", "off"]), default="auto", show_default=True,
              help="GPU checks: where a GPU request works (else GPU-unverified), required to run and pass, or never.")
@click.option("--gpu-request", default="auto", show_default=True, callback=_gpu_request_option,
              help="How containers ask for GPUs: auto (try CDI, --gpus, then an NVIDIA runtime), "
                   "cdi[:DEVICE], gpus or runtime[:NAME].")
@click.option("--definition", default=None, metavar="TAG",
              help="Run this image definition's patch-set checks (default: the one the image's labels name), "
                   "e.g. on the unpatched base to see them catch the bug.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), help="Write JSON here.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path), help="Write JUnit XML here.")
@click.option("--serve-model", type=click.Path(exists=True, path_type=Path), default=None,
              help="Model folder to serve with the image's own entrypoint for the sweep.")
@click.option("--serve-arg", "serve_args", multiple=True, help="Extra argument for `vllm serve` (repeatable).")
@with_options(sweep_options)
@click.pass_obj
@guarded
def smoke(obj: Ctx, image_ref: str, gpu: str, gpu_request: str, definition: str | None, report_path: Path | None,
          junit_path: Path | None, serve_model: Path | None, serve_args: tuple[str, ...], concurrency: str,
          requests_n: int) -> None:
    """Run the smoke checks inside IMAGE; exit non-zero if any fails."""
    from . import smoke as smokelib

    options = _smoke_options(gpu, serve_model, serve_args, concurrency, requests_n, gpu_request, definition)
    report = smokelib.Smoke(obj.engine, obj.root, options, progress).run(image_ref).to_dict()
    smokelib.record(obj.root, report)
    if report_path:
        smokelib.write_json(report, report_path)
    if junit_path:
        smokelib.write_junit(report, junit_path)
    failed = [c["name"] for c in report["checks"] if c["status"] == "fail"]
    gpu_note = "GPU-verified" if report["gpu_verified"] else "GPU-unverified"
    if failed:
        click.secho(f"error: smoke failed for {image_ref}: {', '.join(failed)}", fg="red", err=True)
        sys.exit(7)
    click.echo(f"smoke passed {image_ref} {report['image_id']} ({gpu_note}, {report['seconds']:.1f} s)")


@main.command("serve-check")
@click.option("--url", required=True, help="Base URL of a running OpenAI-compatible server.")
@click.option("--model", default=None, help="Model name (default: the first /v1/models lists).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), help="Write JSON here.")
@with_options(sweep_options)
@guarded
def serve_check(url: str, model: str | None, report_path: Path | None, concurrency: str, requests_n: int) -> None:
    """Run the concurrency sweep against an already running server."""
    import json

    from . import sweep
    from .errors import SmokeError

    levels = sweep.parse_levels(concurrency)
    sweep.wait_healthy(url.rstrip("/"), 30)
    result = sweep.sweep(url, model, levels, requests_n, progress=progress)
    if report_path:
        report_path.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    if not result.ok:
        raise SmokeError(sweep.failure_message(result))
    click.echo(f"sweep passed {url} levels {','.join(map(str, levels))}")


@main.command()
@click.argument("image_ref", metavar="IMAGE")
@click.option("--registry", required=True, help="HOST[:PORT]/PATH, e.g. 127.0.0.1:5000/ops.")
@click.option("--allow-gpu-unverified", is_flag=True, help="Push an image smoke-tested without GPU checks.")
@click.pass_obj
@guarded
def push(obj: Ctx, image_ref: str, registry: str, allow_gpu_unverified: bool) -> None:
    """Push a smoke-tested IMAGE to REGISTRY and confirm the digest there."""
    from . import push as pushlib

    pushed = pushlib.push(obj.engine, obj.root, image_ref, registry,
                          allow_gpu_unverified=allow_gpu_unverified, progress=progress)
    click.echo(f"pushed {pushed.ref} {pushed.digest}")


@main.command("check-upstream")
@click.option("--patches", "patch_set", required=True, help="Patch set to judge, e.g. v0.25.1.")
@click.option("--base", "base_tag", required=True, help="The newer release's tag, e.g. v0.27.0.")
@repo_option
@pull_option
@click.option("--from-wheel", is_flag=True, help="Read the release's PyPI wheel instead of its image.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of lines.")
@click.pass_obj
@guarded
def check_upstream(obj: Ctx, patch_set: str, base_tag: str, base_repo: str | None, pull: str,
                   from_wheel: bool, as_json: bool) -> None:
    """Say per patch of a set whether release TAG still needs it: needed, included or conflicts."""
    import json

    from . import upstream

    report = upstream.check(obj.root, patch_set, base_tag, engine=lambda: obj.engine, base_repo=base_repo,
                            pull=pull, from_wheel=from_wheel, progress=progress)
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2, sort_keys=True))
    else:
        for v in report.verdicts:
            click.echo(f"{v.patch}: {v.verdict} ({v.detail})")
    included = report.by_verdict("included")
    if included and len(included) == len(report.verdicts):
        progress(f"{base_tag} carries every patch of {patch_set}: it needs no hotfix")
    elif included:
        progress(f"{base_tag} carries {', '.join(included)}: drop them from a set for {base_tag}, "
                 "or build with --skip-included")


@main.command("new-patchset")
@base_option
@click.option("--from-pr", "pr", default=None, metavar="N|URL", help="Upstream PR number or URL.")
@click.option("--from-file", "diff_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="A diff saved on disk (offline).")
@click.option("--title", default=None, help="Patch title (default: the PR's, or the file's name).")
@click.option("--api-url", default=None,
              help="GitHub API base URL (default $VLLM_HOTFIX_GITHUB_API or GitHub).")
@click.option("--repo", "gh_repo", default="vllm-project/vllm", show_default=True,
              help="Repository of a bare PR number.")
@click.option("--suffix", default="hotfix", show_default=True,
              help="Output suffix if a definition is created.")
@repo_option
@pull_option
@click.option("--from-wheel", is_flag=True, help="Check against the release's PyPI wheel, not its image.")
@click.pass_obj
@guarded
def new_patchset(obj: Ctx, base_tag: str, pr: str | None, diff_file: Path | None, title: str | None,
                 api_url: str | None, gh_repo: str, suffix: str, base_repo: str | None, pull: str,
                 from_wheel: bool) -> None:
    """Add an upstream PR (or a diff file) as the next patch of base TAG's set."""
    from . import newpatch
    from .errors import UpstreamError

    if (pr is None) == (diff_file is None):
        raise UpstreamError("give exactly one of --from-pr N|URL and --from-file FILE")
    if pr is not None:
        change = newpatch.fetch_pr(pr, api=api_url, repo=gh_repo)
        if title:
            change = newpatch.Change(change.source, title, change.diff, change.number)
    else:
        assert diff_file is not None
        change = newpatch.from_file(diff_file, title)
    made = newpatch.create(obj.root, base_tag, change, engine=lambda: obj.engine, base_repo=base_repo,
                           pull=pull, from_wheel=from_wheel, suffix=suffix, progress=progress)
    click.echo(f"wrote {made.patch} (applies to {made.where} with zero fuzz)")
    click.echo(f"added {made.patch.name} to {made.series}")
    if made.definition is not None:
        click.echo(f"wrote {made.definition}")


def _build_summary(rec: Any) -> dict[str, Any]:
    data = rec.data
    pushes = data.get("pushes") or []
    last = pushes[-1] if pushes else None
    return {
        "created": data.get("created"),
        "image_id": data.get("image_id"),
        "output_ref": data.get("output_ref"),
        "smoke_status": data.get("smoke_status"),
        "push": {"ref": last.get("ref"), "digest": last.get("digest")} if last else None,
        "record": rec.path.name,
    }


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_obj
@guarded
def list_cmd(obj: Ctx, as_json: bool) -> None:
    """Each image definition, its patch set, and its last build, smoke and push."""
    import json

    from . import definitions, records

    rows: list[dict[str, Any]] = []
    for defn in definitions.load_all(obj.root):
        series = obj.root / "patches" / defn.patch_set / "series"
        names = [ln.split("#", 1)[0].strip() for ln in series.read_text(encoding="utf-8").splitlines()] \
            if series.is_file() else []
        builds = records.builds_for(obj.root, defn.tag)
        rows.append({
            "definition": defn.tag,
            "base": defn.base_ref(),
            "patch_set": defn.patch_set,
            "patches": [n for n in names if n],
            "builds": len(builds),
            "last_build": _build_summary(builds[0]) if builds else None,
        })
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    for row in rows:
        head = (f"{row['definition']}  base {row['base']}  "
                f"patch set {row['patch_set']} ({len(row['patches'])} patch(es))")
        last = row["last_build"]
        if last is None:
            click.echo(f"{head}  never built")
            continue
        push = last["push"]
        click.echo(
            f"{head}  last build {last['created']} {last['image_id']} {last['output_ref']}"
            f"  smoke {last['smoke_status'] or 'not run'}"
            f"  push {push['ref'] + '@' + str(push['digest']) if push else 'none'}"
        )


@main.command()
@base_option
@click.option("--to", "to_image", default=None,
              help="Image ID of a recorded build (default: the previous one).")
@click.option("--tag", "output_ref", default=None,
              help="Reference to move (default: the records' output_ref).")
@click.pass_obj
@guarded
def rollback(obj: Ctx, base_tag: str, to_image: str | None, output_ref: str | None) -> None:
    """Point base TAG's output tag back at the previous recorded build."""
    import time

    from . import definitions, records

    defn = definitions.load(obj.root, base_tag)
    builds = records.builds_for(obj.root, defn.tag)
    if not builds:
        raise PipelineError(f"no build records for {defn.tag} under {records.records_dir(obj.root)}",
                            hint="rollback needs at least two recorded builds (python build.py list)")
    ref = output_ref or str(builds[0].data.get("output_ref") or defn.output_ref())
    engine = obj.engine
    current = engine.image(ref)
    present = {r.image_id for r in builds if engine.image(r.image_id) is not None}
    if to_image is not None:
        want = to_image.removeprefix("sha256:")
        match = [r for r in builds if r.image_id.removeprefix("sha256:").startswith(want)]
        if not match:
            raise PipelineError(f"{to_image}: no build record of {defn.tag} has that image ID")
        target: records.Record | None = match[0]
        if match[0].image_id not in present:
            raise PipelineError(f"{match[0].image_id}: recorded but no longer in the engine")
    else:
        target = records.rollback_target(builds, current.id if current else None, present)
    if target is None:
        raise PipelineError(
            f"no earlier build of {defn.tag} to roll {ref} back to "
            "(none older whose image is still in the engine and whose smoke did not fail)",
            hint="python build.py list shows the records",
        )
    engine.tag(target.image_id, ref)
    target.data.setdefault("rollbacks", []).append({
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "ref": ref,
        "from": current.id if current else None,
    })
    target.save()
    was = current.id if current else "untagged"
    click.echo(f"rolled back {ref} to {target.image_id} (built {target.data.get('created')}, "
               f"smoke {target.data.get('smoke_status') or 'not run'}; was {was})")
    progress(f"push it to move the registry tag too: python build.py push {ref} --registry HOST:PORT/PATH")


def run(argv: Sequence[str] | None = None) -> int:
    try:
        main.main(args=list(argv) if argv is not None else None, prog_name="build.py", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0
