"""A ``docker load`` opened before its archive exists, so the engine's start of it overlaps the tool's work.

The engine unpacks a load's archive in a process of its own, started once the
first bytes of the request body arrive; its start takes tens of milliseconds,
about what the tool takes to import its build code and write an assembled
image. So an assembled build can open the load first (:meth:`Engine.expect_load`):
the SDK's ``load_image`` runs in a thread, its body a generator that sends
:data:`LEAD` at once and the archive when the builder hands it over.

:data:`LEAD` is the header of an empty file, the first member of the archive
the engine receives; the archive that follows is a whole tar of its own, so
the two make one tar stream (the engine unpacks the empty file and ignores
it). A run that loads nothing (a reused build, an error, an interrupt)
completes the stream with :data:`NOTHING`, whose empty manifest loads nothing.
"""

from __future__ import annotations

import queue
import tarfile
import threading
from collections.abc import Iterator
from typing import Any

from ..tarball import Entry, write

LEAD = Entry("vllm-hotfix-load", b"", 0o644).info().tobuf(tarfile.PAX_FORMAT)
NOTHING = write([Entry("manifest.json", b"[]", 0o644)])


class PendingLoad:
    """``POST /images/load`` through the SDK in a thread; :meth:`finish` sends the archive and waits for the
    engine's answer, :meth:`cancel` completes it so that it loads nothing."""

    def __init__(self, api: Any) -> None:
        self._rest: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._sent = threading.Event()  # the whole body handed to the connection (or the request over)
        self._messages: list[Any] = []
        self._error: BaseException | None = None
        # A daemon: a process that ends (an interrupt) never waits for the engine's answer to a load.
        self._thread = threading.Thread(target=self._post, args=(api,), name="engine-load", daemon=True)
        self._thread.start()

    def _body(self) -> Iterator[bytes]:
        yield LEAD
        yield self._rest.get()
        self._sent.set()  # asked for more: the archive is written

    def _post(self, api: Any) -> None:
        try:
            self._messages = list(api.load_image(self._body(), quiet=True))
        except BaseException as exc:  # noqa: BLE001 - handed to the caller of finish(), in its thread
            self._error = exc
        finally:
            self._sent.set()

    def finish(self, archive: bytes) -> list[Any]:
        """Send ``archive`` (a whole tar) after the lead; the engine's messages, or what the SDK raised."""
        self._rest.put(archive)
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._messages

    def cancel(self, wait: float) -> None:
        """Complete the archive so that it loads nothing, and wait up to ``wait`` seconds until it is sent.

        Not for the engine's answer: whole, the archive loads nothing, and an engine that has not
        read all of it when the process ends drops the load and its unpacked files.
        """
        self._rest.put(NOTHING)
        self._sent.wait(wait)

    def answer(self, wait: float) -> list[Any] | None:
        """The engine's messages, once it answered within ``wait`` seconds (None: not yet, or the load failed)."""
        self._thread.join(wait)
        return None if self._thread.is_alive() or self._error is not None else self._messages
