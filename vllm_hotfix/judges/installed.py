"""What the distributions installed in an image require in the image's environment, never by running it.

The distributions come read from their dist-info
(:mod:`vllm_hotfix.sitefacts.dists`). What a distribution requires is read
with ``packaging``, as pip reads it: names
canonicalised, extras as asked for, and each environment marker evaluated
against the image's environment (its Python version, Linux, its machine,
the extras asked for), never this host's. Where the image's environment
leaves a value unknown, a requirement is kept if it could apply: checking
one installed distribution too many is safe, missing one is not.
"""

from __future__ import annotations

import logging
import posixpath
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement

from ..sitefacts.dists import Dist, canonical

log = logging.getLogger(__name__)

# What platform.machine() says on Linux for each architecture an image names (its OCI config's).
MACHINES = {"amd64": "x86_64", "arm64": "aarch64", "arm": "armv7l", "386": "i686", "ppc64le": "ppc64le",
            "s390x": "s390x", "riscv64": "riscv64"}
# Tried where the image does not say: a requirement is kept if its marker holds for any of them.
_SOME_MACHINES = ("x86_64", "aarch64")
_SOME_PYTHONS = tuple(f"3.{minor}" for minor in range(8, 16))
_PYTHON_DIR = re.compile(r"/python(\d+\.\d+)/")
_CACHE_TAG = re.compile(r"^(\w+?)-(\d)(\d+)$")


@dataclass(frozen=True, slots=True)
class Environment:
    """The image's side of environment markers (PEP 508); an empty field is not known."""

    python_version: str = ""  # "3.12"
    machine: str = ""  # "x86_64", "aarch64"
    implementation: str = "cpython"

    def markers(self) -> Iterator[dict[str, str]]:
        """Every marker environment the image could be, its unknowns filled each way tried."""
        for python in (self.python_version,) if self.python_version else _SOME_PYTHONS:
            for machine in (self.machine,) if self.machine else _SOME_MACHINES:
                yield {
                    "implementation_name": self.implementation,
                    "implementation_version": python,
                    "os_name": "posix",
                    "platform_machine": machine,
                    "platform_release": "",
                    "platform_system": "Linux",
                    "platform_version": "",
                    "python_full_version": python,
                    "platform_python_implementation": "CPython" if self.implementation == "cpython" else "",
                    "python_version": python,
                    "sys_platform": "linux",
                }

    def applies(self, marker: Marker, extras: Iterable[str] = ()) -> bool:
        """Whether ``marker`` holds in this image for one of ``extras`` (none asked for: the empty extra)."""
        asked = sorted(extras) or [""]
        return any(marker.evaluate({**env, "extra": extra}) for env in self.markers() for extra in asked)


def environment(site_dir: str, cache_tag: str = "", architecture: str = "") -> Environment:
    """The image's environment from what its files and config say: the site folder's or bytecode tag's
    Python (``python3.12``, ``cpython-312``) and the image's architecture (``amd64``)."""
    python = ""
    implementation = "cpython"
    tag = _CACHE_TAG.match(cache_tag)
    if tag:
        implementation, python = tag.group(1), f"{tag.group(2)}.{tag.group(3)}"
    else:
        in_dir = _PYTHON_DIR.search(posixpath.normpath(site_dir) + "/")
        python = in_dir.group(1) if in_dir else ""
    return Environment(python, MACHINES.get(architecture, ""), implementation)


def required(dist: Dist, extras: set[str], env: Environment) -> list[tuple[str, set[str]]]:
    """(name, extras it asks for) of each requirement that applies in ``env`` with the given extras."""
    out = []
    for text in dist.requires:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            log.warning("%s: requirement %r is not valid (%s): not followed", dist.name, text, exc)
            continue
        if req.marker is not None and not env.applies(req.marker, extras):
            continue
        out.append((canonical(req.name), {canonical(e) for e in req.extras}))
    return out


def closure(installed: Mapping[str, Dist], roots: Iterable[str], env: Environment,
            ) -> tuple[dict[str, Dist], dict[str, set[str]]]:
    """The installed distributions ``roots`` need in ``env`` (with the extras asked for), and each one's requirers."""
    todo: list[tuple[str, set[str], str | None]] = [(canonical(r), set(), None) for r in roots]
    seen: dict[str, Dist] = {}
    parents: dict[str, set[str]] = {}
    done: set[tuple[str, str]] = set()
    while todo:
        name, extras, parent = todo.pop()
        if name not in installed:
            continue
        if parent is not None:
            parents.setdefault(name, set()).add(parent)
        key = (name, ",".join(sorted(extras)))
        if key in done:
            continue
        done.add(key)
        seen[name] = installed[name]
        todo.extend((n, e, name) for n, e in required(installed[name], extras, env))
    return seen, parents
