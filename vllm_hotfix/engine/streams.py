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
from collections import deque
from collections.abc import Callable, Mapping

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
                progress(f"{layer}: {status} {chunk.get('progress', '')}".strip())


def build(engine: Seam, context: bytes, progress: Progress | None, on_image: Callable[[str], None] | None,
          buildargs: Mapping[str, str], network: str | None, nocache: bool) -> str:
    """Build an untagged image from a tar context; return its ID (see :meth:`.facade.Engine.build`).

    If the build fails or is interrupted, the images its steps made are
    removed, unless other images depend on them.
    """
    tail: deque[str] = deque(maxlen=LOG_TAIL_LINES)
    made: list[str] = []

    def refused(message: str) -> PipelineError:
        return BuildError(f"docker build failed: {message}", log_tail=tail)

    try:
        with engine.translating("building the image", refused):
            image_id = _build(engine, context, tail, made, progress, on_image, dict(buildargs), network, nocache)
    except BaseException:
        for step in reversed(made):
            try:
                engine.remove_untagged(step, force=False)
            except PipelineError as exc:
                log.debug("build step %s stays: %s", step[:19], exc)
        raise
    return image_id


def _build(engine: Seam, context: bytes, tail: deque[str], made: list[str], progress: Progress | None,
           on_image: Callable[[str], None] | None, buildargs: dict[str, str], network: str | None,
           nocache: bool) -> str:
    image_id: str | None = None
    for chunk in engine.sdk.api.build(fileobj=io.BytesIO(context), custom_context=True, rm=True, forcerm=True,
                                      decode=True, buildargs=buildargs or None, network_mode=network,
                                      nocache=nocache):
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
