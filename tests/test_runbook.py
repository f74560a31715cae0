"""docs/runbook.md: every command in it is one the test suite runs.

The commands are taken from the runbook's code blocks; each must name a real
subcommand and real options, and some test must call the CLI with that
subcommand and (at least) those options. The runbook's own new commands,
`list` and `rollback`, are run here.
"""

from __future__ import annotations

import ast
import json
import shlex
from pathlib import Path

import pytest

from conftest import REPO, STANDIN_REPO, Result, cli
from vllm_hotfix import cli as climod
from vllm_hotfix.engine import Engine

RUNBOOK = REPO / "docs" / "runbook.md"
PATCH = "0001-minimax-m3-topk-buffer-layout.patch"


def runbook_commands() -> list[list[str]]:
    """`python build.py ...` lines of indented or fenced code blocks."""
    out = []
    in_fence = False
    for line in RUNBOOK.read_text(encoding="utf-8").splitlines():
        if line.strip().startswith("```"):
            in_fence = not in_fence
            continue
        code = in_fence or line.startswith("    ")
        text = line.strip()
        if code and text.startswith("python build.py "):
            out.append(shlex.split(text)[2:])
    return out


def _sub_and_flags(args: list[str]) -> tuple[str, set[str]]:
    if args[:1] == ["--root"]:
        args = args[2:]
    return args[0], {a for a in args[1:] if a.startswith("--")}


def exercised() -> list[tuple[str, set[str]]]:
    """(subcommand, options) of every `cli(...)` call with literal arguments in tests/."""
    calls = []
    for path in sorted((REPO / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
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
    command = climod.main.commands.get(sub)
    assert command is not None, f"runbook names unknown command {sub!r}"
    known = {opt for param in command.params for opt in getattr(param, "opts", [])}
    assert flags <= known, f"{sub}: unknown options {flags - known}"
    assert any(s == sub and flags <= f for s, f in exercised()), (
        f"no test runs `{sub}` with {sorted(flags)}"
    )


# -- list and rollback, run for real --------------------------------------------


def _build(project: Path, out: str) -> str:
    r = cli("image", "--base", "v0.25.1", "--tag", out, "--pull", "never", "--no-smoke", root=project)
    assert r.rc == 0, r.err
    return r.out.strip().split()[-1]


def _fails(r: Result, *needles: str) -> None:
    assert r.rc != 0, r.err
    for needle in needles:
        assert needle in r.last_error, f"{needle!r} not in {r.last_error!r}"


@pytest.mark.engine
def test_list_and_rollback(engine: Engine, base_v0251: str, project: Path, unique: str) -> None:
    out = f"hotfix-test/rollback:{unique}"
    r = cli("list", root=project)
    assert r.rc == 0, r.err
    assert r.out.startswith(
        f"v0.25.1  base {STANDIN_REPO}:v0.25.1  patch set v0.25.1 (1 patch(es))  never built"
    )
    first = _build(project, out)
    # A second, different build: a changed patch header changes the labels.
    path = project / "patches/v0.25.1" / PATCH
    path.write_text("Rebuilt for the rollback test.\n" + path.read_text())
    second = _build(project, out)
    assert first != second
    try:
        r = cli("list", root=project)
        assert r.rc == 0, r.err
        assert "2 build(s)" in r.out
        assert f"{second}  {out}  smoke not judged  push none" in r.out
        assert f"{first}  {out}  smoke not judged  push none" in r.out
        rows = json.loads(cli("list", "--json", root=project).out)
        assert [b["image_id"] for b in rows[0]["builds"]] == [second, first]

        r = cli("rollback", "--base", "v0.25.1", root=project)
        assert r.rc == 0, r.err
        assert r.out.startswith(f"rolled back {out} to {first}")
        assert f"python build.py push {out} --registry" in r.err
        info = engine.image(out)
        assert info is not None and info.id == first
        # Nothing older than the first build: one clear error, tag unchanged.
        r = cli("rollback", "--base", "v0.25.1", root=project)
        _fails(r, "no earlier build of v0.25.1")
        assert engine.image(out).id == first  # type: ignore[union-attr]
        # Forward again, by ID, as `list --json` shows it: called forward, not back.
        r = cli("rollback", "--base", "v0.25.1", "--to", second.removeprefix("sha256:")[:12], root=project)
        assert r.rc == 0, r.err
        assert r.out.startswith(f"moved forward {out} to {second}")
        assert engine.image(out).id == second  # type: ignore[union-attr]
        # To the image it already names: nothing moves, and it says so.
        r = cli("rollback", "--base", "v0.25.1", "--to", second, root=project)
        assert r.rc == 0 and r.out.strip() == f"{out} already points at {second}; nothing moved", r.out
        r = cli("rollback", "--base", "v0.25.1", "--to", "sha256:0123abcd", root=project)
        _fails(r, "sha256:0123abcd", "no build record")
    finally:
        engine.untag(out)
        for image_id in (first, second):
            engine.remove_untagged(image_id)


def test_rollback_without_records(project: Path) -> None:
    r = cli("rollback", "--base", "v0.25.1", root=project)
    _fails(r, "no build records for v0.25.1")
