"""The file checks a launcher's job carries, read from the copy of the image it starts, never run.

Podman's store, a registry's blobs or the Docker engine: wherever the image
is started from, its files are read from there and judged the same way
(:func:`~vllm_hotfix.checking.integrity.check_image`), and the runner gets the
finished checks with the job.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...building import definitions, expected, pins, sources
from ...engine import Engine, ImageInfo
from ...errors import DefinitionError, EngineError, PinError, UnknownExpectation
from .. import integrity


def missing_compiled(judged: integrity.Judged) -> tuple[str, ...]:
    """Compiled files RECORD lists but the image lacks; the base's named so. They keep it from GPU-verified."""
    return (*judged.compiled_missing, *(f"{p} (the base's)" for p in judged.compiled_missing_base))


@dataclass(frozen=True, slots=True)
class FileFacts:
    """The file checks of a run whose other checks a runner makes elsewhere, and what they found."""

    checks: tuple[dict[str, Any], ...]
    expected_from: str
    compiled_missing: tuple[str, ...] = ()  # compiled files RECORD lists but the image lacks (the base's named so)


FILE_CHECKS = ("patch-landed", "package-version", "integrity")


def unread_file_checks(why: str) -> list[dict[str, Any]]:
    """The file checks as incomplete, saying ``why``: a run cannot pass without them."""
    return [{"name": name, "status": "incomplete", "detail": why, "data": {"answered_by": integrity.FILESYSTEM}}
            for name in FILE_CHECKS]


def pinned_names(root: Path, definition: str) -> list[str]:
    """The distributions the definition's patch set pins, as pins.txt spells them (integrity reads them as the
    image's own); DefinitionError or PinError when the definition or its pins.txt is unusable."""
    defn = definitions.load(root, definition)
    pinset = pins.load(root, defn.patch_set, defn.package)
    return [p.spelled for p in pinset.pins] if pinset is not None else []


def file_facts(root: Path, image: ImageInfo, files_from: integrity.FileSource, expect_from: Engine | None,
               say: Callable[[str], None] = lambda _l: None) -> FileFacts:
    """The file checks alone, read from ``files_from`` (the store the launcher starts the image from).

    For ``--launcher podman|kubernetes``: the same expectation and judgement
    as a Docker run (:func:`~vllm_hotfix.checking.integrity.check_image`), only the
    files come from wherever the image is started. ``expect_from``: the Docker
    engine that may hold the base to recompute the expectation from (None:
    none; the build record alone then). Files that cannot be read make the
    checks incomplete: the run cannot pass without them.
    """
    fs = {"answered_by": integrity.FILESYSTEM}
    try:
        try:
            found: expected.Expected | str = expected.for_image(expect_from, root, image)
        except EngineError as exc:
            say(f"    no Docker engine to read the base from ({str(exc).splitlines()[0]}): the build record alone")
            found = expected.for_image(None, root, image)
    except UnknownExpectation as exc:
        found = str(exc)
    if isinstance(found, str):
        return FileFacts(({"name": "patch-landed", "status": "fail", "detail": found, "data": fs},), "unknown")
    extra: list[dict[str, Any]] = []
    pinned: list[str] = []
    try:
        pinned = pinned_names(root, found.definition)
    except (DefinitionError, PinError) as exc:
        extra.append({"name": "pins", "status": "fail", "detail": str(exc)})
    try:
        files = integrity.check_image(files_from, sources.cache_dir(root), image.id, found, pinned, say)
    except EngineError as exc:
        why = f"the image's files could not be read: {str(exc).splitlines()[0]}"
        return FileFacts(tuple(unread_file_checks(why) + extra), found.source)
    judged = files.judged
    return FileFacts(tuple([{**c, "data": {**(c.get("data") or {}), **fs}} for c in files.checks] + extra),
                     found.source, missing_compiled(judged))
