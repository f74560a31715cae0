"""The serve sweep from inside the image: start the server, wait for its health, sweep, with the host's code.

The sweep and its judgement are the host's own (:mod:`vllm_hotfix.checking.sweep`,
:mod:`vllm_hotfix.checking.reference`, carried in the runner folder): the same
prompts, the same per-request evidence, the same wrong-answer check against
reference answers within a log-probability tolerance, the same check the
host's smoke makes from a finished sweep. They speak HTTP through
``requests``, which vLLM itself depends on; an image without it fails the
sweep with one line. Only the server's start differs: here it is a process
of the runner, not a container of an engine.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

LOG_LINES = 200


class Process:
    """The server process as the sweep watches it (:class:`vllm_hotfix.checking.sweep.Watcher`)."""

    def __init__(self, argv: Sequence[str]) -> None:
        self.lines: deque[str] = deque(maxlen=LOG_LINES)
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            self.lines.append(line.rstrip())

    def running(self) -> bool:
        return self.proc.poll() is None

    def logs(self) -> str:
        return "\n".join(self.lines)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _failed(detail: str, log: Sequence[str] = ()) -> dict[str, Any]:
    return {"name": "serve-sweep", "status": "fail", "detail": detail, "data": {"server_log": list(log)[-12:]}}


def run(spec: Mapping[str, Any], scratch: str, *, say: Callable[[str], None], phases: dict[str, float],
        recorded: list[bytes] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the serve-sweep check, the sweep's report) for the job's ``serve`` part; wall times into ``phases``.

    With ``record`` in the spec, reference answers are recorded from the
    server first (as ``smoke --record-reference`` on the host), swept
    against, and their file's bytes appended to ``recorded``.
    """
    try:
        from ...errors import PipelineError
        from .. import reference as answers
        from .. import sweep
    except ImportError as exc:
        return _failed(f"the image's Python cannot run the sweep: {exc}"), None
    levels = [int(v) for v in spec.get("levels") or [1]]
    tolerance = float(spec.get("tolerance", answers.DEFAULT_TOLERANCE))
    min_tokens = spec.get("min_tokens")
    ref = None
    if spec.get("reference") is not None:
        path = os.path.join(scratch, "reference.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(spec["reference"], fh)
        named = str(spec.get("reference_file") or "reference answers")
        try:
            ref = answers.load(Path(path), f"--reference {named} (in the runner)")
        except PipelineError as exc:
            return _failed(str(exc).replace(f" {path}:", ":")), None
        ref = replace(ref, path=named)  # reports name the user's file, not the runner's copy
    url = f"http://127.0.0.1:{int(spec['port'])}"
    start = time.monotonic()
    try:
        server = Process([str(a) for a in spec["argv"]])
    except OSError as exc:
        return _failed(f"cannot start {spec['argv'][0]}: {exc}"), None
    try:
        try:
            sweep.wait_healthy(url, float(spec.get("timeout", 900)), server, say)
        except PipelineError as exc:
            phases["server_start"] = round(time.monotonic() - start, 1)
            lines = str(exc).splitlines()
            return _failed(lines[0], lines[1:]), None
        phases["server_start"] = round(time.monotonic() - start, 1)
        say(f"    server healthy after {phases['server_start']:.1f} s")
        record = spec.get("record")
        if isinstance(record, Mapping):
            t0 = time.monotonic()
            named = str(record.get("file") or "reference answers")
            made = answers.write(sweep.record(url, recorded_from=str(record.get("recorded_from") or url),
                                              progress=say), Path(scratch) / "recorded.json")
            if recorded is not None:
                recorded.append((Path(scratch) / "recorded.json").read_bytes())
            ref = replace(made, path=named)
            phases["reference_record"] = round(time.monotonic() - t0, 1)
            say(f"    recorded {len(ref.answers)} reference answers (sha256 {ref.sha256})")
        t0 = time.monotonic()
        result = sweep.sweep(url, None, levels, int(spec.get("requests", 32)), watch=server,
                             min_tokens=min_tokens, reference=ref, tolerance=tolerance, progress=say,
                             keep_going=bool(spec.get("keep_going")))
        phases["sweep"] = round(time.monotonic() - t0, 1)
    except PipelineError as exc:
        return _failed(str(exc).splitlines()[0], list(server.lines)), None
    finally:
        server.stop()
    return sweep.as_check(result, levels, min_tokens, tolerance), result.to_dict()
