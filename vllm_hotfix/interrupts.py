"""Ctrl-C and SIGTERM: raised where the run is, held across a step that must not be cut in two, and never lost.

Python runs a signal's handler between two bytecodes of the main thread,
wherever that is: inside a finalizer too (a ``__del__``, a generator the
collector closes, a weakref callback), where the interrupt it raises cannot
propagate. Python prints it as "Exception ignored" and the run goes on: once,
a Ctrl-C half a second into ``image --rebuild`` was lost there and the run
built, smoked and moved its tag. So each signal is also noted here
(:func:`install` puts the noting handlers in place), and :func:`checkpoint`,
called between the steps of a run, raises a noted one that did not stop it;
the CLI checks once more before it reports success.

:func:`held` is for a step whose half is worse than either whole: asking the
engine for a container. An interrupt that arrived while the engine made it,
raised at once, left the container made after the run stopped looking for
it. Held, the engine's answer comes back first (so the container has an ID to
remove), then the interrupt is raised; a second signal while holding is
raised at once, as an impatient user wants.
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from .errors import Terminated

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGINT, signal.SIGTERM)

# Signals received and not yet known to have stopped the run: the first is the one to raise again.
_noted: list[int] = []


def _noting(handler: Callable[[int, Any], Any]) -> Callable[[int, Any], Any]:
    def note_then_raise(signum: int, frame: Any) -> Any:
        _noted.append(signum)
        return handler(signum, frame)

    note_then_raise.noting = True  # type: ignore[attr-defined]
    return note_then_raise


def install() -> None:
    """Note every SIGINT and SIGTERM the process gets, before the handler in place raises it (SIGINT's only where
    Python's own raises it: one ignored, as a background job's, stays ignored); a finalizer's lost interrupt is
    not printed as a Python error (:func:`checkpoint` raises it again)."""
    for signum in SIGNALS:
        handler = signal.getsignal(signum)
        if callable(handler) and not getattr(handler, "noting", False):
            signal.signal(signum, _noting(handler))
    sys.unraisablehook = _unraisable


def _unraisable(args: Any) -> None:
    if isinstance(args.exc_value, KeyboardInterrupt) and _noted:
        log.debug("an interrupt raised in %r was lost there; raised again at the run's next step", args.object)
        return
    sys.__unraisablehook__(args)


def checkpoint() -> None:
    """Raise the interrupt noted and not raised to the end (a finalizer swallowed it); nothing otherwise.

    Called only where the run goes on normally between its steps: there, a
    noted signal is one that did not stop it.
    """
    if not _noted:
        return
    signum = _noted[0]
    _noted.clear()
    if signum == signal.SIGTERM:
        raise Terminated()
    raise KeyboardInterrupt()


@contextmanager
def held() -> Iterator[None]:
    """The block runs to its end through one SIGINT or SIGTERM, which is raised as the block ends (a second is
    raised at once). Outside the main thread, where no handler runs, the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {signum: signal.getsignal(signum) for signum in SIGNALS}
    got: list[int] = []

    def hold(signum: int, frame: Any) -> None:
        if got:  # asked twice: stop now
            got.clear()
            restore()
            _raise(signum, frame)
        got.append(signum)

    def restore() -> None:
        for signum, handler in before.items():
            signal.signal(signum, handler)

    for signum, handler in before.items():
        if callable(handler):
            signal.signal(signum, hold)
    try:
        yield
    finally:
        restore()
        if got:
            _raise(got[0], None)


def _raise(signum: int, frame: Any) -> None:
    """What the handler in place for ``signum`` does with it (raises, for the tool's own)."""
    handler = signal.getsignal(signum)
    if callable(handler):
        handler(signum, frame)
