"""A probe's output, as both sides read it: its last JSON line of checks, or a check saying why there is none.

The runner reads its probes' output with :func:`parse`, and the host the
output of the probes it starts itself in a container of the base or the
image; each check is then typed by :meth:`vllm_hotfix.verdicts.Check.reported`.
Standard library only: the runner carries it into the image.
"""

from __future__ import annotations

import json
from typing import Any

# Who answered a check the image's Python made, whatever it claims (the host's file facts are "filesystem").
IMAGE_PYTHON = "image-python"


def parse(name: str, stdout: str, stderr: str, code: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A probe's JSON, or one failing (incomplete when it timed out) check that says why there is none."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and isinstance(data.get("checks"), list):
            info = data.get("info")
            checks = [c if isinstance(c, dict) else {"name": name, "status": "fail",
                                                     "detail": f"malformed check {c!r:.80}"}
                      for c in data["checks"]]
            return checks, info if isinstance(info, dict) else {}
    if code == 124:
        tail = (stderr.strip().splitlines() or [""])[-1]
        return [{"name": name, "status": "incomplete", "detail": f"probe did not finish: {tail}".strip()}], {}
    why = (stderr.strip().splitlines() or [f"exit {code}, no output"])[-1]
    return [{"name": name, "status": "fail", "detail": f"probe gave no result: {why}"}], {}
