"""Render the Dockerfile and its build context.

A pure function of its inputs (no engine, no network: the builders in
builders.py take its text to one): the same definition, base and patch results
always give the same bytes, so the engine's layer cache and the build records
can trust them. The base's ENTRYPOINT, CMD, ENV and USER are inherited
untouched: the template only adds COPY and LABEL instructions.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from .. import __version__
from ..engine import labels as keys
from ..errors import PatchError
from .base import BaseFacts, PatchedFile
from .definitions import ImageDefinition
from .patches import Patch

if TYPE_CHECKING:
    from .pins import Prepared

TEMPLATE_NAME = "Dockerfile.j2"
# The context folder laid out like the base's site dir: one COPY of it puts
# every patched file and its bytecode in place as ONE layer. The classic
# builder pays a container create + commit per instruction, so a COPY per
# file made the build grow with the patch set (bench/: 102 steps at 100 files).
CONTEXT_DIR = "files"


@dataclass(frozen=True, slots=True)
class FileCopy:
    rel: str
    dest: str  # the file's path in the image
    pycs: tuple[str, ...]


def template_path(root: Path) -> Path:
    """The root's own template if it has one, else the tool's."""
    own = root / TEMPLATE_NAME
    return own if own.is_file() else Path(__file__).resolve().parents[2] / TEMPLATE_NAME


# LABEL keys are written unquoted: only these characters, so no key can end
# itself, start a second label or name a variable (patch names are held to the
# same set when the patch set loads).
LABEL_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\Z")


def _label_value(value: str) -> str:
    # Dockerfile LABEL values: escape what the parser would interpret; a
    # control character (newline, tab, CR) would end the instruction or split it.
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$")
    return "".join(c if c.isprintable() else " " for c in escaped)


def labels(
    defn: ImageDefinition, base: BaseFacts, files: list[PatchedFile], patches: list[Patch],
    pins: Prepared | None = None,
) -> list[tuple[str, str]]:
    items = {
        keys.OCI_BASE_NAME: base.ref,
        keys.OCI_BASE_DIGEST: base.image.digest.split("@", 1)[1]
        if base.image.digest
        else base.image.id,
        keys.BASE_ID: base.image.id,
        keys.DEFINITION: defn.tag,
        keys.PACKAGE: defn.package,
        keys.PACKAGE_VERSION: base.version or "",
        keys.SITE_DIR: base.site_dir,
        keys.PATCHES: json.dumps({pt.name: pt.sha256 for pt in patches}, sort_keys=True),
        keys.FILES: json.dumps({f.rel: f.sha256 for f in files}, sort_keys=True),
        keys.TOOL_VERSION: __version__,
    }
    for pt in patches:
        items[keys.patch(pt.name)] = pt.sha256
    if pins is not None:
        items.update(pins.labels())
    for key in items:
        if not LABEL_KEY.match(key):
            raise PatchError(f"label key {key!r} holds characters a Dockerfile would read; "
                             "patch file names may hold only letters, digits, '.', '_' and '-'")
    return sorted(items.items())


def copies(base: BaseFacts, files: list[PatchedFile]) -> list[FileCopy]:
    out = []
    for f in sorted(files, key=lambda f: f.rel):
        out.append(
            FileCopy(
                rel=f.rel,
                dest=f"{base.site_dir}/{f.rel}",
                pycs=tuple(PurePosixPath(p).name for p, _ in f.bytecode),
            )
        )
    return out


def render(
    template: str,
    defn: ImageDefinition,
    base: BaseFacts,
    files: list[PatchedFile],
    patches: list[Patch],
    pins: Prepared | None = None,
) -> str:
    import jinja2  # here, not at module level: a reused build never renders

    from .pins import BUILD_ARG

    env = jinja2.Environment(
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False
    )
    env.filters["label"] = _label_value
    return env.from_string(template).render(
        tool_version=__version__,
        definition=defn.tag,
        base_ref=base.ref,
        base_id=base.image.id,
        files=copies(base, files),
        context_dir=CONTEXT_DIR,
        site_dir=base.site_dir,
        labels=labels(defn, base, files, patches, pins),
        pins=pins.entries() if pins is not None else [],
        pin_file=f"patches/{pins.pinset.patch_set}/pins.txt" if pins is not None else "",
        pin_arg=BUILD_ARG,
        python=base.python,
    )


def context(dockerfile: str, base: BaseFacts, files: list[PatchedFile]) -> bytes:
    """The build context: the Dockerfile and the patched files, nothing else.

    Files sit under ``files/`` at their path relative to the site dir (the
    bytecode in its ``__pycache__``), so ``COPY files/ <site_dir>/`` is one layer.
    """
    from ..tarball import tar_bytes  # here: a reused build never makes a context

    entries: dict[str, bytes] = {"Dockerfile": dockerfile.encode()}
    modes: dict[str, int] = {}
    for f in files:
        entries[f"{CONTEXT_DIR}/{f.rel}"] = f.data
        modes[f"{CONTEXT_DIR}/{f.rel}"] = f.mode
        for pyc_rel, data in f.bytecode:
            entries[f"{CONTEXT_DIR}/{PurePosixPath(pyc_rel)}"] = data
    return tar_bytes(entries, modes)
