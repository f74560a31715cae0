"""Launchers: each starts the runner (:mod:`vllm_hotfix.inimage.runner`) in the image under test, its own way.

One interface (:class:`.base.Launcher`), one module per way: :mod:`.docker`
(the engine seam, and the whole Docker run), :mod:`.podman` (the podman CLI,
daemonless, GPUs by CDI) and :mod:`.kubernetes` (a Job, emitted as YAML,
submitted, or collected once it ended, with the official client);
:mod:`.elsewhere` puts the podman and Kubernetes runs together. Shared by
all: :mod:`.options` (what a run is asked, typed), :mod:`.plan` (the same job
for every launcher), :mod:`.smoke_run` (a whole run through a launcher),
:mod:`.judge_run` (what came back, judged on the host: the report through
:mod:`vllm_hotfix.judges.judging`, the sweep's replies, the fixed batches,
the golden), :mod:`.recorded` (a recording's answers kept as a reference),
:mod:`.facts` (the file facts the host reads itself, and the push gate reads
again) and :mod:`.base` (the runner folder, holding no key, and the report
read back). Nothing here signs: the caller signs the host's verdict.
"""

from __future__ import annotations

NAMES = ("docker", "podman", "kubernetes")
