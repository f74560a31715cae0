"""A signal at the moment a container is asked for: the container is removed and the run's note settled.

The moments are ones a real engine cannot be made to hit on purpose (a signal
while the note is written, or while the engine makes the container), so the
seam is a stand-in engine that sends the process the signal there; the signal
handling, the note and the tool's own handlers are the real ones. The
stand-in engine finishes a container it was making whether or not the client
still waits for its answer, as the Docker engine does.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from vllm_hotfix import interrupts
from vllm_hotfix.engine import containers
from vllm_hotfix.errors import Terminated
from vllm_hotfix.journal import leftovers


class Container:
    def __init__(self, name: str) -> None:
        self.id = name


class Containers:
    def __init__(self, seam: Seam) -> None:
        self.seam = seam

    def create(self, image: str, name: str, **_kw: Any) -> Container:
        self.seam.asked += 1
        self.seam.making = name
        for signum in self.seam.signals_in_create:
            signal.raise_signal(signum)  # while the engine makes it
        self.seam.made.append(name)
        self.seam.making = None
        return Container(name)


class Api:
    def __init__(self, seam: Seam) -> None:
        self.seam = seam

    def containers(self, filters: dict[str, str], **_kw: Any) -> list[str]:
        """The containers the engine shows: never one it is still making."""
        return [n for n in self.seam.made if f"^/{n}$" == filters.get("name")]


class Sdk:
    def __init__(self, seam: Seam) -> None:
        self.containers = Containers(seam)
        self.api = Api(seam)


class Seam:
    """Just what ``containers.lifetime`` asks of an engine; ``signals_in_note`` are sent as the note is written for
    the count's +1, ``signals_in_create`` while the engine makes the container."""

    def __init__(self, note: leftovers.Pending, signals_in_note: tuple[int, ...] = (),
                 signals_in_create: tuple[int, ...] = ()) -> None:
        self.note = note
        self.signals_in_note = signals_in_note
        self.signals_in_create = signals_in_create
        self.asked = 0
        self.making: str | None = None
        self.made: list[str] = []
        self.removed: list[str] = []
        self.sdk = Sdk(self)

    @contextmanager
    def translating(self, _operation: str, _refused: Any = None) -> Iterator[None]:
        yield

    def notify(self, change: int) -> None:
        self.note.container(change)
        if change > 0:
            for signum in self.signals_in_note:
                signal.raise_signal(signum)

    def remove_container(self, container_id: str) -> None:
        if container_id in self.made:  # one still being made is not there to remove (the engine answers 404)
            self.removed.append(container_id)

    def left(self) -> set[str]:
        """What the engine holds once it has finished what it was making when the client stopped waiting."""
        return set(self.made + ([self.making] if self.making else [])) - set(self.removed)


@pytest.fixture
def handlers() -> Iterator[None]:
    """The tool's own handlers (Python's for SIGINT, the CLI's for SIGTERM, both noted), put back after."""
    from vllm_hotfix.cli import _on_sigterm

    before = {s: signal.getsignal(s) for s in interrupts.SIGNALS}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _on_sigterm)
    interrupts.install()
    try:
        yield
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)
        interrupts._noted.clear()


CASES = {
    "sigint-while-the-note-is-written": ((signal.SIGINT,), (), KeyboardInterrupt),
    "sigint-while-the-engine-makes-it": ((), (signal.SIGINT,), KeyboardInterrupt),
    "sigterm-while-the-engine-makes-it": ((), (signal.SIGTERM,), Terminated),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_interrupt_as_a_container_is_asked_for_leaves_no_container_and_no_note(tmp_path: Path, handlers: None,
                                                                                  case: str) -> None:
    in_note, in_create, raised = CASES[case]
    note = leftovers.Pending(tmp_path)
    seam = Seam(note, in_note, in_create)
    body_ran = False
    with pytest.raises(raised):
        with containers.lifetime(seam, "img", "smoke", "running x"):  # type: ignore[arg-type]
            body_ran = True
    # The create was answered before the interrupt was raised: the container it made is removed by its ID, the
    # block that would have used it never ran, and the note is settled.
    assert seam.asked == 1 and not body_ran
    assert seam.left() == set() and seam.removed == seam.made
    assert note.containers == 0 and not list(leftovers.runs_dir(tmp_path).glob("*.json"))


def test_asked_twice_while_the_engine_makes_it_stops_at_once_and_the_note_keeps_the_count(
        tmp_path: Path, handlers: None) -> None:
    """A second Ctrl-C is not held: the run stops without the engine's answer, and its note still counts the
    container for the next run's sweep (which finds it by its owner label)."""
    note = leftovers.Pending(tmp_path)
    seam = Seam(note, signals_in_create=(signal.SIGINT, signal.SIGINT))
    with pytest.raises(KeyboardInterrupt):
        with containers.lifetime(seam, "img", "smoke", "running x"):  # type: ignore[arg-type]
            pass
    assert seam.making is not None and seam.made == []
    assert note.containers == 1 and list(leftovers.runs_dir(tmp_path).glob("*.json"))


def test_an_interrupt_a_finalizer_swallowed_is_raised_at_the_next_step(handlers: None) -> None:
    """Python runs a handler inside a ``__del__`` too, where its interrupt cannot propagate: the step goes on, and
    the next checkpoint raises it."""

    class Finalized:
        def __del__(self) -> None:
            signal.raise_signal(signal.SIGINT)

    Finalized()  # dropped at once: its __del__ runs here, the interrupt inside it
    with pytest.raises(KeyboardInterrupt):
        interrupts.checkpoint()
    interrupts.checkpoint()  # raised once: the run's cleanup is not cut short by it again
