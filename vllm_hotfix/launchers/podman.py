"""The runner in a container started by podman: no daemon, GPUs as CDI devices.

Everything goes through the podman CLI as argument lists (never a shell).
Debian's podman (4.3) reads CDI specs from /etc/cdi and /var/run/cdi, so
``nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml`` is what a GPU host
needs; the request is ``--device nvidia.com/gpu=all``.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..engine import labels as L
from ..errors import EngineError, SmokeError
from ..runner import MOUNT
from .base import Launched, argv, results

log = logging.getLogger(__name__)

DEFAULT_DEVICE = "nvidia.com/gpu=all"


def device_of(gpu: str | None) -> str | None:
    """The CDI device for a ``--gpu-request``; podman has no other way to hand out GPUs."""
    if not gpu or gpu == "none":
        return None
    way, _, arg = gpu.partition(":")
    if way in ("auto", "gpus"):
        return DEFAULT_DEVICE
    if way == "cdi":
        return arg or DEFAULT_DEVICE
    raise SmokeError(f"--gpu-request {gpu}: podman reaches GPUs through CDI devices only (cdi[:DEVICE])")


class PodmanLauncher:
    name = "podman"

    def __init__(self, podman: str = "podman", python: str = "python3", timeout: float = 3600,
                 global_args: Sequence[str] = ()) -> None:
        self.podman = podman
        self.python = python
        self.timeout = timeout
        self.global_args = list(global_args)  # e.g. --root/--runroot for a private store

    def command(self, *args: str) -> list[str]:
        return [self.podman, *self.global_args, *args]

    def run_argv(self, image: str, runner_dir: Path, gpu: str | None, model: Path | None, name: str) -> list[str]:
        """The ``podman run`` command line, as data."""
        cmd = self.command("run", "--rm", "--name", name, "--network", "none", "--pull", "never",
                           "--label", f"{L.OWNER}={L.owner()}", "--entrypoint", self.python,
                           "--volume", f"{runner_dir}:{MOUNT}:ro")
        if model is not None:
            cmd += ["--volume", f"{model}:/model:ro"]
        device = device_of(gpu)
        if device is not None:
            cmd += ["--device", device]
        return [*cmd, image, *argv(self.python)[1:]]

    def launch(self, image: str, runner_dir: Path, job: Mapping[str, Any], gpu: str | None,
               model: Path | None = None) -> Launched:
        if shutil.which(self.podman) is None:
            raise EngineError(f"podman: {self.podman} is not installed or not on PATH")
        name = f"vllm-hotfix-runner-{uuid.uuid4().hex[:12]}"
        cmd = self.run_argv(image, runner_dir, gpu, model, name)
        log.debug("running %s", cmd)
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, errors="replace", timeout=self.timeout)
        except subprocess.TimeoutExpired:
            subprocess.run(self.command("rm", "--force", name), capture_output=True, check=False)
            raise SmokeError(f"the runner in {image} (podman) did not finish within {self.timeout:.0f} s") from None
        if done.returncode in (125, 126, 127) and "@@vllm-hotfix-runner" not in done.stdout:
            # podman's own failures: the image missing, a CDI device unknown, a runtime refusing.
            said = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
            raise EngineError(f"podman could not run {image}: {said}")
        return results(done.stdout, done.stderr, f"runner in {image} (podman)")

    def image_facts(self, image: str) -> dict[str, Any]:
        """``podman image inspect`` of ``image``; EngineError when podman does not have it."""
        done = subprocess.run(self.command("image", "inspect", image), capture_output=True, text=True,
                              errors="replace")
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["no such image"])[-1]
            raise EngineError(f"podman has no image {image}: {said}",
                              hint="load it: docker save IMAGE | podman load (or podman pull by digest)")
        import json

        found = json.loads(done.stdout)
        return dict(found[0]) if found else {}
