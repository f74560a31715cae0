"""The builders: what a builder is given, the two that turn it into an image, and the name of each.

``dockerfile`` (:class:`DockerfileBuilder`, the default) has the engine build
the Dockerfile that :func:`.render.render` writes, with the set's pinned wheels
served on loopback; ``assemble`` (:class:`AssembleBuilder`) writes the same
image's layer and config (:mod:`.assemble`) and has the engine load them.
:func:`builder` is the one place a name becomes a builder. What the builders
need is imported when they build, so the CLI can list their names at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..errors import UsageError

if TYPE_CHECKING:
    from ..engine import Engine
    from .base import BaseFacts, PatchedFile
    from .definitions import ImageDefinition
    from .patches import Patch
    from .pins import Prepared

# How `image` can build: the engine builds the rendered Dockerfile (the default),
# or assemble.py writes the image and the engine loads it.
BUILDERS = ("dockerfile", "assemble")


def _quiet(_line: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class BuildJob:
    """What every builder is given: the base, the patched files, and what to call the result."""

    definition: ImageDefinition
    facts: BaseFacts
    files: Sequence[PatchedFile]
    applied: Sequence[Patch]
    template: str
    output_ref: str
    pinned: Prepared | None = None
    on_image: Callable[[str], None] | None = None  # hears the image ID as soon as it is known
    say: Callable[[str], None] = _quiet
    nocache: bool = False  # --rebuild: the engine's build cache must not stand in for a build


class Builder(Protocol):
    """One way to turn a :class:`BuildJob` into an untagged image in the engine."""

    name: str

    def build(self, engine: Engine, job: BuildJob) -> str:
        """The new image's ID; BuildError (AssembleUnsupported: try another builder) if none."""
        ...


def known_builder(name: str) -> str:
    """``name`` if a builder has it; else a usage error, as the CLI's own choice gives (exit 64)."""
    if name not in BUILDERS:
        raise UsageError(f"unknown builder {name!r} (one of {', '.join(BUILDERS)})")
    return name


class DockerfileBuilder:
    """The engine builds the rendered Dockerfile from a context of the patched files."""

    name = "dockerfile"

    def build(self, engine: Engine, job: BuildJob) -> str:
        from .render import context, render

        files = list(job.files)
        dockerfile = render(job.template, job.definition, job.facts, files, list(job.applied), job.pinned)
        ctx = context(dockerfile, job.facts, files)
        job.say(f"==> building {job.output_ref} ({len(files)} patched file(s), context {len(ctx)} bytes)")
        # Pins: the wheels are served on loopback for the RUN step, which needs the
        # host's network to reach them; nothing else in the build uses a network.
        with _served(job.pinned) as buildargs:
            return engine.build(ctx, lambda line: job.say("    " + line), on_image=job.on_image,
                                buildargs=buildargs, network="host" if job.pinned is not None else None,
                                nocache=job.nocache)


@contextmanager
def _served(pinned: Prepared | None) -> Iterator[dict[str, str]]:
    """The pinned wheels on loopback for the build (its build arguments); nothing to serve without pins."""
    if pinned is None:
        yield {}
        return
    from .pins import serve  # here: most patch sets pin nothing

    with serve(pinned) as buildargs:
        yield buildargs


class AssembleBuilder:
    """Write the layer and config the Dockerfile build would make, and load them."""

    name = "assemble"

    def build(self, engine: Engine, job: BuildJob) -> str:
        from . import assemble
        from .render import labels

        job.say(f"==> assembling {job.output_ref} ({len(job.files)} patched file(s)) and loading it")
        image_id = assemble.build(engine, job.facts, job.files,
                                  labels(job.definition, job.facts, list(job.files), list(job.applied)),
                                  f"vllm-hotfix: {job.definition.tag} patched files and bytecode into "
                                  f"{job.facts.site_dir}", on_image=job.on_image)
        job.say(f"    loaded {image_id}")
        return image_id


def builder(name: str) -> Builder:
    """The builder called ``name`` (one of :data:`BUILDERS`)."""
    known: dict[str, type[Builder]] = {"dockerfile": DockerfileBuilder, "assemble": AssembleBuilder}
    return known[known_builder(name)]()
