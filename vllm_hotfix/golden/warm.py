"""The golden's libraries imported ahead, while the image under test runs, so that judging waits only for scoring.

The golden check runs on the host once the runner's replies are back, and
its first step, importing PyTorch and the tokenizers library, took about 4 of
its 6-8 s on the GPU host (the model's load about 0.5 s, the scoring 1.8-2.3 s):
seconds at the end of a smoke's longest path, spent when nothing else is
left to do. Imported in a thread as the runner's container starts, they are
in ``sys.modules`` by the time the replies come back. Nothing is judged or
computed here; a host without them is told so by the check itself
(:func:`.scoring.missing`), never by this.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading

log = logging.getLogger(__name__)

MODULES = ("torch", "tokenizers")


def _import_all() -> None:
    for name in MODULES:
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - whatever stops the import, the check meets it again and says so
            log.debug("golden: %s not imported ahead (%s)", name, exc)
            return


def start() -> threading.Thread | None:
    """Import the golden's libraries in a daemon thread, where this host has them (None: it has not, or they are
    imported already)."""
    from .scoring import missing

    if missing() is not None or all(name in sys.modules for name in MODULES):
        return None
    thread = threading.Thread(target=_import_all, name="golden-warm", daemon=True)
    thread.start()
    return thread
