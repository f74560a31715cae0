"""The settings a smoke run uses, each with where it came from: a flag, the definition's ``[smoke]`` table, or
the tool's default (:func:`resolve`), and the same as text for ``smoke --explain`` (:func:`explain`).

Which definition's table applies to an image is decided from what the user and
this host know, never from the image: ``--definition``, else this host's
build record of the reference, else the reference's tag when it is a
definition's output tag (``v0.25.1-m3patch``, also with a platform suffix
``-x86_64`` / ``-aarch64``). An image's labels do not choose how it is judged;
a label-named definition still decides the patch-set checks as before, and the
layer identity check holds the image to the definition chosen here.

A flag given on the command line replaces the table's value whole (a
``--serve-arg`` list replaces ``serve_args``, one ``--pull-secret`` replaces
``pull_secrets``). Relative paths in the table are relative to the project folder
(``--root``): see :mod:`vllm_hotfix.building.smoke_table`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..building import definitions
from ..building.smoke_table import SmokeTable
from ..engine import split_reference
from ..errors import DefinitionError, UsageError
from ..journal import records

# Every setting, the flag that sets it, and the tool's default when neither flag nor table does.
FLAGS: dict[str, str] = {
    "gpu": "--gpu", "model": "--serve-model", "reference": "--reference", "concurrency": "--concurrency",
    "requests": "--requests", "min_tokens": "--min-tokens", "deadline": "--deadline", "serve_args": "--serve-arg",
    "sign_key": "--sign-key",
    "kubernetes.namespace": "--namespace", "kubernetes.gpus": "--gpus",
    "kubernetes.service_account": "--service-account", "kubernetes.pull_secrets": "--pull-secret",
    "kubernetes.node_selector": "--node-selector", "kubernetes.tolerations": "--toleration",
    "kubernetes.resources": "--resource",
}
DEFAULTS: dict[str, Any] = {
    "gpu": "auto", "model": None, "reference": None, "concurrency": (1, 2, 4, 8, 16), "requests": 32,
    "min_tokens": None, "deadline": None, "serve_args": (), "sign_key": None,
    "kubernetes.namespace": "default", "kubernetes.gpus": 1, "kubernetes.service_account": None,
    "kubernetes.pull_secrets": (), "kubernetes.node_selector": None, "kubernetes.tolerations": (),
    "kubernetes.resources": None,
}
PATHS = ("model", "reference")
PLATFORM_SUFFIXES = ("-x86_64", "-aarch64")


@dataclass(frozen=True, slots=True)
class Setting:
    value: Any
    source: str  # "flag --gpu", "images/v0.25.1.toml [smoke] gpu", "default"


@dataclass(frozen=True, slots=True)
class Resolved:
    """The settings of one smoke run and the definition whose table gave some of them (None: no table)."""

    image: str
    definition: definitions.ImageDefinition | None
    definition_source: str
    settings: Mapping[str, Setting] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.settings[key].value

    def from_table(self, key: str) -> bool:
        return not self.settings[key].source.startswith(("flag", "default"))


def choose_definition(root: Path, image: str, flag: str | None) -> tuple[definitions.ImageDefinition | None, str]:
    """The definition whose ``[smoke]`` table applies to ``image``, and how it was chosen, in words."""
    if flag:
        return definitions.load(root, flag), "flag --definition"
    for entry in records.builds(root):
        if entry.data.get("output_ref") == image:
            tag = str((entry.data.get("inputs") or {}).get("definition") or "")
            if tag:
                return definitions.load(root, tag), f"this host's build record {entry.path.name}"
    if image.startswith("sha256:") or "@" in image:
        return None, f"none: {image} names no tag (give --definition TAG)"
    tag = split_reference(image)[1]
    wanted = {tag, *(tag.removesuffix(s) for s in PLATFORM_SUFFIXES if tag.endswith(s))}
    found: list[definitions.ImageDefinition] = []
    broken: list[DefinitionError] = []
    for path in sorted((root / "images").glob("*.toml")):
        try:
            loaded = definitions.load(root, path.stem)
        except DefinitionError as exc:
            broken.append(exc)
            continue
        if loaded.output_tag in wanted:
            found.append(loaded)
    if not found and broken:
        # A definition that cannot be loaded may be this image's: its error, never a run under the defaults its
        # [smoke] table was meant to tighten.
        raise broken[0]
    if len(found) == 1:
        return found[0], f"the image's tag {tag} (definition {found[0].tag}'s output tag)"
    if len(found) > 1:
        raise UsageError(f"{image}: its tag {tag} is the output tag of definitions "
                         f"{', '.join(d.tag for d in found)}: give --definition TAG")
    return None, f"none: the tag {tag} is no definition's output tag (give --definition TAG)"


def resolve(root: Path, image: str, given: Mapping[str, Any], definition_flag: str | None) -> Resolved:
    """Every setting of :data:`FLAGS` from ``given`` (the flags the user gave, by setting name), else the chosen
    definition's table, else the default."""
    unknown = set(given) - set(FLAGS)
    assert not unknown, unknown
    defn, how = choose_definition(root, image, definition_flag)
    table = defn.smoke if defn is not None else SmokeTable()
    where = _shown_path(root, defn.path) if defn is not None else ""
    settings: dict[str, Setting] = {}
    for key, flag in FLAGS.items():
        if key in given:
            settings[key] = Setting(given[key], f"flag {flag}")
            continue
        value = table.value(key)
        if value is None:
            settings[key] = Setting(DEFAULTS[key], "default")
            continue
        if key in PATHS and not value.is_absolute():
            value = root / value
        elif key == "sign_key" and not value.startswith("env:") and not Path(value).is_absolute():
            value = str(root / value)
        section, _, name = key.rpartition(".")
        settings[key] = Setting(value, f"{where} [smoke{'.' + section if section else ''}] {name}")
    return Resolved(image, defn, how, settings)


def check_paths(resolved: Resolved, record_reference: bool) -> None:
    """A table's model or reference this host does not have: one line naming the file and key."""
    for key in PATHS:
        if not resolved.from_table(key):
            continue
        path = resolved[key]
        if key == "reference" and record_reference:
            continue
        if not path.exists():
            raise UsageError(f"{resolved.settings[key].source}: {path} does not exist on this host",
                             hint=f"{FLAGS[key]} overrides it (smoke --explain shows every setting's source)")


def _shown_path(root: Path, path: Path) -> str:
    try:
        return str(path.relative_to(root))
    except ValueError:
        return str(path)


def _show(value: Any) -> str:
    if value is None or value == () or value == {}:
        return "-"
    if isinstance(value, tuple | list) and all(isinstance(v, int) for v in value):
        return ",".join(map(str, value))
    if isinstance(value, tuple | list):
        return " ".join(getattr(v, "show", lambda v=v: str(v))() for v in value) if value else "-"
    if isinstance(value, Mapping) and all(isinstance(v, Mapping) for v in value.values()):
        return "; ".join(f"{k}: {_show(v)}" for k, v in value.items())
    if isinstance(value, Mapping):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def explain(resolved: Resolved, launcher: str) -> str:
    """The resolved settings as text: one line each, its value and where it came from."""
    lines = [f"smoke settings for {resolved.image}",
             f"  {'definition':<28} {resolved.definition.tag if resolved.definition else '-':<40}  "
             f"{resolved.definition_source}"]
    for key, setting in resolved.settings.items():
        if key.startswith("kubernetes.") and launcher != "kubernetes" and setting.source == "default":
            continue
        value = _show(setting.value)
        if key in PATHS and setting.value is not None and not Path(setting.value).exists():
            value += " (missing on this host)"
        lines.append(f"  {key:<28} {value:<40}  {setting.source}")
    if launcher != "kubernetes" and any(k.startswith("kubernetes.") and s.source != "default"
                                        for k, s in resolved.settings.items()):
        lines.append("  (kubernetes.* apply with --launcher kubernetes only)")
    lines.append("nothing was started")
    return "\n".join(lines)
