"""The two builders behind one protocol: what a builder is given, and what it must do.

``dockerfile`` (:class:`vllm_hotfix.building.render.DockerfileBuilder`, the default)
has the engine build the rendered Dockerfile; ``assemble``
(:class:`vllm_hotfix.building.assemble.AssembleBuilder`) writes the same image and the
engine loads it. :func:`vllm_hotfix.building.pipeline.builder` turns a name into one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ..errors import Refused

if TYPE_CHECKING:
    from ..engine import Engine
    from .base import BaseFacts, PatchedFile
    from .definitions import ImageDefinition
    from .patches import Patch
    from .pins import Prepared

# How `image` can build: the engine builds the rendered Dockerfile (the default),
# or this module writes the image and the engine loads it.
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
    """``name`` if a builder has it; else Refused (a value that did not come through the CLI's choice)."""
    if name not in BUILDERS:
        raise Refused(f"unknown builder {name!r} (one of {', '.join(BUILDERS)})")
    return name
