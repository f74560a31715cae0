"""Launchers: each starts the runner (:mod:`vllm_hotfix.inimage.runner`) in the image under test, its own way.

One interface (:class:`.base.Launcher`), one module per way: :mod:`.docker`
(the engine seam, and the whole Docker run), :mod:`.podman` (the podman CLI,
daemonless, GPUs by CDI) and :mod:`.kubernetes` (a Job, emitted as YAML,
submitted, or collected once it ended, with the official client);
:mod:`.elsewhere` puts the podman and Kubernetes runs together. Shared by
all: :mod:`.options` (what a run is asked, typed), :mod:`.plan` (the same job
for every launcher), :mod:`.facts` (the file facts the host reads itself,
and the push gate reads again), :mod:`.base` (the runner folder, holding no
key, and the report read back) and :mod:`vllm_hotfix.judges.judging` (the host's verdict on
the runner's report). Nothing here signs: the caller signs the host's
verdict.
"""

from __future__ import annotations

NAMES = ("docker", "podman", "kubernetes")
