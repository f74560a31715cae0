"""The serve sweep from inside the image: start the server, wait for its health, ask, send the replies back.

The sweep's sender is carried in the runner folder (:mod:`vllm_hotfix.inimage.sweep`,
:mod:`vllm_hotfix.inimage.recording`): the reference's prompts at every level,
the same per-request evidence. It never has the reference answers and judges
nothing: every reply goes back to the host as it came (``replies``), and the
host judges them and makes the ``serve-sweep`` check
(:mod:`vllm_hotfix.judges.replies`: bit for bit at concurrency 1, by its form
above it). What the runner says of its own sweep (statuses, lengths, how many
replied) is only its measurement. A run that
records reference answers sends them back and is not judged against them.
The server gets the job's ``env``
(``VLLM_BATCH_INVARIANT=1``) on top of the container's. They speak HTTP through
``requests``, which vLLM itself depends on; an image without it fails the
sweep with one line. Only the server's start differs: here it is a process
of the runner, not a container of an engine.

Beside the server, the job's ``batches`` part runs ``probes/batches.py``:
every level's requests through vLLM's engine in a process of its own,
stepped by hand so that each level's batches are fixed (:class:`Batches`).
Its raw replies go back to the host, which judges them against the
reference's answers at the same level; nothing here sees those answers.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import child_env

if TYPE_CHECKING:  # imported when the sweep runs: an image without requests fails the sweep with one line
    from ..sweep import SweepResult

LOG_LINES = 200
# Seconds the batch probe may still run once the server's sweep is over: it starts with the server and runs
# the same requests, so a probe that needs much longer than that is stuck (an engine that hung on a fault).
BATCH_GRACE = 180
BATCH_ALONE = 1200  # seconds for a probe started after the sweep: an engine's start (cold: compiling) and every level


# A line of the server's log that names a start-up step or its time (vLLM's own wording), kept with its moment.
START_STEP = re.compile(r"took|seconds|[Ll]oading|[Ss]tarting|[Ii]nit|[Ww]arm|profil|KV cache|Application startup|"
                        r"[Cc]ompil|[Ee]ngine")
MARKS = 60


class Process:
    """The server process as the sweep watches it (:class:`vllm_hotfix.inimage.sweep.Watcher`)."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        self.lines: deque[str] = deque(maxlen=LOG_LINES)
        # The server's own words on its start-up steps, with the seconds since the start at which each came: where
        # its start's time goes (imports, the engine core, weights, the KV cache), for the report; measured only.
        self.marks: list[str] = []
        self.began = time.monotonic()
        self.proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     errors="replace", env={**os.environ, **dict(env or {})})
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout or ():
            self.lines.append(line.rstrip())
            if len(self.marks) < MARKS and START_STEP.search(line):
                self.marks.append(f"+{time.monotonic() - self.began:.1f}s {line.strip()[:240]}")

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


class Batches:
    """The fixed-batch probe as a process of the runner: started with the server (or after its sweep), its
    output file read back whole when it ends; the host judges what it wrote."""

    LOG_TAIL = 40

    def __init__(self, spec: Mapping[str, Any], scratch: str, probe: Sequence[str]) -> None:
        self.spec, self.scratch, self.probe = dict(spec), scratch, list(probe)
        self.out = os.path.join(scratch, "batches.jsonl")
        self.log = os.path.join(scratch, "batches.log")
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.error = ""

    def start(self) -> None:
        path = os.path.join(self.scratch, "batches.json")
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({**self.spec, "out": self.out}, fh)
        # The same hash seed in every run: nothing that iterates a set may order a batch differently.
        env = child_env({"PYTHONHASHSEED": "0"})
        self.started = time.monotonic()
        try:
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen([*self.probe, path], stdout=log,
                                             stderr=subprocess.STDOUT, env=env, cwd=self.scratch)
        except OSError as exc:
            self.error = f"cannot start the batch probe: {exc}"

    def finish(self, grace: float) -> dict[str, Any]:
        """What the probe wrote (``lines``), its exit code, its log's last lines and its wall time; a probe still
        running ``grace`` seconds after this is asked (the server's sweep is over by then) is killed. One not
        started yet (the server's KV cache size was not given, so the two must not start together) starts now,
        alone, and gets :data:`BATCH_ALONE` seconds."""
        if self.proc is None and not self.error:
            self.start()
            grace = max(grace, BATCH_ALONE)
        code: int | None = None
        if self.proc is not None:
            try:
                code = self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                self.error = (f"the batch probe had not finished {grace:.0f} s after the server's sweep "
                              f"({time.monotonic() - self.started:.0f} s in all): killed")
        lines = []
        try:
            with open(self.out, encoding="utf-8", errors="replace") as fh:
                for text in fh:
                    try:
                        lines.append(json.loads(text))
                    except ValueError:
                        lines.append({"error": f"unreadable line from the probe: {text[:200]!r}"})
        except OSError:
            pass
        try:
            with open(self.log, encoding="utf-8", errors="replace") as fh:
                tail = [ln.rstrip() for ln in deque(fh, maxlen=self.LOG_TAIL)]
        except OSError:
            tail = []
        return {"lines": lines, "exit": code, "error": self.error, "log": tail,
                "seconds": round(time.monotonic() - self.started, 1)}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def _failed(detail: str, log: Sequence[str] = ()) -> dict[str, Any]:
    """The serve-sweep entry where no sweep could be asked: the server did not start or answer, or the image's
    Python cannot run the sender."""
    return {"name": "serve-sweep", "status": "fail", "detail": detail, "data": {"server_log": list(log)[-12:]}}


def _asked(result: SweepResult) -> dict[str, Any]:
    """The serve-sweep entry of a sweep that was asked: what it measured, never a verdict. The host judges the
    replies it sent back and makes the check (:mod:`vllm_hotfix.judges.replies`); until then it is incomplete."""
    asked = [ev for level in result.levels for ev in level.per_request]
    back = sum(ev.http_status == 200 and ev.reply_tokens is not None for ev in asked)
    died = ", the server died" if result.server_died else ""
    detail = (f"asked concurrency {','.join(str(level.concurrency) for level in result.levels)}: {back} of "
              f"{len(asked)} requests replied{died}; the replies go to the host, which judges them")
    return {"name": "serve-sweep", "status": "incomplete", "detail": detail,
            "data": {"server_log": result.server_log.strip().splitlines()[-12:]}}


class Serving:
    """The job's ``serve`` part in two steps, so that the server can start while the GPU checks run.

    :meth:`start` starts the server (``server_start`` counts from here);
    :meth:`finish` waits for its health, records reference answers when the
    job asks, sweeps, and stops it. :meth:`stop` ends a server whose sweep
    will not run.
    """

    def __init__(self, spec: Mapping[str, Any], scratch: str, *, say: Callable[[str], None],
                 phases: dict[str, float], recorded: list[bytes] | None = None,
                 facts: Callable[[], dict[str, Any]] = dict, probe: Sequence[str] = ()) -> None:
        self.spec, self.scratch, self.say, self.phases, self.recorded = spec, scratch, say, phases, recorded
        # probe: the command that starts the runner folder's probes/batches.py (isolated), for the job's ``batches``
        # part; the spec file's path is added to it
        self.facts = facts  # the GPU model and versions this run saw, for the settings a recording names
        self.server: Process | None = None
        self.batches = Batches(spec["batches"], scratch, probe) if spec.get("batches") else None
        self.batch_report: dict[str, Any] | None = None  # what the probe wrote, for the host
        self.replies: dict[str, dict[str, Any]] = {}  # every sweep reply as it came (LEVEL:I), for the host
        self.started = 0.0
        self.failed: dict[str, Any] | None = None

    def start(self) -> None:
        self.started = time.monotonic()
        if self.batches is not None and self.spec.get("overlap"):
            # Together only where the KV cache size is given: otherwise each engine measures the GPU's free memory
            # while it starts, and the other's allocations would upset that (the probe then runs after the sweep).
            self.batches.start()
        argv = [str(a) for a in self.spec["argv"]]
        env = {str(k): str(v) for k, v in (self.spec.get("env") or {}).items()}
        try:
            self.server = Process(argv, env)
        except OSError as exc:
            self.failed = _failed(f"cannot start {argv[0]}: {exc}")

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
        if self.batches is not None:
            self.batches.stop()

    def finish(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """(the serve-sweep check, the sweep's report); wall times into ``phases``."""
        if self.server is None and self.failed is None:
            self.start()
        try:
            if self.failed is not None or self.server is None:
                return self.failed or _failed("the server did not start"), None
            try:
                return self._sweep(self.server)
            finally:
                self.server.stop()
        finally:
            if self.batches is not None:
                self.say("    fixed batches: waiting for the probe")
                self.batch_report = self.batches.finish(float(self.spec["batches"].get("grace", BATCH_GRACE)))
                done = [ln for ln in self.batch_report["lines"] if "level" in ln]
                self.phases["batches"] = self.batch_report["seconds"]
                self.say(f"    fixed batches: {len(done)} level run(s) in {self.batch_report['seconds']:.1f} s"
                         + (f", exit {self.batch_report['exit']}" if self.batch_report["exit"] else ""))

    def _sweep(self, server: Process) -> tuple[dict[str, Any], dict[str, Any] | None]:
        try:
            from ...errors import PipelineError
            from .. import recording, sweep
            from .. import reference as answers
        except ImportError as exc:
            return _failed(f"the image's Python cannot run the sweep: {exc}"), None
        spec, say, phases = self.spec, self.say, self.phases
        levels = [int(v) for v in spec.get("levels") or [1]]
        min_tokens = spec.get("min_tokens")
        url = f"http://127.0.0.1:{int(spec['port'])}"
        try:
            try:
                sweep.wait_healthy(url, float(spec.get("timeout", 900)), server, say)
            except PipelineError as exc:
                phases["server_start"] = round(time.monotonic() - self.started, 1)
                lines = str(exc).splitlines()
                return _failed(lines[0], lines[1:]), None
            phases["server_start"] = round(time.monotonic() - self.started, 1)
            say(f"    server healthy after {phases['server_start']:.1f} s")
            record = spec.get("record")
            if isinstance(record, Mapping):
                t0 = time.monotonic()
                named = str(record.get("file") or "reference answers")
                settings = {**dict(record.get("settings") or {}), **self.facts()}
                source = str(record.get("recorded_from") or url)
                made = answers.write(replace(recording.record(url, recorded_from=source, progress=say),
                                             settings=settings), Path(self.scratch) / "recorded.json")
                if self.recorded is not None:
                    self.recorded.append((Path(self.scratch) / "recorded.json").read_bytes())
                phases["reference_record"] = round(time.monotonic() - t0, 1)
                say(f"    recorded {len(made.answers)} reference answers for {named} (sha256 {made.sha256}); "
                    "this run's sweep is not judged against them")
            t0 = time.monotonic()
            # No reference here: every reply goes back as it came (self.replies), and the host judges them.
            prompts = [str(p) for p in spec.get("prompts") or []] or None
            # min_tokens is the sender's stop rule only: the host judges every reply's length again.
            result = sweep.sweep(url, None, levels, int(spec.get("requests", 32)), watch=server,
                                 min_tokens=min_tokens, progress=say, keep_going=bool(spec.get("keep_going")),
                                 max_tokens=int(spec.get("max_tokens") or sweep.MAX_TOKENS), prompts=prompts,
                                 replies=self.replies)
            phases["sweep"] = round(time.monotonic() - t0, 1)
        except PipelineError as exc:
            return _failed(str(exc).splitlines()[0], list(server.lines)), None
        return _asked(result), {**result.to_dict(), "server_marks": list(server.marks)}


def run(spec: Mapping[str, Any], scratch: str, *, say: Callable[[str], None], phases: dict[str, float],
        recorded: list[bytes] | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the serve-sweep check, the sweep's report) for the job's ``serve`` part: start, wait, sweep, stop.

    With ``record`` in the spec, reference answers are recorded from the
    server first (as ``smoke --record-reference`` on the host) and their
    file's bytes appended to ``recorded``; the sweep is never judged here.
    """
    return Serving(spec, scratch, say=say, phases=phases, recorded=recorded).finish()
