"""What this host last saw a base reference resolve to, so that ``render`` works with no engine reachable.

Each time ``image`` or ``render`` resolves a base through the engine, the
engine's description of it (its inspect answer: ID, config, platform) is kept
under ``VLLM_HOTFIX_CACHE/refs/<hash of the reference>/``, with the same
host-keyed MAC as the facts cache (:mod:`vllm_hotfix.journal.cache`), so a
description someone else wrote into the cache is ignored. With that and the
facts cache of that image ID (the base's files, the patch results and their
bytecode, kept by the same runs), ``render`` needs nothing of an engine; where
some piece is missing it says what and stops, asking nothing of the engine.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from typing import Any, NoReturn

from ..engine import ImageInfo
from ..errors import EngineError, PipelineError
from ..journal.cache import Store, host_key
from ..journal.records import now_iso

log = logging.getLogger(__name__)

INDEX = "description"


def _store(cache: Path, ref: str) -> Store | None:
    key = host_key(cache)
    if key is None:
        return None
    return Store(cache / "refs" / hashlib.sha256(ref.encode()).hexdigest()[:40], key)


def remember(cache: Path, ref: str, info: ImageInfo) -> None:
    """Keep the engine's description of ``ref``; a cache that cannot be written only loses the offline render."""
    if not info.attrs:
        return
    try:
        store = _store(cache, ref)
        if store is not None:
            store.write(INDEX, {"ref": ref, "seen": now_iso(), "inspect": dict(info.attrs)})
    except (OSError, PipelineError) as exc:
        log.warning("could not keep the description of %s for offline renders: %s", ref, exc)


def recall(cache: Path, ref: str) -> tuple[ImageInfo, str] | None:
    """The description of ``ref`` this host kept, and when it was seen; None if none (or not this host's)."""
    store = _store(cache, ref)
    body = store.read(INDEX) if store is not None else None
    if body is None or body.get("ref") != ref or not isinstance(body.get("inspect"), dict):
        return None
    try:
        return ImageInfo.from_inspect(body["inspect"]), str(body.get("seen") or "")
    except (KeyError, TypeError, ValueError):
        return None


class NoEngine:
    """Stands where the engine would: every use is the engine error that made the run go without one, naming what
    was missing from the cache (the caller reaches it only for what the cache did not answer)."""

    def __init__(self, cause: EngineError, ref: str) -> None:
        self._cause = cause
        self._ref = ref

    def __getattr__(self, name: str) -> Any:
        def refuse(*_args: Any, **_kwargs: Any) -> NoReturn:
            raise EngineError(f"{self._cause}; the cache of this host lacks part of what render needs of "
                              f"{self._ref} ({name}): render it once with an engine",
                              hint=self._cause.hint) from None

        return refuse
