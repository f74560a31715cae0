"""Smoke tests run inside a built image before it may be pushed.

Facts about files (the patched files, their bytecode, the installed
distribution against its RECORD) are read from the image's layers and judged
on the host (:mod:`.integrity`): nothing of the image runs for them. What only
the image's Python can answer (where it imports vLLM from, the environment,
pins, GPU checks) is a probe script (vllm_hotfix/probes/, plus the patch set's
own checks in patches/<set>/checks/) run with the image's Python, entrypoint
overridden, under a timeout, in a container that is always removed; each
check's data says which answered it (``answered_by``). The serve sweep
instead starts the image's own entrypoint (`vllm serve`).

A probe's JSON comes from inside the image: each check it reports becomes a
typed :class:`~vllm_hotfix.verdicts.Check` (one that does not fit is a
failing check), and a run ends in one :func:`~vllm_hotfix.verdicts.judge`.

A run goes in phases, cheapest first, so that a doomed image fails fast: the
checks that need no GPU (patched files, environment, integrity, pins), then
the GPU checks, then one server start for the serve sweep (reference answers
recorded and the sweep run against that one server). A phase with a failing
check ends the run, the later phases recorded as skipped, unless
``keep_going``. Each phase's wall time is in the report (``phases``). GPU
containers and the server get the compile cache of the image's base on that
GPU model (:mod:`.compile_cache`), so a second image of the same base starts
warm.

It is the longest step module because it is the one place a smoke run is put
together: each phase, what it records and when a failure ends the run. What
the phases use lives beside it: file facts in :mod:`.integrity`, the GPU
request in :mod:`.gpu_access`, the sweep in :mod:`.sweep`, the compile cache
in :mod:`.compile_cache`, the runner path in :mod:`.launchers`.
"""

from __future__ import annotations

import json
import logging
import socket
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from . import (
    compile_cache,
    definitions,
    expected,
    gpu_access,
    integrity,
    patches,
    pins,
    records,
    sources,
    sweep,
    wheels,
)
from . import reference as answers
from .atomic import write_atomic
from .engine import Engine, GpuRequest, ImageInfo, labels
from .errors import (
    DefinitionError,
    EngineError,
    EngineLost,
    Malformed,
    PatchError,
    PinError,
    SmokeError,
    UnknownExpectation,
)
from .verdicts import Check, Status, Verdict, judge, judge_gpu

log = logging.getLogger(__name__)

GPU_MODES = ("auto", "require", "off")
PROBE_DIR = "/tmp/vllm-hotfix-probes"
# The phases of a run, in the order they run; each reports its wall time.
PHASES = ("checks", "gpu_access", "gpu_checks", "server_start", "reference_record", "sweep")


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
    logprob_tolerance: float = answers.DEFAULT_TOLERANCE
    python: str = "python3"
    probe_timeout: float = 600
    serve_timeout: float = 900
    keep_going: bool = False  # run every phase even after one failed
    compile_cache: bool = True  # keep compile caches between runs (see compile_cache)


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


def modules_of(files: Iterable[str]) -> list[str]:
    """Dotted module names of the Python files among ``files`` (paths from site-packages), sorted."""
    out: set[str] = set()
    for path in files:
        parts = PurePosixPath(path).parts
        if not parts or not parts[-1].endswith(".py"):
            continue
        stem = parts[-1][: -len(".py")]
        names = list(parts[:-1]) + ([] if stem == "__init__" else [stem])
        if names and all(n.isidentifier() for n in names):
            out.add(".".join(names))
    return sorted(out)


def _probe(name: str) -> bytes:
    return resources.files("vllm_hotfix.probes").joinpath(name).read_bytes()


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

    def _cache_args(self, image: ImageInfo) -> dict[str, Any]:
        cache = self.compile_cache(image)
        return {} if cache is None else {"env": cache.env, "writable": [cache.mount]}

    def probe(
        self, image: ImageInfo, script: str, args: Sequence[str], *, gpu: GpuRequest | None = None,
        extra: dict[str, bytes] | None = None, fallback_name: str | None = None, run: str | None = None,
        cache: bool = False,
    ) -> tuple[list[dict[str, Any]], dict[str, Any], float]:
        """Run probe ``script`` (or, with ``run``, a script among ``extra``) in the image.

        ``cache``: with the image's compile cache mounted (GPU checks compile kernels).
        """
        files = {f"vllm-hotfix-probes/{script}": _probe(script), **(extra or {})} if run is None else dict(extra or {})
        start = time.monotonic()
        try:
            res = self.engine.run(
                image.id, [self.opt.python, run or f"{PROBE_DIR}/{script}", *args], files=files, gpu=gpu,
                timeout=self.opt.probe_timeout, **(self._cache_args(image) if cache else {}),
            )
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

    def patch_modules(self, image: ImageInfo) -> list[str]:
        """The modules of the image the patch set touches: each must import for the GPU checks to count."""
        defn = self.definition(image)
        if defn is None:
            return []
        try:
            series = patches.load_series(self.root, defn.patch_set, defn.package)
        except PatchError as exc:
            raise SmokeError(f"patches/{defn.patch_set}: {exc}") from exc
        return modules_of(f for patch in series for f in patch.files)

    def expectation(self, image: ImageInfo) -> expected.Expected | str:
        """What the patched files must be, or why that cannot be known."""
        try:
            return expected.for_image(self.engine, self.root, image)
        except UnknownExpectation as exc:
            return str(exc)

    def run(self, ref: str, want: expected.Expected | None = None) -> Verdict:
        """Smoke-test ``ref``; ``want`` is the build's own expectation when it just built it."""
        image = self.engine.image(ref)
        if image is None:
            raise SmokeError(f"image {ref} is not in the engine")
        self.patch_checks(image)  # a bad --definition is an error before anything runs
        report = Report(ref, image.id, started=records.now_iso(), host=self.engine.host_facts(),
                        platform=f"{image.os}/{image.architecture}")
        start = time.monotonic()
        clock = Clock(report.phases)
        files = self.cpu_checks(report, image, ref, want)
        clock.mark("checks")
        if not self.stop(report, ("gpu", "serve-sweep")):
            self.say(f"==> smoke 4/5: GPU checks (--gpu {self.opt.gpu})")
            self.gpu(report, image, clock)
            if files is not None:
                self.compiled_stop(report, files.judged)
            if not self.stop(report, ("serve-sweep",)):
                self.say("==> smoke 5/5: serve sweep")
                if self.opt.serve_model is None:
                    self.add(report, [{"name": "serve-sweep", "status": "skip", "detail": "no --serve-model given"}],
                             0)
                else:
                    self.serve(report, image, clock)
        report.seconds = time.monotonic() - start
        self.say(f"==> phases: {format_phases(report.phases)} (total {report.seconds:.1f} s)")
        return report.verdict()

    def stop(self, report: Report, skipped: Sequence[str]) -> bool:
        """Whether a failed check ends the run here; if so, ``skipped`` are recorded as not run."""
        failed = report.failed()
        if not failed or self.opt.keep_going:
            return False
        why = f"not run: {', '.join(failed)} failed first (--keep-going runs every check)"
        self.say(f"==> {why}")
        if "gpu" in skipped:
            report.gpu = {"mode": self.opt.gpu, "verified": False, "why_unverified": why}
        self.add(report, [{"name": name, "status": "skip", "detail": why} for name in skipped], 0)
        return True

    def cpu_checks(self, report: Report, image: ImageInfo, ref: str,
                   want: expected.Expected | None) -> integrity.FileChecks | None:
        """The checks that need no GPU: patched files, environment, installed-package integrity, pins.

        Returns what was read from the image's files (None when it could not be told what to expect).
        """
        self.say(f"==> smoke 1/5: patched files in {ref} (read from the image's layers)")
        found = want if want is not None else self.expectation(image)
        if isinstance(found, str):
            report.expected_from = "unknown"
            self.add(report, [{"name": "patch-landed", "status": "fail", "detail": found}], 0,
                     answered_by=integrity.FILESYSTEM)
        else:
            report.expected_from = found.source
            self.say(f"    expected hashes: {found.source}")

        pinset = None if isinstance(found, str) else self.pinset(report, found)
        pinned = [p.spelled for p in pinset.pins] if pinset is not None else []
        files = None
        if not isinstance(found, str):
            start_files = time.monotonic()
            files = integrity.check_image(self.engine, sources.cache_dir(self.root), image.id, found, pinned,
                                          self.say)
            took = time.monotonic() - start_files
            self.add(report, [c for c in files.checks if c["name"] != "integrity"], took)
            if found.site_dir:
                # Where the image's Python imports the package from: only it can say, and it can only add a failure.
                checks, _, took = self.probe(image, "landed.py", [found.package, found.site_dir],
                                             fallback_name="import-location")
                self.add(report, checks, took)

        self.say("==> smoke 2/5: environment report")
        checks, _, took = self.probe(image, "env_report.py", pinned, fallback_name="env-report")
        data = next((c.get("data") for c in checks if c.get("name") == "env-report"), None)
        report.environment = dict(data) if isinstance(data, dict) else {}
        self.add(report, checks, took)

        self.say("==> smoke 3/5: installed-package integrity (RECORD hashes from the layers, relative to the base)")
        if files is None:
            self.add(report, [{"name": "integrity", "status": "fail",
                               "detail": f"cannot tell which files the image must hold: {found}"}], 0,
                     answered_by=integrity.FILESYSTEM)
        else:
            self.add(report, [c for c in files.checks if c["name"] == "integrity"], 0)
        if pinset is not None:
            self.say(f"    and pinned distributions ({pinset.patch_set}/{pins.PINS_FILE})")
            self.pins(report, image, pinset)

        return files

    def pinset(self, report: Report, found: expected.Expected) -> pins.PinSet | None:
        """The pins of the image's definition, from its patch set on disk (never from labels)."""
        try:
            defn = definitions.load(self.root, found.definition)
            return pins.load(self.root, defn.patch_set, defn.package)
        except (DefinitionError, PinError) as exc:
            self.add(report, [{"name": "pins", "status": "fail", "detail": str(exc)}], 0)
            return None

    def pins(self, report: Report, image: ImageInfo, pinset: pins.PinSet) -> None:
        """Versions and files against pins.txt and its wheels, an import per module, the set's CPU checks."""
        cache = pins.cache(self.root)
        spec = []
        for pin in pinset.pins:
            record = None
            for path in sorted(cache.glob("*.whl")) if cache.is_dir() else []:
                if wheels.matches(path.name, pin.name, pin.version) and wheels.sha256_file(path) in pin.hashes:
                    record = wheels.record(path)
                    break
            spec.append({"name": pin.spelled, "version": pin.version, "record": record})
        extra = {"vllm-hotfix-probes/pins.json": json.dumps({"pins": spec}).encode()}
        checks, _, took = self.probe(image, "pins_check.py", [f"{PROBE_DIR}/pins.json"], extra=extra,
                                     fallback_name="pins")
        self.add(report, checks, took)
        folder = pinset.path.parent / "checks" / "cpu"
        for script in sorted(folder.glob("*.py")):
            extra = {f"vllm-hotfix-probes/checks/{script.name}": script.read_bytes()}
            checks, _, took = self.probe(image, script.name, [], extra=extra, fallback_name=f"check:{script.stem}",
                                         run=f"{PROBE_DIR}/checks/{script.name}")
            self.add(report, checks, took)

    def compiled_stop(self, report: Report, judged: integrity.Judged) -> None:
        """Compiled files RECORD lists but the image lacks: never GPU-verified, and a failure under require.

        The base's missing files are named as the base's and stop it all the
        same: a GPU check that passed without vLLM's kernels checked a stub.
        Under ``--gpu require`` with no GPU reachable the run is already
        incomplete (the host's shortcoming); the files are named all the same.
        """
        names = [*judged.compiled_missing, *(f"{p} (the base's)" for p in judged.compiled_missing_base)]
        if not names:
            return
        why = (f"{len(names)} compiled file(s) the installed RECORD lists are absent from the image, e.g. "
               f"{', '.join(names[:integrity.EXAMPLES])}")
        report.gpu_verified = False
        report.gpu["verified"] = False
        report.gpu["compiled_missing"] = names[:50]
        earlier = report.gpu.get("why_unverified")
        report.gpu["why_unverified"] = f"{earlier}; {why}" if earlier else why
        reached = self.opt.gpu == "require" and bool(report.gpu.get("way"))
        status = "fail" if reached else "skip"
        detail = f"--gpu require, but {why}" if reached else f"{why}: image is GPU-unverified"
        self.add(report, [{"name": "compiled-files", "status": status, "detail": detail,
                           "data": {"missing": names[:50]}}], 0, answered_by=integrity.FILESYSTEM)

    def gpu(self, report: Report, image: ImageInfo, clock: Clock | None = None) -> None:
        """GPU checks through the way that was confirmed to give this image a GPU.

        ``auto``: a host where no way works leaves the image GPU-unverified,
        with each way's reason. ``require``: a host where none works makes the
        run fail with an incomplete verdict (the host's shortcoming, not the
        image's). Once a GPU is reachable, the checks are judged by
        :func:`~vllm_hotfix.verdicts.judge_gpu`: only a check that ran against
        the image's own code counts, every module the patch set touches must
        import (tried in the base too, to name the base's failures as the
        base's), and under ``require`` whatever keeps the image from being
        GPU-verified fails it, except a check that is not applicable on this
        GPU family, which leaves the run incomplete.
        """
        clock = clock or Clock({})
        mode = self.opt.gpu
        report.gpu = {"mode": mode, "verified": False}
        if mode == "off":
            report.gpu["why_unverified"] = "--gpu off"
            self.add(report, [{"name": "gpu", "status": "skip", "detail": "--gpu off"}], 0)
            return
        if image.architecture and self.engine.arch and image.architecture != self.engine.arch:
            # An emulated CPU runs no GPU code: only a host of the image's own architecture can verify it.
            why = (f"the image is {image.os}/{image.architecture}, the Docker host {self.engine.arch}: "
                   "GPU checks need a host of the image's architecture")
            report.gpu["why_unverified"] = why
            status = "incomplete" if mode == "require" else "skip"
            self.add(report, [{"name": "gpu", "status": status, "detail": why}], 0)
            return
        access = self.access(image)
        clock.mark("gpu_access")
        report.gpu.update(access.to_dict())
        if access.chosen is None:
            why = f"no GPU request gave a container of this image a GPU ({access.why_none()})"
            report.gpu["why_unverified"] = why
            if mode == "require":
                # The host's shortcoming, not the image's: the run fails, the verdict is incomplete.
                check = {"name": "gpu", "status": "incomplete", "detail": f"--gpu require: {why}"}
            else:
                check = {"name": "gpu", "status": "skip", "detail": f"{why}: image is GPU-unverified"}
            self.add(report, [check], 0)
            return
        extra = self.patch_checks(image)
        modules = self.patch_modules(image)
        args = ["--extra", *[f"/tmp/{name}" for name in sorted(extra)]] if extra else []
        if modules:
            args += ["--modules", *modules]
        raw, info, took = self.probe(image, "gpu_check.py", args, gpu=access.chosen, extra=extra,
                                     fallback_name="gpu", cache=True)
        checks = [as_check(c, round(took / max(len(raw), 1), 3), "gpu") for c in raw]
        if info:
            report.environment["gpu"] = info
        unimportable = sorted({m for c in checks for m in c.import_errors})
        base_errors = self.base_import_errors(image, unimportable, access.chosen) if unimportable else None
        judged = judge_gpu(checks, require=mode == "require", base_import_errors=base_errors)
        clock.mark("gpu_checks")
        self.record(report, judged.checks)
        report.gpu_verified = judged.verified
        report.gpu["verified"] = judged.verified
        if judged.not_real:
            report.gpu["not_real"] = list(judged.not_real)
        if judged.not_applicable:
            report.gpu["not_applicable"] = list(judged.not_applicable)
        if not judged.verified:
            report.gpu["why_unverified"] = f"GPU checks through {access.chosen}: {judged.why_unverified}"

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

    def serve(self, report: Report, image: ImageInfo, clock: Clock | None = None) -> None:
        """One server start: wait for its health, record reference answers if asked, sweep."""
        clock = clock or Clock({})
        model = self.opt.serve_model
        assert model is not None
        if not model.exists():
            raise SmokeError(f"--serve-model {model}: no such file or folder")
        port = _free_port()
        url = f"http://127.0.0.1:{port}"
        command = ["/model", "--port", str(port), *self.opt.serve_args]
        start = time.monotonic()
        # The same way the GPU checks used; a host without one serves without a GPU
        # (and vLLM then fails the sweep, which is the truthful outcome).
        gpu = None if self.opt.gpu == "off" else self.access(image).chosen
        cache = self.compile_cache(image)
        if cache is not None:
            report.environment["compile_cache"] = cache.to_dict()
            self.say(f"    compile cache {cache.host} (base {cache.base_id[:12]}, {cache.gpu}) at {cache.mount[1]}")
        clock.restart()
        try:
            with self.engine.service(image.id, command, mounts=[(str(model.resolve()), "/model")],
                                     gpu=gpu, **self._cache_args(image)) as watch:
                sweep.wait_healthy(url, self.opt.serve_timeout, watch, self.say)
                self.say(f"    server healthy after {clock.mark('server_start'):.1f} s")
                ref = self.opt.reference
                if self.opt.record_reference is not None:
                    ref = answers.write(sweep.record(url, recorded_from=f"{report.image} ({image.id})",
                                                     progress=self.say), self.opt.record_reference)
                    clock.mark("reference_record")
                    self.say(f"    wrote {self.opt.record_reference} (sha256 {ref.sha256})")
                result = sweep.sweep(url, None, self.opt.levels, self.opt.requests, watch=watch,
                                     min_tokens=self.opt.min_tokens, reference=ref,
                                     tolerance=self.opt.logprob_tolerance, progress=self.say,
                                     keep_going=self.opt.keep_going)
                clock.mark("sweep")
        except (SmokeError, EngineError) as exc:
            # Charged to the phase it ended (a server that never got healthy: its start).
            clock.mark("sweep" if "server_start" in report.phases else "server_start")
            lines = str(exc).splitlines()
            self.add(report, [{"name": "serve-sweep", "status": "fail", "detail": lines[0],
                               "data": {"server_log": lines[1:]}}], time.monotonic() - start)
            return
        report.sweep = result.to_dict()
        check = sweep.as_check(result, self.opt.levels, self.opt.min_tokens, self.opt.logprob_tolerance)
        self.add(report, [check], time.monotonic() - start)
        for line in (check.get("data") or {}).get("server_log") or []:
            self.say(f"    | {line}")


@dataclass(frozen=True, slots=True)
class FileFacts:
    """The file checks of a run whose other checks a runner makes elsewhere, and what they found."""

    checks: tuple[dict[str, Any], ...]
    expected_from: str
    compiled_missing: tuple[str, ...] = ()  # compiled files RECORD lists but the image lacks (the base's named so)


FILE_CHECKS = ("patch-landed", "package-version", "integrity")


def unread_file_checks(why: str) -> list[dict[str, Any]]:
    """The file checks as incomplete, saying ``why``: a run cannot pass without them."""
    return [{"name": name, "status": "incomplete", "detail": why, "data": {"answered_by": integrity.FILESYSTEM}}
            for name in FILE_CHECKS]


def file_facts(root: Path, image: ImageInfo, files_from: integrity.FileSource, expect_from: Engine | None,
               say: Callable[[str], None] = lambda _l: None) -> FileFacts:
    """The file checks alone, read from ``files_from`` (the store the launcher starts the image from).

    For ``--launcher podman|kubernetes``: the same expectation and judgement
    as a Docker run (:func:`~vllm_hotfix.integrity.check_image`), only the
    files come from wherever the image is started. ``expect_from``: the Docker
    engine that may hold the base to recompute the expectation from (None:
    none; the build record alone then). Files that cannot be read make the
    checks incomplete: the run cannot pass without them.
    """
    fs = {"answered_by": integrity.FILESYSTEM}
    try:
        try:
            found: expected.Expected | str = expected.for_image(expect_from, root, image)
        except EngineError as exc:
            say(f"    no Docker engine to read the base from ({str(exc).splitlines()[0]}): the build record alone")
            found = expected.for_image(None, root, image)
    except UnknownExpectation as exc:
        found = str(exc)
    if isinstance(found, str):
        return FileFacts(({"name": "patch-landed", "status": "fail", "detail": found, "data": fs},), "unknown")
    extra: list[dict[str, Any]] = []
    pinned: list[str] = []
    try:
        defn = definitions.load(root, found.definition)
        pinset = pins.load(root, defn.patch_set, defn.package)
        pinned = [p.spelled for p in pinset.pins] if pinset is not None else []
    except (DefinitionError, PinError) as exc:
        extra.append({"name": "pins", "status": "fail", "detail": str(exc)})
    try:
        files = integrity.check_image(files_from, sources.cache_dir(root), image.id, found, pinned, say)
    except EngineError as exc:
        why = f"the image's files could not be read: {str(exc).splitlines()[0]}"
        return FileFacts(tuple(unread_file_checks(why) + extra), found.source)
    judged = files.judged
    return FileFacts(tuple([{**c, "data": {**(c.get("data") or {}), **fs}} for c in files.checks] + extra),
                     found.source, (*judged.compiled_missing, *(f"{p} (the base's)" for p in
                                                                  judged.compiled_missing_base)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
    pinned: list[str] = []
    try:
        defn = definitions.load(root, found.definition)
        pinset = pins.load(root, defn.patch_set, defn.package)
        pinned = [p.spelled for p in pinset.pins] if pinset is not None else []
    except (DefinitionError, PinError) as exc:
        return f"pins: {exc}"
    checked = integrity.check_image(engine, sources.cache_dir(root), image.id, found, pinned, say)
    problems = checked.problems()
    if problems:
        return problems[0]
    judged = checked.judged
    missing = [*judged.compiled_missing, *(f"{p} (the base's)" for p in judged.compiled_missing_base)]
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

