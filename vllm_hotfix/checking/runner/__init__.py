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
JOB_VERSION = 2
