"""A signal at the moment a container is asked for: the run's note of its containers is settled, not left behind.

The moments are ones a real engine cannot be made to hit on purpose (a signal
while the note is written, or while the create is on its way), so the seam is
a stand-in that raises the interrupt there; the note is the real one, on disk.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from vllm_hotfix.engine import containers
from vllm_hotfix.journal import leftovers


class Containers:
    def __init__(self, seam: Seam) -> None:
        self.seam = seam

    def create(self, image: str, **_kw: Any) -> Any:
        self.seam.asked += 1
        raise KeyboardInterrupt  # while the engine makes it


class Api:
    def containers(self, **_kw: Any) -> list[str]:
        return []  # the engine never shows it: it was not made


class Sdk:
    def __init__(self, seam: Seam) -> None:
        self.containers = Containers(seam)
        self.api = Api()


class Seam:
    """Just what ``containers.lifetime`` asks of an engine; ``interrupt_note`` raises the interrupt as the note is
    written for the count's +1."""

    def __init__(self, note: leftovers.Pending, interrupt_note: bool) -> None:
        self.note = note
        self.interrupt_note = interrupt_note
        self.asked = 0
        self.removed: list[str] = []
        self.sdk = Sdk(self)

    @contextmanager
    def translating(self, _operation: str, _refused: Any = None) -> Iterator[None]:
        yield

    def notify(self, change: int) -> None:
        self.note.container(change)
        if change > 0 and self.interrupt_note:
            raise KeyboardInterrupt

    def remove_container(self, container_id: str) -> None:
        self.removed.append(container_id)


@pytest.mark.parametrize("interrupt_note", [True, False],
                         ids=["while-the-note-is-written", "while-the-engine-makes-it"])
def test_an_interrupt_as_a_container_is_asked_for_leaves_no_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 interrupt_note: bool) -> None:
    monkeypatch.setattr(containers, "CREATE_SETTLE", 0.0)
    note = leftovers.Pending(tmp_path)
    seam = Seam(note, interrupt_note)
    with pytest.raises(KeyboardInterrupt), containers.lifetime(seam, "img", "smoke", "running x"):  # type: ignore[arg-type]
        pass
    assert note.containers == 0 and not list(leftovers.runs_dir(tmp_path).glob("*.json"))
    # Interrupted before the create was sent, nothing is looked for; after, the container is removed by name.
    assert seam.asked == (0 if interrupt_note else 1)
    assert len(seam.removed) == (0 if interrupt_note else 1)
