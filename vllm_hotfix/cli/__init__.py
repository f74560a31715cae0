"""The command line: parse, call the library, print; map its errors to exit codes.

One module per group of commands, each imported when one of its commands runs
(:data:`app.COMMANDS` says where each command lives):

- ``app``: the group, shared options, checked argument types, printing helpers
- ``image_commands``: image, render, standin
- ``smoke_commands``: smoke, serve-check
- ``push_commands``: push, verify
- ``patchset_commands``: check-upstream, new-patchset
- ``history_commands``: list, rollback, prune

Only :func:`_run`, here, turns errors into an exit code (the table in
``--help`` is made from errors.py, so it names every one). Each command's
body only calls the library and prints what comes back.
"""

from __future__ import annotations

import errno
import gc
import logging
import os
import signal
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

import click

from .. import interrupts
from ..errors import EXIT_INTERRUPTED, EXIT_OUTPUT_CLOSED, EXIT_TERMINATED, PipelineError, Terminated, UsageError
from .app import EXIT_CODES, Checked, every_command, main, report_error

__all__ = ["EXIT_CODES", "Checked", "every_command", "main", "run"]


def run(argv: Sequence[str] | None = None) -> int:
    """The process entry point: only here do errors become exit codes."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    prog = Path(sys.argv[0]).name if sys.argv and sys.argv[0] else "vllm-hotfix"
    signal.signal(signal.SIGTERM, _on_sigterm)
    interrupts.install()
    code = _run(argv, prog)
    try:
        sys.stdout.flush()  # here, not at the interpreter's exit, where a closed pipe is a stray complaint
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return _output_closed() if code == 0 else code
    _skip_last_collection()
    return code


def _skip_last_collection() -> None:
    """The process ends next: spare the interpreter's garbage collections over every object it holds.

    At exit the interpreter still runs atexit handlers, flushes and closes its files and frees the modules,
    but its collections walk every object the imports made (the Docker SDK's and requests' above all): 10-20
    ms of an assembled build, measured. Frozen objects are left to the process's end; finalizers of objects
    in reference cycles are not promised at exit anyway (the language reference, ``object.__del__``).
    """
    gc.freeze()


def _finished_before() -> None:
    """After an interrupt: what this run had journalled, and so finished, before it stopped (a build and its tag
    stand; the next run reuses them)."""
    from ..journal import records

    done = [e for e in records.WRITTEN if e.kind in ("build", "tag", "push")]
    if not done:
        return
    what = "; ".join(f"{e.kind} {e.data.get('output_ref') or e.data.get('ref') or e.image_id or ''} "
                     f"{e.data.get('digest') or e.data.get('image_id') or ''}".strip() for e in done[-3:])
    click.echo(f"hint: finished and journalled before the interrupt, and standing: {what} (`list` shows it; the "
               "next run reuses it)", err=True)


def _output_closed() -> int:
    """The reader of the tool's output went away (``| head``): the run stopped, as an interrupt stops it."""
    try:
        click.secho("error: output closed (what read it went away); the run stopped and cleaned up",
                    fg="red", err=True)
    except OSError:
        pass  # stderr went with it: the exit code says it
    return EXIT_OUTPUT_CLOSED


def _on_sigterm(_signum: int, _frame: object) -> None:
    """Unwind as Ctrl-C does, so that containers, scratch folders and notes are cleaned up.

    Further SIGTERMs are ignored from here: cleanup must not be cut short
    halfway (whoever sent it escalates to SIGKILL if it waits too long).
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Terminated()


def _remove_own_staging() -> None:
    """An interrupt can land between a staging or scratch folder's making and the ``with`` that removes it
    (inside ``tempfile.TemporaryDirectory``): this process's own are removed before it reports the interrupt."""
    from ..journal import leftovers

    leftovers.sweep_staging(own=True)


def _sentence(text: str) -> str:
    """click's message as every other ``error:`` line reads: lower-case first word ("no such command ..."),
    an all-capital word (a metavar such as IMAGE) left as it is."""
    first = text.split(" ", 1)[0]
    return text[:1].lower() + text[1:] if first[:1].isupper() and not first.isupper() else text


def _run(argv: Sequence[str] | None, prog: str) -> int:
    try:
        main.main(args=list(argv) if argv is not None else None, prog_name=prog, standalone_mode=False)
        interrupts.checkpoint()  # one a finalizer swallowed: the run did not end as it was asked to
    except PipelineError as exc:
        return report_error(exc)
    except click.exceptions.UsageError as exc:
        where = exc.ctx.command_path if exc.ctx is not None else prog
        click.secho(f"error: {_sentence(exc.format_message())}", fg="red", err=True)
        click.echo(f"hint: {where} --help", err=True)
        return UsageError.exit_code
    except click.exceptions.Exit as exc:
        return int(exc.exit_code)
    except SystemExit as exc:
        # click ends a write to a closed pipe with exit 1, silently (1 means "nothing to roll back" here),
        # having put its pacifying wrapper around stdout; older clicks exit inside their handler of the error.
        cause = exc.__context__
        if (isinstance(cause, OSError) and cause.errno == errno.EPIPE) or \
                "PacifyFlushWrapper" in type(sys.stdout).__name__:
            return _output_closed()
        raise
    except (click.exceptions.Abort, KeyboardInterrupt) as exc:
        # click turns an interrupt into Abort, keeping the interrupt as its cause.
        _remove_own_staging()
        if isinstance(exc, Terminated) or isinstance(exc.__cause__, Terminated):
            click.secho("error: terminated", fg="red", err=True)
            _finished_before()
            return EXIT_TERMINATED
        click.secho("error: interrupted", fg="red", err=True)
        _finished_before()
        return EXIT_INTERRUPTED
    except click.ClickException as exc:
        click.secho(f"error: {_sentence(exc.format_message())}", fg="red", err=True)
        return UsageError.exit_code
    except Exception:
        # Not an error the pipeline knows: a bug. The traceback is what a fix needs.
        traceback.print_exc()
        click.secho("error: internal error (a bug); the traceback above says where", fg="red", err=True)
        return PipelineError.exit_code
    return 0
