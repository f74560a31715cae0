"""The runner in a container of the Docker engine, through the engine seam."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ...engine import Engine, GpuRequest
from ...errors import RunnerFailed, SmokeError
from ..runner import MOUNT
from .base import Launched, argv, results

log = logging.getLogger(__name__)


def gpu_request(text: str | None) -> GpuRequest | None:
    """``cdi[:DEVICE]``, ``gpus`` or ``runtime[:NAME]`` as the engine's request; None for none."""
    if not text or text == "none":
        return None
    from ..gpu_access import _explicit, parse_request

    return _explicit(parse_request(text))


class DockerLauncher:
    """The runner in a container of ``engine``: the default ``smoke`` and the one ``image`` runs after a build.

    ``env`` and ``writable`` (host folder, container path) give the container
    a compile cache; ``follow`` gets the runner's progress lines as they come.
    """

    name = "docker"

    def __init__(self, engine: Engine, python: str = "python3", timeout: float = 3600, *,
                 env: Mapping[str, str] | None = None, writable: Sequence[tuple[str, str]] = (),
                 follow: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.python = python
        self.timeout = timeout
        self.env = dict(env or {})
        self.writable = list(writable)
        self.follow = follow

    def launch(self, image: str, runner_dir: Path, job: Mapping[str, Any], gpu: str | None,
               model: Path | None = None) -> Launched:
        mounts: list[tuple[str, str]] = []
        files: dict[str, bytes] | None = None
        if self.engine.local:
            mounts.append((str(runner_dir), MOUNT))
        else:
            # An engine on another host cannot mount this host's folder: the same files are copied into the
            # container before it starts (never into an image).
            files = {f"{MOUNT.lstrip('/')}/{p.relative_to(runner_dir)}": p.read_bytes()
                     for p in sorted(runner_dir.rglob("*")) if p.is_file()}
        if model is not None:
            if not self.engine.local:
                raise SmokeError(f"--serve-model: the Docker engine at {self.engine.address} is not on this host, "
                                 "so the model folder cannot be mounted", hint="run smoke on the engine's host")
            mounts.append((str(model), "/model"))
        res = self.engine.run(image, argv(self.python), files=files, files_at="/", gpu=gpu_request(gpu),
                              mounts=mounts, timeout=self.timeout, env=self.env or None, writable=self.writable,
                              follow=self.follow)
        if res.exit_code == 124:
            raise RunnerFailed(f"the runner in {image} did not finish within {self.timeout:.0f} s", incomplete=True,
                               hint="its Python may hang; give it longer with --deadline S if it is only slow")
        return results(res.stdout, res.stderr, f"runner in {image} (docker)")
