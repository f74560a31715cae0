"""The runner: ``python3 /opt/vllm-hotfix-runner/run.py JOB.json`` inside the image under test.

Reads the job (what to check and how; written by a launcher, see
:func:`vllm_hotfix.checking.launchers.base.job`), runs each check as a subprocess of the
image's own Python under a timeout, judges them with the same
:func:`~vllm_hotfix.verdicts.judge` and :func:`~vllm_hotfix.verdicts.judge_gpu`
the host uses, and prints its report on one line after
:data:`~vllm_hotfix.inimage.runner.REPORT_MARK` (base64 JSON). Progress goes to
stderr. A job it cannot read ends it with exit 2 and one line. It holds no
key and signs nothing: the report is the image's word, which the host that
launched it judges (:mod:`vllm_hotfix.judges.judging`) and signs.

The job's keys: ``image``, ``image_id``, ``platform``, ``expected_from``,
``host`` and ``launcher`` (facts for the report); ``checks`` (checks made
outside, such as file facts read from the image's layers, judged with the
rest); ``landed`` (``package``, ``site_dir``: where the image's Python must
import the package from; or null); ``env_names``; ``pins`` (the pins_check spec, or null); ``cpu_checks``;
``gpu`` (``mode``, ``request``, ``extra``, ``modules``,
``base_import_errors``, ``unavailable``: the ``gpu``
check the host already settled, when no GPU request reaches this image);
``serve`` (``argv``, ``env``, ``port``, ``levels``, ``requests``, ``timeout``,
``min_tokens``, ``keep_going``, ``prompts`` and ``max_tokens`` (the
reference's: never its answers), ``record`` (record the answers first; they come
back after :data:`~vllm_hotfix.inimage.runner.ANSWERS_MARK`),
``overlap`` (start the server while the GPU checks run), ``batches`` (the
fixed-batch probe's spec, :func:`vllm_hotfix.judges.fixed_batches.job_part`:
its raw replies come back after :data:`~vllm_hotfix.inimage.runner.BATCHES_MARK`
for the host to judge); or null);
``keep_going``; ``probe_timeout``.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from ... import verdicts
from ...errors import Malformed
from . import (
    ANSWERS_MARK,
    BATCHES_MARK,
    JOB_VERSION,
    NONCE_MARK,
    REPLIES_MARK,
    REPORT_MARK,
    child_argv,
    child_env,
    serve,
)
from .probe_output import IMAGE_PYTHON, parse

# The runner folder: this file is vllm_hotfix/inimage/runner/main.py in it.
HERE = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", ".."))


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def path_of(rel: str) -> str:
    """A file of the runner folder (probes/..., checks/...), never outside it."""
    full = os.path.normpath(os.path.join(HERE, rel))
    if not full.startswith(HERE + os.sep):
        raise Malformed(f"{rel!r} is outside the runner folder")
    return full


class Run:
    def __init__(self, job: dict[str, Any]) -> None:
        self.job = job
        self.timeout = float(job.get("probe_timeout") or 600)
        self.checks: list[verdicts.Check] = []
        # The run's nonce (a Job's): in the report, so the host that collects it can tell it is this run's.
        self.environment: dict[str, Any] = {"run_nonce": job["run_nonce"]} if job.get("run_nonce") else {}
        # Removed by main when the run ends (in an image the container goes anyway; on a host it stays).
        self.scratch = tempfile.mkdtemp(prefix="vllm-hotfix-job-")
        self.recorded: list[bytes] = []
        self.devices: list[str] = []  # the GPUs the container saw
        self.serving_now: serve.Serving | None = None  # the job's server and batch probe, once made

    def argv(self, script: str, args: list[str]) -> list[str]:
        """A probe or check of the runner folder, started isolated with the base's sys.path folders."""
        return child_argv(sys.executable, path_of(script), args, [str(p) for p in self.job.get("python_path") or []])

    def probe(self, script: str, args: Sequence[str], name: str) -> tuple[list[dict[str, Any]], dict[str, Any],
                                                                            float]:
        start = time.monotonic()
        try:
            done = subprocess.run(self.argv(script, list(args)), capture_output=True, text=True,
                                  errors="replace", timeout=self.timeout, env=child_env(), cwd=self.scratch)
            out, err, code = done.stdout, done.stderr, done.returncode
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            err, code = f"timed out after {self.timeout:.0f} s", 124
        took = time.monotonic() - start
        checks, info = parse(name, out, err, code)
        return checks, info, took

    def add(self, raw: list[dict[str, Any]], took: float, name: str,
            answered_by: str | None = IMAGE_PYTHON, quiet: bool = False) -> list[verdicts.Check]:
        """Record checks; a probe's (``answered_by``: the image's Python, whatever it claims) or ones made
        outside the image and handed in with the job (None: as they say)."""
        made = [verdicts.Check.reported(c, round(took / max(len(raw), 1), 3), name) for c in raw]
        if answered_by is not None:
            made = [replace(c, data={**(c.data if isinstance(c.data, dict) else {}), "answered_by": answered_by})
                    for c in made]
        for c in made:
            self.checks.append(c)
            if not quiet:
                say(f"    {c.status.value:<4} {c.name}: {c.detail}")
        return made

    def spec_file(self, name: str, content: Any) -> str:
        path = os.path.join(self.scratch, name)
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(content, fh)
        return path

    def gpu(self) -> tuple[bool, dict[str, Any]]:
        spec = self.job.get("gpu") or {}
        mode, request = str(spec.get("mode", "auto")), str(spec.get("request") or "none")
        facts: dict[str, Any] = {"mode": mode, "verified": False, "way": request, "launcher": self.job.get("launcher")}
        if mode == "off":
            facts["why_unverified"] = "--gpu off"
            self.add([{"name": "gpu", "status": "skip", "detail": "--gpu off"}], 0, "gpu")
            return False, facts
        settled = spec.get("unavailable")
        if isinstance(settled, dict):
            # The host found no GPU request that reaches this image: its check, as it settled it.
            facts["why_unverified"] = str(settled.get("why", ""))
            self.add([{"name": "gpu", "status": str(settled.get("status", "incomplete")),
                       "detail": str(settled.get("detail", ""))}], 0, "gpu")
            return False, facts
        start = time.monotonic()
        try:
            listed = subprocess.run(self.argv("probes/gpu_list.py", []), capture_output=True,
                                    text=True, errors="replace", timeout=120, env=child_env(), cwd=self.scratch)
            seen = json.loads(listed.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError):
            seen = {"devices": [], "error": "the GPU listing gave no answer"}
        devices = [str(d) for d in seen.get("devices") or []]
        facts["devices"] = self.devices = devices
        if not devices:
            why = f"the container started with {request} sees no GPU ({seen.get('error') or 'no device'})"
            facts["why_unverified"] = why
            status = "incomplete" if mode == "require" else "skip"
            detail = f"--gpu require: {why}" if mode == "require" else f"{why}: image is GPU-unverified"
            self.add([{"name": "gpu", "status": status, "detail": detail}], time.monotonic() - start, "gpu")
            return False, facts
        say(f"    the container sees {len(devices)} GPU(s): {', '.join(devices)}")
        args: list[str] = []
        parallel = int(spec.get("tensor_parallel") or 1)
        if parallel > len(devices):
            why = f"the server is to run on {parallel} GPUs (tensor parallel) and the container sees {len(devices)}"
            facts["why_unverified"] = why
            self.add([{"name": "gpu", "status": "incomplete" if mode == "require" else "skip", "detail": why}],
                     time.monotonic() - start, "gpu")
            return False, facts
        if parallel > 1:
            # The patch set's checks on every GPU the server will use (the layout bug is per GPU's share of heads).
            args += ["--devices", str(parallel)]
        extra = [path_of(p) for p in spec.get("extra") or []]
        if extra:
            args += ["--extra", *extra]
        if spec.get("modules"):
            args += ["--modules", *[str(m) for m in spec["modules"]]]
        raw, info, took = self.probe("probes/gpu_check.py", args, "gpu")
        if info:
            self.environment["gpu"] = info
        checks = [verdicts.Check.reported(c, round(took / max(len(raw), 1), 3), "gpu") for c in raw]
        # As they said, before judgement: a host that can ask the image's base re-judges them (rejudge_gpu).
        facts["raw_checks"] = [c.to_dict() for c in checks]
        base = spec.get("base_import_errors")
        judged = verdicts.judge_gpu(checks, require=mode == "require",
                                    base_import_errors=base if isinstance(base, dict) else None)
        for c in judged.checks:
            c = replace(c, data={**(c.data if isinstance(c.data, dict) else {}), "answered_by": IMAGE_PYTHON})
            self.checks.append(c)
            say(f"    {c.status.value:<4} {c.name}: {c.detail}")
        facts["verified"] = judged.verified
        if judged.not_real:
            facts["not_real"] = list(judged.not_real)
        if not judged.verified:
            facts["why_unverified"] = f"GPU checks through {request}: {judged.why_unverified}"
        return judged.verified, facts

    def serving(self, spec: dict[str, Any], phases: dict[str, float]) -> serve.Serving:
        """The job's server and sweep (:class:`.serve.Serving`), not started yet."""
        serving = serve.Serving(spec, self.scratch, say=say, phases=phases, recorded=self.recorded, facts=self.facts,
                                probe=self.argv("probes/batches.py", []))
        self.serving_now = serving
        return serving

    def facts(self) -> dict[str, Any]:
        """What this run saw of the settings a reference names: the GPU model, vLLM's and torch's versions."""
        packages = self.environment.get("packages") or {}
        found: dict[str, Any] = {"vllm": packages.get("vllm"), "torch": packages.get("torch")}
        if self.devices:
            found["gpu"] = ", ".join(self.devices)
        return found

    def failed(self) -> list[str]:
        """As the host's smoke: a failing check ends the run early, an incomplete one (the host's shortcoming,
        such as file facts it could not read) does not."""
        return [c.name for c in self.checks if c.status is verdicts.Status.FAIL]

    def stop(self, skipped: Sequence[str]) -> bool:
        """As the host's smoke: a failed phase ends the run (the rest recorded as not run), unless keep_going."""
        failed = self.failed()
        if not failed or self.job.get("keep_going"):
            return False
        why = f"not run: {', '.join(failed)} failed first (--keep-going runs every check)"
        say(f"==> runner: {why}")
        self.add([{"name": name, "status": "skip", "detail": why} for name in skipped], 0, "skipped", None)
        return True

    def run(self) -> verdicts.Verdict:
        job = self.job
        start = time.monotonic()
        mark = start
        phases: dict[str, float] = {}
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        spec = job.get("serve")
        serving = self.serving(spec, phases) if spec else None
        overlap = serving is not None and bool(spec and spec.get("overlap"))
        if overlap and serving is not None:
            # The server does not measure the GPU's free memory (its KV cache size is given), so it can start while
            # every other check's processes come and go: its start is the run's longest path, and the checks
            # before it (a few seconds of probes) need not wait for it nor it for them. A failed check stops it.
            say("==> runner: the server starts while the checks run")
            serving.start()
        for raw in job.get("checks") or []:
            # Made and shown by the host before the launch.
            self.add([raw], float(raw.get("seconds", 0)) if isinstance(raw, dict) else 0, "check", None, quiet=True)

        landed = job.get("landed")
        if isinstance(landed, dict):
            say("==> runner: where the image's Python imports the package from")
            raw, _, took = self.probe("probes/landed.py", [str(landed.get("package")), str(landed.get("site_dir"))],
                                      "import-location")
            self.add(raw, took, "import-location")

        say("==> runner: environment report")
        raw, _, took = self.probe("probes/env_report.py", [str(n) for n in job.get("env_names") or []],
                                  "env-report")
        data = next((c.get("data") for c in raw if c.get("name") == "env-report"), None)
        self.environment.update(data if isinstance(data, dict) else {})
        self.add(raw, took, "env-report")

        if job.get("pins") is not None:
            say("==> runner: pinned distributions")
            raw, _, took = self.probe("probes/pins_check.py", [self.spec_file("pins.json", job["pins"])], "pins")
            self.add(raw, took, "pins")
        for script in job.get("cpu_checks") or []:
            name = f"check:{os.path.splitext(os.path.basename(script))[0]}"
            raw, _, took = self.probe(script, [], name)
            self.add(raw, took, name)
        phases["checks"] = round(time.monotonic() - mark, 1)

        verified, gpu = False, {"mode": (job.get("gpu") or {}).get("mode", "auto"), "verified": False}
        sweep = None
        if not self.stop(("gpu", "serve-sweep")):
            say(f"==> runner: GPU checks (--gpu {(job.get('gpu') or {}).get('mode', 'auto')})")
            mark = time.monotonic()
            verified, gpu = self.gpu()
            phases["gpu_checks"] = round(time.monotonic() - mark, 1)
            if self.stop(("serve-sweep",)):
                if serving is not None:
                    serving.stop()
            else:
                say("==> runner: serve sweep")
                if serving is None:
                    self.add([{"name": "serve-sweep", "status": "skip", "detail": "no --serve-model given"}], 0,
                             "serve")
                else:
                    t0 = time.monotonic()
                    check, sweep = serving.finish()
                    self.add([check], time.monotonic() - t0, "serve-sweep")
        else:
            gpu["why_unverified"] = "not run: an earlier phase failed"
            if serving is not None:
                serving.stop()
        seconds = time.monotonic() - start
        say(f"==> runner: phases: {', '.join(f'{k} {v:.1f} s' for k, v in phases.items())} (total {seconds:.1f} s)")
        return verdicts.judge(
            str(job.get("image", "")), str(job.get("image_id", "")), self.checks, gpu_verified=verified,
            platform=str(job.get("platform", "")), started=started, seconds=seconds,
            expected_from=str(job.get("expected_from", "")), gpu=gpu, host=dict(job.get("host") or {}),
            environment=self.environment, sweep=sweep, phases=phases,
        )


def emit(mark: str, data: bytes) -> None:
    sys.stdout.write(f"{mark} {base64.b64encode(data).decode()}\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        say("usage: run.py JOB.json")
        return 2
    try:
        with open(args[0], encoding="utf-8") as fh:
            job = json.load(fh)
        if not isinstance(job, dict) or job.get("version") != JOB_VERSION:
            raise ValueError(f"not a version {JOB_VERSION} runner job")
    except (OSError, ValueError) as exc:
        say(f"runner job {args[0]}: {exc}")
        return 2
    # The base's sys.path folders, as the host read them from the base: this process started without its site.
    sys.path.extend(str(p) for p in job.get("python_path") or [] if str(p) not in sys.path)
    if job.get("run_nonce"):
        say(f"{NONCE_MARK} {job['run_nonce']}")
    run = Run(job)
    try:
        verdict = run.run()
    finally:
        shutil.rmtree(run.scratch, ignore_errors=True)
    report = verdict.to_dict()
    for answers in run.recorded:
        emit(ANSWERS_MARK, answers)
    batches = run.serving_now.batch_report if run.serving_now is not None else None
    if batches is not None:
        emit(BATCHES_MARK, json.dumps(batches, sort_keys=True).encode())
    if run.serving_now is not None and run.serving_now.replies:
        emit(REPLIES_MARK, json.dumps(run.serving_now.replies, sort_keys=True).encode())
    emit(REPORT_MARK, json.dumps(report, sort_keys=True).encode())
    return 0
