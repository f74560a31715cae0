"""The host's verdict on a run: its own facts, and the runner's report judged, never taken on its word.

The runner is the image's own Python, and so is whatever answers in its
place: a report it prints may say anything. The host that launched it
decides what it can know itself and judges the rest (:func:`host_verdict`):

- the file facts (patch-landed, package-version, integrity, the pins the
  host could not read) are the host's, read from the image's layers and
  carried in the job; the report's checks of those names are dropped, and
  so are its claims to be the filesystem;
- compiled files the installed RECORD lists but the image lacks are the
  host's too (``compiled-files``): they keep the image from GPU-verified;
- GPU presence is the request the host made: GPU checks, devices or a
  GPU-verified claim reported from a container that was given no GPU are
  refused (a failing ``gpu-claim`` check); where a GPU was given, the GPU
  checks are judged here again from what they said
  (:func:`~vllm_hotfix.verdicts.rejudge_gpu`), with the imports the base
  cannot do either where the host could ask it;
- every check the job asks of the runner must be in its report, or it is a
  failing check of that name;
- the outcome is judged here from the checks (:func:`~vllm_hotfix.verdicts.judge`),
  never read from the report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ..inimage.runner.probe_output import IMAGE_PYTHON
from ..verdicts import Check, Status, Verdict, judge, rejudge_gpu

FILESYSTEM = "filesystem"  # as vllm_hotfix.judges.integrity names the host's file facts
# Checks only the host makes: a runner's report of these names is never taken.
HOST_CHECKS = ("layer-identity", "patch-landed", "package-version", "integrity", "compiled-files", "runner",
               "gpu-claim", "exact-levels", "golden", "reference")


def required(job: Mapping[str, Any]) -> list[str]:
    """The checks a runner must report for ``job`` (beside its GPU checks, judged on their own)."""
    names = ["import-location"] if job.get("landed") else []
    return [*names, "env-report", "serve-sweep"]


def gpu_given(job: Mapping[str, Any]) -> bool:
    """Whether the host gave the runner's container a GPU request for GPU checks (its own record: the job it
    wrote). Under ``--gpu off`` none counts, whatever the container was given."""
    spec = job.get("gpu") or {}
    request = spec.get("request")
    return spec.get("mode") != "off" and bool(request) and request != "none"


def _mine(check: Check) -> Check:
    data = check.data if isinstance(check.data, Mapping) else {}
    return replace(check, data={**data, "answered_by": IMAGE_PYTHON})


def _claims(report: Verdict, gpu_check: Check | None) -> list[str]:
    """What a report says of GPUs that a container given none cannot have seen."""
    found = []
    if report.gpu_verified:
        found.append("GPU-verified")
    devices = report.gpu.get("devices")
    if isinstance(devices, list) and devices:
        found.append(f"device(s) {', '.join(map(str, devices))[:200]}")
    raw = report.gpu.get("raw_checks")
    if isinstance(raw, list) and raw:
        found.append(f"{len(raw)} GPU check(s) run")
    if gpu_check is not None and gpu_check.status in (Status.PASS, Status.FAIL):
        found.append(f"a gpu check that {gpu_check.status.value}ed")
    return found


def _no_gpu(job: Mapping[str, Any], report: Verdict, checks: list[Check]) -> tuple[list[Check], dict[str, Any]]:
    """The ``gpu`` check and facts of a run the host gave no GPU: its own, and any claim otherwise refused."""
    spec = job.get("gpu") or {}
    mode = str(spec.get("mode", "auto"))
    said = next((c for c in checks if c.name == "gpu"), None)
    settled = spec.get("unavailable")
    if mode == "off":
        mine, why = Check("gpu", Status.SKIP, "--gpu off"), "--gpu off"
    elif isinstance(settled, Mapping):
        why = str(settled.get("why", ""))
        mine = Check("gpu", Status(str(settled.get("status", "incomplete"))), str(settled.get("detail", "")))
    elif said is not None and said.status in (Status.SKIP, Status.INCOMPLETE):
        mine, why = said, "no GPU request was made"
    else:
        mine, why = Check("gpu", Status.SKIP, "not run: no GPU request was made"), "no GPU request was made"
    mine = _mine(replace(mine, data=None)) if mine is not said else mine
    out = [mine if c.name == "gpu" else c for c in checks] if said is not None else [*checks, mine]
    claims = _claims(report, said)
    if claims:
        out.append(Check("gpu-claim", Status.FAIL, f"the runner reported {'; '.join(claims)} from a container the "
                                                   "host gave no GPU: refused", data={"answered_by": FILESYSTEM}))
    facts: dict[str, Any] = {"mode": mode, "verified": False, "way": "none", "devices": [],
                             "launcher": job.get("launcher"), "why_unverified": why}
    return out, facts


def _compiled(gpu: dict[str, Any], missing: Sequence[str]) -> Check:
    """The host's ``compiled-files`` check: compiled files RECORD lists but the image lacks (never GPU-verified).

    Under ``--gpu require`` with a GPU reached it fails (a GPU check that
    passed without vLLM's kernels checked a stub); otherwise it is a skip
    that leaves the image GPU-unverified.
    """
    names = [str(n) for n in missing]
    why = (f"{len(names)} compiled file(s) the installed RECORD lists are absent from the image, e.g. "
           f"{', '.join(names[:5])}")
    gpu["verified"] = False
    gpu["compiled_missing"] = names[:50]
    earlier = gpu.get("why_unverified")
    gpu["why_unverified"] = f"{earlier}; {why}" if earlier else why
    reached = gpu.get("mode") == "require" and bool(gpu.get("devices")) and gpu.get("way") != "none"
    status = Status.FAIL if reached else Status.SKIP
    return Check("compiled-files", status, f"--gpu require, but {why}" if status is Status.FAIL else
                 f"{why}: image is GPU-unverified", data={"missing": names[:50], "answered_by": FILESYSTEM})


def _other_run(job: Mapping[str, Any], report: Verdict) -> list[Check]:
    """A report of another image or of another job (a log of another Job, or collected with other options)."""
    why = []
    if report.image_id != job.get("image_id"):
        why.append(f"the report is about {report.image_id[:19] or 'no image'}, not {str(job.get('image_id'))[:19]}")
    mode, said = (job.get("gpu") or {}).get("mode", "auto"), report.gpu.get("mode")
    if said is not None and said != mode:
        why.append(f"the runner ran with --gpu {said}, the host judges --gpu {mode}")
    if not why:
        return []
    return [Check("runner", Status.FAIL, f"{'; '.join(why)}: not this run's report (collect a Job with the options "
                                         "it was emitted with)", data={"answered_by": FILESYSTEM})]


def host_verdict(job: Mapping[str, Any], report: Verdict, *, compiled_missing: Sequence[str] = (),
                 base_imports: Callable[[list[str]], Mapping[str, str] | None] | None = None,
                 started: str = "", seconds: float = 0.0, phases: Mapping[str, float] | None = None,
                 gpu_facts: Mapping[str, Any] | None = None,
                 environment: Mapping[str, Any] | None = None, host_checks: Sequence[Check] = (),
                 exact: Mapping[str, Any] | None = None, judged_here: Sequence[str] = ()) -> Verdict:
    """The verdict on the image of ``job`` (the host's own job): its checks with the runner's ``report`` judged.

    ``compiled_missing``: what the host's file facts found RECORD lists but
    the image lacks. ``base_imports``: asks the image's base which of some
    modules it cannot import either (None: the base cannot be asked here).
    ``gpu_facts``: the host's own facts on how it found the GPU request.
    ``host_checks``: checks the host made of what the runner sent back (the
    ``exact-levels`` judgement of the fixed-batch replies), after the sweep;
    ``exact`` their evidence, kept in the report's sweep under ``exact``;
    ``judged_here`` the report's checks the host already made again from what
    the runner sent back (the serve-sweep judged from its replies).
    """
    spec = job.get("gpu") or {}
    host = [Check.reported(c, float(c.get("seconds", 0)) if isinstance(c, dict) else 0.0, "check")
            for c in job.get("checks") or []]
    owned = {*HOST_CHECKS, *(c.name for c in host)}
    checks = [c if c.name in judged_here else _mine(c) for c in report.checks if c.name not in owned]
    given = gpu_given(job)
    if not given:
        checks, gpu = _no_gpu(job, report, checks)
        verified = False
    else:
        gpu = {k: v for k, v in report.gpu.items() if k not in ("raw_checks", "compiled_missing")}
        gpu.update({"mode": str(spec.get("mode", "auto")), "way": str(spec.get("request")),
                    "launcher": job.get("launcher")})
        raw = [Check.reported(c, float(c.get("seconds", 0) or 0) if isinstance(c, dict) else 0.0, "gpu")
               for c in report.gpu.get("raw_checks") or []] if isinstance(report.gpu.get("raw_checks"), list) else []
        verified = False
        if raw:
            modules = sorted({m for c in raw for m in c.import_errors})
            base = spec.get("base_import_errors")
            if modules and base_imports is not None:
                base = base_imports(modules)
            partial = judge("", "", checks, gpu_verified=False, gpu=gpu)
            judged = rejudge_gpu(partial, raw, require=spec.get("mode") == "require",
                                 base_import_errors=base if isinstance(base, Mapping) else None)
            checks, gpu, verified = [_mine(c) for c in judged.checks], dict(judged.gpu), judged.gpu_verified
        else:
            said = next((c for c in checks if c.name == "gpu"), None)
            if said is None:
                checks.append(Check("gpu", Status.FAIL, "the runner reported neither its GPU checks nor why none ran",
                                    data={"answered_by": FILESYSTEM}))
            elif said.status is Status.PASS:
                checks = [replace(c, status=Status.FAIL, detail=f"a pass with no GPU check behind it ({c.detail})")
                          if c is said else c for c in checks]
            elif said.status is Status.SKIP and spec.get("mode") == "require":
                checks = [replace(c, status=Status.INCOMPLETE, detail=f"--gpu require, but {c.detail}")
                          if c is said else c for c in checks]
            gpu["verified"] = False
            gpu.setdefault("why_unverified", "no GPU check ran")
    theirs = ("mode", "verified", "why_unverified") + (() if given else ("devices",))
    gpu.update({k: v for k, v in (gpu_facts or {}).items() if k not in theirs})
    if compiled_missing:
        compiled = _compiled(gpu, compiled_missing)
        at = next((i for i, c in enumerate(checks) if c.name == "serve-sweep"), len(checks))
        checks.insert(at, compiled)
        verified = False
    present = {c.name for c in checks}
    checks += [Check(name, Status.FAIL, "the runner did not report this check", data={"answered_by": FILESYSTEM})
               for name in required(job) if name not in present]
    at = next((i + 1 for i, c in enumerate(checks) if c.name == "serve-sweep"), len(checks))
    checks[at:at] = [replace(c, data={**(c.data if isinstance(c.data, Mapping) else {}), "answered_by": FILESYSTEM})
                     for c in host_checks]
    checks += _other_run(job, report)
    if verified:
        gpu.pop("why_unverified", None)
    return judge(str(job.get("image", "")), str(job.get("image_id", "")), [*host, *checks], gpu_verified=verified,
                 platform=str(job.get("platform", "")), started=started or report.started, seconds=seconds,
                 expected_from=str(job.get("expected_from", "")), gpu=gpu, host=dict(job.get("host") or {}),
                 environment={**dict(report.environment), **dict(environment or {})},
                 sweep={**dict(report.sweep or {}), "exact": dict(exact)} if exact is not None else report.sweep,
                 phases={**{k: float(v) for k, v in report.phases.items()}, **dict(phases or {})})


def unanswered(job: Mapping[str, Any], status: str, why: str, *, started: str = "", seconds: float = 0.0,
               phases: Mapping[str, float] | None = None, gpu_facts: Mapping[str, Any] | None = None) -> Verdict:
    """The verdict when the runner gave no report: the host's own checks and a ``runner`` check saying why."""
    host = [Check.reported(c, 0.0, "check") for c in job.get("checks") or []]
    spec = job.get("gpu") or {}
    gpu = {"mode": str(spec.get("mode", "auto")), "verified": False, **dict(gpu_facts or {})}
    return judge(str(job.get("image", "")), str(job.get("image_id", "")),
                 [*host, Check("runner", Status(status), why, data={"answered_by": FILESYSTEM})], gpu_verified=False,
                 platform=str(job.get("platform", "")), started=started, seconds=seconds,
                 expected_from=str(job.get("expected_from", "")), gpu=gpu, host=dict(job.get("host") or {}),
                 phases=dict(phases or {}))


def not_its_product(job: Mapping[str, Any], identity: Mapping[str, Any], *, started: str = "",
                    seconds: float = 0.0) -> Verdict:
    """The verdict on an image the host refused before any check ran: its failing ``layer-identity`` check alone
    (nothing of the image was run, so nothing else was judged); incomplete where that check could not be made."""
    spec = job.get("gpu") or {}
    why = ("its base could not be found here: nothing ran" if identity.get("status") == "incomplete"
           else "not its definition's product: nothing ran")
    return judge(str(job.get("image", "")), str(job.get("image_id", "")),
                 [Check.reported(dict(identity), 0.0, "check")], gpu_verified=False,
                 platform=str(job.get("platform", "")), started=started, seconds=seconds,
                 expected_from="", gpu={"mode": str(spec.get("mode", "auto")), "verified": False,
                                        "why_unverified": why},
                 host=dict(job.get("host") or {}))
