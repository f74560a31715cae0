"""The engine's streamed work: pulling, building and pushing, consumed as the engine reports it.

Each is one SDK call whose answer is a stream of JSON chunks: progress is
handed on line by line (one line per layer state change, readable in CI
logs), an ``error`` chunk ends the work as the operation's own error, and
a build keeps the last lines of its log for the error that reports it.
"""

from __future__ import annotations

import io
import logging
import re
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..errors import BaseImageError, BuildError, PipelineError, PushError
from . import dockerconfig, registry_errors
from .model import Seam

log = logging.getLogger(__name__)

LOG_TAIL_LINES = 50
_STEP_ID = re.compile(r"^ ---> ([0-9a-f]{12,64})$")

Progress = Callable[[str], None]


def pull(engine: Seam, ref: str, progress: Progress | None = None, platform: str | None = None) -> None:
    """Pull ``ref`` (of one ``platform`` when given; only engines from API 1.32 take it)."""
    repo, tag = dockerconfig.split_reference(ref)
    shown: dict[str, str] = {}
    extra = {"platform": platform} if platform else {}

    def refused(message: str) -> PipelineError:
        return BaseImageError(f"cannot pull base image {ref}: {message}",
                              hint="check the registry is reachable, or load the image and use --pull never")

    with engine.translating(f"pulling {ref}", refused):
        for chunk in engine.sdk.api.pull(repo, tag=tag, stream=True, decode=True, **extra):
            if "error" in chunk:
                raise BaseImageError(f"cannot pull base image {ref}: {chunk['error']}")
            status = chunk.get("status", "")
            layer = chunk.get("id", "")
            if progress is not None and shown.get(layer) != status:
                shown[layer] = status
                # A chunk about the whole pull ("Pulling from ...", "Digest: ...") names no layer.
                progress(f"{layer + ': ' if layer else ''}{status} {chunk.get('progress', '')}".strip())


def build(engine: Seam, context: bytes, progress: Progress | None, on_image: Callable[[str], None] | None,
          buildargs: Mapping[str, str], network: str | None, nocache: bool) -> str:
    """Build an untagged image from a tar context; return its ID (see :meth:`.facade.Engine.build`).

    If the build fails or is interrupted, the images its steps made are
    removed, unless other images depend on them.
    """
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    made: list[str] = []
    stream: list[Iterator[dict[str, Any]]] = []

    def refused(message: str) -> PipelineError:
        return BuildError(f"docker build failed: {message}", log_tail=tail)

    started = time.time()
    try:
        with engine.translating("building the image", refused):
            image_id = _build(engine, context, tail, made, stream, progress, on_image, dict(buildargs), network,
                              nocache)
    except BaseException:
        # Interrupted (Ctrl-C, TERM) or failed: close the stream first, which ends the engine's build (an open
        # one goes on to the end, committing every step and the whole image after this process stopped).
        for it in stream:
            close = getattr(it, "close", None)
            if close is not None:
                close()
        remove_steps(engine, made, started)
        raise
    return image_id


# Seconds the engine may take, after the build's stream closed, to commit the step it was in.
STEP_SETTLE = 3.0


def remove_steps(engine: Seam, made: list[str], since: float, settle: float = STEP_SETTLE) -> int:
    """Remove the images a build that did not finish made: the steps it reported, and untagged images the
    engine committed on top of them after the last report (the step in flight). Return how many went.

    ``made[0]`` is the base (the classic builder reports the FROM image first): an untagged image on the
    base itself counts as this build's only if the engine made it at or after ``since`` (epoch seconds).
    """
    gone = 0
    known = [m for m in made if m]
    if not known:
        return 0
    end = time.monotonic() + settle
    while True:
        for image_id in late_children(engine, known, since):
            try:
                engine.remove_untagged(image_id, force=False)
                gone += 1
            except PipelineError as exc:
                log.debug("build step %s stays: %s", image_id[:19], exc)
        if time.monotonic() >= end:
            break
        time.sleep(0.5)
    for step in reversed(known[1:]):
        try:
            before = engine.image(step)
            engine.remove_untagged(step, force=False)
            gone += before is not None and engine.image(step) is None
        except PipelineError as exc:
            log.debug("build step %s stays: %s", step[:19], exc)
    return gone


def _epoch(created: str) -> float:
    """An engine's RFC 3339 ``Created`` (nanoseconds and all) as epoch seconds; 0 when unreadable."""
    from datetime import datetime

    text = created.rstrip("Z")
    head, _, frac = text.partition(".")
    try:
        return datetime.fromisoformat(f"{head}.{(frac + '000000')[:6]}+00:00").timestamp()
    except ValueError:
        return 0.0


def late_children(engine: Seam, steps: list[str], since: float) -> list[str]:
    """Untagged images whose parent chain reaches one of ``steps`` (the classic builder records each step's
    parent; ``steps[0]`` is the base, which counts only for images made at or after ``since``), youngest first:
    what a build committed that its stream never reported."""
    known = [s.removeprefix("sha256:") for s in steps]

    def which(image_id: str) -> int | None:
        bare = image_id.removeprefix("sha256:")
        return next((i for i, k in enumerate(known) if bare.startswith(k) or k.startswith(bare)), None)

    with engine.translating("listing untagged images"):
        dangling = [str(i) for i in engine.sdk.api.images(filters={"dangling": True}, quiet=True) or []]
    found: list[tuple[float, str]] = []
    for image_id in dangling:
        if which(image_id) is not None:
            continue  # a reported step: removed after its children
        created, cur, depth, reached = None, image_id, 0, None
        while cur and depth < 200 and reached is None:
            with engine.translating("inspecting an untagged image"):
                try:
                    attrs = engine.sdk.api.inspect_image(cur)
                except Exception:  # noqa: BLE001 - gone meanwhile: not ours to remove
                    break
            created = _epoch(str(attrs.get("Created", ""))) if created is None else created
            cur, depth = str(attrs.get("Parent") or ""), depth + 1
            reached = which(cur) if cur else None
        if reached is None or created is None or (reached == 0 and created < since - 1):
            continue
        found.append((created, image_id))
    return [i for _created, i in sorted(found, reverse=True)]


def _build(engine: Seam, context: bytes, tail: deque[str], made: list[str], stream: list[Iterator[dict[str, Any]]],
           progress: Progress | None, on_image: Callable[[str], None] | None, buildargs: dict[str, str],
           network: str | None, nocache: bool) -> str:
    image_id: str | None = None
    chunks = engine.sdk.api.build(fileobj=io.BytesIO(context), custom_context=True, rm=True, forcerm=True,
                                  decode=True, buildargs=buildargs or None, network_mode=network, nocache=nocache)
    stream.append(chunks)
    for chunk in chunks:
        if "error" in chunk:
            tail.append(chunk["error"].rstrip())
            raise BuildError("docker build failed: " + chunk["error"].strip(), log_tail=tail)
        if "aux" in chunk and "ID" in chunk["aux"]:
            image_id = chunk["aux"]["ID"]
        for line in chunk.get("stream", "").splitlines():
            step = _STEP_ID.match(line)
            if step:
                made.append(step.group(1))
                if on_image is not None:
                    on_image(step.group(1))
            if line.strip():
                tail.append(line)
                if progress is not None:
                    progress(line)
    if image_id is None:
        for line in reversed(tail):
            if line.startswith("Successfully built "):
                found = engine.image(line.split()[-1])
                image_id = found.id if found is not None else None
                break
    if image_id is None:
        raise BuildError("docker build reported no image ID", log_tail=tail)
    return image_id


def push(engine: Seam, ref: str, progress: Progress | None = None) -> str:
    """Push ``ref`` with the credentials `docker login` stored; return the manifest digest.

    The SDK reads them the docker way (:mod:`.dockerconfig`) and hands them to the engine.
    """
    repo, tag = dockerconfig.split_reference(ref)
    host = dockerconfig.registry_of(ref)
    digest: str | None = None
    shown: dict[str, str] = {}
    with engine.translating(f"push of {ref}", lambda message: registry_errors.push_error(ref, host, message)):
        for chunk in engine.sdk.api.push(repo, tag=tag, stream=True, decode=True):
            if "error" in chunk:
                raise registry_errors.push_error(ref, host, chunk["error"].strip())
            aux = chunk.get("aux") or {}
            if "Digest" in aux:
                digest = aux["Digest"]
            status = chunk.get("status", "")
            layer = chunk.get("id", "")
            if progress is not None and shown.get(layer) != status:
                shown[layer] = status
                progress(f"{layer}: {status}".strip(": "))
    if digest is None:
        raise PushError(f"push of {ref} reported no digest")
    return digest
