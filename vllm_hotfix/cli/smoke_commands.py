"""smoke and serve-check: the checks inside an image, and the sweep against a running server."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from ..errors import UsageError
from .app import IMAGE, REPOSITORY, Ctx, check_output_file, progress

if TYPE_CHECKING:
    from ..checking.launchers.options import SmokeOptions
    from ..inimage.reference import AnswerOptions
    from ..verdicts import Verdict


def _smoke_options(gpu: str, serve_model: Path | None, serve_args: tuple[str, ...], concurrency: str,
                   requests_n: int, gpu_request: str = "auto", definition: str | None = None,
                   min_tokens: int | None = None, answers: AnswerOptions | None = None, keep_going: bool = False,
                   compile_cache: bool = True, deadline: int | None = None,
                   base_repo: str | None = None, accept_unsigned_reference: bool = False) -> SmokeOptions:
    from ..checking.launchers.options import SmokeOptions
    from ..inimage import reference, sweep

    answers = answers or reference.answer_options(None, None)
    if serve_model is None and (answers.reference is not None or answers.record is not None):
        raise UsageError("--reference and --record-reference need --serve-model (the model the answers are of)")
    sweep.check_min_tokens(min_tokens, answers.reference.max_tokens if answers.reference else sweep.MAX_TOKENS)
    return SmokeOptions(gpu=gpu, gpu_request=gpu_request, definition=definition, serve_model=serve_model,
                        serve_args=serve_args, levels=sweep.parse_levels(concurrency), requests=requests_n,
                        min_tokens=min_tokens, reference=answers.reference, record_reference=answers.record,
                        keep_going=keep_going, compile_cache=compile_cache,
                        deadline=deadline, base_repo=base_repo, accept_unsigned_reference=accept_unsigned_reference)


def _gpu_request_option(_ctx: click.Context, _param: click.Parameter, value: str) -> str:
    from ..checking import gpu_access
    from ..errors import SmokeError

    try:
        return gpu_access.parse_request(value)
    except SmokeError as exc:
        raise click.BadParameter(str(exc)) from exc


sweep_options = [
    click.option("--concurrency", default="1,2,4,8,16", show_default=True, help="Concurrency levels."),
    click.option("--requests", "requests_n", type=click.IntRange(1), default=32, show_default=True,
                 help="Requests per level."),
    click.option("--min-tokens", type=int, default=None,
                 help="Fail a request whose reply has fewer completion tokens (each asks for 32): for a model "
                      "that cannot stop early, where a short reply means it went wrong."),
    click.option("--reference", "reference_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                 help="Reference answers (from --record-reference on a trusted image, under the settings they "
                      "name): every reply at concurrency 1 must equal its answer bit for bit; above it, every reply "
                      "must be whole (status, length, finish reason, no NaN), and how far it moved from the same "
                      "image's concurrency-1 reply is measured."),
    click.option("--record-reference", "record_path", type=click.Path(dir_okay=False, path_type=Path),
                 default=None,
                 help="Record reference answers to this new file first (the prompt set at concurrency 1, twice, "
                      "temperature 0, top-5 logprobs; then at concurrency 16, how far replies move measured), then "
                      "sweep. Only from a trusted image (smoke writes it only where its run passed, with its golden "
                      "check passed and its GPU checks verified)."),
]


def with_options(options: list[Callable[[Any], Any]]) -> Callable[[Any], Any]:
    def apply(fn: Any) -> Any:
        for opt in reversed(options):
            fn = opt(fn)
        return fn

    return apply


@click.command()
@click.argument("image_ref", metavar="IMAGE", type=IMAGE)
@click.option("--gpu", type=click.Choice(["auto", "require", "off"]), default="auto", show_default=True,
              help="GPU checks: where a GPU request works (else GPU-unverified), required to run and pass, or never.")
@click.option("--gpu-request", default="auto", show_default=True, callback=_gpu_request_option,
              help="How containers ask for GPUs: auto (try CDI, --gpus, then an NVIDIA runtime), "
                   "cdi[:DEVICE], gpus or runtime[:NAME].")
@click.option("--definition", default=None, metavar="TAG",
              help="Judge the image by this image definition: its patch-set checks and its [smoke] table "
                   "(default: this host's build record of the image; else the checks of the definition its label "
                   "names, which the layer-identity check holds it to, and the table of the definition whose "
                   "output tag the reference's tag is), e.g. on the unpatched base to see the checks catch the bug.")
@click.option("--base-repo", type=REPOSITORY, default=None, metavar="REPO",
              help="Where the definition's base is when this host has no build record of the image (the "
                   "repository `image --base-repo` built from): the image must be that base's layers plus exactly "
                   "the builder's. Never taken from the image's labels.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), help="Write JSON here.")
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False, path_type=Path), help="Write JUnit XML here.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write the report as one self-contained HTML page here (what `report` renders).")
@click.option("--serve-model", type=click.Path(exists=True, path_type=Path), default=None,
              help="Model folder to serve with the image's own entrypoint for the sweep.")
@click.option("--serve-arg", "serve_args", multiple=True, help="Extra argument for `vllm serve` (repeatable).")
@click.option("--sign-key", default=None, metavar="KEY",
              help="Sign the verdict with this ECDSA P-256 private key (PEM file readable by its owner alone, or "
                   "env:NAME), here, after judging the runner's report; kept in the journal and attached beside the "
                   "image when it is pushed. With --record-reference it also signs the answers recorded "
                   "(NAME.dsse.json beside them); with --reference it checks theirs first. The key never goes into "
                   "the image's container, Job or mounts.")
@click.option("--accept-unsigned-reference", is_flag=True,
              help="With --reference and --sign-key: judge against a reference that is not signed with the site key "
                   "(no NAME.dsse.json beside it, or another key's), or whose recording run's signed verdict is not "
                   "found (beside it as NAME.verdict.dsse.json, or in the journal); the verdict says so. One whose "
                   "signature does not verify, vouches for other content, or names a recording that did not pass "
                   "is refused all the same.")
@click.option("--attestation", "attestation_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Also write the signed verdict (DSSE envelope) here; needs --sign-key.")
@click.option("--keep-going", is_flag=True,
              help="Run every phase (checks, GPU checks, serve sweep) even after one failed; by default a failed "
                   "phase ends the run and the later ones are recorded as skipped.")
@click.option("--compile-cache/--no-compile-cache", default=True, show_default=True,
              help="Keep Triton, torch, vLLM and FlashInfer compile caches in "
                   "VLLM_HOTFIX_CACHE/compile/<base ID>/<GPU model>/, mounted at /root/.cache in GPU containers.")
@click.option("--launcher", type=click.Choice(["docker", "podman", "kubernetes"]), default="docker",
              show_default=True,
              help="What starts the checks in the image: the Docker engine (as always), the one-entry runner "
                   "through podman (GPUs by CDI), or a Kubernetes Job.")
@click.option("--emit", "emit_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="kubernetes: write the Job and its ConfigMap (multi-document YAML) here; it holds no key.")
@click.option("--submit", is_flag=True, help="kubernetes: create the Job, follow it to its end, judge its report "
                                              "here, and sign it here with --sign-key (attached in the registry).")
@click.option("--collect", default=None, metavar="job/NAME|LOG",
              help="kubernetes: read the report of an emitted Job that has ended (job/NAME through the cluster's "
                   "API, or LOG: its pod's log saved to a file), judge it here, and sign it here with --sign-key.")
@click.option("--kubeconfig", default=None, type=click.Path(exists=True, dir_okay=False), help="kubernetes: config.")
@click.option("--namespace", default="default", show_default=True, help="kubernetes: the Job's namespace.")
@click.option("--node-selector", "node_selectors", multiple=True, metavar="KEY=VALUE",
              help="kubernetes: a node label the pod needs, e.g. nvidia.com/gpu.product=NVIDIA-H200 (repeatable).")
@click.option("--pull-secret", "pull_secrets", multiple=True, metavar="NAME",
              help="kubernetes: an image pull Secret of the namespace for a private registry (repeatable).")
@click.option("--service-account", default=None, metavar="NAME", help="kubernetes: the pod's service account.")
@click.option("--toleration", "tolerations", multiple=True, metavar="KEY[=VALUE][:EFFECT]",
              help="kubernetes: a taint the pod tolerates, as kubectl spells taints, e.g. "
                   "nvidia.com/gpu:NoSchedule (repeatable).")
@click.option("--resource", "resources", multiple=True, metavar="requests|limits.NAME=QUANTITY",
              help="kubernetes: the container's CPU, memory... beside its GPUs, e.g. requests.cpu=8 (repeatable).")
@click.option("--gpus", "gpu_count", type=click.IntRange(1), default=1, show_default=True,
              help="kubernetes: nvidia.com/gpu the Job asks for.")
@click.option("--deadline", type=click.IntRange(5), default=None, metavar="S",
              help="Seconds the checks in the image may take in all, for every launcher (a Job's "
                   "activeDeadlineSeconds); past it the run is incomplete. Default: what the checks asked for "
                   "need (600, +1800 with GPU checks, +2700 with --serve-model).")
@click.option("--explain", is_flag=True,
              help="Print the settings this run would use and where each comes from (a flag, the definition's "
                   "[smoke] table, the default), and start nothing.")
@with_options(sweep_options)
@click.pass_obj
def smoke(obj: Ctx, image_ref: str, gpu: str, gpu_request: str, definition: str | None, base_repo: str | None,
          report_path: Path | None, junit_path: Path | None, html_path: Path | None, serve_model: Path | None,
          serve_args: tuple[str, ...], sign_key: str | None, accept_unsigned_reference: bool,
          attestation_path: Path | None, keep_going: bool, compile_cache: bool, launcher: str,
          emit_path: Path | None, submit: bool, collect: str | None, kubeconfig: str | None, namespace: str,
          node_selectors: tuple[str, ...], pull_secrets: tuple[str, ...], service_account: str | None,
          tolerations: tuple[str, ...], resources: tuple[str, ...], gpu_count: int, deadline: int | None,
          explain: bool, concurrency: str, requests_n: int, min_tokens: int | None, reference_path: Path | None,
          record_path: Path | None) -> None:
    """Run the smoke checks inside IMAGE; exit non-zero if any fails.

    Settings not given as flags come from the [smoke] table of the image's definition (--definition, else this
    host's build record of IMAGE, else IMAGE's tag when it is a definition's output tag), else the defaults shown
    here; --explain prints each one and where it came from.
    """
    from ..checking import smoke as smokelib
    from ..checking import smoke_settings
    from ..inimage import reference, sweep

    ctx = click.get_current_context()
    flags = {"gpu": gpu, "model": serve_model, "reference": reference_path,
             "concurrency": sweep.parse_levels(concurrency),
             "requests": requests_n, "min_tokens": min_tokens,
             "deadline": deadline, "serve_args": serve_args, "sign_key": sign_key, "kubernetes.namespace": namespace,
             "kubernetes.gpus": gpu_count, "kubernetes.service_account": service_account,
             "kubernetes.pull_secrets": pull_secrets, "kubernetes.node_selector": node_selectors,
             "kubernetes.tolerations": tolerations, "kubernetes.resources": resources}
    params = {"model": "serve_model", "reference": "reference_path", "requests": "requests_n",
              "kubernetes.namespace": "namespace", "kubernetes.gpus": "gpu_count",
              "kubernetes.service_account": "service_account", "kubernetes.pull_secrets": "pull_secrets",
              "kubernetes.node_selector": "node_selectors", "kubernetes.tolerations": "tolerations",
              "kubernetes.resources": "resources"}
    given = {key: value for key, value in flags.items()
             if ctx.get_parameter_source(params.get(key, key)) is not click.core.ParameterSource.DEFAULT}
    if record_path is not None and "reference" not in given:
        given["reference"] = None  # recording answers: a table's reference is not what this run checks against
    settings = smoke_settings.resolve(obj.root, image_ref, _parsed_job_flags(given), definition)
    if explain:
        click.echo(smoke_settings.explain(settings, launcher))
        return
    smoke_settings.check_paths(settings, record_path is not None)
    if launcher == "kubernetes" and settings.from_table("model"):
        raise UsageError(f"{settings.settings['model'].source}: a Kubernetes Job cannot serve a folder of this "
                         "host; smoke it with --launcher docker or podman on the GPU host, or give --definition "
                         "of a definition without a model")
    options = _smoke_options(settings["gpu"], settings["model"], tuple(settings["serve_args"]),
                             ",".join(map(str, settings["concurrency"])),
                             settings["requests"], gpu_request,
                             settings.definition.tag if settings.definition is not None else None,
                             settings["min_tokens"],
                             reference.answer_options(settings["reference"], record_path),
                             keep_going=keep_going, compile_cache=compile_cache, deadline=settings["deadline"],
                             base_repo=base_repo, accept_unsigned_reference=accept_unsigned_reference)
    sign_key = settings["sign_key"]
    if launcher == "kubernetes" and not submit and collect is None and settings.from_table("sign_key"):
        sign_key = None  # an emitted Job is signed when its report is collected, by the table's key then
    for path, option in ((report_path, "--report"), (junit_path, "--junit"), (html_path, "--html"),
                         (attestation_path, "--attestation"),
                         (emit_path, "--emit")):
        check_output_file(path, option)
    if launcher != "kubernetes":
        # Options of the Job's alone: given to another launcher they would be ignored without a word.
        job_flags = [smoke_settings.FLAGS[key] for key in given if key.startswith("kubernetes.")]
        if job_flags:
            raise UsageError(f"{', '.join(job_flags)}: {'is an option' if len(job_flags) == 1 else 'are options'} of "
                             f"--launcher kubernetes, not {launcher}",
                             hint="the docker and podman launchers ask for GPUs with --gpu-request")
    cluster = None
    if emit_path or submit or collect or kubeconfig or launcher == "kubernetes":
        cluster = _cluster(settings, collect, emit_path, submit, kubeconfig, options, settings["gpu"] != "off")
    request = smokelib.SmokeRequest(image_ref, options, launcher, sign_key, attestation_path, cluster)
    done = smokelib.run(lambda: obj.engine, obj.root, request, progress)
    if done.wrote:
        click.echo(done.wrote)
    if done.verdict is None:
        return
    assert done.entry is not None
    _finish_smoke(done.verdict, image_ref, done.entry, report_path, junit_path, html_path, done.signed)
    if done.unrecorded:
        from ..errors import SmokeIncomplete

        # The image passed; what was asked, answers to judge later images by, this host could not vouch for.
        raise SmokeIncomplete(f"--record-reference {record_path}: nothing written: {done.unrecorded}",
                              hint="record it on a GPU host whose torch runs the golden (smoke --gpu require)")


def _parsed_job_flags(given: dict[str, Any]) -> dict[str, Any]:
    """The Job's flags as the settings hold them (a table's values have the same shapes)."""
    from ..checking.launchers import kubernetes as k8s

    parse: dict[str, Callable[[Any], Any]] = {
        "kubernetes.node_selector": k8s.parse_selectors,
        "kubernetes.tolerations": lambda texts: tuple(k8s.parse_toleration(t) for t in texts),
        "kubernetes.resources": k8s.parse_resources,
    }
    return {key: parse[key](value) if key in parse else value for key, value in given.items()}


def _cluster(settings: Any, collect: str | None, emit_path: Path | None, submit: bool, kubeconfig: str | None,
             options: SmokeOptions, gpu: bool) -> Any:
    """The Job to emit, submit or collect, from the resolved settings; every name checked as the API would."""
    from ..checking.launchers import elsewhere
    from ..checking.launchers import kubernetes as k8s
    from ..checking.launchers.plan import deadline as job_deadline

    def source(key: str) -> str:
        found: str = settings.settings[key].source
        return found.removeprefix("flag ") if found.startswith("flag ") else found

    name = collect.removeprefix("job/") if collect and collect.startswith("job/") else \
        f"vllm-hotfix-smoke-{uuid.uuid4().hex[:10]}"
    account = settings["kubernetes.service_account"]
    selector = settings["kubernetes.node_selector"]
    spec = k8s.JobSpec(
        name, namespace=k8s.check_name(settings["kubernetes.namespace"], source("kubernetes.namespace"),
                                       subdomain=False),
        gpus=settings["kubernetes.gpus"],
        node_selector=k8s.check_selector(selector, source("kubernetes.node_selector")) if selector else None,
        deadline_s=int(job_deadline(options, gpu)),
        pull_secrets=tuple(k8s.check_name(n, source("kubernetes.pull_secrets"), subdomain=True)
                           for n in settings["kubernetes.pull_secrets"]),
        service_account=k8s.check_name(account, source("kubernetes.service_account"), subdomain=True,
                                       what="a service account's name") if account else None,
        tolerations=tuple(settings["kubernetes.tolerations"]), resources=settings["kubernetes.resources"])
    return elsewhere.Cluster(spec, emit_path, submit, collect, kubeconfig)


def _finish_smoke(verdict: Verdict, image_ref: str, entry: Path, report_path: Path | None,
                  junit_path: Path | None, html_path: Path | None = None, signed: Path | None = None) -> None:
    from .. import verdicts
    from ..checking import smoke as smokelib

    if report_path:
        smokelib.write_json(verdict, report_path)
    if junit_path:
        smokelib.write_junit(verdict, junit_path)
    if html_path:
        from .. import report_page

        report_page.write_verdict(verdict.to_dict(), image_ref, signed, html_path)
    verdicts.require_pass(
        verdict, image_ref, fail_hint=f"verdict: {entry}",
        incomplete_hint="the host could not run a check; run it where it can (the image's earlier verdict stands)",
    )
    gpu_note = "GPU-verified" if verdict.gpu_verified else "GPU-unverified"
    click.echo(f"smoke passed {image_ref} {verdict.image_id} ({gpu_note}, {verdict.seconds:.1f} s; phases: "
               f"{smokelib.format_phases(dict(verdict.phases), verdict.seconds)})")


@click.command("serve-check")
@click.option("--url", required=True, help="Base URL of a running OpenAI-compatible server.")
@click.option("--model", default=None, help="Model name (default: the first /v1/models lists).")
@click.option("--report", "report_path", type=click.Path(dir_okay=False, path_type=Path), help="Write JSON here.")
@click.option("--wait", "wait_s", type=click.FloatRange(0), default=30, show_default=True,
              help="Seconds to wait for the server's /health before giving up.")
@click.option("--keep-going", is_flag=True, help="Run every level even after one failed (while the server lives).")
@with_options(sweep_options)
def serve_check(url: str, model: str | None, report_path: Path | None, wait_s: float, keep_going: bool,
                concurrency: str,
                requests_n: int, min_tokens: int | None, reference_path: Path | None,
                record_path: Path | None) -> None:
    """Run the concurrency sweep against an already running server."""
    import json
    from dataclasses import replace

    from ..errors import SmokeError
    from ..inimage import recording, sweep
    from ..inimage import reference as refmod
    from ..judges import sweep as judged

    sweep.check_url(url)
    levels = sweep.parse_levels(concurrency)
    answers = refmod.answer_options(reference_path, record_path)
    ref = answers.reference
    sweep.check_min_tokens(min_tokens, ref.max_tokens if ref else sweep.MAX_TOKENS)
    check_output_file(report_path, "--report")
    progress(f"==> waiting up to {wait_s:.0f} s for {url.rstrip('/')}/health")
    sweep.wait_healthy(url.rstrip("/"), wait_s, progress=progress)
    if answers.record is not None:
        progress(f"==> recording reference answers from {url.rstrip('/')} (concurrency 1)")
        # A server nobody here started: its settings are not known here, and the file says so.
        ref = refmod.write(replace(recording.record(url, model, progress=progress),
                                   settings={"server": url, "known": False}), answers.record)
        click.echo(f"recorded {len(ref.answers)} reference answers to {answers.record} (sha256 {ref.sha256})")
    result = judged.sweep(url, model, levels, requests_n, min_tokens=min_tokens, reference=ref,
                          progress=progress, watch=sweep.HealthWatch(url), keep_going=keep_going)
    if report_path:
        from ..journal.atomic import write_atomic  # a full disk is one line naming the file, not a dump

        write_atomic(report_path, json.dumps(result.to_dict(), indent=2) + "\n")
    if not result.ok:
        raise SmokeError(judged.failure_message(result))
    checked = (f", every reply at concurrency 1 bitwise {ref.path}'s and every reply above it whole (how far each "
               "moved from its concurrency-1 reply is in the report)" if ref else "")
    click.echo(f"sweep passed {url} levels {','.join(map(str, levels))}{checked}")


@click.command()
@click.argument("files", nargs=-1, required=True, type=click.Path(exists=True, path_type=Path), metavar="FILE...")
@click.option("--out", "-o", "out", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="The HTML page to write.")
def report(files: tuple[Path, ...], out: Path) -> None:
    """Render smoke reports (or a GPU record folder) as one self-contained HTML page: the verdict and its
    reasons, then the sweep, the oracle's evidence and the phases drawn, each chart with its numbers."""
    from .. import report_page

    check_output_file(out, "--out")
    page = report_page.write(list(files), out)
    click.echo(f"wrote {out}: {len(page.shown)} report(s), {len(page.figures)} chart(s)")
