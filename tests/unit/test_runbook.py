"""docs/runbook.md: every command in it is one the test suite runs.

The commands are taken from the runbook's code blocks; each must name a real
subcommand and real options, and some test (in any tier) must call the CLI
with that subcommand and (at least) those options.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
from pathlib import Path

import pytest

from conftest import REPO, Result, cli
from vllm_hotfix import cli as climod

RUNBOOK = REPO / "docs" / "runbook.md"


def runbook_commands() -> list[list[str]]:
    """`python build.py ...` lines of indented or fenced code blocks."""
    out = []
    in_fence = False
    pending = ""  # a command continued on the next line with a trailing backslash
    for line in RUNBOOK.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
            continue
        code = in_fence or line.startswith("    ")
        text = line.strip()
        if pending and code:
            text = pending + " " + text
            pending = ""
        if code and text.startswith("python build.py "):
            if text.endswith("\\"):
                pending = text[:-1].rstrip()
                continue
            out.append(shlex.split(text)[2:])
    return out


def _sub_and_flags(args: list[str]) -> tuple[str, set[str]]:
    if args[:1] == ["--root"]:
        args = args[2:]
    return args[0], {a for a in args[1:] if a.startswith("--")}


@functools.cache  # one parse of every test file, not one per runbook command
def exercised() -> list[tuple[str, set[str]]]:
    """(subcommand, options) of every `cli(...)` call with literal arguments in tests/, every tier."""
    calls = []
    for path in sorted((REPO / "tests").rglob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        if "cli(" not in text:
            continue  # no call to find (parsing every test file took half a second of a worker)
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "cli" and node.args:
                words = [a.value for a in node.args
                         if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                if words and isinstance(node.args[0], ast.Constant):
                    calls.append(_sub_and_flags(words))
    return calls


def test_runbook_has_commands() -> None:
    subs = {_sub_and_flags(c)[0] for c in runbook_commands()}
    expected = {"image", "smoke", "push", "list", "rollback", "check-upstream", "new-patchset"}
    assert expected <= subs


@pytest.mark.parametrize("args", runbook_commands(), ids=lambda a: " ".join(a))
def test_runbook_command_is_real_and_exercised(args: list[str]) -> None:
    sub, flags = _sub_and_flags(args)
    command = climod.every_command().get(sub)
    assert command is not None, f"runbook names unknown command {sub!r}"
    known = {opt for param in command.params for opt in getattr(param, "opts", [])}
    assert flags <= known, f"{sub}: unknown options {flags - known}"
    assert any(s == sub and flags <= f for s, f in exercised()), (
        f"no test runs `{sub}` with {sorted(flags)}"
    )


def _fails(r: Result, *needles: str) -> None:
    assert r.rc != 0, r.err
    for needle in needles:
        assert needle in r.last_error, f"{needle!r} not in {r.last_error!r}"


def test_rollback_without_records(project: Path) -> None:
    r = cli("rollback", "--definition", "v0.25.1", root=project)
    _fails(r, "no build records for v0.25.1")


def _placeholder(value: str) -> bool:
    """IMAGE, ID, sha256:...: words the reader replaces."""
    return value.isupper() or "..." in value


@pytest.mark.parametrize("args", runbook_commands(), ids=lambda a: " ".join(a))
def test_runbook_values_pass_their_checks(args: list[str]) -> None:
    """Every reference, tag, registry and image ID written out in the runbook is one the CLI accepts as it stands
    (its `rollback --to sha256:0123abcd` was refused as no image ID, exit 64, where it documents exit 1)."""
    from vllm_hotfix.cli.app import Checked
    from vllm_hotfix.errors import UsageError

    sub_args = args[2:] if args[:1] == ["--root"] else args
    command = climod.every_command()[sub_args[0]]
    checked = {opt: param.type for param in command.params for opt in getattr(param, "opts", [])
               if isinstance(param.type, Checked)}
    words = [w for w in sub_args[1:] if not w.startswith("#")]
    for opt, value in zip(words, words[1:], strict=False):
        if opt in checked and not _placeholder(value):
            try:
                checked[opt].convert(value, None, None)
            except UsageError as exc:
                pytest.fail(f"runbook command `{' '.join(args)}`: {exc}")


def _tables(text: str) -> list[list[list[str]]]:
    """Markdown tables whose first header cell is `exit`: their rows' cells (an escaped `\\|` stays in its cell)."""
    tables: list[list[list[str]]] = []
    current: list[list[str]] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            current = None
            continue
        cells = [c.strip().replace("\\|", "|") for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
        if current is None:
            current = [] if cells[:1] == ["exit"] else None
            if current is not None:
                tables.append(current)
        elif not set("".join(cells)) <= set("-: "):
            current.append(cells)
    return tables


def test_readme_exit_table_is_errors_py() -> None:
    """README's exit table is exit_table(), row for row, as --help prints it."""
    from vllm_hotfix.errors import exit_table

    [table] = _tables((REPO / "README.md").read_text(encoding="utf-8"))
    assert [(int(code), meaning) for code, meaning in table] == exit_table()
    shown = " ".join(climod.EXIT_CODES.split())
    for code, meaning in exit_table():
        assert f"{code} {' '.join(meaning.split())}" in shown


def test_runbook_exit_codes_are_the_tools() -> None:
    """Every exit code the runbook's tables give is one errors.py has (or `-`, for warnings)."""
    from vllm_hotfix.errors import exit_table

    codes = {str(code) for code, _ in exit_table()} | {"-"}
    tables = _tables(RUNBOOK.read_text(encoding="utf-8"))
    assert len(tables) >= 2
    for table in tables:
        for row in table:
            assert row[0] in codes, f"runbook row names exit {row[0]}, which the tool does not have: {row}"


def test_the_readme_names_the_installed_command_and_it_answers() -> None:
    """pyproject installs `vllm-hotfix`; the README says so, and the installed command is the tool."""
    import shutil
    import subprocess
    import sys
    import tomllib

    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"vllm-hotfix": "vllm_hotfix.cli:run"}
    readme = (REPO / "README.md").read_text()
    assert "`vllm-hotfix`" in readme and "vllm-hotfix smoke" in readme
    command = Path(sys.executable).parent / "vllm-hotfix"
    if not command.exists():
        command = Path(shutil.which("vllm-hotfix") or "")
    if not command.is_file():
        pytest.skip("the tool is not installed in this environment (make setup installs it)")
    done = subprocess.run([str(command), "smoke", "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "--explain" in done.stdout, done.stderr
