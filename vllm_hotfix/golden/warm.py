"""The golden's work done ahead, while the image under test runs, so that judging waits for little once it ends.

The golden check runs on the host once the runner's replies are back. Its
first step, importing PyTorch and the tokenizers library, took about 4 of
its 6-8 s on the GPU host; then a recording measures the golden's envelope
(30-43 s on the tiny models, beside other smokes), and a judged run scores
every distinct reply in three worlds (9-20 s). All of it happened at the end
of a smoke's longest path, when nothing else was left to do.

None of it needs what the image serves: the envelope is the golden's alone,
and a right image serves the reference's answers, whose distributions are a
function of the prompt and the tokens. So :func:`start` imports the
libraries in a daemon thread as the runner's container starts and prepares
a :class:`~.scoring.Scorer` of the served model there: the recording's
envelope, or the reference's answers scored (:meth:`~.scoring.Scorer.prepare`).
The check takes that scorer (:func:`take`) and computes only what the run
served that was not prepared; a reply is judged by the same computation
whether it was prepared or not. Nothing is judged here, and nothing the
image says reaches it. A host without torch is told so by the check itself
(:func:`.scoring.missing`), never by this; work that failed here is simply
done again by the check, which then says why it could not.
"""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MODULES = ("torch", "tokenizers")


@dataclass
class Ahead:
    """The work one run asked for: the model, the prompts, the answers expected (prompt index -> token ID lists)
    and, for a recording, the envelope's length; the thread doing it and the scorer it prepared (None until it
    has, or where it failed)."""

    model: Path
    prompts: tuple[str, ...]
    expected: Mapping[int, Sequence[Sequence[int]]]
    envelope_tokens: int | None
    thread: threading.Thread = field(init=False)
    scorer: Any = None
    cancel: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.thread = threading.Thread(target=self.run, name="golden-ahead", daemon=True)

    def run(self) -> None:
        try:
            if not _import_all() or self.cancel.is_set():
                return
            from .scoring import Scorer

            scorer = Scorer(self.model)
            scorer.cancelled = self.cancel.is_set
            scorer.prepare(self.prompts, self.expected, envelope_tokens=self.envelope_tokens)
            scorer.cancelled = lambda: False
            self.scorer = scorer
        except Exception as exc:  # noqa: BLE001 - the check does the same work again and says what stops it
            log.debug("golden: nothing prepared ahead (%s: %s)", type(exc).__name__, exc)


_ahead: Ahead | None = None


def _import_all() -> bool:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - whatever stops the import, the check meets it again and says so
            log.debug("golden: %s not imported ahead (%s)", name, exc)
            return False
    return True


def start(model: Path, prompts: Sequence[str], expected: Mapping[int, Sequence[Sequence[int]]],
          envelope_tokens: int | None = None) -> threading.Thread | None:
    """Import the golden's libraries and prepare a scorer of ``model`` in a daemon thread, where this host has
    them (``expected``: the replies a right image gives, by prompt index; ``envelope_tokens``: a recording's
    envelope length). None: the host lacks them, and nothing is started."""
    global _ahead
    from .scoring import missing

    if missing() is not None:
        return None
    _ahead = Ahead(Path(model), tuple(str(p) for p in prompts), dict(expected), envelope_tokens)
    _ahead.thread.start()
    return _ahead.thread


def take(model: Path, prompts: Sequence[str]) -> Any:
    """The scorer prepared for ``model`` and ``prompts`` (waiting for the thread to finish its work), once; None
    where none was asked for them, or the work failed."""
    global _ahead
    work, _ahead = _ahead, None
    if work is None or work.model.resolve() != Path(model).resolve() or work.prompts != tuple(str(p) for p in prompts):
        return None
    work.thread.join()
    return work.scorer


def settle(wait: float = 120.0) -> None:
    """The run is over (judged or not): work still under way for it is called off, and waited for (between two
    prompts it stops) so that the process never ends with the golden computing in a thread."""
    global _ahead
    work, _ahead = _ahead, None
    if work is None:
        return
    work.cancel.set()
    work.thread.join(wait)


def expected_answers(reference: Any, prompts: int) -> dict[int, list[list[int]]]:
    """The replies a right image gives, from ``reference`` (its answers at concurrency 1 and, where it recorded
    them, every level's under fixed batches: request ``i`` asks prompt ``i mod prompts``), by prompt index, as
    token IDs; a token not named ``token_id:N`` is left out with its reply."""
    from .scoring import token_id

    out: dict[int, list[list[int]]] = {}

    def add(k: int, tokens: Sequence[Any]) -> None:
        ids = [token_id(str(t)) for t in tokens]
        if all(i is not None for i in ids):
            out.setdefault(k, []).append([int(i) for i in ids if i is not None])

    for k, answer in enumerate(reference.answers):
        add(k, answer.tokens)
    by_level = (reference.levels or {}).get("answers") or {}
    if isinstance(by_level, Mapping) and prompts:
        for replies in by_level.values():
            for i, reply in enumerate(replies if isinstance(replies, list) else ()):
                if isinstance(reply, Mapping) and isinstance(reply.get("tokens"), list):
                    add(i % prompts, reply["tokens"])
    return out
