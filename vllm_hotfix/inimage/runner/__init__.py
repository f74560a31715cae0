"""The checks that run inside an image, as one entry that needs only the image's own Python.

The package is copied as it is (with :mod:`vllm_hotfix.verdicts` and
:mod:`vllm_hotfix.errors`, the probes and the patch set's checks) into a
folder that a launcher mounts read-only into a container of the image under
test; nothing here imports beyond the standard library. It holds no key and
signs nothing: what it prints is the image's word, judged and signed by the
host that started it. See :mod:`.main`.
"""

from __future__ import annotations

# Where launchers mount the runner folder, and the lines its results come back on.
MOUNT = "/opt/vllm-hotfix-runner"
REPORT_MARK = "@@vllm-hotfix-runner:report@@"
ANSWERS_MARK = "@@vllm-hotfix-runner:answers@@"
BATCHES_MARK = "@@vllm-hotfix-runner:batches@@"  # the fixed-batch probe's raw replies, for the host to judge
REPLIES_MARK = "@@vllm-hotfix-runner:replies@@"  # the sweep's replies as they came, for the host to judge
# A Job's run nonce, said as the runner starts: a saved log of a runner that then gave no report is still known
# as that Job's (a failure of the image), where a log without it is nobody's (nothing learned about the image).
NONCE_MARK = "@@vllm-hotfix-runner:run_nonce@@"
JOB_VERSION = 3

# How the runner starts (python -I -S run.py JOB) and starts every probe, check and batch engine: no user site,
# no site module (so no .pth file of the image runs and no sitecustomize is imported), no bytecode written, and
# no PYTHON* variable of the image's environment; the folders the base's own start-up puts on sys.path, which the
# host read from the base (the job's ``python_path``), are added explicitly.
RUNNER_FLAGS = ("-I", "-S")
CHILD_FLAGS = ("-s", "-S", "-B")
_START = ("import json, os, runpy, sys; path = json.loads(sys.argv[1]); script = sys.argv[2]; "
          "sys.argv = sys.argv[2:]; sys.path[:] = [os.path.dirname(script), *[p for p in sys.path if p], *path]; "
          "runpy.run_path(script, run_name='__main__')")


def child_argv(python: str, script: str, args: list[str], python_path: list[str]) -> list[str]:
    """The command that runs ``script`` isolated (see :data:`CHILD_FLAGS`) with ``python_path`` added."""
    import json

    return [python, *CHILD_FLAGS, "-c", _START, json.dumps(list(python_path)), script, *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The runner's environment without any PYTHON* variable (the image's PYTHONPATH, PYTHONSTARTUP, ...),
    plus ``extra``."""
    import os

    return {**{k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}, **(extra or {})}
