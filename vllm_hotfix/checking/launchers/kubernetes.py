"""The runner as a Kubernetes Job: emitted as YAML, or submitted and followed with the official client.

The Job starts the image by digest (a cluster pulls; it has no local
images), asks for ``nvidia.com/gpu``, mounts the runner from a ConfigMap
(emitted with it), never retries and has a deadline. It holds no key, no
Secret and no signing: the runner only reports.

The report comes back in the pod's log, on a marked line. ``--submit``
follows the Job to its end and reads the log; ``--collect job/NAME`` reads
the log of a Job that was emitted and has ended (:meth:`KubernetesLauncher.collect`),
and ``--collect FILE`` reads a log saved from it. Either way the host that
reads it judges it and signs it. The ``kubernetes`` package is imported
only here, only to talk to a cluster.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...building.smoke_table import Toleration, resource_problem, toleration_problem
from ...errors import Refused, SmokeError, SmokeIncomplete, UsageError
from ...inimage.runner import MOUNT
from ...registry.refs import shown
from .base import Launched, argv, job_bytes, results, runner_files

log = logging.getLogger(__name__)

POLL_S = 10
# Every API call's (connect, read) limit in seconds: an API server that accepts and never answers must not
# hold the run (the pod log is the largest answer: a report of a few hundred KB).
API_TIMEOUT = (10.0, 120.0)
CONFIGMAP_LIMIT = 1024 * 1024  # what the API server accepts for one ConfigMap's data


@dataclass(frozen=True, slots=True)
class JobSpec:
    name: str
    namespace: str = "default"
    gpus: int = 1
    node_selector: Mapping[str, str] | None = None
    deadline_s: int = 3600
    python: str = "python3"
    # The pod's, for a private registry and a locked-down cluster: the kubelet's pull credentials by Secret
    # name (nothing of them reaches the runner), the account the pod runs as, where it may be scheduled.
    pull_secrets: tuple[str, ...] = ()
    service_account: str | None = None
    tolerations: tuple[Toleration, ...] = ()
    resources: Mapping[str, Mapping[str, str]] | None = None  # requests/limits beside the GPUs


def config_key(rel: str) -> str:
    """A ConfigMap key for a runner file (keys may not hold '/')."""
    return rel.replace("/", "__")


def manifests(image: str, spec: JobSpec, job: Mapping[str, Any], extra: Mapping[str, bytes]) -> list[dict[str, Any]]:
    """The ConfigMap with the runner and the Job that runs it, as plain dicts (Kubernetes API objects)."""
    if "@sha256:" not in image:
        raise UsageError(f"{image}: a cluster starts the image by digest (NAME@sha256:...): push it first")
    files = {**runner_files(extra), "job.json": job_bytes(job)}
    labels = {"app.kubernetes.io/name": "vllm-hotfix-smoke"}
    meta: dict[str, Any] = {"name": spec.name, "namespace": spec.namespace, "labels": labels}
    config_map = {
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": dict(meta),
        "data": {config_key(rel): data.decode("utf-8") for rel, data in files.items()},
    }
    size = sum(len(data) for data in files.values())
    if size > CONFIGMAP_LIMIT:
        # The API server refuses such an object; say so before anything is written or created.
        raise UsageError(f"the runner and its job come to {size} bytes, over the {CONFIGMAP_LIMIT} bytes a "
                         "ConfigMap may hold: fewer patch-set checks, or smaller reference answers")
    volumes: list[dict[str, Any]] = [{
        "name": "runner",
        "configMap": {"name": spec.name, "items": [{"key": config_key(rel), "path": rel} for rel in files]},
    }]
    mounts: list[dict[str, Any]] = [{"name": "runner", "mountPath": MOUNT, "readOnly": True}]
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{
            "name": "runner", "image": image, "imagePullPolicy": "IfNotPresent",
            "command": argv(spec.python),
            "env": [{"name": "PYTHONDONTWRITEBYTECODE", "value": "1"}],
            "resources": job_resources(spec),
            "volumeMounts": mounts,
        }],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.pull_secrets:
        pod["imagePullSecrets"] = [{"name": name} for name in spec.pull_secrets]
    if spec.service_account:
        pod["serviceAccountName"] = spec.service_account
    if spec.tolerations:
        pod["tolerations"] = [t.to_api() for t in spec.tolerations]
    batch_job = {
        "apiVersion": "batch/v1", "kind": "Job", "metadata": dict(meta),
        "spec": {"backoffLimit": 0, "activeDeadlineSeconds": spec.deadline_s, "ttlSecondsAfterFinished": 86400,
                 "template": {"metadata": {"labels": dict(labels)}, "spec": pod}},
    }
    return [config_map, batch_job]


def job_resources(spec: JobSpec) -> dict[str, dict[str, str]]:
    """The container's requests and limits: the GPUs as a limit (Kubernetes sets the request to it), and what
    ``resources`` adds; a GPU request of its own is refused where ``resources`` is read."""
    out: dict[str, dict[str, str]] = {kind: dict(amounts) for kind, amounts in (spec.resources or {}).items()
                                      if amounts}
    out.setdefault("limits", {})["nvidia.com/gpu"] = str(spec.gpus)
    return out


def to_yaml(docs: list[dict[str, Any]]) -> str:
    """A multi-document YAML stream; each document is JSON, which YAML reads as it is."""
    return "".join(f"---\n{json.dumps(doc, indent=2, sort_keys=True)}\n" for doc in docs)


# Kubernetes' own rules for what these names may be (the API server refuses anything else, after the work).
_DNS_LABEL = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?"
_LABEL_NAME = r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?"


def parse_selectors(texts: Sequence[str]) -> dict[str, str] | None:
    """Every ``--node-selector KEY=VALUE`` as one node selector."""
    out: dict[str, str] = {}
    for text in texts:
        out.update(parse_selector(text) or {})
    return out or None


def check_selector(selector: Mapping[str, str], where: str) -> dict[str, str]:
    """A node selector from a definition's table, held to the rules of the flag's."""
    for key, value in selector.items():
        try:
            parse_selector(f"{key}={value}")
        except UsageError as exc:
            raise UsageError(f"{where}: {str(exc).removeprefix('--node-selector ')}") from None
    return dict(selector)


def parse_selector(text: str | None) -> dict[str, str] | None:
    """``KEY=VALUE``, each as a label key and value must be (a prefix of DNS labels, 63-character names)."""
    if not text:
        return None
    key, sep, value = text.partition("=")
    if not sep or not key or not value:
        raise UsageError(f"--node-selector {shown(text)}: expected KEY=VALUE, e.g. "
                         "nvidia.com/gpu.product=NVIDIA-H200")
    prefix, slash, name = key.rpartition("/")
    bad_prefix = slash and (len(prefix) > 253 or not re.fullmatch(rf"{_DNS_LABEL}(\.{_DNS_LABEL})*", prefix))
    if bad_prefix or len(name) > 63 or not re.fullmatch(_LABEL_NAME, name):
        raise UsageError(f"--node-selector {shown(text)}: {shown(key)} is not a label key "
                         "([PREFIX/]NAME: NAME up to 63 letters, digits, '-', '_', '.')")
    if len(value) > 63 or not re.fullmatch(_LABEL_NAME, value):
        raise UsageError(f"--node-selector {shown(text)}: {shown(value)} is not a label value "
                         "(up to 63 letters, digits, '-', '_', '.', starting and ending with a letter or digit)")
    return {key: value}


def parse_toleration(text: str) -> Toleration:
    """kubectl's taint spelling: ``KEY=VALUE:EFFECT`` (Equal), ``KEY:EFFECT`` or ``KEY`` (Exists), or ``:`` (every
    taint); the effect may be left out (every effect)."""
    head, colon, effect = text.rpartition(":") if ":" in text else (text, "", "")
    key, eq, value = head.partition("=")
    made = Toleration(key=key, operator="Equal" if eq else "Exists", value=value, effect=effect)
    problem = toleration_problem(made) if text else "empty"
    if problem or (colon and not effect and key):
        raise UsageError(f"--toleration {shown(text)}: {problem or 'an effect after the colon'} (expected "
                         "KEY=VALUE:EFFECT, KEY:EFFECT, KEY or ':'; EFFECT NoSchedule, PreferNoSchedule or NoExecute)")
    return made


def parse_resources(texts: Sequence[str]) -> dict[str, dict[str, str]] | None:
    """Every ``--resource requests.cpu=8`` / ``limits.memory=96Gi`` as a container's requests and limits."""
    out: dict[str, dict[str, str]] = {}
    for text in texts:
        name, eq, quantity = text.partition("=")
        kind, dot, resource = name.partition(".")
        if not eq or not dot or kind not in ("requests", "limits"):
            raise UsageError(f"--resource {shown(text)}: expected requests.NAME=QUANTITY or limits.NAME=QUANTITY, "
                             "e.g. requests.cpu=8 or limits.memory=96Gi")
        problem = resource_problem(resource, quantity)
        if problem:
            raise UsageError(f"--resource {shown(text)}: {problem}")
        out.setdefault(kind, {})[resource] = quantity
    return out or None


def check_name(value: str, option: str, *, subdomain: bool, what: str | None = None) -> str:
    """A namespace (a DNS-1123 label) or a Secret's or service account's name (a DNS-1123 subdomain), checked
    before any work."""
    pattern = rf"{_DNS_LABEL}(\.{_DNS_LABEL})*" if subdomain else _DNS_LABEL
    limit = 253 if subdomain else 63
    if len(value) > limit or not re.fullmatch(pattern, value):
        kind, chars = ("a Secret's name", "'-' and '.'") if subdomain else ("a namespace", "'-'")
        what = what or kind
        raise UsageError(f"{option} {shown(value)}: not {what} in Kubernetes (lowercase letters, digits and "
                         f"{chars}, starting and ending with a letter or digit, at most {limit})")
    return value


def load_config(kubeconfig: str | None) -> None:
    """Load the kubeconfig the client talks with; UsageError (64, one line) for a file that is not one.

    Called before anything is read from a registry or written, so a wrong
    file is named at once, and again by the launcher that talks to the cluster.
    """
    try:
        from kubernetes import config
    except ImportError:
        raise UsageError("--launcher kubernetes --submit/--collect job/NAME needs the kubernetes package: "
                         "pip install 'vllm-hotfix[kubernetes]'") from None
    import yaml  # the client's own YAML reader (a requirement of kubernetes)
    from kubernetes.config.config_exception import ConfigException

    try:
        config.load_kube_config(config_file=kubeconfig)
    except (ConfigException, OSError, yaml.YAMLError, ValueError, AttributeError, TypeError) as exc:
        # A file that is not YAML raises the YAML library's own error; YAML that is not a mapping, an
        # AttributeError or TypeError inside the client: all of them the file's fault.
        why = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise UsageError(f"kubeconfig {kubeconfig or '(default)'}: not a usable kubeconfig: {why}") from None


class KubernetesLauncher:
    """Submits the Job with the official client and follows it to its end, or reads one that has ended."""

    name = "kubernetes"

    def __init__(self, spec: JobSpec, kubeconfig: str | None = None, say: Callable[[str], None] = lambda _l: None,
                 extra: Mapping[str, bytes] | None = None, *, image: str | None = None, gpus: int | None = None
                 ) -> None:
        self.spec = spec
        self.kubeconfig = kubeconfig
        self.say = say
        self.extra = dict(extra or {})
        # What the pod the report is read from must have run: the image by digest and the GPUs it was given.
        self.image, self.gpus = image, gpus

    def launch(self, image: str, runner_dir: Path, job: Mapping[str, Any], gpu: str | None,
               model: Path | None = None) -> Launched:
        if model is not None:
            raise UsageError("--serve-model with --launcher kubernetes: the model folder is not on the cluster")
        config_map, batch_job = manifests(image, self.spec, job, self.extra)
        ns = self.spec.namespace

        def submit(core: Any, batch: Any) -> bool:
            core.create_namespaced_config_map(ns, config_map, _request_timeout=API_TIMEOUT)
            batch.create_namespaced_job(ns, batch_job, _request_timeout=API_TIMEOUT)
            self.say(f"    submitted Job {ns}/{self.spec.name}")
            deadline = time.monotonic() + self.spec.deadline_s + 300
            while not self._ended(batch):
                if time.monotonic() > deadline:
                    raise SmokeError(f"Job {ns}/{self.spec.name} did not end within its deadline")
                time.sleep(POLL_S)
            return True

        return self._talk(submit)

    def collect(self) -> Launched:
        """The report of the Job ``spec.name``, which must have ended (emitted, applied and run elsewhere)."""
        ns = self.spec.namespace

        def ended(_core: Any, batch: Any) -> bool:
            if not self._ended(batch):
                raise SmokeError(f"Job {ns}/{self.spec.name} has not ended yet",
                                 hint="collect it once `kubectl get job` shows it complete or failed")
            return True

        return self._talk(ended)

    def _check_pod(self, pod: Any) -> None:
        """Refused unless the pod ran the runner in the image this host emitted or submitted the Job for, with the
        GPUs it asked for: a Job of the same name made by someone else reports nothing about this image."""
        if self.image is None and self.gpus is None:
            return
        containers = [c for c in ((pod.spec.containers if pod.spec is not None else None) or [])
                      if c.name == "runner"]
        where = f"Job {self.spec.namespace}/{self.spec.name}"
        if not containers:
            raise Refused(f"{where}: its pod has no runner container: not the Job this host made")
        runner = containers[0]
        if self.image is not None and runner.image != self.image:
            raise Refused(f"{where}: its pod ran {runner.image}, not {self.image} (the image the Job was made for)")
        limits = dict((runner.resources.limits if runner.resources is not None else None) or {})
        given = str(limits.get("nvidia.com/gpu", "0"))
        if self.gpus is not None and given != str(self.gpus):
            raise Refused(f"{where}: its pod was given {given} GPU(s), the Job was made with {self.gpus}")

    def _ended(self, batch: Any) -> bool:
        status = batch.read_namespaced_job_status(self.spec.name, self.spec.namespace,
                                                  _request_timeout=API_TIMEOUT).status
        return bool(status.succeeded or status.failed)

    def _talk(self, first: Callable[[Any, Any], bool]) -> Launched:
        """Run ``first`` against the cluster, then read the runner's report from the Job's pod log."""
        load_config(self.kubeconfig)
        import urllib3.exceptions
        from kubernetes import client
        from kubernetes.client.rest import ApiException

        api: Any = client.ApiClient()
        # Untyped on purpose: the client takes the manifests as the same dicts --emit writes.
        core: Any = client.CoreV1Api(api)
        batch: Any = client.BatchV1Api(api)
        ns = self.spec.namespace
        try:
            first(core, batch)
            pods = core.list_namespaced_pod(ns, label_selector=f"job-name={self.spec.name}",
                                            _request_timeout=API_TIMEOUT).items
            if not pods:
                raise SmokeError(f"Job {ns}/{self.spec.name} ended with no pod to read the report from")
            self._check_pod(pods[0])
            text = core.read_namespaced_pod_log(pods[0].metadata.name, ns, container="runner",
                                               _request_timeout=API_TIMEOUT)
        except ApiException as exc:
            raise SmokeError(f"the cluster refused the Job {ns}/{self.spec.name}: {exc.status} {exc.reason}") \
                from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            # The host could not run the Job: incomplete (11), not a check the image failed (7).
            raise SmokeIncomplete(f"cannot reach the Kubernetes API server of "
                                  f"{self.kubeconfig or 'the default kubeconfig'}: "
                                  f"{(str(exc).splitlines() or [type(exc).__name__])[0][:300]}",
                                  hint="check the cluster's address in the kubeconfig and that it answers "
                                       "(kubectl cluster-info)") from None
        return results(text, text, f"Job {ns}/{self.spec.name}")
