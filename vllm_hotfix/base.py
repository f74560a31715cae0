"""Read the base image: its vLLM version, where its Python imports the package
from, the files the patches touch; then patch them and compile their bytecode
with the image's own Python.

All of it happens in one throw-away container and one scratch folder, both
removed before :func:`prepare` returns.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import tempfile
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from . import patches as patchlib
from .definitions import ImageDefinition
from .engine import Box, Engine, ImageInfo
from .errors import BaseImageError, PatchError

log = logging.getLogger(__name__)

SCRATCH = "/tmp/vllm-hotfix"


def scratch_prefix() -> str:
    """Scratch folders carry the run's ID (tests set one) so leaks can be traced."""
    run_id = os.environ.get("VLLM_HOTFIX_RUN_ID", "")
    return f"vllm-hotfix-scratch-{run_id + '-' if run_id else ''}"


def probe_source(name: str) -> str:
    return resources.files("vllm_hotfix.probes").joinpath(name).read_text(encoding="utf-8")


@dataclass(frozen=True)
class BaseFacts:
    """What the base image says about itself, by its own Python."""

    ref: str
    image: ImageInfo
    python: str
    python_version: str
    cache_tag: str
    site_dir: str  # the folder holding the package folder
    package_dir: str
    version: str | None
    machine: str = ""  # platform.machine() of the image's Python: the architecture that compiled the bytecode


@dataclass(frozen=True)
class PatchedFile:
    rel: str  # relative to site_dir, e.g. vllm/models/.../indexer.py
    data: bytes
    mode: int
    original_sha256: str
    bytecode: tuple[tuple[str, bytes], ...]  # (path relative to site_dir, pyc bytes)

    @property
    def sha256(self) -> str:
        return patchlib.sha256_bytes(self.data)


def probe_timeout() -> int:
    """Seconds a probe of the base may take (VLLM_HOTFIX_PROBE_TIMEOUT, default 120)."""
    try:
        return max(1, int(os.environ.get("VLLM_HOTFIX_PROBE_TIMEOUT", "120")))
    except ValueError:
        return 120


def _run_probe(box: Box, python: str, script: str, args: list[str], ref: str) -> dict:
    limit = probe_timeout()
    result = box.exec([python, "-c", probe_source(script), *args], timeout=limit)
    if result.exit_code == 124:
        raise BaseImageError(f"{ref}: probe {script} with {python} timed out after {limit} s",
                             hint="the image's Python hangs at start; check the image")
    try:
        data = json.loads(result.stdout)
    except ValueError:
        err = (result.stderr or result.stdout).strip().splitlines()
        raise BaseImageError(
            f"{ref}: probe {script} failed in the image with {python}: "
            f"{err[-1] if err else 'exit ' + str(result.exit_code)}"
        ) from None
    if not isinstance(data, dict):
        raise BaseImageError(f"{ref}: probe {script} printed no JSON object")
    return data


def locate(
    box: Box, defn: ImageDefinition, ref: str, image: ImageInfo, rels: list[str]
) -> tuple[BaseFacts, dict]:
    return locate_package(box, defn.package, defn.python, ref, image, rels)


def locate_package(
    box: Box, package: str, python: str, ref: str, image: ImageInfo, rels: list[str]
) -> tuple[BaseFacts, dict]:
    data = _run_probe(box, python, "locate.py", [package, *rels], ref)
    if "error" in data:
        raise BaseImageError(f"{ref}: {data['error']} with {python}")
    lacking = [k for k in ("python", "cache_tag", "site_dir", "package_dir", "files") if k not in data]
    if lacking or not isinstance(data.get("files"), dict) or set(rels) - set(data["files"]):
        raise BaseImageError(
            f"{ref}: probe locate.py with {python} answered without {', '.join(lacking) or 'every file'}: "
            "is it the image's Python interpreter?"
        )
    facts = BaseFacts(
        ref=ref,
        image=image,
        python=python,
        python_version=data["python"],
        cache_tag=data["cache_tag"],
        site_dir=data["site_dir"],
        package_dir=data["package_dir"],
        version=data.get("version"),
        machine=str(data.get("machine") or ""),
    )
    return facts, data["files"]


def read_files(
    engine: Engine, package: str, python: str, ref: str, image: ImageInfo, rels: list[str]
) -> tuple[BaseFacts, dict[str, bytes | None]]:
    """The files ``rels`` as the image's Python would import them, no version check.

    A path that is missing, or is not a regular file reached without links,
    reads as None: for a question like "does this release carry the patch?"
    that is an answer (it does not), not an error.
    """
    with engine.box(image.id, python) as box:
        facts, info = locate_package(box, package, python, ref, image, rels)
    return facts, {rel: _content(info[rel]) for rel in rels}


def _content(info: dict) -> bytes | None:
    """A file's bytes as the locate probe read them (regular files only)."""
    data = info.get("data_b64")
    return base64.b64decode(data) if data is not None else None


def check_version(facts: BaseFacts, defn: ImageDefinition) -> None:
    if facts.version != defn.package_version:
        raise BaseImageError(
            f"{facts.ref}: installed {defn.package} is {facts.version or 'unknown'} "
            f"but patch set {defn.patch_set} is for {defn.package_version}",
            hint="use the definition made for this release, or check the tag points at the right image",
        )


def check_targets(files: dict, patches: list[patchlib.Patch], ref: str, site_dir: str) -> None:
    """Each touched path must be a regular file reached without symlinks."""
    for patch in patches:
        for rel in patch.files:
            info = files[rel]
            where = f"{site_dir}/{rel}"
            if info["kind"] == "missing":
                raise PatchError(f"{patch.name}: {ref} has no file {where}", patch=patch.name, file=rel)
            if info["kind"] != "file":
                raise PatchError(
                    f"{patch.name}: {where} in {ref} is a {info['kind']}, not a regular file; refusing to patch it",
                    patch=patch.name,
                    file=rel,
                )
            if not info["real"]:
                raise PatchError(
                    f"{patch.name}: {where} in {ref} is reached through a symlink; refusing to patch it",
                    patch=patch.name,
                    file=rel,
                )


def touched_files(patches: list[patchlib.Patch]) -> list[str]:
    seen: dict[str, None] = {}
    for patch in patches:
        for rel in patch.files:
            seen.setdefault(rel, None)
    return list(seen)


def prepare(
    engine: Engine,
    defn: ImageDefinition,
    ref: str,
    image: ImageInfo,
    patches: list[patchlib.Patch],
    *,
    skip_included: bool = False,
) -> tuple[BaseFacts, list[PatchedFile], list[patchlib.Patch]]:
    """Probe the base, patch the touched files, compile fresh bytecode.

    Returns the base's facts, the files that changed and the patches applied
    (all of them, unless ``skip_included`` let the base's own copies stand).
    """
    rels = touched_files(patches)
    with engine.box(image.id, defn.python) as box:
        facts, info = locate(box, defn, ref, image, rels)
        check_version(facts, defn)
        check_targets(info, patches, ref, facts.site_dir)
        # The probe read each file with the image's own Python after checking
        # it is a regular file reached without links; here the bytes are only
        # written under the scratch folder, at paths we chose.
        originals: dict[str, tuple[bytes, int]] = {}
        for rel in rels:
            data = _content(info[rel])
            if data is None:
                raise PatchError(f"{facts.site_dir}/{rel} in {ref} could not be read as a regular file", file=rel)
            originals[rel] = (data, int(info[rel]["mode"]))

        patched, included = apply_in_scratch(
            patches, {rel: data for rel, (data, _m) in originals.items()}, skip_included=skip_included
        )
        applied = [p for p in patches if p not in included]
        # A file only skipped patches touch is the base's own: nothing to copy.
        rels = [rel for rel in rels if patched[rel] != originals[rel][0]]
        log.info("patched %d file(s) with %d patch(es)", len(rels), len(applied))

        box.write("/tmp", {f"vllm-hotfix/{rel}": data for rel, data in patched.items()})
        args = [SCRATCH] + [f"{rel}={','.join(map(str, info[rel]['opt_levels']))}" for rel in rels]
        compiled = _run_probe(box, defn.python, "compile.py", args, ref)
        result = []
        for rel in rels:
            entry = compiled.get(rel, {})
            if "error" in entry:
                owner = next(p.name for p in applied if rel in p.files)
                raise PatchError(f"{owner}: patched {rel} does not compile: {entry['error']}", patch=owner, file=rel)
            bytecode = tuple((pyc, base64.b64decode(b64)) for pyc, b64 in sorted(entry["pycs"].items()))
            data, mode = originals[rel]
            result.append(
                PatchedFile(rel, patched[rel], mode & 0o7777, patchlib.sha256_bytes(data), bytecode)
            )
    return facts, result, applied


def apply_in_scratch(
    patches: list[patchlib.Patch], files: dict[str, bytes], *, skip_included: bool = False
) -> tuple[dict[str, bytes], list[patchlib.Patch]]:
    """Apply the series to copies of ``files`` in a temp folder, removed after.

    Returns the patched files and the patches the files already carried.
    """
    with tempfile.TemporaryDirectory(prefix=scratch_prefix()) as tmp:
        work = Path(tmp)
        for rel, data in files.items():
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_bytes(data)
        included = patchlib.apply_series(patches, work, skip_included=skip_included)
        return {rel: (work / rel).read_bytes() for rel in files}, included
