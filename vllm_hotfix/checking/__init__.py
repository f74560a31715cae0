"""Checking: is a built image what its patch set says, and does it run? What starts the image and feeds the judges.

The ``smoke`` step is one library call, :func:`.smoke.run`. Before anything of the image runs, the host
settles that the image is its definition's product (:mod:`vllm_hotfix.judges.identity`: the base found by the
host, never by a label; the layers above it exactly what the builder writes, the pip layer of pins judged by
:mod:`vllm_hotfix.judges.pin_layer`; the config the base's plus labels), else nothing else runs. Then it reads
the image's files from outside (:mod:`vllm_hotfix.judges.integrity`: the landed check, installed-package
integrity; :mod:`vllm_hotfix.judges.installed`: what each installed distribution requires), finds how a
container reaches the host's GPUs, tried in the base (:mod:`.gpu_access`), keeps compile caches between runs
keyed by the base it proved (:mod:`.compile_cache`), starts the in-image runner (:mod:`vllm_hotfix.inimage`,
isolated from the image's Python configuration) through a launcher (:mod:`.launchers`: docker, podman, a
Kubernetes Job), judges the runner's report against the host's own facts (:mod:`vllm_hotfix.judges.judging`),
records the verdict and signs it when asked. The runner holds no key and never sees a reference answer: its
sweep sends every reply back as it came, and the host judges them (:mod:`vllm_hotfix.judges.replies`,
:mod:`vllm_hotfix.judges.fixed_batches`). What a check found is a :mod:`vllm_hotfix.verdicts` value.
"""
