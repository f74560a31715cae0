"""The CLI run inside the test's own process, as a process of its own would run it.

The unit tier drives build.py about three hundred times; a process per run
(even forked from one that imported everything) cost 30-40 ms each, a third of
the tier's time. Here a run is `run(argv)`, build.py's entry, called in the
test's process with what a fresh process would give it: its own environment,
argv, standard output and error (file descriptors 1 and 2 too, so that what a
child program such as pip or patch writes there is read back as well), the
default logging and warning setup, and none of the state the tool keeps for
a process's life (listed in :func:`_tool_state`). What run() does to ready a
process for its exit (gc.freeze) is left out: no exit follows here. All of it
is put back when the run ends, so the next test sees the process as it was.

What only a process can show (an exit through ``python3 build.py``, what a
fresh interpreter imports, a signal) stays in a process: tests/conftest.py
forks or starts an interpreter for those tiers and tests.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Python's own warning filters, as a fresh interpreter starts with them.
FRESH_WARNINGS = (("default", DeprecationWarning, "__main__"), ("ignore", DeprecationWarning, None),
                  ("ignore", PendingDeprecationWarning, None), ("ignore", ImportWarning, None),
                  ("ignore", ResourceWarning, None))
# The signals whose handlers a run sets (build.py's SIGTERM, the interrupts' noting ones) or this module does.
HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)


class _Overran(BaseException):
    """The run passed its time limit (a BaseException: the tool's own error handling must not take it)."""


def _tool_state() -> tuple[list[Any], list[Any]]:
    """What the tool keeps for its process's life, which a fresh process starts without: (containers that start
    empty, functools caches). A new one added to the tool belongs here, or a run here would see an earlier run's."""
    from vllm_hotfix import interrupts
    from vllm_hotfix.journal import cache, leftovers, records

    return ([records.WRITTEN, records._warned, leftovers._NOTES, interrupts._noted],  # noqa: SLF001
            [cache._host_key])  # noqa: SLF001


def _set_environment(env: dict[str, str]) -> None:
    """os.environ made ``env``, variable by variable where they differ (clearing and refilling it set every
    variable of the process again, twice a run)."""
    for name in [n for n in os.environ if n not in env]:
        del os.environ[name]
    for name, value in env.items():
        if os.environ.get(name) != value:
            os.environ[name] = value


def _set_level(logger: logging.Logger, level: int) -> None:
    if logger.level != level:  # each change empties the level cache of every logger of the process
        logger.setLevel(level)


@contextmanager
def _fresh_process(argv: list[str], env: dict[str, str]) -> Iterator[None]:
    """This process set up for one run as a fresh one would be, and put back as it was afterwards."""
    held_env, held_argv, held_hook = dict(os.environ), sys.argv, sys.unraisablehook
    handlers = {signum: signal.getsignal(signum) for signum in HANDLED}
    root, tool_logger = logging.getLogger(), logging.getLogger("vllm_hotfix")
    held_root, held_level, held_tool_level = root.handlers[:], root.level, tool_logger.level
    containers, caches = _tool_state()
    kept = [container.copy() for container in containers]
    try:
        for container in containers:
            container.clear()
        for cached in caches:
            cached.cache_clear()
        _set_environment(env)
        sys.argv = argv
        # As in a fresh interpreter: no handler (run() adds its own), no warning capture.
        root.handlers.clear()
        _set_level(root, logging.WARNING)
        with warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(FRESH_WARNINGS):
                warnings.filterwarnings(action, category=category, module=module or "")
            yield
    finally:
        for container, before in zip(containers, kept, strict=True):
            container.clear()
            if isinstance(container, list):
                container.extend(before)
            else:
                container.update(before)
        for cached in caches:
            cached.cache_clear()
        _set_environment(held_env)
        sys.argv = held_argv
        sys.unraisablehook = held_hook
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        root.handlers[:] = held_root
        _set_level(root, held_level)
        _set_level(tool_logger, held_tool_level)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass  # a run that closed its output: what it wrote before is in the file


@contextmanager
def _own_output() -> Iterator[tuple[Any, Any]]:
    """Descriptors 1 and 2, and sys.stdout and sys.stderr over them, into files of the run's own."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        held_streams = sys.stdout, sys.stderr
        held_fds = os.dup(1), os.dup(2)
        try:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = open(1, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", encoding="utf-8", closefd=False)  # noqa: SIM115
            yield out, err
        finally:
            _flush()
            sys.stdout, sys.stderr = held_streams
            os.dup2(held_fds[0], 1)
            os.dup2(held_fds[1], 2)
            os.close(held_fds[0])
            os.close(held_fds[1])


def run(script: Path, argv: list[str], env: dict[str, str], timeout: float) -> tuple[int, str, str]:
    """Run ``script argv...`` (build.py's entry, ``run``) here: its exit code, standard output and error."""
    from vllm_hotfix import cli as entry

    def overran(_signum: int, _frame: object) -> None:
        raise _Overran()

    # run() readies the process for its exit (gc.freeze): no exit follows here, and this process's garbage
    # must stay collectable.
    exit_ready = entry._skip_last_collection  # noqa: SLF001
    with _own_output() as (out, err):
        code = 1
        try:
            entry._skip_last_collection = lambda: None  # noqa: SLF001
            with _fresh_process([str(script), *argv], env):
                signal.signal(signal.SIGALRM, overran)
                signal.setitimer(signal.ITIMER_REAL, timeout)
                try:
                    code = entry.run(argv)
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
        except _Overran:
            raise subprocess.TimeoutExpired(argv, timeout) from None
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        except BaseException:  # noqa: BLE001 - what an interpreter would print on its way out
            traceback.print_exc()
        finally:
            entry._skip_last_collection = exit_ready  # noqa: SLF001
        _flush()
        out.seek(0)
        err.seek(0)
        return code, out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")
