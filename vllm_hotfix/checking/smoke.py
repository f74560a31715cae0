"""Smoke an image: one library call that chooses the launcher, judges, records and signs.

:func:`run` takes a :class:`SmokeRequest` and starts the runner
(:mod:`vllm_hotfix.inimage.runner`) through the launcher it names: the Docker engine
(:mod:`.launchers.docker`, also what ``image`` runs after a build), podman,
or a Kubernetes Job (:mod:`.launchers.elsewhere`). Whichever it is, the
host's own facts (the image's files, the GPU request it made) decide what
the host can judge, and the runner's report only adds the checks that need
the image's Python (:mod:`vllm_hotfix.judges.judging`). The verdict is appended to
the journal, and with a key it is signed here, by the host that started the
runner, after it judged the report (:mod:`.attest`); no key ever goes near
the image under test. The same key signs the reference answers a run
records (``--record-reference``; only a passing recording's, after its own
verdict, which the signed reference names), and checks the signature of
those a run is judged against (``--reference``), and the verdict of the run
that recorded them, before anything starts (:mod:`..trust.references`). The
CLI only parses options and prints what comes back.
"""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..building import expected
from ..engine import Engine
from ..errors import BaseImageError, PipelineError, UsageError
from ..journal import records
from ..journal.atomic import write_atomic
from ..registry.pulling import pull_missing
from ..trust import attest, references, signing, travel
from ..verdicts import Status, Verdict
from .launchers import NAMES, elsewhere
from .launchers.docker import DockerRun, format_phases
from .launchers.options import GPU_MODES, SmokeOptions
from .launchers.plan import Target

__all__ = ["GPU_MODES", "SmokeOptions", "SmokeRequest", "SmokeResult", "format_phases", "run", "runner"]


@dataclass(frozen=True, slots=True)
class SmokeRequest:
    """What to smoke, how, and whether to sign: everything ``smoke`` is asked."""

    image: str
    options: SmokeOptions = field(default_factory=SmokeOptions)
    launcher: str = "docker"  # one of launchers.NAMES
    sign_key: str | None = None  # a PEM file (mode 0600 or stricter) or env:NAME
    attestation: Path | None = None  # also write the signed verdict here
    cluster: elsewhere.Cluster | None = None  # kubernetes: emit, submit or collect the Job


@dataclass(frozen=True, slots=True)
class SmokeResult:
    """A smoke run as the host concluded it; ``verdict`` None when a Job was only written (``--emit``)."""

    verdict: Verdict | None
    entry: Path | None = None  # the journal entry
    signed: Path | None = None  # the signed verdict kept in the journal folder
    wrote: str = ""  # what was written instead of a run (the Job), in words
    unrecorded: str = ""  # why a passing run asked to record reference answers wrote none ("": it did, or failed)


def check(request: SmokeRequest) -> None:
    """UsageError (or AttestationError for a key that cannot sign) before anything runs."""
    if request.launcher not in NAMES:
        raise UsageError(f"--launcher {request.launcher}: expected one of {', '.join(NAMES)}")
    if request.attestation is not None and request.sign_key is None:
        raise UsageError("--attestation needs --sign-key")
    cluster = request.cluster
    if request.launcher != "kubernetes" and cluster is not None:
        raise UsageError("--emit, --submit, --collect, --kubeconfig and --node-selector need --launcher kubernetes")
    if request.launcher == "kubernetes":
        if cluster is None or (cluster.emit is None and not cluster.submit and cluster.collect is None):
            raise UsageError("--launcher kubernetes needs --emit FILE, --submit, or --collect job/NAME|LOG")
        if cluster.submit and cluster.collect is not None:
            raise UsageError("--submit runs a new Job and --collect reads one that ran: give one of them")
        if request.sign_key is not None and not cluster.submit and cluster.collect is None:
            raise UsageError("--emit writes a Job that holds no key: sign when its report is read, with "
                             "--collect job/NAME (or the pod's log) --sign-key KEY")
    options = request.options
    if options.accept_unsigned_reference and (options.reference is None or request.sign_key is None):
        raise UsageError("--accept-unsigned-reference needs --reference and --sign-key (without a key no "
                         "reference signature is checked, and the verdict says so)")
    if request.sign_key is not None:
        signing.load_private_key(request.sign_key)  # a key that cannot sign fails before the run, not after it
        record = options.record_reference
        for beside in (references.envelope_path(record), references.verdict_path(record)) if record else ():
            if beside.exists():
                raise UsageError(f"--record-reference {record}: {beside} already exists; a reference, its signature "
                                 "and its recording's verdict are written once (remove them to record it again)")


def reference_signature(root: Path, request: SmokeRequest) -> references.Signature | None:
    """The signature of the reference a run is judged against, and the verdict of the run that recorded it (beside
    it, or in this host's journal), checked with the site key before anything runs (None: no reference). A
    reference not signed with it, or whose recording verdict is not found, is refused unless the run accepts it;
    one recorded by a run that did not pass always is."""
    ref = request.options.reference
    if ref is None:
        return None
    if request.sign_key is None:
        return references.UNCHECKED
    journal = [attest.folder(root, ref.image_id)] if ref.image_id else []
    return references.check(Path(ref.path), ref.sha256, request.sign_key,
                            accept_unsigned=request.options.accept_unsigned_reference, journal=journal)


def recorded(verdict: Verdict, request: SmokeRequest) -> Path | None:
    """The reference answers this run wrote (``--record-reference``, named by the verdict: only a passing
    recording's are), None where it wrote none."""
    record = request.options.record_reference
    said = (verdict.sweep or {}).get("recorded")
    if record is None or not isinstance(said, Mapping) or not record.exists():
        return None
    return record


def name_signature(verdict: Verdict, request: SmokeRequest) -> Verdict:
    """A recording run's verdict naming the signature its reference will get (:func:`sign_recorded`, after the
    verdict itself is signed: the signed reference names the signed verdict)."""
    from ..inimage.reference import load
    from .launchers import judge_run

    record = recorded(verdict, request)
    if record is None or request.sign_key is None:
        return verdict
    ref = load(record, "--record-reference")
    return judge_run.restamp(verdict, ref, recorded=True, signature=references.planned(record, request.sign_key))


def sign_recorded(verdict: Verdict, envelope: bytes, request: SmokeRequest, progress: Callable[[str], None]) -> None:
    """A recording run's reference, written by the host, signed with the site key beside it (``NAME.dsse.json``),
    naming the run's signed verdict ``envelope`` (kept beside it too, ``NAME.verdict.dsse.json``). Nothing where no
    file was written, nor for a verdict that is no passing recording (:func:`..trust.references.unfit`)."""
    from ..inimage.reference import load

    record = recorded(verdict, request)
    if record is None or request.sign_key is None or references.unfit(verdict) is not None:
        return
    ref = load(record, "--record-reference")
    signature = references.sign(record, ref.sha256, {
        "image_id": ref.image_id, "recorded_from": ref.recorded_from, "model": ref.model,
        "served_model": ref.served_model, "recorded": ref.recorded, "settings": ref.settings,
        "tool_version": ref.tool_version}, request.sign_key, recording=envelope)
    progress(f"==> signed reference answers: {signature.envelope} (key {signature.key_id[:12]}; the recording's "
             f"signed verdict {signature.recording[:19]} beside it: {references.verdict_path(record).name})")


def run(engine: Callable[[], Engine], root: Path, request: SmokeRequest,
        progress: Callable[[str], None] = lambda _l: None) -> SmokeResult:
    """Smoke ``request.image`` through its launcher; record the host's verdict, and sign it when asked.

    ``engine`` gives the Docker engine when one is needed (podman and a Job
    written for a cluster may do without it).
    """
    check(request)
    records.ensure_writable(root)
    options = request.options
    signature = reference_signature(root, request)
    if signature is not None:
        options = replace(options, reference_signature=signature)
        progress(f"==> reference {options.reference.path if options.reference else ''}: {signature.words()}")
    if request.launcher == "docker":
        docker = engine()
        # An image only its registry holds (made there by image --in-registry): pulled by digest.
        pull_missing(docker, request.image, records.registry_digest(root, request.image), progress)
        if docker.image(request.image) is None:
            # Nothing was checked, so nothing failed: the image is missing (exit 4), as a missing base is.
            raise BaseImageError(f"image {request.image!r} is not in the engine",
                                 hint="build it with `image`, or pull it first")
        ran, target = DockerRun(docker, root, options, progress).smoke(request.image)
    elif request.launcher == "podman":
        ran, target = elsewhere.podman(root, engine, request.image, options, progress)
    else:
        assert request.cluster is not None
        found, target, wrote = elsewhere.kubernetes(root, engine, request.image, options, request.cluster, progress)
        if found is None:
            return SmokeResult(None, wrote=wrote)
        ran = found
    verdict = name_signature(ran.verdict, request)
    entry = records.append_verdict(root, verdict)
    signed = None
    unrecorded = ""
    if options.record_reference is not None and verdict.passed and recorded(verdict, request) is None:
        unrecorded = references.unfit(verdict) or "no answers came back"
    if request.sign_key is not None and verdict.judged:
        # The subject names every registry copy this host knows by its manifest digest, beside the config digest:
        # tools that look attestations up by manifest digest find it.
        places = registry_copies(root, target) if request.launcher != "kubernetes" else []
        subjects = signing.subjects(target.ref, verdict.image_id, [*target.repo_digests, *places])
        # What the signed verdict says the image is comes from the host's identity check; the labels go only under
        # its ``claimed`` key (signing.predicate).
        signed, envelope = attest.sign(root, verdict, target.labels, subjects, request.sign_key,
                                       request.attestation)
        progress(f"==> signed verdict: {signed}")
        if request.launcher == "kubernetes":
            attest.attach_and_read_back(engine(), target.start, envelope)
            progress(f"    signed verdict attached to {target.start} and read back from its registry")
        else:
            attach_where_it_lives(engine, places, envelope, progress)
        sign_recorded(verdict, envelope, request, progress)
    return SmokeResult(verdict, entry.path, signed, unrecorded=unrecorded)


def registry_copies(root: Path, target: Target) -> list[str]:
    """Every registry copy of the judged image this host knows, as NAME@sha256:... (the engine's repo digests,
    the journal's pushes and in-registry builds)."""
    return travel.registry_copies(root, target.image_id, target.repo_digests)


def attach_where_it_lives(engine: Callable[[], Engine], places: list[str], envelope: bytes,
                          progress: Callable[[str], None]) -> None:
    """The signed verdict, pass or fail, beside each of ``places`` (:func:`registry_copies`), so that a later
    fail reaches wherever a deployment reads verdicts. A registry that cannot be reached is named; the verdict
    stands in the journal and ``push`` attaches it with the image."""
    for place in places:
        try:
            attest.attach_and_read_back(engine(), place, envelope)
        except PipelineError as exc:
            progress(f"    signed verdict not attached to {place}: {exc} (push attaches it with the image)")
            continue
        progress(f"    signed verdict attached to {place} and read back from its registry")


def runner(
    root: Path, progress: Callable[[str], None], options: SmokeOptions | None = None
) -> Callable[[Engine, str, expected.Expected | None], Verdict]:
    """The hook `image` calls after a build, before tagging."""

    def smoke(engine: Engine, image_id: str, want: expected.Expected | None) -> Verdict:
        return DockerRun(engine, root, options or SmokeOptions(), progress).run(image_id, want)

    return smoke


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
