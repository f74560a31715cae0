"""Smoke through the runner where no Docker engine starts it: podman on the host, or a Kubernetes Job.

From an image reference to a verdict: where the launcher's copy of the
image is (podman's store, the registry a cluster pulls from), its file facts
read from that copy without running it, the job planned (:mod:`.plan`), the
runner started, and its verdict and signed envelope brought back. The CLI
only parses options and prints what comes back.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...engine import Engine
from ...errors import EngineError, UsageError
from ...journal.atomic import write_atomic
from . import facts, plan

log = logging.getLogger(__name__)

def key_file(sign_key: str | None) -> Path | None:
    """The signing key as a file the runner folder can carry (env:NAME written to a private temporary file)."""
    if sign_key is None:
        return None
    if not sign_key.startswith("env:"):
        return Path(sign_key)
    fd, name = tempfile.mkstemp(prefix="vllm-hotfix-key-")
    with os.fdopen(fd, "wb") as fh:
        fh.write(os.environ.get(sign_key.removeprefix("env:"), "").encode())
    return Path(name)


def podman(root: Path, engine: Callable[[], Engine], image_ref: str, options: Any, sign_key: str | None,
           say: Callable[[str], None]) -> tuple[Any, bytes | None]:
    """Smoke ``image_ref`` as podman's store holds it; (verdict, envelope)."""
    from .podman import PodmanFiles, PodmanLauncher

    launcher = PodmanLauncher(python=options.python, timeout=plan.deadline(options, options.gpu != "off"))
    inspected = launcher.image_facts(image_ref)
    config = inspected.get("Config") or {}
    labels = dict(config.get("Labels") or inspected.get("Labels") or {})
    image_id = "sha256:" + str(inspected.get("Id", "")).removeprefix("sha256:")
    target = plan.Target(image_ref, image_id, image_id, labels,
                         f"{inspected.get('Os', '')}/{inspected.get('Architecture', '')}",
                         entrypoint=tuple(config.get("Entrypoint") or plan.DEFAULT_ENTRYPOINT),
                         repo_digests=tuple(inspected.get("RepoDigests") or ()))
    # File facts from podman's own copy, the one it starts; the expectation from the base where a Docker
    # engine holds it, else from the build record.
    files = PodmanFiles(launcher)
    info = files.image(image_id)
    missing: tuple[str, ...] = ()
    if info is None:
        checks = facts.unread_file_checks(f"podman has no image {image_id}: its files were not read")
        expected_from = ""
    else:
        try:
            docker: Engine | None = engine()
        except EngineError:
            docker = None
        found = facts.file_facts(root, info, files, docker, say)
        checks, expected_from, missing = list(found.checks), found.expected_from, found.compiled_missing
    key = key_file(sign_key)
    try:
        launched = plan.smoke(launcher, root, target, options,
                              gpu_request=None if options.gpu == "off" else options.gpu_request,
                              checks=checks, expected_from=expected_from, host={"launcher": "podman"},
                              sign_key=key, say=say, compiled_missing=missing)
    finally:
        if key is not None and sign_key is not None and sign_key.startswith("env:"):
            key.unlink(missing_ok=True)
    return launched.verdict, launched.envelope


def registry_file_facts(root: Path, engine: Callable[[], Engine], ref: str, image_id: str,
                        say: Callable[[str], None]) -> tuple[list[dict[str, Any]], str, tuple[str, ...], Any]:
    """The file checks of the image a cluster pulls, read from the registry's blobs (never run).

    The copy judged is the registry's (manifest by digest, every blob checked
    against its digest, :mod:`vllm_hotfix.registry.blobs`). A registry that cannot be
    read leaves the checks incomplete, so the Job's verdict cannot pass on the
    runner's checks alone.
    """
    from ...registry import blobs
    from ...registry import client as registry

    try:
        docker = engine()
        source = blobs.for_reference(lambda host: registry.client_for(docker, host), ref)
        info = source.image(image_id) if image_id else source.image(ref.partition("@")[2])
        if info is None:
            raise EngineError(f"{ref} holds another image than {image_id[:19]} (the engine's copy differs)")
    except EngineError as exc:
        why = f"the image's files could not be read from its registry: {str(exc).splitlines()[0]}"
        say(f"    {why}")
        return facts.unread_file_checks(why), "", (), None
    say(f"==> reading the files of {ref} from its registry's blobs")
    found = facts.file_facts(root, info, source, docker, say)
    return list(found.checks), found.expected_from, found.compiled_missing, info


def kubernetes(root: Path, engine: Callable[[], Engine], image_ref: str, options: Any, spec: Any,
               emit_path: Path | None, submit: bool, kubeconfig: str | None, say: Callable[[str], None],
               ) -> tuple[Any, bytes | None, str]:
    """Emit and/or submit the Job for ``image_ref``; (verdict, envelope, what was written), verdict None unless
    submitted."""
    from . import kubernetes as k8s
    from .base import stage

    if options.serve_model is not None:
        # Refused before the registry is read or anything is written: a Job has no folder of this host's.
        raise UsageError("--serve-model with --launcher kubernetes: the model folder is not on the cluster")
    if "@sha256:" in image_ref:
        ref, labels, image_id = image_ref, {}, ""
    else:
        local = engine().image(image_ref)
        if local is None or not local.repo_digests:
            raise UsageError(f"{image_ref}: a cluster pulls the image by digest: push it, then name it NAME@sha256:...")
        ref, labels, image_id = local.repo_digests[0], dict(local.labels), local.id
    checks, expected_from, missing, found = registry_file_facts(root, engine, ref, image_id, say)
    if found is not None:
        labels, image_id = labels or dict(found.labels), found.id
    target = plan.Target(image_ref, image_id or ref.partition("@")[2], ref, labels, repo_digests=(ref,))
    key_path = f"{k8s.KEY_MOUNT}/{k8s.KEY_SECRET_KEY}" if spec.key_secret else None
    job, extra = plan.job(root, target, options, launcher="kubernetes", gpu_request=f"nvidia.com/gpu={spec.gpus}",
                          key_path=key_path, host={"launcher": "kubernetes", "namespace": spec.namespace},
                          checks=checks, expected_from=expected_from, compiled_missing=missing)
    wrote = ""
    if emit_path is not None:
        # A folder that refuses the file, or a full disk: one line naming it (exit 10), never a half-written Job.
        write_atomic(emit_path, k8s.to_yaml(k8s.manifests(ref, spec, job, extra)))
        wrote = f"wrote {emit_path}: ConfigMap and Job {spec.namespace}/{spec.name} for {ref}"
    if not submit:
        return None, None, wrote
    with tempfile.TemporaryDirectory() as tmp:
        folder = stage(Path(tmp) / "runner", job, extra)
        launched = k8s.KubernetesLauncher(spec, kubeconfig, say, extra).launch(ref, folder, job, None)
    envelope = launched.envelope
    if envelope is not None:
        envelope = plan.attach_and_read_back(engine(), ref, envelope)
        say(f"    signed verdict attached to {ref} and read back from its registry")
    return launched.verdict, envelope, wrote
