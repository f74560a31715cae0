"""Image definitions: ``images/<tag>.toml``, loaded and validated as data.

A new base release is a new definition file and a new patch folder; no code
changes. Example::

    [base]
    repository = "vllm/vllm-openai"
    tag = "v0.25.1"

    [package]
    name = "vllm"
    version = "0.25.1"   # optional; derived from the tag when absent

    [patches]
    set = "v0.25.1"      # folder under patches/

    [output]
    suffix = "m3patch"

A variant for some hosts only (another patch set for the same base) is its own
file, ``images/<base tag>-<variant>.toml``, with::

    [variant]
    name = "sm100"
    hosts = "NVIDIA SM100 (Blackwell) GPUs"   # who should use it, in words

and is built with ``--definition <base tag>-<variant>``.

An optional ``[smoke]`` table says how ``smoke`` judges an image of the
definition (:mod:`.smoke_table`).

A pinned base names, per platform, the image ID (the config digest: the
same whatever registry or mirror serves it, and what an engine names a
local image by) that the tag must resolve to::

    [base.digests]
    "linux/amd64" = "sha256:..."
    "linux/arm64" = "sha256:..."

``new-patchset`` writes it from the base it read. A base found with another
ID for a pinned platform is refused by name (:meth:`ImageDefinition.check_base`);
a definition without the table pins nothing, and every run says so.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import BaseImageError, DefinitionError, UsageError
from ..registry import refs
from . import smoke_table

DEFAULT_REPOSITORY = "vllm/vllm-openai"

_SCHEMA: dict[str, dict[str, tuple[type, bool]]] = {
    # section -> key -> (type, required)
    "base": {"repository": (str, False), "tag": (str, True)},
    "package": {"name": (str, True), "version": (str, False), "python": (str, False)},
    "patches": {"set": (str, True)},
    "output": {"suffix": (str, True)},
    "variant": {"name": (str, True), "hosts": (str, False)},
}
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")
# package.python is run in containers and written into the Dockerfile's RUN line:
# a program name or an absolute path, nothing a shell or a template would read.
_PYTHON = re.compile(r"^(?:/[A-Za-z0-9._+-]+)+\Z|^[A-Za-z0-9][A-Za-z0-9._+-]*\Z")
# package.version is compared with the image's and written into labels: a PEP 440 shape.
_VERSION = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+!_-]{0,63}\Z")
_HOSTS_MAX = 200
_IMAGE_ID = re.compile(r"^sha256:[0-9a-f]{64}\Z")
_PLATFORM = re.compile(r"^[a-z0-9]+/[a-z0-9_]+(?:/[a-z0-9]+)?\Z")


@dataclass(frozen=True, slots=True)
class ImageDefinition:
    tag: str
    base_repository: str
    base_tag: str
    package: str
    package_version: str
    python: str
    patch_set: str
    suffix: str
    path: Path
    variant: str | None = None
    hosts: str | None = None
    smoke: smoke_table.SmokeTable = field(default_factory=smoke_table.SmokeTable)
    base_digests: Mapping[str, str] = field(default_factory=dict)  # platform -> the base's image ID

    def base_ref(self, repository: str | None = None) -> str:
        return f"{repository or self.base_repository}:{self.base_tag}"

    def base_problem(self, image_id: str, platform: str, found_as: str) -> str | None:
        """Why the base ``found_as`` (image ``image_id``, on ``platform`` os/arch[/variant]) is not the one this
        definition pins, in one line; None where it is, or where the definition pins no base at all."""
        if not self.base_digests:
            return None
        want = self.base_digests.get(platform) or self.base_digests.get("/".join(platform.split("/")[:2]))
        if want is None:
            return (f"base {found_as} is a {platform} image; definition {self.tag} pins the base for "
                    f"{', '.join(sorted(self.base_digests))} only ({self.path})")
        if image_id != want:
            return (f"base {found_as} is {image_id}; definition {self.tag} pins {want} for {platform} "
                    f"({self.path})")
        return None

    def check_base(self, image_id: str, platform: str, found_as: str) -> None:
        """Refuse (BaseImageError, naming the base and both IDs) a base that is not the pinned one."""
        problem = self.base_problem(image_id, platform, found_as)
        if problem is not None:
            raise BaseImageError(problem, hint="a moved tag or a mirror's other build: pull the pinned base, or "
                                               "pin the new one on purpose (see the runbook, 'a pinned base')")

    def output_ref(self, repository: str | None = None) -> str:
        return f"{repository or self.base_repository}:{self.output_tag}"

    @property
    def output_tag(self) -> str:
        return f"{self.base_tag}-{self.suffix}"


def platform_text(os: str, architecture: str, variant: str = "") -> str:
    """A platform as ``[base.digests]`` keys it: os/architecture[/variant]."""
    return f"{os}/{architecture}" + (f"/{variant}" if variant else "")


def version_from_tag(tag: str) -> str:
    return tag[1:] if tag.startswith("v") and tag[1:2].isdigit() else tag


def definition_path(root: Path, tag: str) -> Path:
    return root / "images" / f"{tag}.toml"


def load(root: Path, tag: str) -> ImageDefinition:
    """Load and validate ``images/<tag>.toml`` under ``root``."""
    if not _NAME.match(tag):
        raise DefinitionError(f"invalid base tag {tag!r}")
    path = definition_path(root, tag)
    if not path.is_file():
        names = sorted(p.stem for p in (root / "images").glob("*.toml"))
        # A tag written without its "v" (0.25.1 for v0.25.1), or with one too many: the definition meant.
        meant = next((n for n in (f"v{tag}", tag.removeprefix("v")) if n != tag and n in names), None)
        raise DefinitionError(
            f"{path}: no image definition for base {tag} (known: {', '.join(names) or 'none'})",
            hint=f"did you mean {meant}? (definitions are named as the upstream tags are)" if meant else
            f"add {path.name} and patches/{tag}/, or run new-patchset",
        )
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise DefinitionError(f"{path}: not valid TOML: {exc}") from exc
    return parse(data, path, tag)


def _digests(table: object, path: Path) -> dict[str, str]:
    """``[base.digests]``: platform -> image ID, each checked."""
    if not isinstance(table, dict) or not table:
        raise DefinitionError(f"{path}: [base.digests] must be a table of platform = \"sha256:...\"")
    out = {}
    for plat, digest in table.items():
        if not _PLATFORM.match(str(plat)):
            raise DefinitionError(f"{path}: base.digests key {refs.shown(str(plat), 40)} is not a platform "
                                  "(os/architecture[/variant], e.g. linux/amd64)")
        if not isinstance(digest, str) or not _IMAGE_ID.match(digest):
            raise DefinitionError(f"{path}: base.digests.\"{plat}\" must be an image ID, sha256: and 64 hex digits")
        out[str(plat)] = digest
    return out


def parse(data: dict[str, Any], path: Path, tag: str) -> ImageDefinition:
    base_table = data.get("base")
    pinned: dict[str, str] = {}
    if isinstance(base_table, dict) and "digests" in base_table:
        base_table = dict(base_table)
        pinned = _digests(base_table.pop("digests"), path)
        data = {**data, "base": base_table}
    for section in data:
        if section not in _SCHEMA and section != "smoke":
            raise DefinitionError(f"{path}: unknown section [{section}]")
    values: dict[str, dict[str, str]] = {}
    for section, keys in _SCHEMA.items():
        table = data.get(section, {})
        if not isinstance(table, dict):
            raise DefinitionError(f"{path}: [{section}] must be a table")
        for key in table:
            if key not in keys:
                raise DefinitionError(f"{path}: unknown key {section}.{key}")
        values[section] = {}
        if section == "variant" and section not in data:
            continue
        for key, (typ, required) in keys.items():
            if key not in table:
                if required:
                    raise DefinitionError(f"{path}: missing {section}.{key}")
                continue
            if not isinstance(table[key], typ) or not table[key]:
                raise DefinitionError(f"{path}: {section}.{key} must be a non-empty string")
            values[section][key] = table[key]
    base_tag = values["base"]["tag"]
    variant = values["variant"].get("name")
    if variant is not None and not _NAME.match(variant):
        raise DefinitionError(f"{path}: variant.name {variant!r} is not a plain name")
    want = f"{base_tag}-{variant}" if variant is not None else base_tag
    if want != tag:
        raise DefinitionError(
            f"{path}: base.tag is {base_tag!r}"
            + (f" and variant.name {variant!r}" if variant is not None else "")
            + f", so the file must be images/{want}.toml, not for {tag!r}"
        )
    repository = values["base"].get("repository", DEFAULT_REPOSITORY)
    try:
        refs.check_repository(repository, "base.repository")
    except UsageError:
        raise DefinitionError(f"{path}: base.repository {refs.shown(repository, 80)} is not a repository name "
                              "(lowercase, no tag or digest, e.g. vllm/vllm-openai)") from None
    for section, key in (("patches", "set"), ("output", "suffix"), ("package", "name")):
        if not _NAME.match(values[section][key]):
            raise DefinitionError(f"{path}: {section}.{key} {values[section][key]!r} is not a plain name")
    python = values["package"].get("python", "python3")
    if not _PYTHON.match(python):
        raise DefinitionError(f"{path}: package.python {refs.shown(python, 80)} is not a program name or an "
                              "absolute path (letters, digits, . _ + -; e.g. python3 or /opt/venv/bin/python)")
    version = values["package"].get("version")
    if version is not None and not _VERSION.match(version):
        raise DefinitionError(f"{path}: package.version {refs.shown(version, 80)} is not a version "
                              "(e.g. 0.25.1 or 0.25.1+cu129)")
    hosts = values["variant"].get("hosts")
    if hosts is not None and (len(hosts) > _HOSTS_MAX or not hosts.isprintable() or "{" in hosts or "$" in hosts):
        raise DefinitionError(f"{path}: variant.hosts {refs.shown(hosts, 80)} must be one line of plain words "
                              f"(at most {_HOSTS_MAX} characters, no '{{' or '$')")
    return ImageDefinition(
        tag=tag,
        base_repository=repository,
        base_tag=base_tag,
        package=values["package"]["name"],
        package_version=values["package"].get("version", version_from_tag(base_tag)),
        python=python,
        patch_set=values["patches"]["set"],
        suffix=values["output"]["suffix"],
        path=path,
        variant=variant,
        hosts=values["variant"].get("hosts"),
        smoke=smoke_table.parse(data["smoke"], path) if "smoke" in data else smoke_table.SmokeTable(),
        base_digests=pinned,
    )


def load_all(root: Path) -> list[ImageDefinition]:
    # By name, so that a variant (v0.25.1-sm100) comes after its base's definition (v0.25.1).
    return [load(root, p.stem) for p in sorted((root / "images").glob("*.toml"), key=lambda p: p.stem)]
