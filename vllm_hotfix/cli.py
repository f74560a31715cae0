"""The command line: parse, call the library, print; map its errors to exit codes.

Only this module prints errors, and only :func:`_run` turns them into an exit
code (the table in ``--help`` is made from errors.py, so it names every one).
It is long because it declares the options of twelve commands (smoke alone
takes the GPU, serve, reference-answer, signing and launcher options) and the
checked argument types they share; each command's body only calls the
library and prints what comes back.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import traceback
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from . import __version__
from .builders import BUILDERS
from .engine import Engine
from .errors import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    BaseImageError,
    BuildError,
    PinError,
    PipelineError,
    Terminated,
    UsageError,
    exit_table,
)
from .pulling import PULL_POLICIES

if TYPE_CHECKING:
    from . import pipeline

REPO_ROOT = Path(__file__).resolve().parent.parent


def progress(line: str) -> None:
    # An engine's last status chunk can be empty (a push ended with a blank line): say only what has words.
    if line.strip():
        click.echo(line, err=True)


# Hints name the command line's flags; run through `make`, the user's handle is a make variable.
_MAKE_SPELLING = {"--allow-gpu-unverified": "ALLOW_GPU_UNVERIFIED=1", "--platform all": "PLATFORM=all"}
VIA_MAKE_ENV = "VLLM_HOTFIX_VIA_MAKE"


def _json(data: Any) -> None:
    import json

    click.echo(json.dumps(data, indent=2, sort_keys=True))


def report_error(exc: PipelineError) -> int:
    """One red line (after the build's last lines), a hint if there is one; the error's exit code."""
    if isinstance(exc, BuildError) and exc.log_tail:
        click.echo("last lines of the build output:", err=True)
        for line in exc.log_tail:
            click.echo("  | " + line, err=True)
    click.secho(f"error: {exc}", fg="red", err=True)
    if exc.hint:
        hint = exc.hint
        if os.environ.get(VIA_MAKE_ENV):
            for flag, variable in _MAKE_SPELLING.items():
                hint = hint.replace(f"pass {flag}", f"run make again with {variable}").replace(flag, variable)
        click.echo(f"hint: {hint}", err=True)
    return exc.exit_code


class Ctx:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._engine: Engine | None = None

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            from . import leftovers

            # No ping: the first real call says just as clearly that no engine answers.
            self._engine = Engine.connect(ping=False)
            # Runs that died (killed, or the engine lost under them) left
            # containers and images behind, and notes saying so: remove them
            # before new work, and note this run's own containers the same way.
            leftovers.sweep(self._engine, self.root, progress)
            leftovers.watch(self._engine, self.root)
        return self._engine


class Checked(click.ParamType):
    """A value checked by a function of :mod:`refs` while the command line is parsed, before any work.

    Every IMAGE, REF, --tag and --base-repo of every command is one of these
    (a unit test walks the commands to hold that), so no command can reach the
    engine with a reference the engine would refuse with its own words.
    """

    def __init__(self, name: str, check: Callable[[str, str], str]) -> None:
        self.name = name
        self._check = check

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if value is None:
            return None
        what = self.name
        if param is not None:
            what = param.opts[0] if isinstance(param, click.Option) else (param.metavar or param.name or what)
        return self._check(str(value), what)


def _tag_only(value: str, what: str) -> str:
    from . import refs

    return refs.check_reference(value, what, tag_only=True)


def _image_id(value: str, what: str) -> str:
    from . import refs

    if not refs.IMAGE_ID.match(value):
        raise UsageError(f"{what} {refs.shown(value)}: not an image ID (sha256:HEX or 12+ hex digits; list shows them)")
    return value


def _refs_check(name: str) -> Callable[[str, str], str]:
    def check(value: str, what: str) -> str:
        from . import refs

        fn: Callable[[str, str], str] = getattr(refs, name)
        return fn(value, what)

    return check


IMAGE = Checked("image", _refs_check("check_image"))  # a reference or an image ID in the engine
REFERENCE = Checked("reference", _refs_check("check_reference"))
TAG = Checked("tag", _tag_only)  # a name:tag to set (no digest)
REPOSITORY = Checked("repository", _refs_check("check_repository"))
IMAGE_ID = Checked("image ID", _image_id)


EXIT_CODES = "\b\nExit codes:\n" + "".join(f"{code:>4}  {meaning}\n" for code, meaning in exit_table()) + """
\b
Environment:
  DOCKER_HOST           engine to use (default: the local socket)
  DOCKER_CONFIG         where `docker login` stored registry credentials
  VLLM_HOTFIX_CACHE     wheel and rootfs cache (default: build/cache)
  VLLM_HOTFIX_RECORDS   the journal folder (default: build/records)
  VLLM_HOTFIX_RUN_ID    label put on every container a run starts
  VLLM_HOTFIX_PROBE_TIMEOUT  seconds a probe of the base may take (120)
  VLLM_HOTFIX_GITHUB_API  GitHub API base URL for new-patchset
  VLLM_HOTFIX_BINFMT_DIR  where the host registers emulators (default /proc/sys/fs/binfmt_misc)
"""


def _verbose(_ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        logging.getLogger("vllm_hotfix").setLevel(logging.DEBUG)


def _check_root(root: Path, where: str) -> Path:
    """The project folder must exist: a mistyped --root would otherwise show an empty project and exit 0."""
    from . import refs

    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise UsageError(f"{where} {refs.shown(str(root))}: {what}",
                         hint="--root names the folder holding images/ and patches/")
    return root.resolve()


def _set_root(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    # --root after the subcommand: the same as before it.
    if value is not None:
        ctx.find_object(Ctx).root = _check_root(value, "--root")  # type: ignore[union-attr]


# Commands that keep files in VLLM_HOTFIX_CACHE: a cache that cannot be written is a usage error at once.
_CACHE_USERS = frozenset({"image", "render", "standin", "smoke", "check-upstream", "new-patchset", "push"})
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_environment(command: str | None) -> None:
    """Environment values the tool puts into names, labels and paths, checked before any work."""
    from . import refs

    run_id = os.environ.get("VLLM_HOTFIX_RUN_ID")
    if run_id and not _RUN_ID.fullmatch(run_id):
        raise UsageError(f"VLLM_HOTFIX_RUN_ID={refs.shown(run_id, 60)}: expected up to 128 letters, digits, "
                         "'.', '_' or '-' (it names containers' labels and scratch folders)")
    cache = os.environ.get("VLLM_HOTFIX_CACHE")
    if cache is not None and command in _CACHE_USERS:
        problem = writable_folder_problem(Path(cache)) if cache else "is empty"
        if problem:
            raise UsageError(f"VLLM_HOTFIX_CACHE={refs.shown(cache, 120)}: {problem}",
                             hint="point it at a folder this user can write, or unset it (default build/cache)")


def writable_folder_problem(folder: Path) -> str | None:
    """Why files cannot be written in ``folder`` (made if missing), or None if they can."""
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return f"{probe} is a file, not a folder"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"{probe} is not writable by this user"
    return None


def check_output_file(path: Path | None, option: str) -> None:
    """A file a command writes at its end (--report, --junit): its folder must be makeable before the work."""
    if path is None:
        return
    from . import refs

    if path.is_dir():
        raise UsageError(f"{option} {refs.shown(str(path))}: is a folder; give a file name")
    problem = writable_folder_problem(path.parent)
    if problem:
        raise UsageError(f"{option} {refs.shown(str(path))}: cannot write there: {problem}")


@click.group(context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES,
             invoke_without_command=True)
@click.option(
    "--root",
    type=click.Path(path_type=Path),
    default=REPO_ROOT,
    show_default="the repository",
    help="Folder holding images/ and patches/ (and build/ records); also accepted after the subcommand.",
)
@click.option("-v", "--verbose", is_flag=True, expose_value=False, is_eager=True, callback=_verbose,
              help="Debug logging of the tool (also accepted after the subcommand).")
@click.version_option(__version__)
@click.pass_context
def main(ctx: click.Context, root: Path) -> None:
    """Turn a published vLLM image into a patched, tested, pushed image."""
    if ctx.invoked_subcommand is None:
        # A bare `build.py`: the help, plainly (not "error: Usage: ..."); nothing was asked, nothing failed.
        click.echo(ctx.get_help())
        return
    check_environment(ctx.invoked_subcommand)
    ctx.obj = Ctx(_check_root(root, "--root"))
    ctx.call_on_close(ctx.obj.close)


base_option = click.option("--base", "base_tag", required=True,
                           help="Base image tag, e.g. v0.25.1 (or TAG-VARIANT for a variant definition).")
repo_option = click.option("--base-repo", type=REPOSITORY, default=None,
                           help="Base repository (default: the definition's).")
platform_option = click.option(
    "--platform", "platform_text", default=None, metavar="LIST|all",
    help="linux/amd64, linux/arm64, both comma-separated, or all (every platform of the base's index). "
         "Default: all when the base is an index in a registry, the engine's own when the base is only local.",
)
pull_option = click.option(
    "--pull", type=click.Choice(PULL_POLICIES), default="missing", show_default=True,
    help="When to pull the base from its registry.",
)


@main.command()
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
@click.pass_obj
def image(obj: Ctx, base_tag: str, base_repo: str | None, output_ref: str | None,
          pull: str, no_smoke: bool, rebuild: bool, skip_included: bool, force: bool, builder: str, as_json: bool,
          wheelhouse: Path | None, platform_text: str | None) -> None:
    """Build the patched image for base TAG (one per platform of the base, tagged OUTPUT-<machine>)."""
    from . import pipeline, platforms

    wanted = platforms.parse(platform_text)
    plan = pipeline.plan(obj.root, base_tag, base_repo, output_ref)
    def smoke(engine: Engine, image_id: str, want: Any) -> Any:
        # Imported when a build is smoked, not for one that is reused (the sweep's HTTP stack is ~0.1 s).
        from . import smoke as smokelib

        return smokelib.runner(obj.root, progress)(engine, image_id, want)

    options = pipeline.BuildOptions(pull=pull, rebuild=rebuild, skip_included=skip_included, force=force,
                                    builder=builder, wheelhouse=wheelhouse, smoke=None if no_smoke else smoke,
                                    progress=progress)
    local = obj.engine.image(plan.base_ref)
    bases = pipeline.platform_bases(obj.engine, plan, wanted, pull, asked=platform_text is not None,
                                    local=local, progress=progress)
    if bases is not None:
        results = pipeline.build_platforms(obj.engine, plan, bases, options)
        if isinstance(results, pipeline.NoHotfix):
            _report_no_hotfix(results, as_json)
        else:
            _report_platforms(plan, results, as_json)
        return
    result = pipeline.build_image(obj.engine, plan, options, base_info=local)
    if isinstance(result, pipeline.NoHotfix):
        _report_no_hotfix(result, as_json)
        return
    how = "reused" if result.reused else "built"
    if as_json:
        _json({"result": how, "ref": result.output_ref, "image_id": result.image_id,
               "record": result.record.path.name, **_smoke_facts(result)})
        return
    click.echo(f"{how} {result.output_ref} {result.image_id}")


def _smoke_facts(result: pipeline.BuildResult) -> dict[str, Any]:
    verdict = result.smoke
    return {"smoke": verdict.status.value if verdict else None,
            "gpu_verified": bool(verdict and verdict.gpu_verified)}


def _report_no_hotfix(result: pipeline.NoHotfix, as_json: bool) -> None:
    """Not a failure: nothing to build, nothing tagged."""
    if as_json:
        _json({"result": "no-hotfix-needed", "base": result.base_ref, "patches": list(result.patches)})
        return
    click.echo(result.message())


def _report_platforms(plan: pipeline.Plan, results: list[pipeline.BuildResult], as_json: bool) -> None:
    if as_json:
        _json({"result": "built" if any(not r.reused for r in results) else "reused", "ref": plan.output_ref,
               "platforms": [{"platform": r.platform, "ref": r.output_ref, "image_id": r.image_id,
                              "reused": r.reused, "record": r.record.path.name, **_smoke_facts(r)}
                             for r in results]})
        return
    for r in results:
        click.echo(f"{'reused' if r.reused else 'built'} {r.output_ref} {r.image_id} {r.platform}")
    names = ",".join(str(r.platform) for r in results)
    click.echo(f"platforms {plan.output_ref} {names} "
               f"(push them with an index: push {plan.output_ref} --platform {names} --registry HOST[:PORT]/PATH)")


@main.command()
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
    from . import pipeline

    plan = pipeline.plan(obj.root, base_tag, base_repo)
    plat = _one_platform(platform_text)
    dockerfile = pipeline.render_only(obj.engine, plan, pull, progress, wheelhouse=wheelhouse, platform=plat)
    if isinstance(dockerfile, pipeline.NoHotfix):
        progress(dockerfile.message())
        return
    click.echo(dockerfile, nl=False)
    progress("==> its COPY needs the files/ context that `image` sends with it; `docker build` of this text "
             "alone has none (build with `image`)")


def _one_platform(text: str | None) -> Any:
    from . import platforms

    if text is None:
        return None
    wanted = platforms.parse(text)
    if wanted is None or len(wanted) != 1:
        raise UsageError(f"--platform {text!r}: name one platform here (linux/amd64 or linux/arm64)")
    return wanted[0]


@main.command("standin")
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
    from . import platforms, refs, standin

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


def _smoke_options(gpu: str, serve_model: Path | None, serve_args: tuple[str, ...], concurrency: str,
                   requests_n: int, gpu_request: str = "auto", definition: str | None = None,
                   min_tokens: int | None = None, answers: Any = None, keep_going: bool = False,
                   compile_cache: bool = True) -> Any:
    from . import reference, sweep
    from . import smoke as smokelib

    answers = answers or reference.answer_options(None, None, None)
    if serve_model is None and (answers.reference is not None or answers.record is not None):
        raise UsageError("--reference and --record-reference need --serve-model (the model the answers are of)")
    sweep.check_min_tokens(min_tokens, answers.reference.max_tokens if answers.reference else sweep.MAX_TOKENS)
    return smokelib.SmokeOptions(gpu=gpu, gpu_request=gpu_request, definition=definition,
                                 serve_model=serve_model, serve_args=serve_args,
                                 levels=sweep.parse_levels(concurrency), requests=requests_n,
                                 min_tokens=min_tokens, reference=answers.reference,
                                 record_reference=answers.record, logprob_tolerance=answers.tolerance,
                                 keep_going=keep_going, compile_cache=compile_cache)


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
    click.option("--min-tokens", type=int, default=None,
                 help="Fail a request whose reply has fewer completion tokens (each asks for 32): for a model "
                      "that cannot stop early, where a short reply means it went wrong."),
    click.option("--reference", "reference_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="Reference answers (from --record-reference on a trusted image, same model and GPU model): "
                      "every reply at every level must equal its answer, or diverge from it only at a near-tie."),
    click.option("--record-reference", "record_path", type=click.Path(dir_okay=False, path_type=Path),
                 default=None,
                 help="Record reference answers to this new file first (the prompt set once each, concurrency 1, "
                      "temperature 0, top-5 logprobs), then sweep against them. Only from a trusted image."),
    click.option("--logprob-tolerance", type=float, default=None, metavar="NATS",
                 help="A divergence from the reference passes if the reference's token is in the served top-5 "
                      "and at most this far below the served token (default 0.5)."),
]


def with_options(options: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def apply(fn: Any) -> Any:
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return apply


@main.command()
@click.argument("image_ref", metavar="IMAGE", type=IMAGE)
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
@click.option("--sign-key", default=None, metavar="KEY",
              help="Sign the verdict with this ECDSA P-256 private key (PEM file, or env:NAME); kept in the journal "
                   "and attached beside the image when it is pushed.")
@click.option("--attestation", "attestation_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the signed verdict (DSSE envelope) here; needs --sign-key.")
@click.option("--keep-going", is_flag=True,
              help="Run every phase (checks, GPU checks, serve sweep) even after one failed; by default a failed "
                   "phase ends the run and the later ones are recorded as skipped.")
@click.option("--compile-cache/--no-compile-cache", default=True, show_default=True,
              help="Keep Triton, torch, vLLM and FlashInfer compile caches in "
                   "VLLM_HOTFIX_CACHE/compile/<base ID>/<GPU model>/, mounted at /root/.cache in GPU containers.")
@click.option("--launcher", type=click.Choice(["docker", "podman", "kubernetes"]), default="docker",
              show_default=True,
              help="What starts the checks in the image: the Docker engine (as always), the one-entry runner "
                   "through podman (GPUs by CDI), or a Kubernetes Job.")
@click.option("--emit", "emit_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="kubernetes: write the Job and its ConfigMap (multi-document YAML) here.")
@click.option("--submit", is_flag=True, help="kubernetes: create the Job, follow it to its end, attach its "
                                              "signed verdict in the registry and report the one read back.")
@click.option("--kubeconfig", default=None, type=click.Path(exists=True, dir_okay=False), help="kubernetes: config.")
@click.option("--namespace", default="default", show_default=True, help="kubernetes: the Job's namespace.")
@click.option("--node-selector", default=None, metavar="KEY=VALUE",
              help="kubernetes: e.g. nvidia.com/gpu.product=NVIDIA-H200.")
@click.option("--gpus", "gpu_count", type=click.IntRange(1), default=1, show_default=True,
              help="kubernetes: nvidia.com/gpu the Job asks for.")
@click.option("--sign-secret", default=None, metavar="NAME",
              help="kubernetes: the Secret holding the signing key (key key.pem); the runner in the Job signs.")
@click.option("--deadline", type=click.IntRange(60), default=3600, show_default=True,
              help="kubernetes: the Job's activeDeadlineSeconds.")
@with_options(sweep_options)
@click.pass_obj
def smoke(obj: Ctx, image_ref: str, gpu: str, gpu_request: str, definition: str | None, report_path: Path | None,
          junit_path: Path | None, serve_model: Path | None, serve_args: tuple[str, ...], sign_key: str | None,
          attestation_path: Path | None, keep_going: bool, compile_cache: bool, launcher: str,
          emit_path: Path | None, submit: bool, kubeconfig: str | None, namespace: str, node_selector: str | None,
          gpu_count: int, sign_secret: str | None, deadline: int, concurrency: str, requests_n: int,
          min_tokens: int | None, reference_path: Path | None, record_path: Path | None,
          logprob_tolerance: float | None) -> None:
    """Run the smoke checks inside IMAGE; exit non-zero if any fails."""
    from . import attest, records, reference, signing
    from . import smoke as smokelib

    options = _smoke_options(gpu, serve_model, serve_args, concurrency, requests_n, gpu_request, definition,
                             min_tokens, reference.answer_options(reference_path, record_path, logprob_tolerance),
                             keep_going=keep_going, compile_cache=compile_cache)
    if attestation_path is not None and sign_key is None and sign_secret is None:
        raise UsageError("--attestation needs --sign-key")
    for path, option in ((report_path, "--report"), (junit_path, "--junit"), (attestation_path, "--attestation"),
                         (emit_path, "--emit")):
        check_output_file(path, option)
    if launcher != "kubernetes" and (emit_path or submit or sign_secret or node_selector or kubeconfig):
        raise UsageError("--emit, --submit, --kubeconfig, --node-selector and --sign-secret need "
                         "--launcher kubernetes")
    if sign_key is not None:
        signing.load_private_key(sign_key)  # a key that cannot sign fails before the run, not after it
    if launcher == "kubernetes":
        from .launchers import kubernetes as k8s

        spec = k8s.JobSpec(f"vllm-hotfix-smoke-{uuid.uuid4().hex[:10]}", namespace=namespace, gpus=gpu_count,
                           node_selector=k8s.parse_selector(node_selector), key_secret=sign_secret,
                           deadline_s=deadline)
        if sign_key is not None:
            raise UsageError("--launcher kubernetes signs in the cluster: give --sign-secret NAME, not --sign-key")
        if not emit_path and not submit:
            raise UsageError("--launcher kubernetes needs --emit FILE, --submit, or both")
    records.ensure_writable(obj.root)
    if launcher != "docker":
        verdict, envelope = _smoke_elsewhere(obj, image_ref, options, launcher, sign_key, emit_path,
                                             spec if launcher == "kubernetes" else None, submit, kubeconfig)
        if verdict is None:
            return
        entry = records.append_verdict(obj.root, verdict)
        if envelope is not None:
            from .launchers.plan import keep_envelope

            progress(f"==> signed verdict: {keep_envelope(obj.root, verdict.image_id, envelope, attestation_path)}")
        _finish_smoke(verdict, image_ref, entry.path, report_path, junit_path)
        return
    if obj.engine.image(image_ref) is None:
        # Nothing was checked, so nothing failed: the image is missing (exit 4), as a missing base is.
        raise BaseImageError(f"image {image_ref!r} is not in the engine",
                             hint="build it with `image`, or pull it first")
    verdict = smokelib.Smoke(obj.engine, obj.root, options, progress).run(image_ref)
    entry = records.append_verdict(obj.root, verdict)
    if sign_key is not None and verdict.judged:
        info = obj.engine.image(verdict.image_id)
        if info is not None:
            signed = attest.sign(obj.root, verdict, info, image_ref, sign_key, attestation_path)
            progress(f"==> signed verdict: {signed}")
    _finish_smoke(verdict, image_ref, entry.path, report_path, junit_path)


def _finish_smoke(verdict: Any, image_ref: str, entry: Path, report_path: Path | None,
                  junit_path: Path | None) -> None:
    from . import smoke as smokelib
    from . import verdicts

    if report_path:
        smokelib.write_json(verdict, report_path)
    if junit_path:
        smokelib.write_junit(verdict, junit_path)
    verdicts.require_pass(
        verdict, image_ref, fail_hint=f"verdict: {entry}",
        incomplete_hint="the host could not run a check; run it where it can (the image's earlier verdict stands)",
    )
    gpu_note = "GPU-verified" if verdict.gpu_verified else "GPU-unverified"
    click.echo(f"smoke passed {image_ref} {verdict.image_id} ({gpu_note}, {verdict.seconds:.1f} s; phases: "
               f"{smokelib.format_phases(dict(verdict.phases))})")


def _smoke_elsewhere(obj: Ctx, image_ref: str, options: Any, launcher: str, sign_key: str | None,
                     emit_path: Path | None, spec: Any, submit: bool, kubeconfig: str | None) -> tuple[Any, Any]:
    """Smoke through the runner with podman or a Kubernetes Job; (verdict, envelope), or (None, None) after --emit."""
    from .launchers import elsewhere

    def engine() -> Engine:
        return obj.engine

    if launcher == "podman":
        return elsewhere.podman(obj.root, engine, image_ref, options, sign_key, progress)
    verdict, envelope, wrote = elsewhere.kubernetes(obj.root, engine, image_ref, options, spec, emit_path, submit,
                                                    kubeconfig, progress)
    if wrote:
        click.echo(wrote)
    return verdict, envelope


@main.command("serve-check")
@click.option("--url", required=True, help="Base URL of a running OpenAI-compatible server.")
@click.option("--model", default=None, help="Model name (default: the first /v1/models lists).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), help="Write JSON here.")
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=30, show_default=True,
              help="Seconds to wait for the server's /health before giving up.")
@click.option("--keep-going", is_flag=True, help="Run every level even after one failed (while the server lives).")
@with_options(sweep_options)
def serve_check(url: str, model: str | None, report_path: Path | None, wait_s: float, keep_going: bool,
                concurrency: str,
                requests_n: int, min_tokens: int | None, reference_path: Path | None, record_path: Path | None,
                logprob_tolerance: float | None) -> None:
    """Run the concurrency sweep against an already running server."""
    import json

    from . import reference as refmod
    from . import sweep
    from .errors import SmokeError

    sweep.check_url(url)
    levels = sweep.parse_levels(concurrency)
    answers = refmod.answer_options(reference_path, record_path, logprob_tolerance)
    ref = answers.reference
    sweep.check_min_tokens(min_tokens, ref.max_tokens if ref else sweep.MAX_TOKENS)
    check_output_file(report_path, "--report")
    progress(f"==> waiting up to {wait_s:.0f} s for {url.rstrip('/')}/health")
    sweep.wait_healthy(url.rstrip("/"), wait_s, progress=progress)
    if answers.record is not None:
        progress(f"==> recording reference answers from {url.rstrip('/')} (concurrency 1)")
        ref = refmod.write(sweep.record(url, model, progress=progress), answers.record)
        click.echo(f"recorded {len(ref.answers)} reference answers to {answers.record} (sha256 {ref.sha256})")
    result = sweep.sweep(url, model, levels, requests_n, min_tokens=min_tokens, reference=ref,
                         tolerance=answers.tolerance, progress=progress, watch=sweep.HealthWatch(url),
                         keep_going=keep_going)
    if report_path:
        from .atomic import write_atomic  # a full disk is one line naming the file, not a dump

        write_atomic(report_path, json.dumps(result.to_dict(), indent=2) + "\n")
    if not result.ok:
        raise SmokeError(sweep.failure_message(result))
    checked = f", every reply matched {ref.path} (near-ties within {answers.tolerance} nats)" if ref else ""
    click.echo(f"sweep passed {url} levels {','.join(map(str, levels))}{checked}")


@main.command()
@click.argument("image_ref", metavar="IMAGE", type=REFERENCE)
@click.option("--registry", required=True, help="HOST[:PORT]/PATH, e.g. 127.0.0.1:5000/ops.")
@click.option("--allow-gpu-unverified", is_flag=True, help="Push an image smoke-tested without GPU checks.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--platform", "platform_text", default=None, metavar="LIST|all",
              help="Push IMAGE-<machine> of each platform (all: every one `image` made) and an index over them "
                   "as IMAGE. Default: every platform `image` built for IMAGE (IMAGE alone after a "
                   "single-platform build).")
@click.option("--require-attestation", default=None, metavar="PUBKEY",
              help="Let the image through on a signed verdict that verifies with this public key (PEM file, or "
                   "env:NAME) instead of the local journal's verdict.")
@click.option("--attestation", "attestation_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="A signed verdict (DSSE envelope) made elsewhere, e.g. on the GPU host; "
                                 "attached beside the image.")
@click.pass_obj
def push(obj: Ctx, image_ref: str, registry: str, allow_gpu_unverified: bool, as_json: bool,
         platform_text: str | None, require_attestation: str | None, attestation_path: Path | None) -> None:
    """Push a smoke-tested IMAGE to REGISTRY and confirm the digest there."""
    from . import platforms, refs
    from . import push as pushlib

    refs.check_registry(registry)
    policy = pushlib.Gate(allow_gpu_unverified, require_attestation, attestation_path)
    # Without --platform, push what `image` built for IMAGE: every platform of a multi-platform build.
    plats = platforms.parse(platform_text) if platform_text is not None else \
        pushlib.plain_selection(obj.engine, obj.root, image_ref)
    if platform_text is not None or plats is not None:
        index = pushlib.push_index(obj.engine, obj.root, image_ref, registry, plats, policy=policy,
                                   progress=progress)
        if as_json:
            _json({"ref": index.ref, "digest": index.digest, "media_type": index.media_type,
                   "children": index.children})
            return
        for child in index.children:
            click.echo(f"pushed {child['ref']} {child['digest']} {child['platform']}")
        click.echo(f"pushed index {index.ref} {index.digest}")
        return
    pushed = pushlib.push(obj.engine, obj.root, image_ref, registry, policy=policy, progress=progress)
    if as_json:
        _json({"ref": pushed.ref, "digest": pushed.digest, "image_id": pushed.image_id, "verdict": pushed.verdict,
               "attestations": list(pushed.attestations)})
        return
    click.echo(f"pushed {pushed.ref} {pushed.digest}")


@main.command()
@click.argument("ref", metavar="REF", type=IMAGE)
@click.option("--key", "key", required=True, metavar="PUBKEY",
              help="The public key the verdict must be signed with (PEM file, or env:NAME).")
@click.option("--require-gpu", "require_gpu", default="", metavar="NAME,...",
              help="GPU products the signed smoke run must have run on, e.g. H200 (matched in the device names).")
@click.option("--allow-gpu-unverified", is_flag=True, help="Accept a signed pass that was not GPU-verified.")
@click.option("--attestation", "attestation_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              default=None, help="Check this signed verdict file instead of the registry's; REF is then the "
                                 "image's ID (sha256:...), the subject it must name.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_obj
def verify(obj: Ctx, ref: str, key: str, require_gpu: str, allow_gpu_unverified: bool,
           attestation_path: Path | None, as_json: bool) -> None:
    """Check the signed smoke verdict attached to REF in its registry (or given as a file)."""
    from . import attest

    products = [p.strip() for p in require_gpu.split(",") if p.strip()]
    if attestation_path is not None:
        if not re.fullmatch(r"sha256:[0-9a-f]{64}", ref):
            raise UsageError(f"verify --attestation: REF {ref!r} must be the image's ID (sha256:<64 hex>)")
        digest = ref
        accepted = attest.judge(attest.local_candidates(obj.root, ref, attestation_path), {ref}, ref, key,
                                gpu_verified=not allow_gpu_unverified, gpu_products=products)
    else:
        digest, accepted = attest.verify(obj.engine, ref, key, gpu_verified=not allow_gpu_unverified,
                                         gpu_products=products)
    devices = ", ".join(str(d) for d in (accepted.report.get("gpu") or {}).get("devices") or []) or "no GPU"
    if as_json:
        _json({"ref": ref, "digest": digest, "key_id": accepted.key_id, "status": accepted.report.get("status"),
               "gpu_verified": accepted.gpu_verified, "devices": devices, "source": accepted.source})
        return
    click.echo(f"verified {ref} {digest}: signed pass by key {accepted.key_id[:12]} "
               f"({'GPU-verified' if accepted.gpu_verified else 'GPU-unverified'} on {devices})")


@main.command("check-upstream")
@click.option("--patches", "patch_set", required=True, help="Patch set to judge, e.g. v0.25.1.")
@click.option("--base", "base_tag", required=True, help="The newer release's tag, e.g. v0.27.0.")
@repo_option
@pull_option
@click.option("--from-wheel", is_flag=True, help="Read the release's PyPI wheel instead of its image.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of lines.")
@click.option("--platform", "platform_text", default=None, metavar="PLATFORM",
              help="Judge this platform's image (or wheel) of the release: linux/amd64 or linux/arm64.")
@click.pass_obj
def check_upstream(obj: Ctx, patch_set: str, base_tag: str, base_repo: str | None, pull: str,
                   from_wheel: bool, as_json: bool, platform_text: str | None) -> None:
    """Say per patch of a set whether release TAG still needs it: needed, included or conflicts."""
    import json

    from . import upstream

    report = upstream.check(obj.root, patch_set, base_tag, engine=lambda: obj.engine, base_repo=base_repo,
                            pull=pull, from_wheel=from_wheel, progress=progress,
                            platform=_one_platform(platform_text))
    if as_json:
        click.echo(json.dumps(report.as_dict(), indent=2, sort_keys=True))
    else:
        for v in report.verdicts:
            click.echo(f"{v.patch}: {v.verdict} ({v.detail})")
        for judged in report.pins:
            click.echo(f"pin {judged['pin']}: {judged['verdict']} ({judged['detail']})")
    included = report.by_verdict("included")
    contradicting = report.pins_by_verdict("contradicts")
    if included and report.needs_hotfix:
        what = "every patch" if report.carries_every_patch else ", ".join(included)
        progress(f"{base_tag} carries {what} of {patch_set}: drop them from a set for {base_tag}, "
                 "or build with --skip-included")
    if contradicting:
        # The release's own requirements rule these versions out: building the set on it
        # would fail pip check, so the set is not done with, whatever its patches say.
        raise PinError(f"{base_tag} requires other versions than {patch_set}'s pins {', '.join(contradicting)}: "
                       f"the set still needs attention", pin=contradicting[0].split("==")[0],
                       hint=f"update or drop them in patches/{patch_set}/pins.txt for a set for {base_tag}")
    if not report.needs_hotfix:
        progress(f"{base_tag} carries every patch of {patch_set}"
                 f"{' and requires its pinned versions' if report.pins else ''}: it needs no hotfix")
    elif report.carries_every_patch:
        kept = [p["pin"] for p in report.pins if p.get("verdict") != "included"]
        progress(f"{base_tag} carries every patch of {patch_set} but not its pins {', '.join(kept)}: "
                 "a set for it would pin only")


@main.command("new-patchset")
@base_option
@click.option("--from-pr", "pr", default=None, metavar="N|URL", help="Upstream PR number or URL.")
@click.option("--from-file", "diff_file", type=click.Path(exists=True, dir_okay=False, path_type=Path), default=None,
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
@click.option("--pin", "pin_specs", multiple=True, metavar="NAME==VERSION",
              help="Add a line to the set's pins.txt with the hashes of the wheels that fit the image (repeatable).")
@click.option("--wheelhouse", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Take --pin wheels from this folder instead of downloading them.")
@click.pass_obj
def new_patchset(obj: Ctx, base_tag: str, pr: str | None, diff_file: Path | None, title: str | None,
                 api_url: str | None, gh_repo: str, suffix: str, base_repo: str | None, pull: str,
                 from_wheel: bool, pin_specs: tuple[str, ...], wheelhouse: Path | None) -> None:
    """Add an upstream PR (or a diff file) as the next patch of base TAG's set, or pins with --pin."""
    from . import newpatch

    if pin_specs and (pr is not None or diff_file is not None):
        raise UsageError("--pin goes alone: add the patch and the pins in two runs")
    if (pr is None) == (diff_file is None) and not pin_specs:
        raise UsageError("give exactly one of --from-pr N|URL and --from-file FILE (or only --pin)")
    # Malformed values are usage errors, found before the network or the engine is asked anything.
    if pr is not None:
        newpatch.parse_pr(pr, gh_repo)
    for spec in pin_specs:
        from . import pinfile

        if pinfile.exact(spec.strip()) is None:
            raise UsageError(f"--pin {spec!r}: write NAME==VERSION (one exact version)")
    if pin_specs:
        pinned = newpatch.add_pins(obj.root, base_tag, pin_specs, lambda: obj.engine, base_repo=base_repo,
                                   pull=pull, wheelhouse=wheelhouse, progress=progress)
        click.echo(f"pinned {', '.join(pin_specs)} in {pinned.path} (wheels for {pinned.image})")
        return
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


@main.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_obj
def list_cmd(obj: Ctx, as_json: bool) -> None:
    """Each image definition, its patch set, and every build with its newest verdict and pushes."""
    import json

    from . import lifecycle

    rows = lifecycle.overview(obj.root)
    if as_json:
        click.echo(json.dumps(rows, indent=2, sort_keys=True))
        return
    for row in rows:
        made = f"{len(row['builds'])} build(s)" if row["builds"] else "never built"
        click.echo(f"{row['definition']}  base {row['base']}  patch set {row['patch_set']} "
                   f"({len(row['patches'])} patch(es))  {made}")
        for b in row["builds"]:
            verdict = b["verdict"] or "not judged"
            if b["verdict"] == "pass":
                verdict += " (GPU-verified)" if b["gpu_verified"] else " (GPU-unverified)"
            if b["incomplete_runs"]:
                verdict += f", {b['incomplete_runs']} later incomplete run(s)"
            pushes = ", ".join(f"{p['ref']}@{p['digest']}" for p in b["pushes"]) or "none"
            click.echo(f"  {b['created']}  {b['image_id']}  {b['output_ref']}  smoke {verdict}  push {pushes}")


@main.command()
@base_option
@click.option("--to", "to_image", type=IMAGE_ID, default=None,
              help="Image ID of a recorded build (default: the one before the tag's current image).")
@click.option("--tag", "output_ref", type=TAG, default=None,
              help="Reference to move (default: the newest build's output reference).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.pass_obj
def rollback(obj: Ctx, base_tag: str, to_image: str | None, output_ref: str | None, as_json: bool) -> None:
    """Point base TAG's output tag at the previous recorded build (or the one --to names)."""
    from . import lifecycle

    moves = lifecycle.rollback(obj.engine, obj.root, base_tag, to_image, output_ref)
    rows = [{"ref": m.ref, "image_id": m.to.image_id, "was": m.was, "direction": m.direction,
             "platform": m.to.platform} for m in moves]
    if as_json:
        # One tag: the object as before; a multi-platform output: each tag moved, in one object.
        _json({k: v for k, v in rows[0].items() if k != "platform"} if len(rows) == 1
              else {"ref": _rolled_output(moves), "moved": rows})
        return
    for moved in moves:
        target = moved.to
        if moved.direction == "unchanged":
            click.echo(f"{moved.ref} already points at {target.image_id}; nothing moved")
            continue
        verb = "rolled back" if moved.direction == "back" else "moved forward"
        click.echo(f"{verb} {moved.ref} to {target.image_id} (built {target.created}, "
                   f"smoke {target.verdict or 'not judged'}; was {moved.was or 'untagged'})")
    if any(m.direction != "unchanged" for m in moves):
        progress(f"push it to move the registry tag too: python build.py push {_rolled_output(moves)} "
                 "--registry HOST:PORT/PATH")


def _rolled_output(moves: Any) -> str:
    """The tag a rollback moved; for a multi-platform output, its plain TAG (a push of it pushes them all)."""
    from . import platforms

    if len(moves) == 1:
        return str(moves[0].ref)
    parents = {got[0] for m in moves if (got := platforms.parent_ref(m.ref)) is not None}
    return parents.pop() if len(parents) == 1 else str(moves[-1].ref)


def _accept_verbose_anywhere() -> None:
    for command in main.commands.values():
        command.params.append(click.Option(["-v", "--verbose"], is_flag=True, expose_value=False,
                                           callback=_verbose, help="Debug logging of the tool."))
        command.params.append(click.Option(["--root"], type=click.Path(path_type=Path), default=None,
                                           expose_value=False, callback=_set_root,
                                           help="Folder holding images/ and patches/ (as before the subcommand)."))


_accept_verbose_anywhere()


def run(argv: Sequence[str] | None = None) -> int:
    """The process entry point: only here do errors become exit codes."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "vllm-hotfix"
    signal.signal(signal.SIGTERM, _on_sigterm)
    return _run(argv, prog)


def _on_sigterm(_signum: int, _frame: object) -> None:
    """Unwind as Ctrl-C does, so that containers, scratch folders and notes are cleaned up.

    Further SIGTERMs are ignored from here: cleanup must not be cut short
    halfway (whoever sent it escalates to SIGKILL if it waits too long).
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def _run(argv: Sequence[str] | None, prog: str) -> int:
    try:
        main.main(args=list(argv) if argv is not None else None, prog_name=prog, standalone_mode=False)
    except PipelineError as exc:
        return report_error(exc)
    except click.exceptions.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else prog
        click.secho(f"error: {exc.format_message()}", fg="red", err=True)
        click.echo(f"hint: {where} --help", err=True)
        return UsageError.exit_code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt) as exc:
        # click turns an interrupt into Abort, keeping the interrupt as its cause.
        if isinstance(exc, Terminated) or isinstance(exc.__cause__, Terminated):
            click.secho("error: terminated", fg="red", err=True)
            return EXIT_TERMINATED
        click.secho("error: interrupted", fg="red", err=True)
        return EXIT_INTERRUPTED
    except click.ClickException as exc:
        click.secho(f"error: {exc.format_message()}", fg="red", err=True)
        return UsageError.exit_code
    except Exception:
        # Not an error the pipeline knows: a bug. The traceback is what a fix needs.
        traceback.print_exc()
        click.secho("error: internal error (a bug); the traceback above says where", fg="red", err=True)
        return PipelineError.exit_code
    return 0
