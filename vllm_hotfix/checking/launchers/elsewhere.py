"""Smoke through the runner where no Docker engine starts it: podman on the host, or a Kubernetes Job.

From an image reference to the host's verdict: where the launcher's copy of
the image is (podman's store, the registry a cluster pulls from), its file
facts read from that copy without running it, the job planned (:mod:`.plan`,
the same checks a docker run has), the runner started (:mod:`.smoke_run`), and
what came back judged here (:mod:`.judge_run`). Nothing is signed here and no key goes
anywhere: the caller signs the verdict this returns.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from ...engine import Engine, ImageInfo, split_reference
from ...errors import EngineError, NotRegular, PushError, Refused, RunnerFailed, UsageError
from ...inimage.runner import NONCE_MARK
from ...journal import records
from ...journal.atomic import opened_regular, write_atomic
from ...judges import identity, layer_read
from ...registry import client as registry
from . import facts, judge_run, plan, recorded, smoke_run
from .base import LINE, Launched, results
from .kubernetes import JobSpec
from .options import SmokeOptions

if TYPE_CHECKING:
    from .podman import PodmanLauncher

log = logging.getLogger(__name__)


def podman(root: Path, engine: Callable[[], Engine], image_ref: str, options: SmokeOptions,
           say: Callable[[str], None]) -> tuple[judge_run.Ran, plan.Target]:
    """Smoke ``image_ref`` as podman's store holds it: (the host's run, the image as the host knows it)."""
    from .podman import PodmanFiles, PodmanLauncher

    launcher = PodmanLauncher(python=options.python, timeout=plan.deadline(options, options.gpu != "off"))
    into_podman(root, engine, launcher, image_ref, say)
    inspected = launcher.image_facts(image_ref)
    config = inspected.get("Config") or {}
    labels = dict(config.get("Labels") or inspected.get("Labels") or {})
    image_id = "sha256:" + str(inspected.get("Id", "")).removeprefix("sha256:")
    target = plan.Target(image_ref, image_id, image_id, labels,
                         f"{inspected.get('Os', '')}/{inspected.get('Architecture', '')}",
                         entrypoint=tuple(config.get("Entrypoint") or plan.DEFAULT_ENTRYPOINT),
                         repo_digests=registry_digests(inspected.get("RepoDigests") or ()))
    # File facts from podman's own copy, the one it starts; the base and the expectation from the Docker engine
    # that holds the base.
    files = PodmanFiles(launcher)
    info = files.image(image_id)
    if info is None:
        found = facts.FileFacts(tuple(facts.unread_file_checks(f"podman has no image {image_id}: its files were "
                                                               "not read")), "")
        proven = None
    else:
        read = layer_read.from_folders_or(lambda: files.export_layers(image_id))
        proven = prove(root, engine, info, options, say, lambda n: read(info, n))
        if proven.status in ("fail", "incomplete"):
            return judge_run.refused(target, proven.check(), {"launcher": "podman"}, "off"), target
        target = replace(target, base_id=proven.base_id)
        found = facts.file_facts(root, info, files, engine(), say, proven)
        found = replace(found, checks=(proven.check(), *found.checks))
    from .podman import settle_gpu

    request, unavailable = settle_gpu(options.gpu, options.gpu_request)
    if unavailable is not None:
        say(f"    {unavailable['why']}")
    ran = smoke_run.smoke(launcher, root, target, options, gpu_request=request, gpu_unavailable=unavailable,
                     checks=found.checks, expected_from=found.expected_from, host={"launcher": "podman"},
                     landed=found.landed, say=say, facts=judge_run.HostFacts(found.compiled_missing),
                     python_path=proven.python_path if proven is not None else ())
    return recorded.keep_recorded(ran, options, target, say), target


# The name podman's store gives an image that came from no registry (loaded, built, committed): its own
# namespace, no registry's host.
PODMAN_LOCAL = "localhost/"


def registry_digests(names: Sequence[object]) -> tuple[str, ...]:
    """Podman's repo digests of an image that name a registry copy of it: those under its store's own
    ``localhost/`` name are no copy anywhere, and a signed verdict is attached beside none of them."""
    return tuple(str(n) for n in names if not str(n).startswith(PODMAN_LOCAL))


def into_podman(root: Path, engine: Callable[[], Engine], launcher: PodmanLauncher, image_ref: str,
                say: Callable[[str], None]) -> None:
    """The image into podman's store where podman lacks it: from the Docker engine that holds it (``save`` into
    ``podman load``), else pulled by the digest this host's journal names for it. Nothing is taken on trust: the
    copy podman starts is the copy whose layers and files are judged next."""
    if launcher.has_image(image_ref):
        return
    docker = None
    try:
        docker = engine()
        held = docker.image(image_ref)
    except EngineError:
        held = None
    if docker is not None and held is not None:
        say(f"==> podman has no {image_ref}: moving it from the Docker engine ({held.id[:19]}) into podman's store")
        # Saved by name, so the archive carries it (saved by ID it would be nameless in podman's store).
        launcher.load(docker.save_stream(image_ref), image_ref)
        if launcher.image_id(image_ref) != held.id:
            raise EngineError(f"podman loaded {image_ref} as {launcher.image_id(image_ref)[:19]}, not the Docker "
                              f"engine's {held.id[:19]}")
        return
    digest = records.registry_digest(root, image_ref)
    if digest is not None:
        by_digest = f"{image_ref.rsplit(':', 1)[0] if ':' in image_ref.rsplit('/', 1)[-1] else image_ref}@{digest}"
        say(f"==> podman has no {image_ref}: pulling it by digest ({by_digest})")
        launcher.pull(by_digest, image_ref)


def prove(root: Path, engine: Callable[[], Engine], image: ImageInfo, options: SmokeOptions,
          say: Callable[[str], None], read_layers: layer_read.LayerSource) -> identity.Outcome:
    """The image's layer identity (:mod:`vllm_hotfix.judges.identity`), its layers read where the launcher starts
    it, its base found in the Docker engine; incomplete where this host has none (nothing it could compare the
    image with)."""
    say(f"==> {image.id[:19]} against what its builder writes over its base (read from the layers)")
    try:
        docker = engine()
    except EngineError as exc:
        proven = identity.Outcome("incomplete", "no Docker engine here holds the definition's base to compare the "
                                                f"image with: {str(exc).splitlines()[0]}")
    else:
        proven = identity.prove(docker, root, image, definition=options.definition, base_repo=options.base_repo,
                                say=say, read_layers=read_layers)
    say(f"    {proven.status:<4} {identity.CHECK}: {proven.detail}")
    return proven


def registry_file_facts(root: Path, engine: Callable[[], Engine], ref: str, image_id: str,
                        say: Callable[[str], None], options: SmokeOptions, *, new_job: bool = False
                        ) -> tuple[facts.FileFacts, ImageInfo | None, identity.Outcome | None]:
    """The identity and file facts of the image a cluster pulls, read from the registry's blobs (never run).

    The copy judged is the registry's (manifest by digest, every blob checked
    against its digest, :mod:`vllm_hotfix.registry.blobs`). A registry that cannot be
    read leaves the checks incomplete, so the Job's verdict cannot pass on the
    runner's checks alone: for a ``new_job`` (emitted or submitted now) that is
    refused here, before anything is written or started, as a registry's fault
    (exit 8); a Job collected later is judged incomplete.
    """
    from ...registry import blobs

    if new_job:
        engine().info()  # an engine that does not answer is the engine's fault (exit 5), named before any registry's
    try:
        docker = engine()
        source = blobs.for_reference(lambda host: registry.client_for(docker, host), ref)
        info = source.image(image_id) if image_id else source.image(ref.partition("@")[2])
        if info is None:
            raise EngineError(f"{ref} holds another image than {image_id[:19]} (the engine's copy differs)")
    except EngineError as exc:
        why = f"the image's files could not be read from its registry: {str(exc).splitlines()[0]}"
        if new_job:
            raise PushError(f"{ref}: {why}; a Job run now could not pass without them, so none was written or "
                            "submitted", hint="reach the registry (docker login HOST where it needs one), then "
                                              "emit the Job again") from None
        say(f"    {why}")
        return facts.FileFacts(tuple(facts.unread_file_checks(why)), ""), None, None
    proven = prove(root, engine, info, options, say,
                   lambda n: source.top_layers(n, layer_read.small_script, layer_read.SCRIPT_MAX))
    if proven.status in ("fail", "incomplete"):
        return facts.FileFacts((), ""), info, proven
    say(f"==> reading the files of {ref} from its registry's blobs")
    found = facts.file_facts(root, info, source, docker, say, proven)
    return replace(found, checks=(proven.check(), *found.checks)), info, proven


def _registry_digest(engine: Engine, ref: str, local: ImageInfo | None) -> str | None:
    """``ref`` (a tag in a registry) as ``NAME@sha256:...`` by asking that registry; None if it has no such tag.

    An index resolves to its child holding the local image, when the engine has one.
    """
    repo, tag = split_reference(ref)
    try:
        host, path = registry.split_repo(repo)
    except PushError:
        return None
    manifest = registry.client_for(engine, host).manifest(path, tag)
    if manifest is None:
        return None
    if manifest.is_index:
        client = registry.client_for(engine, host)
        for child in registry.children(manifest):
            found = client.manifest(path, child.digest)
            config = (found.json().get("config") or {}).get("digest") if found is not None else None
            if local is not None and config == local.id:
                return f"{repo}@{child.digest}"
        raise UsageError(f"{ref} is an index over several platforms: name one platform's image (NAME@sha256:...)")
    return f"{repo}@{manifest.digest}"


def by_digest(root: Path, engine: Callable[[], Engine], image_ref: str) -> tuple[str, dict[str, str], str]:
    """The image a cluster pulls, as (``NAME@sha256:...``, the engine's labels, the engine's image ID).

    A digest is taken as given. A tag is resolved through the engine's repo
    digests, else through the registry: the one the reference names, or the
    ones the journal says the engine's image was pushed to (an engine records
    no repo digest for an image it pushed and no longer tags there).
    """
    if "@sha256:" in image_ref:
        return image_ref, {}, ""
    docker = engine()
    local = docker.image(image_ref)
    if local is not None and local.repo_digests:
        return local.repo_digests[0], dict(local.labels), local.id
    tried = [image_ref]
    if local is not None:
        tried += [str(e.data.get("ref")) for e in records.pushes(root, local.id) if e.data.get("ref")]
    failed: list[str] = []
    for ref in dict.fromkeys(tried):
        try:
            found = _registry_digest(docker, ref, local)
        except PushError as exc:
            # One registry down or refusing the login: the others the image was pushed to are asked too.
            failed.append(f"{ref}: {exc}")
            continue
        if found is not None:
            return found, dict(local.labels) if local is not None else {}, local.id if local is not None else ""
    if failed:
        raise PushError(f"{image_ref}: cannot resolve it to a digest through a registry that holds it "
                        f"({'; '.join(failed)})",
                        hint="reach the registry (docker login HOST where it needs one), or name the image by "
                             "digest (NAME@sha256:...)")
    raise UsageError(f"{image_ref}: a cluster pulls the image by digest, and no registry holds it under that "
                     "name: push it, then name it NAME or NAME@sha256:...")


@dataclass(frozen=True, slots=True)
class Cluster:
    """What to do with the Job: write it, submit it and follow it, or collect the report of one that ended."""

    spec: JobSpec
    emit: Path | None = None
    submit: bool = False
    collect: str | None = None  # job/NAME (read through the client), or a file holding its pod's log
    kubeconfig: str | None = None


def kubernetes(root: Path, engine: Callable[[], Engine], image_ref: str, options: SmokeOptions, cluster: Cluster,
               say: Callable[[str], None]) -> tuple[judge_run.Ran | None, plan.Target, str]:
    """Emit, submit or collect the Job for ``image_ref``: (the host's run, or None after --emit alone; the image
    as the host knows it; what was written)."""
    from . import kubernetes as k8s
    from .base import stage

    if options.serve_model is not None:
        # Refused before the registry is read or anything is written: a Job has no folder of this host's.
        raise UsageError("--serve-model with --launcher kubernetes: the model folder is not on the cluster")
    if cluster.submit or (cluster.collect or "").startswith("job/"):
        k8s.load_config(cluster.kubeconfig)  # a kubeconfig that is not one, named before any registry is read
    ref, labels, image_id = by_digest(root, engine, image_ref)
    found, info, proven = registry_file_facts(root, engine, ref, image_id, say, options,
                                              new_job=cluster.collect is None)
    if info is not None:
        labels, image_id = labels or dict(info.labels), info.id
    target = plan.Target(image_ref, image_id or ref.partition("@")[2], ref, labels, repo_digests=(ref,))
    if proven is not None and proven.status in ("fail", "incomplete"):
        # Nothing is written or started for an image that is not its definition's product.
        return judge_run.refused(target, proven.check(), {"launcher": "kubernetes"}, "off"), target, ""
    if proven is not None:
        target = replace(target, base_id=proven.base_id)
    spec = cluster.spec
    job, extra = plan.job(root, target, options, launcher="kubernetes", gpu_request=f"nvidia.com/gpu={spec.gpus}",
                          host={"launcher": "kubernetes", "namespace": spec.namespace}, checks=found.checks,
                          expected_from=found.expected_from, landed=found.landed,
                          python_path=proven.python_path if proven is not None else ())
    wrote = ""
    text = ""
    if cluster.collect is None:
        # A nonce for this run alone, in the Job and journalled here: the report collected later must carry it.
        job["run_nonce"] = secrets.token_hex(16)
        text = k8s.to_yaml(k8s.manifests(ref, spec, job, extra))
        records.append(root, "job", {"name": spec.name, "namespace": spec.namespace, "image": ref,
                                     "image_id": target.image_id, "gpus": spec.gpus, "nonce": job["run_nonce"],
                                     "spec_sha256": hashlib.sha256(text.encode()).hexdigest()})
    if cluster.emit is not None:
        # A folder that refuses the file, or a full disk: one line naming it (exit 10), never a half-written Job.
        write_atomic(cluster.emit, text)
        wrote = (f"wrote {cluster.emit}: ConfigMap and Job {spec.namespace}/{spec.name} for {ref}; once it has "
                 f"ended: smoke {image_ref} --launcher kubernetes --collect job/{spec.name} (or the pod's log "
                 "saved to a file) [--sign-key KEY]")
    host_facts = judge_run.HostFacts(found.compiled_missing)
    started = records.now_iso()
    launched: Launched | RunnerFailed
    if cluster.collect is not None:
        try:
            launched = _collected(root, cluster, say, ref)
        except RunnerFailed as exc:
            launched = exc
    elif cluster.submit:
        with tempfile.TemporaryDirectory() as tmp:
            folder = stage(Path(tmp) / "runner", job, extra)
            try:
                launched = k8s.KubernetesLauncher(spec, cluster.kubeconfig, say, extra, image=ref,
                                                  gpus=spec.gpus).launch(ref, folder, job, None)
            except RunnerFailed as exc:
                launched = exc
    else:
        return None, target, wrote
    if isinstance(launched, Launched):
        started = _this_run(root, launched, ref, cluster, job.get("run_nonce"))
    verdict, _levels, _noise = judge_run.judged(job, launched, host_facts, started=started, reference=options.reference,
                                           model=Path(options.serve_model) if options.serve_model else None,
                                           signature=options.reference_signature)
    for c in verdict.checks:
        say(f"    {c.status.value:<4} {c.name}: {c.detail}")
    return judge_run.Ran(verdict, job), target, wrote


def _this_run(root: Path, launched: Launched, ref: str, cluster: Cluster, submitted: str | None) -> str:
    """When the run whose report came back was made (its journalled Job's time: the verdict's time); Refused
    unless the report carries the nonce of a Job this host emitted or submitted for ``ref`` (that very one, for
    --submit; the one named, for --collect job/NAME): a replayed or foreign log is never judged."""
    said = str((launched.report.environment or {}).get("run_nonce") or "")
    where = f"the report of {cluster.collect or f'Job {cluster.spec.name}'}"
    if not said:
        raise Refused(f"{where} carries no run nonce: not the report of a Job this host emitted or submitted",
                      hint="emit or submit the Job from this host, and collect what it ran")
    if submitted is not None and said != submitted:
        raise Refused(f"{where} carries run nonce {said[:12]}, not this submission's {submitted[:12]}")
    entry = next((e for e in records.jobs(root, said) if e.data.get("image") == ref), None)
    if entry is None:
        raise Refused(f"{where} carries run nonce {said[:12]}, which no Job this host made for {ref} was given "
                      "(another run's log, or another image's)")
    name = (cluster.collect or "").removeprefix("job/") if (cluster.collect or "").startswith("job/") else None
    if name is not None and entry.data.get("name") != name:
        raise Refused(f"{where} is the report of Job {entry.data.get('name')}, not of {name}")
    return str(entry.data.get("created") or records.now_iso())


def _collected(root: Path, cluster: Cluster, say: Callable[[str], None], ref: str) -> Launched:
    """The runner's report of a Job that has ended: through the client (job/NAME), or from its saved log."""
    from .kubernetes import KubernetesLauncher

    given = cluster.collect or ""
    if given.startswith("job/"):
        say(f"==> reading the report of Job {cluster.spec.namespace}/{cluster.spec.name} through the cluster's API")
        # The Job's pod must have run the image it was made for, with the GPUs it asked for (the journal's Job).
        made = next((e for e in records.jobs(root) if e.data.get("name") == cluster.spec.name
                     and e.data.get("namespace") == cluster.spec.namespace), None)
        gpus = int(made.data["gpus"]) if made is not None and isinstance(made.data.get("gpus"), int) else None
        return KubernetesLauncher(cluster.spec, cluster.kubeconfig, say, image=ref, gpus=gpus).collect()
    try:
        with opened_regular(given) as (fh, _st):
            text = fh.read().decode("utf-8", errors="replace")
    except NotRegular:
        raise UsageError(f"--collect {given}: not a regular file (give the pod's log saved to a file)") from None
    except OSError as exc:
        raise UsageError(f"--collect {given}: cannot read the pod's log ({exc.strerror or exc})") from None
    say(f"==> reading the runner's report from {given}")
    try:
        return results(text, text, f"the pod's log {given}")
    except RunnerFailed as exc:
        if _said_nonce(root, text, ref):
            raise  # the Job's own runner, started in the image, gave no report: the image's failure
        # Nothing in the file ties it to a Job this host made (a kubectl error, another pod's log): it says
        # nothing about the image, so no verdict on it is judged or signed.
        last = (text.strip().splitlines() or ["it is empty"])[-1][:LINE]
        raise RunnerFailed(f"--collect {given}: no runner report and no run nonce of a Job this host made for "
                           f"{ref} (its last line: {last}): not that Job's log, so it says nothing about the image",
                           hint=f"collect the Job's own pod log (--collect job/NAME, or kubectl logs job/NAME > "
                                f"FILE); {exc.hint}", incomplete=True) from None


def _said_nonce(root: Path, text: str, ref: str) -> bool:
    """Whether ``text`` holds the nonce line of a runner started by a Job this host made for ``ref``."""
    for line in text.splitlines():
        mark, _, nonce = line.strip().partition(" ")
        if mark == NONCE_MARK and nonce and any(e.data.get("image") == ref for e in records.jobs(root, nonce)):
            return True
    return False

