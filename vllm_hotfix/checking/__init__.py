"""Checking: is a built image what its patch set says, and does it run?

The ``smoke`` step is one library call, :func:`.smoke.run`: it reads the image's files from outside
(:mod:`.integrity`: the landed check, installed-package integrity), finds how a container reaches the host's
GPUs (:mod:`.gpu_access`), keeps compile caches between runs (:mod:`.compile_cache`), starts the in-image
runner (:mod:`.runner`, with the scripts of :mod:`.probes`) through a launcher (:mod:`.launchers`: docker,
podman, a Kubernetes Job), judges the runner's report against the host's own facts
(:mod:`.launchers.judging`), records the verdict and signs it when asked. The runner holds no key.
The runner's serve check drives the concurrency sweep of :mod:`.sweep` and compares replies with the
reference answers of :mod:`.reference`. What a check found is a :mod:`vllm_hotfix.verdicts` value.
"""
