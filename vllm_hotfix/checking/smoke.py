"""Smoke tests run inside a built image before it may be pushed.

Facts about files (the patched files, their bytecode, the installed
distribution against its RECORD) are read from the image's layers and judged
on the host (:mod:`.integrity`): nothing of the image runs for them. What only
the image's Python can answer (where it imports vLLM from, the environment,
pins, the GPU checks, the serve sweep) is asked by the runner
(:mod:`vllm_hotfix.checking.runner`), one entry started in one container of the image
with its folder mounted read-only, the same runner podman and a Kubernetes
Job start (:mod:`.launchers`). Each check's data says which answered it
(``answered_by``).

A run here has three steps: the file facts; the GPU request that reaches the
image, tried on this host (:mod:`.gpu_access`); the runner through the docker
launcher, given both, its progress followed live. The runner goes in phases,
cheapest first, so that a doomed image fails fast: the checks that need no
GPU, then the GPU checks, then one server start for the serve sweep
(reference answers recorded and the sweep run against that one server). A
phase with a failing check ends the run, the later phases recorded as
skipped, unless ``keep_going``. The runner's GPU checks are judged again here
from what they said, with the imports that fail in the image asked of its
base too (:func:`~vllm_hotfix.verdicts.rejudge_gpu`). Each phase's wall time
is in the report (``phases``). The runner's container gets the compile cache
of the image's base on that GPU model (:mod:`.compile_cache`), so a second
image of the same base starts warm.

It is one of the longer step modules (a little over 500 lines) because it
is the one place a Docker smoke run is put together, and it also holds what
the push gate re-reads from an image's layers (:func:`landed_problem`,
:func:`pins_problem`). The file facts the other launchers read from their
own copy are in :mod:`.launchers.facts`.
"""
from __future__ import annotations

import json
import logging
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import Any

from .. import verdicts
from ..building import definitions, expected, pins, sources
from ..engine import Engine, GpuRequest, ImageInfo, labels
from ..errors import (
    DefinitionError,
    EngineError,
    EngineLost,
    Malformed,
    PinError,
    RunnerFailed,
    SmokeError,
    UnknownExpectation,
)
from ..journal import records
from ..journal.atomic import write_atomic
from ..verdicts import Check, Status, Verdict, judge
from . import compile_cache, gpu_access, integrity, oracle, sweep
from . import reference as answers

log = logging.getLogger(__name__)

GPU_MODES = ("auto", "require", "off")
PROBE_DIR = "/tmp/vllm-hotfix-probes"
# The phases of a run, in the order they run; each reports its wall time.
PHASES = ("files", "gpu_access", "checks", "gpu_checks", "server_start", "reference_record", "sweep")


@dataclass(frozen=True, slots=True)
class SmokeOptions:
    gpu: str = "auto"
    gpu_request: str = "auto"
    definition: str | None = None
    serve_model: Path | None = None
    serve_args: Sequence[str] = ()
    levels: Sequence[int] = sweep.DEFAULT_LEVELS
    requests: int = 32
    min_tokens: int | None = None
    reference: answers.Reference | None = None  # judge every reply against these answers
    record_reference: Path | None = None  # record answers here first (a trusted image), then judge against them
    noise_multiple: float = oracle.NOISE_MULTIPLE  # tolerance above concurrency 1 = this x the recorded noise
    python: str = "python3"
    probe_timeout: float = 600
    serve_timeout: float = 900
    keep_going: bool = False  # run every phase even after one failed
    compile_cache: bool = True  # keep compile caches between runs (see compile_cache)
    deadline: float | None = None  # seconds the runner may take in all (--deadline); None: plan.deadline's


@dataclass(slots=True)
class Report:
    """What a run gathers as it goes; :meth:`verdict` judges it once, at the end."""

    image: str
    image_id: str
    checks: list[Check] = field(default_factory=list)
    environment: dict[str, Any] = field(default_factory=dict)
    sweep: dict[str, Any] | None = None
    gpu_verified: bool = False
    gpu: dict[str, Any] = field(default_factory=dict)
    started: str = ""
    seconds: float = 0.0
    expected_from: str = ""
    host: dict[str, Any] = field(default_factory=dict)
    platform: str = ""
    phases: dict[str, float] = field(default_factory=dict)

    def verdict(self) -> Verdict:
        return judge(self.image, self.image_id, self.checks, gpu_verified=self.gpu_verified,
                     platform=self.platform, started=self.started, seconds=self.seconds,
                     expected_from=self.expected_from, gpu=self.gpu, host=self.host,
                     environment=self.environment, sweep=self.sweep, phases=self.phases)

    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status is Status.FAIL]


class Clock:
    """Wall time per phase: :meth:`mark` charges the time since the last mark to a phase."""

    def __init__(self, phases: dict[str, float], now: Callable[[], float] = time.monotonic) -> None:
        self.phases = phases
        self._now = now
        self._last = now()

    def restart(self) -> None:
        """Charge the time since the last mark to no phase."""
        self._last = self._now()

    def mark(self, phase: str) -> float:
        now = self._now()
        took = now - self._last
        self._last = now
        self.phases[phase] = round(self.phases.get(phase, 0.0) + took, 3)
        return took


def format_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()) or "none"


def as_check(raw: dict[str, Any], seconds: float, probe: str) -> Check:
    """A probe's check as a typed Check; a malformed one is the probe's failing check."""
    try:
        check = Check.from_dict(raw)
    except Malformed as exc:
        name = raw.get("name") if isinstance(raw, dict) and isinstance(raw.get("name"), str) else ""
        return Check(name or probe, Status.FAIL, f"the probe reported a malformed check: {exc}", seconds)
    return Check(check.name, check.status, check.detail, seconds, check.data, check.ran_against, check.stubs,
                 check.import_errors)


def _probe(name: str) -> bytes:
    return resources.files("vllm_hotfix.checking.probes").joinpath(name).read_bytes()


def _parse_checks(name: str, stdout: str, stderr: str, code: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A probe's JSON, or one failing check that says why there is none."""
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
        # Neither a pass nor a failure of the image: it never finished.
        tail = (stderr.strip().splitlines() or [""])[-1]
        return [{"name": name, "status": "incomplete", "detail": f"probe did not finish: {tail}".strip()}], {}
    why = (stderr.strip().splitlines() or [f"exit {code}, no output"])[-1]
    return [{"name": name, "status": "fail", "detail": f"probe gave no result: {why}"}], {}


class Smoke:
    def __init__(self, engine: Engine, root: Path, options: SmokeOptions, progress: Callable[[str], None]) -> None:
        self.engine = engine
        self.root = root
        self.opt = options
        self.say = progress
        self._access: dict[str, gpu_access.GpuAccess] = {}
        self._caches: dict[str, compile_cache.CompileCache | None] = {}

    def access(self, image: ImageInfo) -> gpu_access.GpuAccess:
        """The way this image's containers get the GPUs; chosen once per image, then reused."""
        if image.id not in self._access:
            self._access[image.id] = gpu_access.choose(self.engine, image.id, self.opt.gpu_request,
                                                       self.opt.python, self.say)
        return self._access[image.id]

    def compile_cache(self, image: ImageInfo) -> compile_cache.CompileCache | None:
        """The compile cache folder of the image's base on the GPU model in use (None: not kept)."""
        if not self.opt.compile_cache:
            return None
        if image.id not in self._caches:
            access = self._access.get(image.id)
            devices = access.devices if access is not None and access.chosen is not None else []
            self._caches[image.id] = compile_cache.folder(sources.cache_dir(self.root), image.id,
                                                          image.labels.get(labels.BASE_ID), devices)
        return self._caches[image.id]

    def probe(self, image: ImageInfo, script: str, args: Sequence[str], *, gpu: GpuRequest | None = None,
              fallback_name: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
        """Run probe ``script`` alone in a container of ``image`` (the base's imports: another image than the
        runner's)."""
        start = time.monotonic()
        try:
            res = self.engine.run(image.id, [self.opt.python, f"{PROBE_DIR}/{script}", *args],
                                  files={f"vllm-hotfix-probes/{script}": _probe(script)}, gpu=gpu,
                                  timeout=self.opt.probe_timeout)
        except EngineLost as exc:
            took = time.monotonic() - start
            return [{"name": fallback_name or script, "status": "incomplete", "detail": str(exc)}], {}, took
        except EngineError as exc:
            took = time.monotonic() - start
            return [{"name": fallback_name or script, "status": "fail", "detail": str(exc)}], {}, took
        took = time.monotonic() - start
        checks, info = _parse_checks(fallback_name or script, res.stdout, res.stderr, res.exit_code)
        return checks, info, took

    def add(self, report: Report, checks: list[dict[str, Any]], took: float, probe: str = "probe",
            answered_by: str = integrity.IMAGE_PYTHON) -> None:
        self.record(report, [as_check(raw, round(took / max(len(checks), 1), 3), probe) for raw in checks],
                    answered_by)

    def record(self, report: Report, checks: Sequence[Check], answered_by: str = integrity.IMAGE_PYTHON) -> None:
        """Record checks; each says whether the image's filesystem or its own Python answered it."""
        for c in checks:
            if answered_by == integrity.FILESYSTEM or not (c.data or {}).get("answered_by"):
                # A probe's own claim to be the filesystem is not believed: it ran in the image.
                c = replace(c, data={**(c.data or {}), "answered_by": answered_by})
            report.checks.append(c)
            self.say(f"    {c.status.value:<4} {c.name}: {c.detail}")

    def definition(self, image: ImageInfo) -> definitions.ImageDefinition | None:
        """The definition whose patch set the image is judged by.

        The one of ``--definition`` if given (so an unpatched base can be shown
        to fail its checks), else the one the image's label names.
        """
        tag = self.opt.definition or image.labels.get(labels.DEFINITION)
        if not tag:
            return None
        try:
            return definitions.load(self.root, tag)
        except DefinitionError as exc:
            if self.opt.definition:
                raise SmokeError(f"--definition {tag}: {exc}") from exc
            return None

    def patch_checks(self, image: ImageInfo) -> dict[str, bytes]:
        """The patch set's own checks, e.g. a GPU regression test for the fix."""
        defn = self.definition(image)
        if defn is None:
            return {}
        folder = self.root / "patches" / defn.patch_set / "checks"
        return {f"vllm-hotfix-probes/checks/{p.name}": p.read_bytes() for p in sorted(folder.glob("*.py"))}

    def expectation(self, image: ImageInfo) -> expected.Expected | str:
        """What the patched files must be, or why that cannot be known."""
        try:
            return expected.for_image(self.engine, self.root, image)
        except UnknownExpectation as exc:
            return str(exc)

    def run(self, ref: str, want: expected.Expected | None = None) -> Verdict:
        """Smoke-test ``ref``; ``want`` is the build's own expectation when it just built it.

        Three steps: the file facts from the image's layers (here, nothing
        run); the GPU request that reaches the image (here, tried); then the
        runner (:mod:`vllm_hotfix.checking.runner`) in one container of the image, as
        the podman and Kubernetes launchers start it, with the file facts in
        its job. Its GPU checks are judged again here, where the image's base
        can be asked which imports fail in it too.
        """
        from .launchers import facts, plan
        from .launchers.docker import DockerLauncher

        image = self.engine.image(ref)
        if image is None:
            raise SmokeError(f"image {ref} is not in the engine")
        self.patch_checks(image)  # a bad --definition is an error before anything runs
        report = Report(ref, image.id, started=records.now_iso(), host=self.engine.host_facts(),
                        platform=f"{image.os}/{image.architecture}")
        start = time.monotonic()
        clock = Clock(report.phases)
        files, landed = self.file_checks(report, image, ref, want)
        clock.mark("files")
        early_stop = bool(report.failed()) and not self.opt.keep_going
        request, unavailable = (None, None) if early_stop else self.gpu_plan(report, image)
        if not early_stop and self.opt.gpu != "off":
            clock.mark("gpu_access")
        seen = self._access[image.id].devices if image.id in self._access else []
        if self.opt.reference is not None and seen:  # a reference recorded on another GPU model: refused now
            answers.refuse_other_settings(self.opt.reference, {"gpu": ", ".join(seen)})
        cache = self.compile_cache(image) if request is not None or self.opt.serve_model is not None else None
        if cache is not None:
            report.environment["compile_cache"] = cache.to_dict()
            self.say(f"    compile cache {cache.host} (base {cache.base_id[:12]}, {cache.gpu}) at {cache.mount[1]}")
        launcher = DockerLauncher(self.engine, self.opt.python, plan.deadline(self.opt, request is not None),
                                  env=cache.env if cache is not None else None,
                                  writable=[cache.mount] if cache is not None else (),
                                  follow=lambda line: self.say(f"  {line}" if line.startswith("==>") else line))
        target = plan.Target(ref, image.id, image.id, dict(image.labels), report.platform,
                             entrypoint=tuple(image.entrypoint or plan.DEFAULT_ENTRYPOINT))
        self.say(f"==> smoke 3/3: the checks in the image, by the runner in one container "
                 f"(GPU request: {request or 'none'})")
        clock.restart()
        try:
            launched = plan.smoke(launcher, self.root, target, self.opt, gpu_request=request,
                                  checks=[c.to_dict() for c in report.checks], host=report.host,
                                  expected_from=report.expected_from,
                                  compiled_missing=facts.missing_compiled(files.judged) if files is not None else (),
                                  landed=landed, gpu_unavailable=unavailable, echo=False)
        except EngineLost as exc:
            return self._ended(report, start, "incomplete", str(exc))
        except EngineError as exc:
            return self._ended(report, start, "fail", str(exc))
        except RunnerFailed as exc:
            # The image's Python could not run the checks (or never finished): that is the run's outcome.
            self.say(f"    {exc}" + (f"\n{exc.hint}" if getattr(exc, "hint", None) else ""))
            return self._ended(report, start, "incomplete" if exc.incomplete else "fail", str(exc))
        verdict = launched.verdict
        if launched.answers is not None and self.opt.record_reference is not None:
            self.keep_answers(launched.answers, {**plan.serve_settings(self.opt, target),
                                                 **plan.run_settings(verdict)})
        verdict = self.rejudge(verdict, image)
        # The runner's GPU facts, with the host's own on how the request was found.
        gpu = {**dict(verdict.gpu), **{k: v for k, v in report.gpu.items()
                                       if k not in ("mode", "verified", "why_unverified")}}
        gpu.pop("raw_checks", None)
        phases = {**report.phases, **{k: float(v) for k, v in verdict.phases.items()}}
        seconds = time.monotonic() - start
        self.say(f"==> phases: {format_phases(phases)} (total {seconds:.1f} s)")
        return judge(ref, image.id, verdict.checks, gpu_verified=verdict.gpu_verified, platform=report.platform,
                     started=report.started, seconds=seconds, expected_from=report.expected_from, gpu=gpu,
                     host=report.host, environment={**dict(verdict.environment), **report.environment},
                     sweep=verdict.sweep, phases=phases)

    def _ended(self, report: Report, start: float, status: str, why: str) -> Verdict:
        """The run when the runner's container could not give an answer (the engine failed or went away)."""
        self.add(report, [{"name": "runner", "status": status, "detail": why}], 0)
        report.seconds = time.monotonic() - start
        return report.verdict()

    def keep_answers(self, data: bytes, settings: dict[str, Any]) -> None:
        """Write the reference answers the runner recorded (``--record-reference``) with their settings."""
        assert self.opt.record_reference is not None
        ref = answers.keep(self.opt.record_reference, data, settings)
        self.say(f"    wrote {ref.path} (sha256 {ref.sha256}; {answers.describe(settings)})")

    def file_checks(self, report: Report, image: ImageInfo, ref: str, want: expected.Expected | None,
                    ) -> tuple[integrity.FileChecks | None, dict[str, str] | None]:
        """The checks read from the image's layers (patched files, integrity), and where its package must import
        from (the runner asks the image's Python); None for either when it cannot be told what to expect."""
        self.say(f"==> smoke 1/3: patched files in {ref} (read from the image's layers)")
        found = want if want is not None else self.expectation(image)
        if isinstance(found, str):
            report.expected_from = "unknown"
            self.add(report, [{"name": "patch-landed", "status": "fail", "detail": found},
                              {"name": "integrity", "status": "fail",
                               "detail": f"cannot tell which files the image must hold: {found}"}], 0,
                     answered_by=integrity.FILESYSTEM)
            return None, None
        report.expected_from = found.source
        self.say(f"    expected hashes: {found.source}")
        from .launchers.facts import pinned_names

        pinned: list[str] = []
        try:
            pinned = pinned_names(self.root, found.definition)
        except (DefinitionError, PinError):
            pass  # the runner's job carries the same error as a failing pins check
        start_files = time.monotonic()
        files = integrity.check_image(self.engine, sources.cache_dir(self.root), image.id, found, pinned, self.say)
        self.add(report, list(files.checks), time.monotonic() - start_files, answered_by=integrity.FILESYSTEM)
        landed = {"package": found.package, "site_dir": found.site_dir} if found.site_dir else None
        return files, landed

    def gpu_plan(self, report: Report, image: ImageInfo) -> tuple[str | None, dict[str, str] | None]:
        """The GPU request the runner's container gets, or the ``gpu`` check settled here when none can reach it.

        ``off``: none (the runner records the skip). An image of another
        architecture than the host: an emulated CPU runs no GPU code.
        Otherwise each way is tried (:func:`~vllm_hotfix.checking.gpu_access.choose`);
        under ``auto`` a host where none works leaves the image
        GPU-unverified, under ``require`` the run incomplete (the host's
        shortcoming, not the image's).
        """
        mode = self.opt.gpu
        report.gpu = {"mode": mode, "verified": False}
        if mode == "off":
            return None, None
        self.say(f"==> smoke 2/3: a GPU request that reaches the image (--gpu {mode})")
        if image.architecture and self.engine.arch and image.architecture != self.engine.arch:
            why = (f"the image is {image.os}/{image.architecture}, the Docker host {self.engine.arch}: "
                   "GPU checks need a host of the image's architecture")
            return None, {"status": "incomplete" if mode == "require" else "skip", "detail": why, "why": why}
        access = self.access(image)
        report.gpu.update(access.to_dict())
        if access.chosen is None:
            why = f"no GPU request gave a container of this image a GPU ({access.why_none()})"
            if mode == "require":
                return None, {"status": "incomplete", "detail": f"--gpu require: {why}", "why": why}
            return None, {"status": "skip", "detail": f"{why}: image is GPU-unverified", "why": why}
        return str(access.chosen), None

    def rejudge(self, verdict: Verdict, image: ImageInfo) -> Verdict:
        """The runner's GPU checks judged here, from what they said: an import that fails in the image is asked
        of its base too (same GPU request), so that the base's own failures are named as the base's."""
        access = self._access.get(image.id)
        raw = [as_check(c, float(c.get("seconds", 0)), "gpu") for c in verdict.gpu.get("raw_checks") or []
               if isinstance(c, dict)]
        if not raw or access is None or access.chosen is None:
            return verdict
        unimportable = sorted({m for c in raw for m in c.import_errors})
        base_errors = self.base_import_errors(image, unimportable, access.chosen) if unimportable else None
        return verdicts.rejudge_gpu(verdict, raw, require=self.opt.gpu == "require", base_import_errors=base_errors)

    def base_import_errors(self, image: ImageInfo, modules: Sequence[str], gpu: GpuRequest) -> dict[str, str] | None:
        """Which of ``modules`` the image's base cannot import either (same GPU request); None: base unknown."""
        base_id = image.labels.get(labels.BASE_ID)
        base = self.engine.image(base_id) if base_id and base_id != image.id else None
        if base is None:
            self.say("    the image's base is not in the engine: every import failure counts as the image's")
            return None
        self.say(f"    importing {len(modules)} module(s) in the base {base_id[:19] if base_id else ''} too")
        raw, _, _ = self.probe(base, "gpu_check.py", ["--imports-only", "--modules", *modules], gpu=gpu,
                               fallback_name="model-imports")
        found = [as_check(c, 0, "model-imports") for c in raw]
        if not any(c.name == "model-imports" and c.status in (Status.PASS, Status.FAIL) for c in found):
            self.say(f"    the base's imports gave no answer ({'; '.join(c.detail for c in found)[:200]})")
            return None
        return {m: e for c in found for m, e in c.import_errors.items()}


def landed_problem(engine: Engine, root: Path, image: ImageInfo,
                   say: Callable[[str], None] = lambda _line: None, *, gpu_claimed: bool = False) -> str | None:
    """The file checks alone, read from the image's layers: None if its files are what they must be.

    The patched files with the hashes the patch set and the base give, the
    whole installed distribution against its RECORD relative to the base, the
    pinned versions: nothing of the image runs, so neither an edited journal
    nor the image's own interpreter can vouch for it. ``gpu_claimed``: the
    verdict says GPU-verified, which an image lacking compiled files cannot be.
    """
    smoke = Smoke(engine, root, SmokeOptions(probe_timeout=120), say)
    found = smoke.expectation(image)
    if isinstance(found, str):
        return found
    problem = pins_problem(engine, root, image, found)
    if problem is not None:
        return problem
    from .launchers.facts import missing_compiled, pinned_names

    try:
        pinned = pinned_names(root, found.definition)
    except (DefinitionError, PinError) as exc:
        return f"pins: {exc}"
    checked = integrity.check_image(engine, sources.cache_dir(root), image.id, found, pinned, say)
    problems = checked.problems()
    if problems:
        return problems[0]
    missing = missing_compiled(checked.judged)
    if gpu_claimed and missing:
        return (f"compiled-files: its verdict says GPU-verified, but {len(missing)} compiled file(s) the installed "
                f"RECORD lists are absent, e.g. {', '.join(missing[:integrity.EXAMPLES])}")
    return None


def pins_problem(engine: Engine, root: Path, image: ImageInfo, found: expected.Expected) -> str | None:
    """None if every distribution the definition's pins.txt names has its pinned version, once."""
    try:
        defn = definitions.load(root, found.definition)
        pinset = pins.load(root, defn.patch_set, defn.package)
    except (DefinitionError, PinError) as exc:
        return f"pins: {exc}"
    if pinset is None:
        return None
    state = pins.probe(engine, image.id, defn.python, pinset.names)
    for pin in pinset.pins:
        have = sorted(c.version for c in state.dists.get(pin.name) or ())
        if have != [pin.version]:
            return (f"pins: {pin.spelled} is {', '.join(have) or 'not installed'} in the image, but "
                    f"{pinset.path.parent.name}/{pins.PINS_FILE} {pin.where} pins {pin.version}")
    return None


def runner(
    root: Path, progress: Callable[[str], None], options: SmokeOptions | None = None
) -> Callable[[Engine, str, expected.Expected | None], Verdict]:
    """The hook `image` calls after a build, before tagging."""

    def run(engine: Engine, image_id: str, want: expected.Expected | None) -> Verdict:
        return Smoke(engine, root, options or SmokeOptions(), progress).run(image_id, want)

    return run


def write_json(verdict: Verdict, path: Path) -> None:
    # write_atomic: a full disk or an unwritable folder is one line naming the file (exit 10).
    write_atomic(path, json.dumps(verdict.to_dict(), indent=2, sort_keys=True) + "\n")


def write_junit(verdict: Verdict, path: Path) -> None:
    checks = verdict.checks
    suite = ET.Element(
        "testsuite",
        name=f"smoke {verdict.image}",
        tests=str(len(checks)),
        failures=str(sum(c.status is Status.FAIL for c in checks)),
        skipped=str(sum(c.status is Status.SKIP for c in checks)),
        time=f"{verdict.seconds:.3f}",
    )
    for c in checks:
        case = ET.SubElement(suite, "testcase", classname="smoke", name=c.name, time=f"{c.seconds:.3f}")
        if c.status is Status.FAIL:
            ET.SubElement(case, "failure", message=c.detail).text = json.dumps(c.data or {})[:4000]
        elif c.status is Status.SKIP:
            ET.SubElement(case, "skipped", message=c.detail)
    write_atomic(path, ET.tostring(suite, encoding="utf-8", xml_declaration=True))

