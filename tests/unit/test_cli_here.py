"""A CLI run in the test's own process (tests/cli_here.py) is a run as a fresh process makes it, and leaves the
process as it found it: what it wrote, its exit code, its environment, its log levels and the tool's journal
warnings are its own."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from conftest import cli
from vllm_hotfix.journal import records


def _process() -> dict[str, Any]:
    """What a run may change in the process that runs it."""
    return {"environ": dict(os.environ), "argv": list(sys.argv), "stdout": sys.stdout, "stderr": sys.stderr,
            "handlers": {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)},
            "unraisable": sys.unraisablehook, "root": (logging.getLogger().level, list(logging.getLogger().handlers)),
            "tool": logging.getLogger("vllm_hotfix").level, "timer": signal.getitimer(signal.ITIMER_REAL),
            "written": list(records.WRITTEN)}


def test_a_run_here_leaves_the_process_as_it_found_it(tmp_path: Path) -> None:
    before, frozen = _process(), gc.get_freeze_count()
    # -v turns the tool's debug logging on; the variable is the run's alone.
    r = cli("list", "-v", root=tmp_path, env={"VLLM_HOTFIX_TEST_ONLY_HERE": "1"})
    assert r.rc == 0, r.err
    assert _process() == before
    # Nothing of the run kept from the collector (run() freezes every object for the exit of its own process).
    assert gc.get_freeze_count() <= frozen
    assert "VLLM_HOTFIX_TEST_ONLY_HERE" not in os.environ


def test_each_run_starts_without_what_an_earlier_one_kept(project: Path) -> None:
    """The tool names a damaged journal entry once a process: each run here names it, as each process would."""
    damaged = records.records_dir(project) / "verdict" / f"{1:020d}-{'ab' * 32}.json"
    damaged.parent.mkdir(parents=True)
    damaged.write_text('{"kind": "verd')
    for _ in range(2):
        r = cli("list", root=project)
        assert r.rc == 0, r.err
        assert f"journal entry {damaged}" in r.err


def test_what_a_run_writes_and_its_exit_code_are_its_own(capfd: pytest.CaptureFixture[str]) -> None:
    r = cli("--version")
    assert r.rc == 0 and "version" in r.out and not r.err
    r = cli("no-such-command")
    assert r.rc == 64 and r.last_error.startswith("error: no such command") and not r.out
    seen = capfd.readouterr()
    assert "version" not in seen.out and "no such command" not in seen.err
