"""Launchers: each starts the runner (:mod:`vllm_hotfix.checking.runner`) in the image under test, its own way.

One interface (:class:`.base.Launcher`), one module per way: :mod:`.docker`
(the engine seam), :mod:`.podman` (the podman CLI, daemonless, GPUs by CDI)
and :mod:`.kubernetes` (a Job, emitted as YAML or submitted with the official
client). :mod:`.base` stages the runner folder and reads its results back.
"""

from __future__ import annotations

NAMES = ("docker", "podman", "kubernetes")
