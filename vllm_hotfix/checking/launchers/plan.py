"""From an image and the smoke options to a runner job, and a whole smoke run through a launcher.

The job is data the runner reads; everything the host knows and the image
must not decide (which patch set, which pins, which modules must import,
where the package must import from) is settled here, from the project's
files. Every launcher gets the same job for the same image, so every one
runs the same named checks. The job holds no key: the runner signs nothing.
A run ends with the host's verdict (:mod:`vllm_hotfix.judges.judging`), not the runner's.
"""

from __future__ import annotations

import json
import logging
import socket
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...building import definitions, patches, pins, wheels
from ...building.pinfile import Pin
from ...engine import labels as L
from ...errors import DefinitionError, Malformed, PatchError, PinError, RunnerFailed, SmokeError, UsageError
from ...golden import check as golden
from ...inimage import oracle
from ...inimage.reference import PROMPTS, Reference
from ...journal import leftovers, records
from ...judges import fixed_batches, judging, replies
from ...trust.references import UNCHECKED, Signature, unfit
from ...verdicts import Check, Status, Verdict
from .. import compile_cache
from .base import Launched, Launcher, stage
from .options import SmokeOptions

log = logging.getLogger(__name__)

DEFAULT_ENTRYPOINT = ("vllm", "serve")
SERVE_PORT = 8000


@dataclass(frozen=True, slots=True)
class Target:
    """The image a launcher starts, as the host knows it."""

    ref: str  # what the user named
    image_id: str  # config digest
    start: str  # what the launcher starts: an ID, or name@manifest-digest for a cluster
    labels: Mapping[str, str]
    platform: str = ""
    entrypoint: Sequence[str] = DEFAULT_ENTRYPOINT
    repo_digests: Sequence[str] = ()
    base_id: str = ""  # the base the host found by its layers ("": none found; the image stands for its base)


def job(root: Path, target: Target, options: SmokeOptions, *, launcher: str, gpu_request: str | None,
        checks: Sequence[Mapping[str, Any]] = (), host: Mapping[str, Any] | None = None,
        expected_from: str = "", landed: Mapping[str, str] | None = None,
        gpu_unavailable: Mapping[str, str] | None = None,
        python_path: Sequence[str] = ()) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The runner job for ``target`` and the patch set's check files it names.

    ``checks`` are the host's own checks (file facts), shown by the runner
    and kept by the host's verdict as the host made them;
    ``landed`` the package and folder its Python must import it from;
    ``gpu_unavailable`` the ``gpu`` check (status, detail, why) a host that
    found no GPU request reaching the image settled before the launch;
    ``python_path`` the folders the base's Python puts on sys.path (read from
    the base), which the runner, started without its site module, adds; the
    landed site folder where the base could not be asked.
    """
    if options.record_reference is not None and launcher not in ("docker", "podman"):
        raise UsageError(f"--record-reference needs --launcher docker or podman (the host that keeps the file "
                         f"starts the server): record the answers once there, then give them to the {launcher} "
                         "launcher with --reference")
    extra: dict[str, bytes] = {}
    out: dict[str, Any] = {
        "image": target.ref, "image_id": target.image_id, "platform": target.platform, "launcher": launcher,
        "host": dict(host or {}), "checks": [dict(c) for c in checks], "env_names": [], "pins": None,
        "cpu_checks": [], "probe_timeout": options.probe_timeout, "serve": None,
        "expected_from": expected_from, "keep_going": options.keep_going,
        "gpu": {"mode": options.gpu, "request": gpu_request, "extra": [], "modules": [], "base_import_errors": None,
                "unavailable": dict(gpu_unavailable) if gpu_unavailable else None},
        "landed": dict(landed) if landed else None,
        "python_path": list(python_path) or ([str(landed["site_dir"])] if landed and landed.get("site_dir") else []),
    }
    tag = options.definition or target.labels.get(L.DEFINITION)
    defn = None
    if tag:
        try:
            defn = definitions.load(root, tag)
        except DefinitionError as exc:
            if options.definition:
                raise SmokeError(f"--definition {tag}: {exc}") from exc
    if defn is not None:
        folder = root / "patches" / defn.patch_set / "checks"
        for path in sorted(folder.glob("*.py")):
            extra[f"checks/{path.name}"] = path.read_bytes()
            out["gpu"]["extra"].append(f"checks/{path.name}")
        for path in sorted((folder / "cpu").glob("*.py")):
            extra[f"checks/cpu/{path.name}"] = path.read_bytes()
            out["cpu_checks"].append(f"checks/cpu/{path.name}")
        try:
            series = patches.load_series(root, defn.patch_set, defn.package)
            pinset = pins.load(root, defn.patch_set, defn.package)
        except PatchError as exc:
            raise SmokeError(f"patches/{defn.patch_set}: {exc}") from exc
        except PinError as exc:
            out["checks"].append({"name": "pins", "status": "fail", "detail": str(exc)})
            pinset = None
        out["gpu"]["modules"] = patches.modules_of(f for patch in series for f in patch.files)
        if pinset is not None:
            out["env_names"] = [p.spelled for p in pinset.pins]
            out["pins"] = {"pins": [{"name": p.spelled, "version": p.version, "record": _record(root, p)}
                                    for p in pinset.pins]}
    if options.serve_model is not None:
        if not Path(options.serve_model).exists():
            raise SmokeError(f"--serve-model {options.serve_model}: no such file or folder")
        settings = serve_settings(options, target)
        out["gpu"]["tensor_parallel"] = tensor_parallel(settings["serve_args"])
        out["serve"] = {"argv": [*target.entrypoint, "/model", "--port", str(SERVE_PORT), *settings["serve_args"]],
                        "env": settings["env"], "overlap": overlaps(settings["serve_args"]),
                        "port": SERVE_PORT, "levels": list(options.levels), "requests": options.requests,
                        "min_tokens": options.min_tokens, "timeout": options.serve_timeout,
                        "keep_going": options.keep_going}
        ref = options.reference
        if ref is not None:
            from ...inimage.reference import refuse_judged_image, refuse_other_settings

            refuse_judged_image(ref, target.image_id, target.base_id)
            refuse_other_settings(ref, settings)
            fixed_batches.refuse_other_schedule(ref, options.levels, options.requests)
            # The reference's prompts and length only: its answers stay here, where the replies are judged.
            out["serve"]["prompts"] = list(ref.prompts)
            out["serve"]["max_tokens"] = ref.max_tokens
        record = options.record_reference
        if record is not None:
            # The settings the host knows; the runner adds the GPU model and the versions the image reports.
            out["serve"]["record"] = {"file": str(record), "recorded_from": f"{target.ref} ({target.image_id})",
                                      "settings": settings}
        if ref is not None or record is not None:
            from ...inimage.sweep import MAX_TOKENS

            # Every level again under fixed batches: the probe's replies come back raw and are judged here.
            out["serve"]["batches"] = fixed_batches.job_part(
                settings, options.levels, options.requests, ref.prompts if ref is not None else PROMPTS,
                ref.max_tokens if ref is not None else MAX_TOKENS, recording=record is not None)
    return out, extra


def serve_settings(options: SmokeOptions, target: Target) -> dict[str, Any]:
    """What the host knows, before anything runs, of the settings a reference names (oracle.SETTING_KEYS): the
    server's arguments (the user's, then the oracle's), its environment, the base image, the model."""
    args = [str(a) for a in options.serve_args]
    try:
        oracle.check_serve_args(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        base = "sha256:" + compile_cache.base_key(target.image_id, target.base_id or None)
    except SmokeError:
        base = target.image_id  # not an image ID (a cluster's digest): the image stands for its base
    return {"serve_args": [*args, *oracle.SERVE_ARGS], "env": dict(oracle.SERVE_ENV), "base_image_id": base,
            "model": oracle.fingerprint(str(options.serve_model))}


def run_settings(verdict: Verdict) -> dict[str, Any]:
    """What a finished run reported of those settings: the GPU model its container saw, vLLM's and torch's
    versions (the image's env-report)."""
    packages = (verdict.environment or {}).get("packages") or {}
    devices = (verdict.gpu or {}).get("devices") or []
    found: dict[str, Any] = {"vllm": packages.get("vllm"), "torch": packages.get("torch")}
    if devices:
        found["gpu"] = ", ".join(str(d) for d in devices)
    return found


TP_SHM = "16g"  # /dev/shm of a tensor-parallel server's container: NCCL moves tensors between its GPUs there


def serve_arg(args: Sequence[str], *names: str) -> str | None:
    """The value given to the server's option ``names`` (``--name VALUE`` or ``--name=VALUE``) among ``args``."""
    items = [str(a) for a in args]
    for i, arg in enumerate(items):
        name, eq, value = arg.partition("=")
        if name in names:
            return value if eq else (items[i + 1] if i + 1 < len(items) else "")
    return None


def tensor_parallel(args: Sequence[str]) -> int:
    """The ``--tensor-parallel-size`` (``-tp``) the server is given among ``args`` (1 where none is)."""
    text = serve_arg(args, "--tensor-parallel-size", "-tp")
    if text is None:
        return 1
    try:
        return max(1, int(text))
    except ValueError:
        raise UsageError(f"--serve-arg --tensor-parallel-size {text}: --tensor-parallel-size takes a whole number "
                         "of GPUs") from None


def shm_size(job: Mapping[str, Any]) -> str | None:
    """The /dev/shm size the runner's container needs for ``job``: TP_SHM for a tensor-parallel server, else the
    engine's default (None)."""
    serve = job.get("serve") or {}
    return TP_SHM if tensor_parallel(serve.get("argv") or []) > 1 else None


OVERLAP_MEMORY = 0.5  # the most --gpu-memory-utilization under which two vLLM engines can start side by side


def overlaps(args: Sequence[str]) -> bool:
    """Whether the server may start while the GPU checks run, and the fixed-batch probe's engine beside it: only
    with its KV cache size given, where vLLM does not size the cache from the GPU's free memory (which the
    checks' processes change as they come and go), and with --gpu-memory-utilization at most OVERLAP_MEMORY
    (vLLM's own default is 0.9): each engine refuses to start unless that share of the GPU is free."""
    if serve_arg(args, "--kv-cache-memory-bytes") is None:
        return False
    share = serve_arg(args, "--gpu-memory-utilization")
    try:
        return float(share if share is not None else 0.9) <= OVERLAP_MEMORY
    except ValueError:
        return False


def _record(root: Path, pin: Pin) -> dict[str, str] | None:
    wheel = pins.cached_wheel(root, pin)
    return dict(wheels.record(wheel)) if wheel is not None else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What the runner may take by default, by the checks asked for: the checks that need no GPU (the image's
# Python imports the package, reports its environment and pins), the GPU checks, the server and its sweep.
CPU_CHECKS_S, GPU_CHECKS_S, SWEEP_S = 600, 1800, 1800


def deadline(options: SmokeOptions, gpu: bool) -> float:
    """``--deadline``, else what the checks asked for need, so an image whose Python hangs ends incomplete."""
    if options.deadline is not None:
        return float(options.deadline)
    serve = options.serve_timeout + SWEEP_S if options.serve_model is not None else 0
    return CPU_CHECKS_S + (GPU_CHECKS_S if gpu else 0) + serve


@dataclass(frozen=True, slots=True)
class Ran:
    """A run through a launcher: the host's verdict, the job it judged by, and what the runner recorded."""

    verdict: Verdict
    job: Mapping[str, Any]
    answers: bytes | None = None  # reference answers the runner recorded (the file's bytes)
    levels: Mapping[str, Any] | None = None  # per-level answers recorded under fixed batches (the host's reading)
    golden: Mapping[str, Any] | None = None  # the golden section a recording run kept (its envelope; the host's)


@dataclass(frozen=True, slots=True)
class HostFacts:
    """What the host knows of a run beside its job: its file facts' compiled files, how it found the GPU
    request, its own environment notes, and a way to ask the image's base which imports fail there too."""

    compiled_missing: Sequence[str] = ()
    gpu: Mapping[str, Any] | None = None
    environment: Mapping[str, Any] | None = None
    base_imports: Callable[[list[str]], Mapping[str, str] | None] | None = None


def refused(target: Target, identity: Mapping[str, Any], host: Mapping[str, Any], gpu_mode: str, *,
            started: str = "", seconds: float = 0.0) -> Ran:
    """The run of an image whose identity check (``identity``) failed or could not be judged: nothing of it
    started, and its verdict holds that check alone."""
    job = {"image": target.ref, "image_id": target.image_id, "platform": target.platform, "host": dict(host),
           "gpu": {"mode": gpu_mode}}
    return Ran(judging.not_its_product(job, identity, started=started, seconds=seconds), job)


def batch_check(job: Mapping[str, Any], launched: Launched, reference: Reference | None
                ) -> tuple[list[Check], dict[str, Any] | None, Mapping[str, Any] | None]:
    """The host's ``exact-levels`` check of the probe's replies (none where the job ran no probe), its evidence,
    and, for a recording, the per-level answers to keep (None where they cannot be kept, and the check fails)."""
    spec = (job.get("serve") or {}).get("batches")
    if not spec:
        return [], None, None
    ran = launched.report.checks
    sweep = next((c for c in ran if c.name == "serve-sweep"), None)
    if launched.batches is None and (sweep is None or sweep.status is Status.SKIP):
        why = sweep.detail if sweep is not None else "the sweep did not run"
        return [Check(fixed_batches.CHECK, Status.SKIP, f"not run: {why}")], None, None
    run = fixed_batches.parse(launched.batches)
    levels, requests = [int(c) for c in spec["levels"]], int(spec["requests"])
    if reference is None:  # recording
        try:
            section = fixed_batches.record(run, [str(p) for p in spec["prompts"]], levels, requests,
                                           int(spec["max_tokens"]))
        except SmokeError as exc:
            return [Check(fixed_batches.CHECK, Status.FAIL, str(exc))], None, None
        return [fixed_batches.recorded_check(section)], None, section
    check, evidence = fixed_batches.judge(reference, run, levels, requests)
    return [check], evidence, None


def golden_check(job: Mapping[str, Any], launched: Launched, reference: Reference | None, model: Path | None
                 ) -> tuple[list[Check], dict[str, Any] | None]:
    """The host's ``golden`` check of the replies that came back (none where the job judged no answers, or the
    host has no model folder), and, for a recording, the golden's envelope to keep in the reference. Every level
    the job scheduled (the sweep's and the fixed batches') must be covered."""
    spec = (job.get("serve") or {}).get("batches")
    if not spec or model is None:
        return [], None
    sweep = next((c for c in launched.report.checks if c.name == "serve-sweep"), None)
    if launched.batches is None and (sweep is None or sweep.status is Status.SKIP):
        return [golden.judge.skipped(sweep.detail if sweep is not None else "the sweep did not run")], None
    prompts = [str(p) for p in spec["prompts"]]
    try:
        http = json.loads(launched.replies) if launched.replies is not None else {}
        if not isinstance(http, dict):
            raise Malformed("the sweep's replies are not an object")
        served = golden.served_replies(http, len(prompts), fixed_batches.parse(launched.batches).runs)
    except (ValueError, Malformed) as exc:
        return [Check(golden.judge.CHECK, Status.FAIL, f"the runner's replies cannot be read: {exc}")], None
    start = time.monotonic()
    levels = sorted({int(c) for c in [*(spec.get("levels") or ()), *((job.get("serve") or {}).get("levels") or ())]})
    check, section = golden.run(model, prompts, served, section=reference.golden if reference is not None else None,
                                recording=reference is None, levels=levels, tokens=spec.get("max_tokens"))
    return [replace(check, seconds=round(time.monotonic() - start, 3))], section


def sweep_judged(job: Mapping[str, Any], launched: Launched, reference: Reference | None) -> Verdict:
    """The runner's report with its serve-sweep judged here from the replies it sent back
    (:mod:`vllm_hotfix.judges.replies`): against ``reference`` where there is one, else by status and length alone
    (a recording run included)."""
    report = launched.report
    spec = job.get("serve") or {}
    said = next((c for c in report.checks if c.name == "serve-sweep"), None)
    if not spec or said is None or said.status is Status.SKIP or not isinstance(report.sweep, Mapping) \
            or not report.sweep.get("levels"):
        return report
    try:
        raw = json.loads(launched.replies) if launched.replies is not None else {}
        if not isinstance(raw, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        raw = {}
        log.info("the runner's sweep replies are unreadable (%s): every request fails", exc)
    # The schedule is the job's: its levels, its requests per level, its prompts (the fixed set where it named none).
    check, sweep = replies.rejudge(report.sweep, raw, reference, [int(c) for c in spec.get("levels") or []],
                                   int(spec.get("requests") or 0), prompts=len(spec.get("prompts") or PROMPTS),
                                   min_tokens=spec.get("min_tokens"),
                                   keep_going=bool(spec.get("keep_going")))
    if said.status is Status.FAIL and check["status"] == "pass":
        # The runner's own failure (no server, a request refused) stands: the host found nothing to judge against it.
        return report
    mine = Check(str(check["name"]), Status(str(check["status"])), str(check["detail"]),
                 data={**dict(check.get("data") or {}), "answered_by": "filesystem"}, seconds=said.seconds)
    marks = report.sweep.get("server_marks")
    if isinstance(marks, list) and sweep is not None:
        # The server's start-up lines as the image's server printed them: a measurement of where its start went,
        # kept as said (strings, at most the runner's cap), never read as a fact about the image.
        sweep = {**sweep, "server_marks": [str(m)[:300] for m in marks[:60]]}
    return replace(report, checks=tuple(mine if c is said else c for c in report.checks), sweep=sweep)


def judged(job: Mapping[str, Any], launched: Launched | RunnerFailed, facts: HostFacts | None = None, *,
           started: str = "", seconds: float = 0.0, reference: Reference | None = None,
           model: Path | None = None, signature: Signature | None = None
           ) -> tuple[Verdict, Mapping[str, Any] | None, Mapping[str, Any] | None]:
    """The host's verdict on what came back: the report judged, or the runner's failure to give one; the
    per-level answers a recording run gave (``reference``: the loaded reference the probe's replies are judged
    against; None while recording) and the golden's noise it measured (``model``: the served model's folder on
    this host, which the golden computes); ``signature``: what the host found of the reference's signature."""
    facts = facts or HostFacts()
    if isinstance(launched, RunnerFailed):
        return judging.unanswered(job, "incomplete" if launched.incomplete else "fail", str(launched),
                                  started=started, seconds=seconds, gpu_facts=facts.gpu), None, None
    checks, evidence, levels = batch_check(job, launched, reference)
    found, noise = golden_check(job, launched, reference, model)
    checks += found
    if reference is not None:
        checks.append(reference_check(reference, signature or UNCHECKED))
    report = sweep_judged(job, launched, reference)
    here = ["serve-sweep"] if report is not launched.report else []
    verdict = judging.host_verdict(job, report, judged_here=here, compiled_missing=facts.compiled_missing,
                                   base_imports=facts.base_imports, started=started, seconds=seconds,
                                   gpu_facts=facts.gpu, environment=facts.environment, host_checks=checks,
                                   exact=evidence)
    if reference is not None:
        verdict = restamp(verdict, reference, signature=signature or UNCHECKED)
    return verdict, levels, noise


REFERENCE_CHECK = "reference"


def reference_check(reference: Reference, signature: Signature) -> Check:
    """The host's ``reference`` check: which answers the run is judged against, the image they were recorded from
    (refused before the run where it is the judged image or its base) and their signature. A pass only where the
    site key's signature verified; a skip, saying why, where it was not checked or was accepted unsigned."""
    status = Status.PASS if signature.state == "signed" else Status.SKIP
    detail = (f"{reference.path} (sha256 {reference.sha256}) recorded from image {reference.image_id}, neither the "
              f"judged image nor its base; {signature.words()}")
    return Check(REFERENCE_CHECK, status, detail,
                 data={"file": reference.path, "sha256": reference.sha256, "image_id": reference.image_id,
                       "recorded_from": reference.recorded_from, "signature": signature.to_dict()})


def proves(verdict: Verdict, reference: Reference) -> str | None:
    """What the run's answers prove, in words, where they prove anything: every level bitwise the reference's
    under fixed batches and every HTTP reply judged passed make the judged image reproduce the reference image's
    answers; no more (a wrong backport built twice would reproduce itself, hence a reference of another image)."""
    passed = {c.name for c in verdict.checks if c.status is Status.PASS}
    if {fixed_batches.CHECK, "serve-sweep"} <= passed:
        return f"reproducible against image {reference.image_id}"
    return None


def restamp(verdict: Verdict, reference: Reference, *, recorded: bool = False,
            signature: Signature | None = None) -> Verdict:
    """The verdict naming the reference file as the host has it (path, sha256, the image it was recorded from,
    levels, its signature, what the answers prove): which file judged or was recorded by a run is the host's fact
    (the runner wrote its recording before the host added the per-level answers). A recording run, never judged
    against what it recorded, names it under ``recorded``."""
    entry: dict[str, Any] = {"file": reference.path, "sha256": reference.sha256, "image_id": reference.image_id,
                             "levels": reference.summary()["levels"], "noise": reference.noise}
    if signature is not None:
        entry["signature"] = signature.to_dict()
    if not recorded:
        entry["proves"] = proves(verdict, reference)
    if verdict.sweep is None:
        return verdict
    if recorded:
        return replace(verdict, sweep={**dict(verdict.sweep), "recorded": entry})
    said = verdict.sweep.get("reference")
    if not isinstance(said, Mapping):
        return verdict
    return replace(verdict, sweep={**dict(verdict.sweep), "reference": {**dict(said), **entry}})


def smoke(launcher: Launcher, root: Path, target: Target, options: SmokeOptions, *, gpu_request: str | None,
          checks: Sequence[Mapping[str, Any]] = (), host: Mapping[str, Any] | None = None,
          say: Callable[[str], None] = lambda _l: None, expected_from: str = "",
          landed: Mapping[str, str] | None = None, gpu_unavailable: Mapping[str, str] | None = None,
          facts: HostFacts | None = None, echo: bool = True, python_path: Sequence[str] = ()) -> Ran:
    """Stage the runner for ``target``, start it through ``launcher``, and judge what it reported, here.

    The staged folder lives in a temporary folder removed before this
    returns. A runner that gives no report is the run's failing (incomplete
    when it ran out of time), as the host records it. ``echo``: say what
    starts and each check after the run (a launcher that followed the
    runner's progress has shown the runner's).
    """
    spec, extra = job(root, target, options, launcher=launcher.name, gpu_request=gpu_request, checks=checks,
                      host=host, expected_from=expected_from, landed=landed, gpu_unavailable=gpu_unavailable,
                      python_path=python_path)
    started, start = records.now_iso(), time.monotonic()
    # A killed run cannot remove its staging folder: the next run removes those of processes that are gone.
    leftovers.sweep_staging()
    with tempfile.TemporaryDirectory(prefix=leftovers.staging_prefix()) as tmp:
        folder = stage(Path(tmp) / "runner", spec, extra)
        if echo:
            say(f"==> smoke through {launcher.name}: the runner in {target.start} "
                f"(GPU request: {gpu_request or 'none'})")
        model = Path(options.serve_model).resolve() if options.serve_model is not None else None
        try:
            launched: Launched | RunnerFailed = launcher.launch(target.start, folder, spec, gpu_request, model)
        except RunnerFailed as exc:
            if exc.hint:
                say(exc.hint)
            launched = exc
    verdict, levels, noise = judged(spec, launched, facts, started=started, seconds=time.monotonic() - start,
                                    reference=options.reference, model=model, signature=options.reference_signature)
    if options.reference is not None and isinstance(launched, Launched):
        from ...inimage.reference import refuse_other_settings

        # What the host judged the run to have had (a GPU model only where it gave one), as the reference names it.
        refuse_other_settings(options.reference, run_settings(verdict))
    said = {(c.name, c.status, c.detail) for c in launched.report.checks} if isinstance(launched, Launched) else set()
    shown = {(c.get("name"), c.get("status"), c.get("detail")) for c in spec["checks"]}
    for c in verdict.checks:
        if echo or ((c.name, c.status, c.detail) not in said and (c.name, c.status.value, c.detail) not in shown):
            say(f"    {c.status.value:<4} {c.name}: {c.detail}" + ("" if echo else " (judged here)"))
    return Ran(verdict, spec, launched.answers if isinstance(launched, Launched) else None, levels, noise)


def keep_recorded(ran: Ran, options: SmokeOptions, target: Target, say: Callable[[str], None]) -> Ran:
    """A recording run (``--record-reference``, docker or podman): the answers the runner recorded written with
    their settings, the per-level answers the host read from the batch probe and the golden's noise measured on
    them, and the verdict naming the file; only from a passing recording (:func:`...trust.references.unfit`: a
    pass, its golden passed, GPU-verified). Nothing is written otherwise: without the per-level answers (the run
    fails on its exact-levels check, which says why), where the golden judged the trusted image wrong or did not
    run, or where no GPU verified the image."""
    if options.record_reference is None:
        return ran
    from ...inimage import reference as answers

    where = f"    --record-reference {options.record_reference}"
    if ran.answers is None:
        say(f"{where}: the runner recorded no answers (see the serve-sweep check); nothing written")
        return ran
    if not ran.levels:
        say(f"{where}: no per-level answers under fixed batches came back (see the exact-levels check); nothing "
            "written")
        return ran
    why = unfit(ran.verdict) or (None if ran.golden else "the golden measured no noise to keep")
    if why is not None:
        say(f"{where}: nothing written: {why}")
        return ran
    settings = {**serve_settings(options, target), **run_settings(ran.verdict)}
    # The image they were recorded from: its config digest, the host's fact.
    kept = answers.keep(options.record_reference, ran.answers, settings, dict(ran.levels),
                        dict(ran.golden) if ran.golden else None, image_id=target.image_id)
    say(f"    wrote {kept.path} (sha256 {kept.sha256}; {answers.describe(settings)}; answers at concurrency "
        f"{','.join(map(str, ran.levels['schedule']['levels']))} under fixed batches)")
    # The report names the file as written (its sweep was not judged against it).
    return replace(ran, verdict=restamp(ran.verdict, kept, recorded=True))
