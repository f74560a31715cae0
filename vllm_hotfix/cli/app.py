"""The command group, its shared options and checked argument types, and how the CLI prints.

:data:`main` names every command and the module that defines it (:data:`COMMANDS`); a
command's module is imported when the command is run, or when ``--help`` lists them
all. Only :func:`vllm_hotfix.cli.run` turns errors into exit codes.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .. import __version__
from ..engine import Engine
from ..errors import BuildError, PipelineError, UsageError, exit_table
from ..registry.pulling import PULL_POLICIES

REPO_ROOT = Path(__file__).resolve().parents[2]  # the checkout: vllm_hotfix/cli/app.py


def progress(line: str) -> None:
    # An engine's last status chunk can be empty (a push ended with a blank line): say only what has words.
    if line.strip():
        click.echo(line, err=True)


# Hints name the command line's flags; run through `make`, the user's handle is a make variable.
_MAKE_SPELLING = {"--allow-gpu-unverified": "ALLOW_GPU_UNVERIFIED=1", "--platform all": "PLATFORM=all"}
VIA_MAKE_ENV = "VLLM_HOTFIX_VIA_MAKE"


def print_json(data: Any) -> None:
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
        # A hint that spells out a command (python build.py ...) is left whole: PLATFORM=all is no flag of it.
        if os.environ.get(VIA_MAKE_ENV) and "python build.py" not in hint:
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
            from ..journal import leftovers

            # No ping: the first real call says just as clearly that no engine answers.
            self._engine = Engine.connect(ping=False)
            # Runs that died (killed, or the engine lost under them) left
            # containers and images behind, and notes saying so: remove them
            # before new work, and note this run's own containers the same way.
            leftovers.sweep(self._engine, self.root, progress)
            leftovers.sweep_staging()
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
    from ..registry import refs

    return refs.check_reference(value, what, tag_only=True)


def _image_id(value: str, what: str) -> str:
    from ..registry import refs

    if not refs.IMAGE_ID.match(value):
        raise UsageError(f"{what} {refs.shown(value)}: not an image ID (sha256:HEX or 12+ hex digits; list shows them)")
    return value


def _refs_check(name: str) -> Callable[[str, str], str]:
    def check(value: str, what: str) -> str:
        from ..registry import refs

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


def set_verbose(_ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if value:
        logging.getLogger("vllm_hotfix").setLevel(logging.DEBUG)


def _check_root(root: Path, where: str) -> Path:
    """The project folder must exist: a mistyped --root would otherwise show an empty project and exit 0."""
    from ..registry import refs

    if not root.is_dir():
        what = "is not a folder" if root.exists() else "does not exist"
        raise UsageError(f"{where} {refs.shown(str(root))}: {what}",
                         hint="--root names the folder holding images/ and patches/")
    return root.resolve()


def set_root(ctx: click.Context, _param: click.Parameter, value: Path | None) -> None:
    # --root after the subcommand: the same as before it.
    if value is not None:
        ctx.find_object(Ctx).root = _check_root(value, "--root")  # type: ignore[union-attr]


# Commands that keep files in VLLM_HOTFIX_CACHE: a cache that cannot be written is a usage error at once.
_CACHE_USERS = frozenset({"image", "render", "standin", "smoke", "check-upstream", "new-patchset", "push"})
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")


def check_environment(command: str | None) -> None:
    """Environment values the tool puts into names, labels and paths, checked before any work."""
    from ..registry import refs

    run_id = os.environ.get("VLLM_HOTFIX_RUN_ID")
    if run_id and not _RUN_ID.fullmatch(run_id):
        raise UsageError(f"VLLM_HOTFIX_RUN_ID={refs.shown(run_id, 60)}: expected up to 128 letters, digits, "
                         "'.', '_' or '-' (it names containers' labels and scratch folders)")
    timeout = os.environ.get("VLLM_HOTFIX_PROBE_TIMEOUT")
    if timeout is not None:
        from ..building.sources import PROBE_TIMEOUT_MAX

        if not timeout.isdigit() or not 1 <= int(timeout) <= PROBE_TIMEOUT_MAX:
            raise UsageError(f"VLLM_HOTFIX_PROBE_TIMEOUT={refs.shown(timeout, 60)}: expected whole seconds from 1 to "
                             f"{PROBE_TIMEOUT_MAX}", hint="unset it for the default of 120")
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
    # os.access answers yes to root for any folder (/proc too): make and remove a folder there to be sure.
    import tempfile

    try:
        os.rmdir(tempfile.mkdtemp(prefix=".vllm-hotfix-probe-", dir=probe))
    except OSError as exc:
        return f"{probe} is not writable: it takes no new files ({exc.strerror or exc})"
    return None


def check_output_file(path: Path | None, option: str) -> None:
    """A file a command writes at its end (--report, --junit): its folder must exist, or be one folder to make
    in one that exists, before the work."""
    if path is None:
        return
    from ..registry import refs

    if path.is_dir():
        raise UsageError(f"{option} {refs.shown(str(path))}: is a folder; give a file name")
    folder = path.parent
    if not os.path.lexists(folder) and not os.path.lexists(folder.parent):
        # The file's own folder is made, nothing above it: a mistyped path would otherwise grow a tree anywhere
        # this user may write (a typo made /nonexistent/dir as root).
        raise UsageError(f"{option} {refs.shown(str(path))}: cannot write there: {refs.shown(str(folder.parent))} "
                         "does not exist (only the file's own folder is made)")
    problem = writable_folder_problem(folder)
    if problem:
        raise UsageError(f"{option} {refs.shown(str(path))}: cannot write there: {problem}")


# Each command and where it is defined (module.function, under vllm_hotfix/cli/). Imported when
# named, so `image` does not import the smoke, push and history commands and what they import.
COMMANDS = {
    "image": "image_commands.image",
    "render": "image_commands.render",
    "standin": "image_commands.standin_cmd",
    "smoke": "smoke_commands.smoke",
    "serve-check": "smoke_commands.serve_check",
    "report": "smoke_commands.report",
    "push": "push_commands.push",
    "verify": "push_commands.verify",
    "check-upstream": "patchset_commands.check_upstream",
    "new-patchset": "patchset_commands.new_patchset",
    "list": "history_commands.list_cmd",
    "rollback": "history_commands.rollback",
    "prune": "history_commands.prune",
}


class CommandGroup(click.Group):
    """A group whose commands are imported on demand (click's lazy-loading pattern), each given the
    group's ``-v/--verbose`` and ``--root`` as well, so they may follow the subcommand."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module_name, name = COMMANDS[cmd_name].rsplit(".", 1)
            command = getattr(importlib.import_module(f".{module_name}", __package__), name)
            if not isinstance(command, click.Command) or command.name != cmd_name:
                raise TypeError(f"COMMANDS[{cmd_name!r}] names {COMMANDS[cmd_name]}, not that command")
            _accept_group_options(command)
            self.add_command(command)
        return self.commands.get(cmd_name)


def _accept_group_options(command: click.Command) -> None:
    command.params.append(click.Option(["-v", "--verbose"], is_flag=True, expose_value=False,
                                       callback=set_verbose, help="Debug logging of the tool."))
    command.params.append(click.Option(["--root"], type=click.Path(path_type=Path), default=None,
                                       expose_value=False, callback=set_root,
                                       help="Folder holding images/ and patches/ (as before the subcommand)."))


def every_command() -> dict[str, click.Command]:
    """Every command by name, each module imported (for a walk over all of them, as ``--help`` does)."""
    ctx = click.Context(main)
    found = {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}
    return {name: command for name, command in found.items() if command is not None}


@click.group(cls=CommandGroup, context_settings={"help_option_names": ["-h", "--help"]}, epilog=EXIT_CODES,
             invoke_without_command=True)
@click.option(
    "--root",
    type=click.Path(path_type=Path),
    default=REPO_ROOT,
    show_default="the repository",
    help="Folder holding images/ and patches/ (and build/ records); also accepted after the subcommand.",
)
@click.option("-v", "--verbose", is_flag=True, expose_value=False, is_eager=True, callback=set_verbose,
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


def definition_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--definition NAME`` (images/NAME.toml), given to the command as ``base_tag``; ``--base``, its old name,
    still works and says so in one line."""

    @functools.wraps(fn)
    def command(*args: Any, definition_name: str | None, base_alias: str | None, **kwargs: Any) -> Any:
        if base_alias is not None:
            if definition_name is not None and definition_name != base_alias:
                raise UsageError(f"--definition {definition_name} and --base {base_alias}: --base is the old name of "
                                 "--definition; give one")
            progress("note: --base is the old name of --definition (a definition's name, images/NAME.toml); "
                     "use --definition")
            definition_name = base_alias
        if definition_name is None:
            raise UsageError("missing option --definition NAME (images/NAME.toml, e.g. v0.25.1 or v0.25.1-sm100)")
        return fn(*args, base_tag=definition_name, **kwargs)

    command = click.option("--base", "base_alias", default=None, metavar="NAME",
                           help="The old name of --definition (still accepted).")(command)
    return click.option("--definition", "definition_name", default=None, metavar="NAME",
                        help="Image definition images/NAME.toml, e.g. v0.25.1 (its base is the file's base.tag), "
                             "or v0.25.1-sm100 for a variant. Required.")(command)


# Kept for the commands' decorators: every --base that names a definition is --definition now.
base_option = definition_option
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


def one_platform(text: str | None) -> Any:
    from ..building import platforms

    if text is None:
        return None
    wanted = platforms.parse(text)
    if wanted is None or len(wanted) != 1:
        raise UsageError(f"--platform {text!r}: name one platform here (linux/amd64 or linux/arm64)")
    return wanted[0]
