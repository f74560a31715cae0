"""From an image and the smoke options to a runner job: what the runner is to do, settled by the host.

The job is data the runner reads; everything the host knows and the image
must not decide (which patch set, which pins, which modules must import,
where the package must import from, the schedule and the prompts of the
sweep) is settled here, from the project's files. Every launcher gets the
same job for the same image, so every one runs the same named checks. The
job holds no key: the runner signs nothing. A whole run through a launcher
is :mod:`.smoke_run`; what came back is judged by :mod:`.judge_run`, and a
recording kept by :mod:`.recorded`.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...building import definitions, patches, pins, wheels
from ...building.pinfile import Pin
from ...engine import labels as L
from ...errors import DefinitionError, PatchError, PinError, SmokeError, UsageError
from ...inimage import oracle
from ...inimage.reference import PROMPTS
from ...inimage.sweep import MAX_TOKENS
from ...judges import fixed_batches
from ...trust import reference_fit
from ...verdicts import Verdict
from .. import compile_cache
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
            reference_fit.refuse_judged_image(ref, target.image_id, target.base_id)
            reference_fit.refuse_other_settings(ref, settings)
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
            # Every level again under fixed batches: the probe's replies come back raw and are judged here.
            out["serve"]["batches"] = fixed_batches.job_part(
                settings, options.levels, options.requests, ref.prompts if ref is not None else PROMPTS,
                ref.max_tokens if ref is not None else MAX_TOKENS, recording=record is not None)
    return out, extra


def golden_ahead(options: SmokeOptions) -> tuple[Path, list[str], dict[int, list[list[int]]], int | None]:
    """What the golden can compute before the run's replies come back (:func:`vllm_hotfix.golden.warm.start`):
    the served model, the prompts the job asks (as :func:`job` gives them to the fixed batches), the reference's
    answers by prompt, and for a recording the envelope's length (the replies' length)."""
    from ...golden import warm

    assert options.serve_model is not None
    ref = options.reference
    if ref is not None:
        return Path(options.serve_model), list(ref.prompts), warm.expected_answers(ref, len(ref.prompts)), None
    return Path(options.serve_model), list(PROMPTS), {}, MAX_TOKENS


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
