"""Read the base image: its vLLM version, where its Python imports the package
from, the files the patches touch; then patch them and compile their bytecode
with the image's own Python.

All of it happens in at most one throw-away container (none when the facts
cache of this base answers everything, see :mod:`sources`) and one scratch
folder, both removed before :func:`prepare` returns.
"""

from __future__ import annotations

import base64
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine import Engine, ImageInfo
from ..errors import BaseImageError, PatchError
from . import patches as patchlib
from .definitions import ImageDefinition
from .sources import BaseFacts, ImageReader, content, patch_key, run_probe, scratch_tree

log = logging.getLogger(__name__)

SCRATCH = "/tmp/vllm-hotfix"

__all__ = ["BaseFacts", "PatchedFile", "prepare", "apply_in_scratch", "touched_files"]


@dataclass(frozen=True, slots=True)
class PatchedFile:
    rel: str  # relative to site_dir, e.g. vllm/models/.../indexer.py
    data: bytes
    mode: int
    original_sha256: str
    bytecode: tuple[tuple[str, bytes], ...]  # (path relative to site_dir, pyc bytes)

    @property
    def sha256(self) -> str:
        return patchlib.sha256_bytes(self.data)


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
    cache: Path | None = None,
) -> tuple[BaseFacts, list[PatchedFile], list[patchlib.Patch]]:
    """Probe the base, patch the touched files, compile fresh bytecode.

    Returns the base's facts, the files that changed and the patches applied
    (all of them, unless ``skip_included`` let the base's own copies stand).
    With a ``cache`` folder, what the base said of itself and the bytecode of
    each patched source are kept per base image ID: a probe container starts
    only for a file never read or a source never compiled on this base.
    """
    rels = touched_files(patches)
    with ImageReader(engine, image, ref, defn.package, defn.python, cache) as reader:
        facts, info = reader.locate(rels)
        check_version(facts, defn)
        check_targets(info, patches, ref, facts.site_dir)
        # The probe read each file with the image's own Python after checking
        # it is a regular file reached without links; here the bytes are only
        # written under the scratch folder, at paths we chose.
        originals: dict[str, tuple[bytes, int]] = {}
        for rel in rels:
            data = content(info[rel])
            if data is None:
                raise PatchError(f"{facts.site_dir}/{rel} in {ref} could not be read as a regular file", file=rel)
            originals[rel] = (data, int(info[rel]["mode"]))

        sources_in = {rel: data for rel, (data, _m) in originals.items()}
        # GNU patch is deterministic: the same patches on the same bytes give the
        # same files. Only successful runs are kept; a failing one runs each time.
        key = patch_key([(p.name, p.sha256) for p in patches], sources_in, skip_included)
        found_patched = reader.cached_patched(key)
        if found_patched is not None:
            patched, included_names = found_patched
            included = [p for p in patches if p.name in included_names]
        else:
            patched, included = apply_in_scratch(patches, sources_in, skip_included=skip_included)
            reader.store_patched(key, patched, [p.name for p in included])
        applied = [p for p in patches if p not in included]
        # A file only skipped patches touch is the base's own: nothing to copy.
        rels = [rel for rel in rels if patched[rel] != originals[rel][0]]
        log.info("patched %d file(s) with %d patch(es)", len(rels), len(applied))

        levels = {rel: ",".join(map(str, info[rel]["opt_levels"])) for rel in rels}
        bytecode: dict[str, dict[str, bytes]] = {}
        for rel in rels:
            found = reader.cached_bytecode(rel, patched[rel], levels[rel])
            if found is not None:
                bytecode[rel] = found
        todo = [rel for rel in rels if rel not in bytecode]
        if todo:
            log.info("probe: compile %d file(s)", len(todo))
            box = reader.box()
            box.write("/tmp", {f"vllm-hotfix/{rel}": patched[rel] for rel in todo})
            compiled = run_probe(box, defn.python, "compile.py", [SCRATCH] + [f"{rel}={levels[rel]}" for rel in todo],
                                 ref)
            for rel in todo:
                entry: dict[str, Any] = compiled.get(rel, {})
                if "error" in entry:
                    owner = next(p.name for p in applied if rel in p.files)
                    raise PatchError(f"{owner}: patched {rel} does not compile: {entry['error']}", patch=owner,
                                     file=rel)
                bytecode[rel] = {pyc: base64.b64decode(b64) for pyc, b64 in entry["pycs"].items()}
                reader.store_bytecode(rel, patched[rel], levels[rel], bytecode[rel])
        log.info("probe containers started: %d", reader.containers)
        result = []
        for rel in rels:
            data, mode = originals[rel]
            result.append(
                PatchedFile(rel, patched[rel], mode & 0o7777, patchlib.sha256_bytes(data),
                            tuple(sorted(bytecode[rel].items())))
            )
    return facts, result, applied


def apply_in_scratch(
    patches: list[patchlib.Patch], files: dict[str, bytes], *, skip_included: bool = False
) -> tuple[dict[str, bytes], list[patchlib.Patch]]:
    """Apply the series to copies of ``files`` in a temp folder, removed after.

    Returns the patched files and the patches the files already carried.
    """
    with scratch_tree(files) as work:
        included = patchlib.apply_series(patches, work, skip_included=skip_included)
        return {rel: (work / rel).read_bytes() for rel in files}, included
