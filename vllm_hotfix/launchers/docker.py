"""The runner in a container of the Docker engine, through the engine seam."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..engine import Engine, GpuRequest
from ..errors import SmokeError
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
    name = "docker"

    def __init__(self, engine: Engine, python: str = "python3", timeout: float = 3600) -> None:
        self.engine = engine
        self.python = python
        self.timeout = timeout

    def launch(self, image: str, runner_dir: Path, job: Mapping[str, Any], gpu: str | None,
               model: Path | None = None) -> Launched:
        mounts = [(str(runner_dir), MOUNT)]
        if model is not None:
            mounts.append((str(model), "/model"))
        if not self.engine.local:
            raise SmokeError(f"the Docker engine at {self.engine.address} is not on this host: the runner "
                             "folder cannot be mounted into its containers", hint="run smoke on the engine's host")
        res = self.engine.run(image, argv(self.python), gpu=gpu_request(gpu), mounts=mounts, timeout=self.timeout)
        if res.exit_code == 124:
            raise SmokeError(f"the runner in {image} did not finish within {self.timeout:.0f} s")
        return results(res.stdout, res.stderr, f"runner in {image} (docker)")
