"""The Makefile as a front door: a variable carries more of the tool's arguments, and a failure says the tool's
own exit code (make itself exits 2 for any failed recipe)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO


def _make(*args: str) -> subprocess.CompletedProcess[str]:
    # This Python, so that the run needs no virtual environment in the checkout.
    return subprocess.run(["make", "-s", *args, f"PYTHON={sys.executable}"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("target", ["image", "render", "smoke", "push"])
def test_args_carries_extra_arguments_to_the_tool(target: str) -> None:
    done = subprocess.run(["make", "-n", target, 'ARGS=--rebuild --builder assemble --tag x/y:z'], cwd=REPO,
                          capture_output=True, text=True, check=True)
    line = done.stdout.strip().splitlines()[-1]
    assert f"build.py {target} " in line and line.rstrip().endswith("--rebuild --builder assemble --tag x/y:z")


def test_a_failed_run_says_the_tools_own_exit_code() -> None:
    done = _make("render", "ARGS=--no-such-option")
    assert done.returncode == 2  # make's own, whatever the recipe's
    assert "no such option" in done.stderr
    assert "make: build.py exited 64 " in done.stderr, done.stderr
    done = _make("smoke", "IMAGE=hotfix-test/absent:1")  # no engine in this tier: the engine's code
    assert "make: build.py exited 5 " in done.stderr, done.stderr


def test_a_passing_run_says_nothing_more() -> None:
    done = _make("render", "ARGS=--help")
    assert done.returncode == 0, done.stderr
    assert "exited" not in done.stderr and "Usage:" in done.stdout
