"""Smoke through the Docker engine: the default ``smoke``, and the one ``image`` runs after a build.

A run has three steps. The file facts are read from the image's layers and
judged here (:mod:`vllm_hotfix.judges.integrity`): nothing of the image runs for
them. The GPU request that reaches the image is tried on this host
(:mod:`vllm_hotfix.checking.gpu_access`). Then the runner (:mod:`vllm_hotfix.inimage.runner`)
runs in one container of the image (:class:`DockerLauncher`), its folder
mounted read-only, its progress followed live, and its report is judged
here (:mod:`vllm_hotfix.judges.judging`): the file facts stay the host's, GPU claims stand
only where a GPU was given, and its GPU checks are judged again with the
imports that fail in the image asked of its base too. The runner goes in
phases, cheapest first, so that a doomed image fails fast; a phase with a
failing check ends the run unless ``keep_going``. Each phase's wall time is
in the report (``phases``). The runner's container gets the compile cache of
the image's base on that GPU model (:mod:`vllm_hotfix.checking.compile_cache`), so a
second image of the same base starts warm.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from ...building import definitions, expected, sources
from ...engine import Engine, GpuRequest, ImageInfo
from ...errors import DefinitionError, EngineError, EngineLost, PinError, RunnerFailed, SmokeError, UnknownExpectation
from ...golden import warm as golden_warm
from ...inimage.runner import MOUNT
from ...inimage.runner.probe_output import parse
from ...journal import records
from ...judges import identity, integrity, judging
from ...trust.reference_fit import refuse_other_settings
from ...verdicts import Check, Status, Verdict
from .. import compile_cache, gpu_access
from . import facts, judge_run, plan, recorded, smoke_run
from .base import Launched, argv, results
from .options import SmokeOptions

log = logging.getLogger(__name__)

PROBE_DIR = "/tmp/vllm-hotfix-probes"


def gpu_request(text: str | None) -> GpuRequest | None:
    """``cdi[:DEVICE]``, ``gpus`` or ``runtime[:NAME]`` as the engine's request; None for none."""
    if not text or text == "none":
        return None
    from ..gpu_access import _explicit, parse_request

    return _explicit(parse_request(text))


class DockerLauncher:
    """The runner in a container of ``engine``.

    ``env`` and ``writable`` (host folder, container path) give the container
    a compile cache; ``follow`` gets the runner's progress lines as they come.
    """

    name = "docker"

    def __init__(self, engine: Engine, python: str = "python3", timeout: float = 3600, *,
                 env: Mapping[str, str] | None = None, writable: Sequence[tuple[str, str]] = (),
                 follow: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.python = python
        self.timeout = timeout
        self.env = dict(env or {})
        self.writable = list(writable)
        self.follow = follow

    def launch(self, image: str, runner_dir: Path, job: Mapping[str, Any], gpu: str | None,
               model: Path | None = None) -> Launched:
        mounts: list[tuple[str, str]] = []
        files: dict[str, bytes] | None = None
        if self.engine.local:
            mounts.append((str(runner_dir), MOUNT))
        else:
            # An engine on another host cannot mount this host's folder: the same files are copied into the
            # container before it starts (never into an image).
            files = {f"{MOUNT.lstrip('/')}/{p.relative_to(runner_dir)}": p.read_bytes()
                     for p in sorted(runner_dir.rglob("*")) if p.is_file()}
        if model is not None:
            if not self.engine.local:
                raise SmokeError(f"--serve-model: the Docker engine at {self.engine.address} is not on this host, "
                                 "so the model folder cannot be mounted", hint="run smoke on the engine's host")
            mounts.append((str(model), "/model"))
        res = self.engine.run(image, argv(self.python), files=files, files_at="/", gpu=gpu_request(gpu),
                              mounts=mounts, timeout=self.timeout, env=self.env or None, writable=self.writable,
                              follow=self.follow, shm_size=plan.shm_size(job))
        if res.exit_code == 124:
            raise RunnerFailed(f"the runner in {image} did not finish within {self.timeout:.0f} s", incomplete=True,
                               hint="its Python may hang; give it longer with --deadline S if it is only slow")
        return results(res.stdout, res.stderr, f"runner in {image} (docker)")


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


def format_phases(phases: Mapping[str, float], total: float | None = None) -> str:
    """``name 1.2 s, ...``; given the run's ``total``, the time no phase accounts for too, so the line adds up
    (phases that ran side by side can add up to more, and then nothing is added)."""
    rest = total - sum(phases.values()) if total is not None else 0.0
    shown = {**phases, **({"outside the phases": rest} if rest >= 0.05 else {})}
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in shown.items()) or "none"


def _probe(name: str) -> bytes:
    return resources.files("vllm_hotfix.inimage.probes").joinpath(name).read_bytes()


class DockerRun:
    """One Docker engine's smoke runs, each judged here; the GPU way and compile cache kept per image."""

    def __init__(self, engine: Engine, root: Path, options: SmokeOptions, progress: Callable[[str], None]) -> None:
        self.engine = engine
        self.root = root
        self.opt = options
        self.say = progress
        self._access: dict[str, gpu_access.GpuAccess] = {}
        self._caches: dict[str, compile_cache.CompileCache | None] = {}
        self._bases: dict[str, str] = {}  # image ID -> the base this host found for it (never a label)

    def access(self, image: ImageInfo) -> gpu_access.GpuAccess:
        """The way this image's containers get the GPUs; chosen once per image, then reused."""
        if image.id not in self._access:
            # Tried in the base the host found (the image itself only where it is that base): the GPU model a verdict
            # names is what a container of the trusted base saw, never what the image under test says it saw.
            self._access[image.id] = gpu_access.choose(self.engine, self._bases.get(image.id, image.id),
                                                       self.opt.gpu_request, self.opt.python, self.say)
        return self._access[image.id]

    def compile_cache(self, image: ImageInfo, *, is_base: bool = False,
                      proven: bool = False) -> compile_cache.CompileCache | None:
        """The compile cache folder of the image's base on the GPU model in use (None: not kept), and how this
        run gets it: written in place only by the base itself (``is_base``), an image whose layers this run proved
        (``proven``: its code is the base's and a patch set's of this checkout) or an image whose newest verdict
        here meets the default policy (:func:`compile_cache.trusted_by`); read-only under a private layer for any
        other; a folder of its own for a recording."""
        if not self.opt.compile_cache:
            return None
        if image.id not in self._caches:
            access = self._access.get(image.id)
            devices = access.devices if access is not None and access.chosen is not None else []
            found = compile_cache.folder(sources.cache_dir(self.root), image.id, self._bases.get(image.id), devices)
            judged = records.judgement(self.root, image.id)
            trusted = is_base or proven or (judged is not None and compile_cache.trusted_by(judged.verdict))
            how = compile_cache.access(trusted=trusted, recording=self.opt.record_reference is not None)
            self._caches[image.id] = replace(found, access=how)
        return self._caches[image.id]

    def probe(self, image: ImageInfo, script: str, args: Sequence[str], *, gpu: GpuRequest | None = None,
              fallback_name: str | None = None) -> list[dict[str, Any]]:
        """Run probe ``script`` alone in a container of ``image`` (the base's imports: another image than the
        runner's); its checks as it reported them."""
        try:
            res = self.engine.run(image.id, [self.opt.python, f"{PROBE_DIR}/{script}", *args],
                                  files={f"vllm-hotfix-probes/{script}": _probe(script)}, gpu=gpu,
                                  timeout=self.opt.probe_timeout)
        except EngineLost as exc:
            return [{"name": fallback_name or script, "status": "incomplete", "detail": str(exc)}]
        except EngineError as exc:
            return [{"name": fallback_name or script, "status": "fail", "detail": str(exc)}]
        return parse(fallback_name or script, res.stdout, res.stderr, res.exit_code)[0]

    def definition_check(self, image: ImageInfo) -> None:
        """A ``--definition`` that cannot be loaded is an error before anything runs."""
        tag = self.opt.definition
        if tag:
            try:
                definitions.load(self.root, tag)
            except DefinitionError as exc:
                raise SmokeError(f"--definition {tag}: {exc}") from exc

    def run(self, ref: str, want: expected.Expected | None = None) -> Verdict:
        """Smoke-test ``ref`` and return the host's verdict (``want``: the build's own expectation)."""
        return self.smoke(ref, want)[0].verdict

    def smoke(self, ref: str, want: expected.Expected | None = None) -> tuple[judge_run.Ran, plan.Target]:
        """Smoke-test ``ref``: (the host's run, the image as the host knows it)."""
        image = self.engine.image(ref)
        if image is None:
            raise SmokeError(f"image {ref} is not in the engine")
        self.definition_check(image)
        platform = f"{image.os}/{image.architecture}"
        target = plan.Target(ref, image.id, image.id, dict(image.labels), platform,
                             entrypoint=tuple(image.entrypoint or plan.DEFAULT_ENTRYPOINT),
                             repo_digests=tuple(image.repo_digests))
        started, start = records.now_iso(), time.monotonic()
        phases: dict[str, float] = {}
        clock = Clock(phases)
        proven = self.prove_identity(image, ref, want)
        clock.mark("identity")
        if proven.status in ("fail", "incomplete"):
            ran = judge_run.refused(target, proven.check(), self.engine.host_facts(), self.opt.gpu, started=started,
                               seconds=time.monotonic() - start)
            return replace(ran, verdict=replace(ran.verdict, phases=phases)), target
        target = replace(target, base_id=proven.base_id)
        found = self.file_facts(image, ref, want, proven)
        # The identity check leads the host's checks of every verdict of this run (passed, or skipped for a base).
        found = replace(found, checks=(proven.check(), *found.checks))
        clock.mark("files")
        early_stop = any(c.get("status") == "fail" for c in found.checks) and not self.opt.keep_going
        gpu_facts: dict[str, Any] = {"mode": self.opt.gpu, "verified": False}
        request, unavailable = (None, None) if early_stop else self.gpu_plan(image, gpu_facts)
        if not early_stop and self.opt.gpu != "off":
            clock.mark("gpu_access")
        seen = self._access[image.id].devices if image.id in self._access else []
        if self.opt.reference is not None and seen:  # a reference recorded on another GPU model: refused now
            refuse_other_settings(self.opt.reference, {"gpu": ", ".join(seen)})
        layers_proven = proven.status == "pass"
        cache = (self.compile_cache(image, is_base=proven.status == "skip", proven=layers_proven)
                 if request is not None or self.opt.serve_model is not None else None)
        environment = {"compile_cache": cache.to_dict()} if cache is not None else {}
        if cache is not None:
            self.say(f"    compile cache {cache.host} (base {cache.base_id[:12]}, {cache.gpu}) at {cache.mount[1]}, "
                     + {compile_cache.SHARED: "written in place" + (" (its layers proven)" if layers_proven else ""),
                        compile_cache.LAYERED: "read-only under a private layer (no verdict here meets the default "
                                               "policy yet)",
                        compile_cache.PRIVATE: "a folder of its own (a recording reads none)"
                                               + ("; what it compiles warms the base's folder after it (its layers "
                                                  "proven)" if layers_proven else "")}[cache.access])
        if self.opt.serve_model is not None and (self.opt.reference is not None
                                                 or self.opt.record_reference is not None):
            # The golden judges the replies on this host once they are back: meanwhile its libraries load and it
            # computes what needs nothing served (a recording's envelope, the reference's answers scored).
            golden_warm.start(*plan.golden_ahead(self.opt))
        self.say(f"==> smoke 3/3: the checks in the image, by the runner in one container "
                 f"(GPU request: {request or 'none'})")
        clock.restart()
        host = self.engine.host_facts()
        host_facts = judge_run.HostFacts(found.compiled_missing, gpu_facts, environment,
                                    lambda modules: self.base_import_errors(image, modules))
        mounted = None
        # The run, once judged: a layered cache's writes are kept only where it met the default policy.
        done: list[judge_run.Ran] = []
        try:
            with contextlib.ExitStack() as stack:
                # A recording's writes are kept where its image's layers were proven; a layered run's where its
                # verdict met the default policy.
                keep = (lambda: layers_proven) if cache is not None and cache.access == compile_cache.PRIVATE else \
                    (lambda: bool(done) and compile_cache.trusted_by(done[0].verdict))
                mounted = stack.enter_context(compile_cache.given(self.engine, cache, keep=keep)) \
                    if cache is not None else None
                launcher = DockerLauncher(self.engine, self.opt.python, plan.deadline(self.opt, request is not None),
                                          env=mounted.env if mounted is not None else None,
                                          writable=[mounted.mount] if mounted is not None else (),
                                          follow=lambda line: self.say(f"  {line}" if line.startswith("==>")
                                                                       else line))
                ran = smoke_run.smoke(launcher, self.root, target, self.opt, gpu_request=request, checks=found.checks,
                                 host=host, expected_from=found.expected_from, landed=found.landed,
                                 gpu_unavailable=unavailable, facts=host_facts, say=self.say, echo=False,
                                 python_path=proven.python_path)
                done.append(ran)
        except EngineLost as exc:
            ran = self._ended(target, found, host, "incomplete", str(exc))
        except EngineError as exc:
            # An engine that cannot mount the cache's overlay is the host's shortcoming, not the image's.
            own = mounted is not None and mounted.access == compile_cache.LAYERED and mounted.source in str(exc)
            ran = self._ended(target, found, host, "incomplete" if own else "fail", str(exc))
        finally:
            golden_warm.settle()  # what the golden computed ahead for a run that was not judged by it is called off
        ran = recorded.keep_recorded(ran, self.opt, target, self.say)
        verdict = ran.verdict
        seconds = time.monotonic() - start
        phases = {**phases, **dict(verdict.phases)}
        verdict = replace(verdict, started=started, seconds=round(seconds, 3), phases=phases)
        self.say(f"==> phases: {format_phases(phases, seconds)} (total {seconds:.1f} s)")
        return replace(ran, verdict=verdict), target

    def _ended(self, target: plan.Target, found: facts.FileFacts, host: Mapping[str, Any], status: str,
               why: str) -> judge_run.Ran:
        """The run when the runner's container could not give an answer (the engine failed or went away)."""
        job = {"image": target.ref, "image_id": target.image_id, "platform": target.platform, "host": dict(host),
               "checks": list(found.checks), "expected_from": found.expected_from, "gpu": {"mode": self.opt.gpu}}
        self.say(f"    {status:<4} runner: {why}")
        return judge_run.Ran(judging.unanswered(job, status, why), job)

    def prove_identity(self, image: ImageInfo, ref: str, want: expected.Expected | None) -> identity.Outcome:
        """Whether the image is its definition's product over the base this host finds
        (:mod:`vllm_hotfix.judges.identity`)."""
        self.say(f"==> smoke 1/3: {ref} against what its builder writes over its base (read from the layers)")
        proven = identity.prove(self.engine, self.root, image, definition=self.opt.definition,
                                base_repo=self.opt.base_repo, built_on=want.base_id if want is not None else None,
                                say=self.say)
        self.say(f"    {proven.status:<4} {identity.CHECK}: {proven.detail}")
        if proven.base is not None:
            self._bases[image.id] = proven.base.info.id
        return proven

    def file_facts(self, image: ImageInfo, ref: str, want: expected.Expected | None,
                   proven: identity.Outcome | None = None) -> facts.FileFacts:
        """The checks read from the image's layers (patched files, integrity), and where its package must import
        from (the runner asks the image's Python)."""
        self.say(f"    patched files in {ref}")
        try:
            found = want if want is not None else expected.for_image(
                self.engine, self.root, image, base_id=proven.base_id if proven is not None else None,
                definition=proven.base.definition.tag if proven is not None and proven.base is not None else None)
        except UnknownExpectation as exc:
            fs = {"answered_by": integrity.FILESYSTEM}
            checks: tuple[dict[str, Any], ...] = (
                {"name": "patch-landed", "status": "fail", "detail": str(exc), "data": fs},
                      {"name": "integrity", "status": "fail", "data": fs,
                       "detail": f"cannot tell which files the image must hold: {exc}"})
            for c in checks:
                self.say(f"    fail {c['name']}: {c['detail']}")
            return facts.FileFacts(checks, "unknown")
        self.say(f"    expected hashes: {found.source}")
        pinned: list[str] = []
        try:
            pinned = facts.pinned_names(self.root, found.definition)
        except (DefinitionError, PinError):
            pass  # the job carries the same error as a failing pins check
        start = time.monotonic()
        files = integrity.check_image(self.engine, sources.cache_dir(self.root), image.id, found, pinned, self.say)
        took = round((time.monotonic() - start) / max(len(files.checks), 1), 3)
        checks = tuple({**c, "seconds": took, "data": {**(c.get("data") or {}), "answered_by": integrity.FILESYSTEM}}
                       for c in files.checks)
        for c in checks:
            self.say(f"    {c['status']:<4} {c['name']}: {c['detail']}")
        return facts.FileFacts(checks, found.source, facts.missing_compiled(files.judged), facts.landed_of(found))

    def gpu_plan(self, image: ImageInfo, gpu: dict[str, Any]) -> tuple[str | None, dict[str, str] | None]:
        """The GPU request the runner's container gets, or the ``gpu`` check settled here when none can reach it.

        ``off``: none (the runner records the skip). An image of another
        architecture than the host: an emulated CPU runs no GPU code.
        Otherwise each way is tried (:func:`~vllm_hotfix.checking.gpu_access.choose`);
        under ``auto`` a host where none works leaves the image
        GPU-unverified, under ``require`` the run incomplete (the host's
        shortcoming, not the image's). ``gpu`` gets the host's facts.
        """
        mode = self.opt.gpu
        if mode == "off":
            return None, None
        self.say(f"==> smoke 2/3: a GPU request that reaches the image (--gpu {mode})")
        if image.architecture and self.engine.arch and image.architecture != self.engine.arch:
            why = (f"the image is {image.os}/{image.architecture}, the Docker host {self.engine.arch}: "
                   "GPU checks need a host of the image's architecture")
            return None, {"status": "incomplete" if mode == "require" else "skip", "detail": why, "why": why}
        access = self.access(image)
        gpu.update(access.to_dict())
        if access.chosen is None:
            why = f"no GPU request gave a container of this image a GPU ({access.why_none()})"
            if mode == "require":
                return None, {"status": "incomplete", "detail": f"--gpu require: {why}", "why": why}
            return None, {"status": "skip", "detail": f"{why}: image is GPU-unverified", "why": why}
        return str(access.chosen), None

    def base_import_errors(self, image: ImageInfo, modules: Sequence[str]) -> dict[str, str] | None:
        """Which of ``modules`` the image's base cannot import either (same GPU request); None: base unknown."""
        access = self._access.get(image.id)
        base_id = self._bases.get(image.id)
        base = self.engine.image(base_id) if base_id and base_id != image.id else None
        if base is None or access is None or access.chosen is None:
            self.say("    the image's base is not in the engine: every import failure counts as the image's")
            return None
        self.say(f"    importing {len(modules)} module(s) in the base {base_id[:19] if base_id else ''} too")
        raw = self.probe(base, "gpu_check.py", ["--imports-only", "--modules", *modules], gpu=access.chosen,
                         fallback_name="model-imports")
        found = [Check.reported(c, 0, "model-imports") for c in raw]
        if not any(c.name == "model-imports" and c.status in (Status.PASS, Status.FAIL) for c in found):
            self.say(f"    the base's imports gave no answer ({'; '.join(c.detail for c in found)[:200]})")
            return None
        return {m: e for c in found for m, e in c.import_errors.items()}
