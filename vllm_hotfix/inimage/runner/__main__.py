"""``python3 -m vllm_hotfix.inimage.runner JOB.json``: the runner's entry (see :mod:`.main`)."""

from __future__ import annotations

import sys

from .main import main

sys.exit(main())
