"""The ``[smoke]`` table of an image definition: how ``smoke`` judges an image of that definition.

Example (every key optional)::

    [smoke]
    gpu = "require"                          # auto | require | off
    model = "/models/MiniMax-M3"             # served with the image's own `vllm serve`
    reference = "references/v0.25.1.json"    # answers recorded from a trusted image
    concurrency = [1, 2, 4, 8, 16]
    requests = 32
    min_tokens = 32
    deadline = 3600                          # seconds
    serve_args = ["--max-model-len", "8192", "--enforce-eager"]
    sign_key = "env:VLLM_HOTFIX_SIGN_KEY"    # or a PEM file

    [smoke.kubernetes]                       # used with --launcher kubernetes
    namespace = "gpu"
    gpus = 1
    service_account = "vllm-hotfix"
    pull_secrets = ["internal-registry"]
    node_selector = { "nvidia.com/gpu.product" = "NVIDIA-H200" }
    tolerations = [{ key = "nvidia.com/gpu", operator = "Exists", effect = "NoSchedule" }]
    resources = { requests = { cpu = "8", memory = "64Gi" }, limits = { memory = "96Gi" } }

Relative paths (``model``, ``reference``, a ``sign_key`` file) are relative to
the project folder that holds ``images/`` (``--root``), never to the working
folder, so that the same definition means the same files from wherever
``make`` or the tool is started. Only the shapes are checked here, when the
definition is loaded; whether a path exists is the business of the host that
smokes (``smoke --explain`` says).

Signing keys are local ECDSA P-256 keys (a PEM file or ``env:NAME``). A key
held by a KMS (``awskms://``, ``gcpkms://``, ``hashivault://``...) is refused by
name: signing with one would need that service's client and credentials,
which this tool does not have.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import DefinitionError

GPU_MODES = ("auto", "require", "off")
_EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
_OPERATORS = ("Exists", "Equal")
_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
# A Kubernetes quantity: 8, 500m, 64Gi, 1.5, 2e3.
QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E)?\Z")
_RESOURCE_NAME = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?\Z")


@dataclass(frozen=True, slots=True)
class Toleration:
    key: str = ""
    operator: str = "Equal"
    value: str = ""
    effect: str = ""
    seconds: int | None = None  # tolerationSeconds (NoExecute only)

    def to_api(self) -> dict[str, Any]:
        """As the Kubernetes API spells a toleration."""
        out: dict[str, Any] = {"operator": self.operator}
        for name, value in (("key", self.key), ("value", self.value), ("effect", self.effect)):
            if value:
                out[name] = value
        if self.seconds is not None:
            out["tolerationSeconds"] = self.seconds
        return out

    def show(self) -> str:
        """kubectl's taint spelling: KEY[=VALUE]:EFFECT, or KEY (Exists), or : (every taint)."""
        head = self.key + (f"={self.value}" if self.operator == "Equal" and self.value else "")
        tail = f":{self.effect}" if self.effect else ""
        return (head + tail) or ":"


@dataclass(frozen=True, slots=True)
class KubernetesTable:
    namespace: str | None = None
    gpus: int | None = None
    service_account: str | None = None
    pull_secrets: tuple[str, ...] | None = None
    node_selector: Mapping[str, str] | None = None
    tolerations: tuple[Toleration, ...] | None = None
    resources: Mapping[str, Mapping[str, str]] | None = None  # requests/limits -> resource -> quantity


@dataclass(frozen=True, slots=True)
class SmokeTable:
    """The table as written; None for a key it does not set."""

    gpu: str | None = None
    model: Path | None = None
    reference: Path | None = None
    concurrency: tuple[int, ...] | None = None
    requests: int | None = None
    min_tokens: int | None = None
    deadline: int | None = None
    serve_args: tuple[str, ...] | None = None
    sign_key: str | None = None
    kubernetes: KubernetesTable = field(default_factory=KubernetesTable)

    def value(self, key: str) -> Any:
        """A key's value, ``kubernetes.KEY`` for the Job's."""
        if key.startswith("kubernetes."):
            return getattr(self.kubernetes, key.removeprefix("kubernetes."))
        return getattr(self, key)


class _Reader:
    """Reads one table of one file; every error names the file and the key."""

    def __init__(self, path: Path, prefix: str, table: Mapping[str, Any], keys: tuple[str, ...]) -> None:
        self.path, self.prefix, self.table = path, prefix, table
        for key in table:
            if key not in keys:
                raise DefinitionError(f"{path}: unknown key {prefix}.{key} (known: {', '.join(keys)})")

    def fail(self, key: str, what: str) -> DefinitionError:
        return DefinitionError(f"{self.path}: {self.prefix}.{key} {what}")

    def text(self, key: str, choices: tuple[str, ...] = ()) -> str | None:
        value = self.table.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value or not value.isprintable():
            raise self.fail(key, "must be a non-empty string of one line")
        if choices and value not in choices:
            raise self.fail(key, f"{value!r}: expected one of {', '.join(choices)}")
        return value

    def whole(self, key: str, low: int, high: int) -> int | None:
        value = self.table.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            raise self.fail(key, f"must be a whole number from {low} to {high}")
        return value

    def texts(self, key: str) -> tuple[str, ...] | None:
        value = self.table.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, str) and v.isprintable() for v in value):
            raise self.fail(key, "must be a list of strings, each of one line")
        return tuple(value)


def parse(data: Any, path: Path) -> SmokeTable:
    """The ``[smoke]`` table of ``path`` (``data`` as TOML read it); DefinitionError naming the file and key."""
    if not isinstance(data, dict):
        raise DefinitionError(f"{path}: [smoke] must be a table")
    read = _Reader(path, "smoke", data, ("gpu", "model", "reference", "concurrency", "requests", "min_tokens",
                                         "deadline", "serve_args", "sign_key", "kubernetes"))
    levels = data.get("concurrency")
    if levels is not None and (not isinstance(levels, list) or not levels or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 4096 for n in levels)):
        raise read.fail("concurrency", "must be a list of whole numbers from 1 to 4096, e.g. [1, 2, 4, 8, 16]")
    model, reference = read.text("model"), read.text("reference")
    return SmokeTable(
        gpu=read.text("gpu", GPU_MODES), model=Path(model) if model else None,
        reference=Path(reference) if reference else None,
        concurrency=tuple(levels) if levels is not None else None, requests=read.whole("requests", 1, 100_000),
        min_tokens=read.whole("min_tokens", 1, 100_000),
        deadline=read.whole("deadline", 5, 7 * 86400),
        serve_args=read.texts("serve_args"), sign_key=_sign_key(read),
        kubernetes=_kubernetes(data.get("kubernetes"), path),
    )


def _sign_key(read: _Reader) -> str | None:
    value = read.text("sign_key")
    if value is None:
        return None
    scheme = _URI.match(value)
    if scheme:
        raise read.fail("sign_key", f"{value!r}: a key held by a KMS ({scheme.group(1)}://) is not supported: "
                                    "this tool signs with a local ECDSA P-256 key, a PEM file or env:NAME")
    if value.startswith("env:") and not _ENV_NAME.match(value.removeprefix("env:")):
        raise read.fail("sign_key", f"{value!r}: env:NAME needs an environment variable's name")
    return value


def _kubernetes(data: Any, path: Path) -> KubernetesTable:
    if data is None:
        return KubernetesTable()
    if not isinstance(data, dict):
        raise DefinitionError(f"{path}: [smoke.kubernetes] must be a table")
    read = _Reader(path, "smoke.kubernetes", data, ("namespace", "gpus", "service_account", "pull_secrets",
                                                    "node_selector", "tolerations", "resources"))
    selector = data.get("node_selector")
    if selector is not None and (not isinstance(selector, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in selector.items())):
        raise read.fail("node_selector",
                        'must be a table of strings, e.g. { "nvidia.com/gpu.product" = "NVIDIA-H200" }')
    tolerations = data.get("tolerations")
    if tolerations is not None:
        if not isinstance(tolerations, list):
            raise read.fail("tolerations", "must be a list of tables (key, operator, value, effect, seconds)")
        tolerations = tuple(toleration(item, f"{path}: smoke.kubernetes.tolerations[{n}]")
                            for n, item in enumerate(tolerations))
    resources = data.get("resources")
    if resources is not None:
        resources = _resources(resources, f"{path}: smoke.kubernetes.resources")
    return KubernetesTable(namespace=read.text("namespace"), gpus=read.whole("gpus", 1, 1024),
                           service_account=read.text("service_account"), pull_secrets=read.texts("pull_secrets"),
                           node_selector=dict(selector) if selector is not None else None,
                           tolerations=tolerations, resources=resources)


def toleration(item: Any, where: str) -> Toleration:
    """One toleration from a table; DefinitionError naming ``where``."""
    if not isinstance(item, dict):
        raise DefinitionError(f"{where} must be a table (key, operator, value, effect, seconds)")
    unknown = sorted(set(item) - {"key", "operator", "value", "effect", "seconds"})
    if unknown:
        raise DefinitionError(f"{where}: unknown key {unknown[0]} (known: key, operator, value, effect, seconds)")
    if not all(isinstance(item.get(k, ""), str) for k in ("key", "operator", "value", "effect")):
        raise DefinitionError(f"{where}: key, operator, value and effect must be strings")
    seconds = item.get("seconds")
    if seconds is not None and (not isinstance(seconds, int) or isinstance(seconds, bool) or seconds < 0):
        raise DefinitionError(f"{where}: seconds must be a whole number of seconds")
    made = Toleration(key=item.get("key", ""), operator=item.get("operator", "Equal"), value=item.get("value", ""),
                      effect=item.get("effect", ""), seconds=seconds)
    problem = toleration_problem(made)
    if problem:
        raise DefinitionError(f"{where}: {problem}")
    return made


def toleration_problem(t: Toleration) -> str | None:
    """What the API server would refuse in a toleration, in words; None if nothing."""
    if t.operator not in _OPERATORS:
        return f"operator {t.operator!r}: expected Exists or Equal"
    if t.effect and t.effect not in _EFFECTS:
        return f"effect {t.effect!r}: expected one of {', '.join(_EFFECTS)}"
    if t.operator == "Exists" and t.value:
        return "operator Exists takes no value"
    if not t.key and t.operator != "Exists":
        return "a toleration without a key must use operator Exists"
    if t.key and not _RESOURCE_NAME.match(t.key):
        return f"key {t.key!r} is not a label key"
    if t.seconds is not None and t.effect != "NoExecute":
        return "seconds applies to effect NoExecute only"
    return None


def _resources(data: Any, where: str) -> dict[str, dict[str, str]]:
    if not isinstance(data, dict) or not set(data) <= {"requests", "limits"}:
        raise DefinitionError(f"{where} must be a table of requests and/or limits, e.g. "
                              '{ requests = { cpu = "8", memory = "64Gi" } }')
    out: dict[str, dict[str, str]] = {}
    for kind, table in data.items():
        if not isinstance(table, dict):
            raise DefinitionError(f"{where}.{kind} must be a table of resource = quantity")
        out[kind] = {}
        for name, value in table.items():
            quantity = str(value) if isinstance(value, int) and not isinstance(value, bool) else value
            problem = resource_problem(name, quantity)
            if problem:
                raise DefinitionError(f"{where}.{kind}.{name}: {problem}")
            out[kind][name] = quantity
    return out


def resource_problem(name: str, quantity: Any) -> str | None:
    """What the API server would refuse in one resource amount, in words; None if nothing."""
    if not _RESOURCE_NAME.match(name):
        return f"{name!r} is not a resource name (e.g. cpu, memory, nvidia.com/gpu)"
    if name == "nvidia.com/gpu":
        return "the GPUs are the Job's gpus (--gpus), not a resource of their own here"
    if not isinstance(quantity, str) or not QUANTITY.match(quantity):
        return f"{quantity!r} is not a quantity (e.g. 8, 500m, 64Gi)"
    return None
