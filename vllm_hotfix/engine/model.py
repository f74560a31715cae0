"""What the engine's answers become: plain frozen data the rest of the tool reads."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import PipelineError

# What a refusal of the engine becomes for the caller (a pull: a base-image error; a push: a push error).
Refused = Callable[[str], PipelineError]


@dataclass(frozen=True, slots=True)
class ImageInfo:
    """What the pipeline needs to know about an image in the engine."""

    id: str
    tags: tuple[str, ...]
    repo_digests: tuple[str, ...]
    entrypoint: tuple[str, ...] | None
    cmd: tuple[str, ...] | None
    env: tuple[str, ...]
    user: str
    labels: Mapping[str, str] = field(default_factory=dict)
    size: int = 0
    # The engine's whole answer, for what the fields above leave out.
    attrs: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    os: str = "linux"
    architecture: str = ""
    variant: str = ""

    @property
    def digest(self) -> str | None:
        """The registry digest (``name@sha256:...``) if the image has one."""
        return self.repo_digests[0] if self.repo_digests else None

    @classmethod
    def from_inspect(cls, attrs: Mapping[str, Any]) -> ImageInfo:
        """From the engine's ``/images/{name}/json`` answer."""
        config = attrs.get("Config") or {}
        return cls(
            id=attrs["Id"],
            tags=tuple(attrs.get("RepoTags") or ()),
            repo_digests=tuple(attrs.get("RepoDigests") or ()),
            entrypoint=_tuple(config.get("Entrypoint")),
            cmd=_tuple(config.get("Cmd")),
            env=tuple(config.get("Env") or ()),
            user=config.get("User") or "",
            labels=dict(config.get("Labels") or {}),
            size=int(attrs.get("Size") or 0),
            attrs=attrs,
            os=str(attrs.get("Os") or "linux"),
            architecture=str(attrs.get("Architecture") or ""),
            variant=str(attrs.get("Variant") or ""),
        )


def _tuple(value: Sequence[str] | None) -> tuple[str, ...] | None:
    return tuple(value) if value is not None else None


@dataclass(frozen=True, slots=True)
class GpuRequest:
    """How a container asks the engine for GPUs; chosen elsewhere (gpu_access), passed through here.

    ``cdi``: a CDI device (``device``, e.g. ``nvidia.com/gpu=all``; engine API >= 1.44 with
    the ``cdi`` feature). ``gpus``: the capability request of ``docker run --gpus all``.
    ``runtime``: a registered OCI runtime (``runtime``, e.g. ``nvidia``) with every GPU visible.
    """

    way: str
    device: str = ""
    runtime: str = ""

    def __str__(self) -> str:
        if self.way == "cdi":
            return f"cdi:{self.device}"
        if self.way == "runtime":
            return f"runtime:{self.runtime}"
        return self.way


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the engine says about itself that bears on GPU access."""

    server_version: str
    api_version: str
    cdi_spec_dirs: tuple[str, ...]
    runtimes: tuple[str, ...]
    default_runtime: str
    local: bool


@dataclass(frozen=True, slots=True)
class ExecResult:
    exit_code: int
    stdout: str
    stderr: str


class Seam(Protocol):
    """What the container, file and stream helpers need of an :class:`~vllm_hotfix.engine.facade.Engine`.

    They are the facade's parts, written against this so that they import
    nothing of the facade that imports them.
    """

    @property
    def sdk(self) -> Any: ...

    def translating(self, operation: str, refused: Refused | None = None) -> AbstractContextManager[None]: ...

    def deadline(self, seconds: float | None) -> AbstractContextManager[None]: ...

    def notify(self, change: int) -> None: ...

    def remove_container(self, container_id: str) -> None: ...

    def image(self, ref: str) -> ImageInfo | None: ...

    def remove_untagged(self, image_id: str, force: bool = True) -> None: ...
