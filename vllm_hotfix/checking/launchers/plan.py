"""From an image and the smoke options to a runner job, and a whole smoke run through a launcher.

The job is data the runner reads; everything the host knows and the image
must not decide (which patch set, which pins, which modules must import,
the signing subjects) is settled here, from the project's files.
"""

from __future__ import annotations

import json
import logging
import socket
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ... import __version__
from ...building import definitions, patches, pins, wheels
from ...engine import labels as L
from ...errors import DefinitionError, PatchError, PinError, SmokeError, UsageError
from ...journal import leftovers
from .. import compile_cache, oracle
from ..runner import MOUNT
from .base import KEY_FILE, Launched, Launcher, stage

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


def predicate_extra(labels: Mapping[str, str]) -> dict[str, Any]:
    """What the signed report says the image was made from (as :func:`vllm_hotfix.trust.attest.predicate`)."""
    try:
        made_of = json.loads(labels.get(L.PATCHES, "{}"))
    except ValueError:
        made_of = {}
    return {
        "tool_version": __version__,
        "definition": labels.get(L.DEFINITION, ""),
        "patches": made_of if isinstance(made_of, dict) else {},
        "base": {"id": labels.get(L.BASE_ID, ""), "name": labels.get(L.OCI_BASE_NAME, ""),
                 "digest": labels.get(L.OCI_BASE_DIGEST, "")},
    }


def subjects(target: Target) -> dict[str, str]:
    found = {target.ref: target.image_id}
    for repo_digest in target.repo_digests:
        name, _, digest = repo_digest.partition("@")
        if digest.startswith("sha256:"):
            found[name] = digest
    return found


def job(root: Path, target: Target, options: Any, *, launcher: str, gpu_request: str | None,
        checks: Sequence[Mapping[str, Any]] = (), host: Mapping[str, Any] | None = None,
        key_path: str | None = None, expected_from: str = "",
        compiled_missing: Sequence[str] = (), landed: Mapping[str, str] | None = None,
        gpu_unavailable: Mapping[str, str] | None = None) -> tuple[dict[str, Any], dict[str, bytes]]:
    """The runner job for ``target`` and the patch set's check files it names.

    ``options`` is a :class:`vllm_hotfix.checking.smoke.SmokeOptions`; ``checks`` are
    checks made outside the image (file facts), judged with the rest;
    ``key_path`` where the runner finds the signing key inside the container;
    ``compiled_missing`` the compiled files the file facts found RECORD lists
    but the image lacks (they keep it from being GPU-verified);
    ``landed`` the package and folder its Python must import it from;
    ``gpu_unavailable`` the ``gpu`` check (status, detail, why) a host that
    found no GPU request reaching the image settled before the launch.
    """
    if getattr(options, "record_reference", None) is not None and launcher != "docker":
        raise UsageError(f"--record-reference needs --launcher docker: record the answers once on a host with "
                         f"Docker, then give them to the {launcher} launcher with --reference")
    extra: dict[str, bytes] = {}
    out: dict[str, Any] = {
        "image": target.ref, "image_id": target.image_id, "platform": target.platform, "launcher": launcher,
        "host": dict(host or {}), "checks": [dict(c) for c in checks], "env_names": [], "pins": None,
        "cpu_checks": [], "probe_timeout": options.probe_timeout, "serve": None, "sign": None,
        "expected_from": expected_from, "keep_going": options.keep_going,
        "gpu": {"mode": options.gpu, "request": gpu_request, "extra": [], "modules": [], "base_import_errors": None,
                "compiled_missing": list(compiled_missing),
                "unavailable": dict(gpu_unavailable) if gpu_unavailable else None},
        "landed": dict(landed) if landed else None,
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
        out["serve"] = {"argv": [*target.entrypoint, "/model", "--port", str(SERVE_PORT), *settings["serve_args"]],
                        "env": settings["env"], "overlap": overlaps(settings["serve_args"]),
                        "port": SERVE_PORT, "levels": list(options.levels), "requests": options.requests,
                        "min_tokens": options.min_tokens, "timeout": options.serve_timeout,
                        "keep_going": options.keep_going, "noise_multiple": options.noise_multiple,
                        "reference": None}
        ref = options.reference
        if ref is not None:
            from ..reference import refuse_other_settings

            refuse_other_settings(ref, settings)
            # The file as it stands (its sha256 inside): the runner loads and checks it as the host does.
            try:
                out["serve"]["reference"] = json.loads(Path(ref.path).read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise UsageError(f"--reference {ref.path}: cannot read it again ({exc})") from None
            out["serve"]["reference_file"] = ref.path
        record = getattr(options, "record_reference", None)
        if record is not None:
            # The settings the host knows; the runner adds the GPU model and the versions the image reports.
            out["serve"]["record"] = {"file": str(record), "recorded_from": f"{target.ref} ({target.image_id})",
                                      "settings": settings}
    if key_path is not None:
        out["sign"] = {"key": key_path, "subjects": subjects(target), "predicate": predicate_extra(target.labels)}
    return out, extra


def serve_settings(options: Any, target: Target) -> dict[str, Any]:
    """What the host knows, before anything runs, of the settings a reference names (oracle.SETTING_KEYS): the
    server's arguments (the user's, then the oracle's), its environment, the base image, the model."""
    args = [str(a) for a in options.serve_args]
    try:
        oracle.check_serve_args(args)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    try:
        base = "sha256:" + compile_cache.base_key(target.image_id, target.labels.get(L.BASE_ID))
    except SmokeError:
        base = target.image_id  # not an image ID (a cluster's digest): the image stands for its base
    return {"serve_args": [*args, *oracle.SERVE_ARGS], "env": dict(oracle.SERVE_ENV), "base_image_id": base,
            "model": oracle.fingerprint(str(options.serve_model))}


def run_settings(verdict: Any) -> dict[str, Any]:
    """What a finished run reported of those settings: the GPU model its container saw, vLLM's and torch's
    versions (the image's env-report)."""
    packages = (verdict.environment or {}).get("packages") or {}
    devices = (verdict.gpu or {}).get("devices") or []
    found: dict[str, Any] = {"vllm": packages.get("vllm"), "torch": packages.get("torch")}
    if devices:
        found["gpu"] = ", ".join(str(d) for d in devices)
    return found


def overlaps(args: Sequence[str]) -> bool:
    """Whether the server may start while the GPU checks run: only with its KV cache size given, where vLLM
    does not measure the GPU's free memory (which the checks' processes change as they come and go)."""
    return any(str(a).split("=", 1)[0] == "--kv-cache-memory-bytes" for a in args)


def _record(root: Path, pin: Any) -> dict[str, str] | None:
    cache = pins.cache(root)
    for path in sorted(cache.glob("*.whl")) if cache.is_dir() else []:
        if wheels.matches(path.name, pin.name, pin.version) and wheels.sha256_file(path) in pin.hashes:
            return dict(wheels.record(path))
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# What the runner may take by default, by the checks asked for: the checks that need no GPU (the image's
# Python imports the package, reports its environment and pins), the GPU checks, the server and its sweep.
CPU_CHECKS_S, GPU_CHECKS_S, SWEEP_S = 600, 1800, 1800


def deadline(options: Any, gpu: bool) -> float:
    """``--deadline``, else what the checks asked for need, so an image whose Python hangs ends incomplete."""
    if options.deadline is not None:
        return float(options.deadline)
    serve = options.serve_timeout + SWEEP_S if options.serve_model is not None else 0
    return CPU_CHECKS_S + (GPU_CHECKS_S if gpu else 0) + serve


def smoke(launcher: Launcher, root: Path, target: Target, options: Any, *, gpu_request: str | None,
          checks: Sequence[Mapping[str, Any]] = (), host: Mapping[str, Any] | None = None,
          sign_key: Path | None = None, say: Callable[[str], None] = lambda _l: None,
          expected_from: str = "", compiled_missing: Sequence[str] = (), landed: Mapping[str, str] | None = None,
          gpu_unavailable: Mapping[str, str] | None = None, echo: bool = True) -> Launched:
    """Stage the runner for ``target``, start it through ``launcher``, return what it reported.

    The staged folder (with the key, when signing) lives in a temporary
    folder removed before this returns. ``echo``: print each check after the
    run (a launcher that followed the runner's progress has shown them).
    """
    key_path = f"{MOUNT}/{KEY_FILE}" if sign_key is not None else None
    spec, extra = job(root, target, options, launcher=launcher.name, gpu_request=gpu_request, checks=checks,
                      host=host, key_path=key_path, expected_from=expected_from,
                      compiled_missing=compiled_missing, landed=landed, gpu_unavailable=gpu_unavailable)
    # A killed run cannot remove its staging folder (which may hold a copy of the signing key): the next
    # run removes those of processes that are gone.
    leftovers.sweep_staging()
    with tempfile.TemporaryDirectory(prefix=leftovers.staging_prefix()) as tmp:
        folder = stage(Path(tmp) / "runner", spec, extra, key=sign_key)
        say(f"==> smoke through {launcher.name}: the runner in {target.start} (GPU request: {gpu_request or 'none'})")
        model = Path(options.serve_model).resolve() if options.serve_model is not None else None
        launched = launcher.launch(target.start, folder, spec, gpu_request, model)
    if options.reference is not None:
        from ..reference import refuse_other_settings

        refuse_other_settings(options.reference, run_settings(launched.verdict))
    if echo:
        for c in launched.verdict.checks:
            say(f"    {c.status.value:<4} {c.name}: {c.detail}")
    return launched


def keep_envelope(root: Path, image_id: str, envelope: bytes, copy_to: Path | None = None) -> Path:
    """Keep a runner's signed envelope where ``smoke --sign-key`` keeps the host's (push attaches them)."""
    import hashlib

    from ...errors import AttestationError
    from ...journal.atomic import write_atomic
    from ...trust.attest import folder

    path = folder(root, image_id) / f"{hashlib.sha256(envelope).hexdigest()}.dsse.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, envelope, error=AttestationError)
    if copy_to is not None:
        write_atomic(copy_to, envelope, error=AttestationError)
    return path


def attach_and_read_back(engine: Any, image: str, envelope: bytes) -> bytes:
    """Attach ``envelope`` to ``image`` (NAME@sha256:...) in its registry, and return it as read back from there.

    The verdict a cluster run ends with is the one the registry holds, not the
    one the pod printed: whoever pulls the image later reads the same bytes.
    """
    from ...errors import AttestationMissing
    from ...registry import client as registry
    from ...trust import referrers

    name, _, digest = image.partition("@")
    host, path = registry.split_repo(name)
    client = registry.client_for(engine, host)
    manifest = client.manifest(path, digest)
    if manifest is None:
        raise AttestationMissing(f"registry {host} has no {path}@{digest} to attach the signed verdict to")
    subject = referrers.Subject(manifest.digest, manifest.media_type, manifest.size)
    artifact = referrers.attach(client, path, subject, envelope)
    for found, data in referrers.envelopes(client, path, manifest.digest):
        if found == artifact:
            return data
    raise AttestationMissing(f"registry {host}: the signed verdict {artifact[:19]} attached to {path}@{digest} "
                             "is not listed among its referrers")
