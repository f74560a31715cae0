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
from .errors import BuildError, PipelineError

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
@click.pass_obj
@guarded
def image(obj: Ctx, base_tag: str, base_repo: str | None, output_ref: str | None,
          pull: str, no_smoke: bool, rebuild: bool) -> None:
    """Build the patched image for base TAG."""
    plan = pipeline.plan(obj.root, base_tag, base_repo, output_ref)
    smoke = None
    if not no_smoke:
        from . import smoke as smokelib

        smoke = smokelib.runner(obj.root, progress)
    result = pipeline.build_image(
        obj.engine, plan, pull=pull, rebuild=rebuild, smoke=smoke, progress=progress
    )
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


def run(argv: Sequence[str] | None = None) -> int:
    try:
        main.main(args=list(argv) if argv is not None else None, prog_name="build.py", standalone_mode=True)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0
