"""The command line as a process: each command's module imported when that command runs, every command listed
by --help, the group's -v/--root accepted after every subcommand, and the end of a run left to the process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from vllm_hotfix import cli as climod
from vllm_hotfix.cli.app import COMMANDS

REPO = Path(__file__).resolve().parents[2]


def _modules_after(*argv: str) -> tuple[int, set[str]]:
    """Run the CLI with ``argv`` in a fresh interpreter: its exit code and the modules it imported."""
    code = ("import sys\nfrom vllm_hotfix.cli import run\nrc = run(sys.argv[1:])\n"
            "print('MODULES', ' '.join(sorted(sys.modules)))\nsys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("MODULES "))
    return done.returncode, set(line.split()[1:])


def test_a_command_imports_its_own_module_and_no_other_commands() -> None:
    rc, modules = _modules_after("image", "--help")
    assert rc == 0
    commands = {m for m in modules if m.startswith("vllm_hotfix.cli.")}
    assert commands == {"vllm_hotfix.cli.app", "vllm_hotfix.cli.image_commands"}, commands
    # Nor the engine's SDK, nor the HTTP client the error mapper names errors of: --help never reaches the engine.
    assert not {m for m in modules if m.split(".")[0] in ("docker", "requests", "urllib3") or m == "http.client"}


def test_help_lists_every_command_with_its_short_help() -> None:
    done = subprocess.run([sys.executable, "build.py", "--help"], capture_output=True, text=True, timeout=120,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    listed = done.stdout.split("Commands:", 1)[1].split("Exit codes:", 1)[0]
    rows = {line.split()[0]: line.split(None, 1)[1] for line in listed.splitlines() if line.strip()}
    assert set(rows) == set(COMMANDS)
    commands = climod.every_command()
    for name, short in rows.items():
        assert short.rstrip(".").removesuffix("..") in commands[name].get_short_help_str(limit=200), name


def test_every_command_is_where_the_table_says_and_takes_verbose_and_root_after_it() -> None:
    first = climod.every_command()
    again = climod.every_command()  # loaded once: the options are not added twice
    assert set(first) == set(COMMANDS)
    for name, command in first.items():
        assert command is again[name] and command.name == name
        opts = [opt for param in command.params for opt in getattr(param, "opts", [])]
        assert opts.count("--root") == 1 and opts.count("-v") == 1 and opts.count("--verbose") == 1, (name, opts)


def test_root_after_the_subcommand_is_taken(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    done = subprocess.run([sys.executable, "build.py", "list", "--root", str(missing), "-v"], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert done.returncode == 64, done.stderr
    assert f"--root '{missing}': does not exist" in done.stderr


def test_the_run_leaves_its_objects_to_the_process_end_and_still_finishes_its_exit(tmp_path: Path) -> None:
    """run() freezes what the interpreter holds (no collection walks it at exit); atexit handlers still run and
    output is still written."""
    mark = tmp_path / "atexit-ran"
    code = ("import atexit, gc, sys\nfrom vllm_hotfix.cli import run\n"
            f"atexit.register(lambda: open({str(mark)!r}, 'w').write('yes'))\n"
            "rc = run(['--version'])\nprint('FROZEN', gc.get_freeze_count())\nsys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "version" in done.stdout
    frozen = int(done.stdout.split("FROZEN", 1)[1].split()[0])
    assert frozen > 1000, done.stdout
    assert mark.read_text() == "yes"


def test_a_python_without_the_dependencies_is_told_to_set_up_in_one_line() -> None:
    # -S: this interpreter without its site folder, where the dependencies are, as a Python never set up.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-S", "build.py", "image", "--help"], capture_output=True, text=True,
                          timeout=120, cwd=REPO, env=env)
    assert done.returncode == 69, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    [line] = done.stderr.splitlines()
    assert line.startswith(f"error: {sys.executable} lacks ") and "run `make setup`" in line, line
