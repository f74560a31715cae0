#!/usr/bin/env bash
# The GPU campaign, as the records and pages of earlier campaigns name it: gpu-runs/campaign.py runs it (its
# help holds the steps, the environment and the time plan), on the host's Python, with the same arguments.
#
#   bash gpu-runs/gpu-host-serve.sh PARTS_DIR OUTDIR
#
# PYTHON (python3) is the Python it runs with, as the tool and its helpers do.
exec "$(command -v "${PYTHON:-python3}")" "$(dirname "$0")/campaign.py" "$@"
