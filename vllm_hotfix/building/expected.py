"""What the patched files of an image must be, never taken from the image.

An image's labels are just data its builder chose: copying them onto an
unpatched image must not make it pass. So the expected sha256 of every patched
file is recomputed from the patch set on disk and the base's original files
(read from the base image by its ID), and cross-checked against the tool's own
build entry for that image ID where there is one. Only when the base image is
gone does the build entry stand alone, and then only if the patch set still
has the hashes it was built from.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..engine import Engine, ImageInfo, labels
from ..errors import DefinitionError, PatchError, PipelineError, UnknownExpectation
from ..journal import records
from . import base as baselib
from . import definitions, sources
from . import patches as patchlib

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Expected:
    """The sha256 each patched file must have, and where that knowledge came from."""

    files: Mapping[str, str]  # path relative to the site dir -> sha256
    package: str
    version: str
    definition: str
    source: str
    # Where the package's parent folder is in the image (the base's, which the
    # hotfix layer writes into), the Python's bytecode tag, and the base's ID:
    # what the image's files are read and judged by, without running it.
    site_dir: str = ""
    cache_tag: str = ""
    base_id: str = ""


def from_build(defn: definitions.ImageDefinition, base_id: str, version: str | None,
               files: Mapping[str, str], site_dir: str = "", cache_tag: str = "") -> Expected:
    """The expectation of a build that just patched the files itself."""
    return Expected(dict(files), defn.package, version or "", defn.tag,
                    f"this build: patches/{defn.patch_set} applied to base {base_id[:19]}",
                    site_dir, cache_tag, base_id)


def for_image(engine: Engine | None, root: Path, image: ImageInfo, *, base_id: str | None = None,
              definition: str | None = None) -> Expected:
    """Recompute the expected files of ``image``; raise UnknownExpectation if impossible.

    ``engine``: the Docker engine that may hold the base; None where there is
    none (a podman host), and then only the build record can tell.
    ``base_id`` and ``definition``: the base and definition the host found the
    image to be the product of (:mod:`vllm_hotfix.judges.identity`); they
    stand before the image's labels.
    """
    built = records.builds_of_image(root, image.id)
    entry = built[0] if built else None
    if entry is not None:
        tag = str((entry.data.get("inputs") or {}).get("definition", ""))
        base_id = str((entry.data.get("base") or {}).get("id", ""))
        how = f"build record {entry.path.name}"
    else:
        # Labels only choose which definition and base to recompute from; the
        # hashes themselves come from the patch set and the base's own files.
        tag = definition or image.labels.get(labels.DEFINITION, "")
        found_base = base_id
        base_id = base_id or image.labels.get(labels.BASE_ID, "")
        how = "the base found by the image's layers" if found_base else "the image's labels"
    if not tag or not base_id:
        raise UnknownExpectation(
            f"no build record for {image.id[:19]} and no labels naming its definition and base: "
            "not built by this tool"
        )
    try:
        defn = definitions.load(root, tag)
        patches = patchlib.load_series(root, defn.patch_set, defn.package)
    except (DefinitionError, PatchError) as exc:
        raise UnknownExpectation(f"cannot load definition {tag} named by {how}: {exc}") from exc

    base_image = engine.image(base_id) if engine is not None else None
    if engine is None or base_image is None:
        return _from_record_alone(entry, defn, patches, base_id)

    rels = baselib.touched_files(patches)
    try:
        facts, originals = sources.image_files(engine, defn.package, defn.python, base_id, base_image, rels,
                                               sources.cache_dir(root))
        missing = [rel for rel, data in originals.items() if data is None]
        if missing:
            raise UnknownExpectation(f"base {base_id[:19]} has no regular file {missing[0]}")
        patched, included = baselib.apply_in_scratch(
            patches, {rel: data for rel, data in originals.items() if data is not None}, skip_included=True
        )
        if patches and len(included) == len(patches):
            raise UnknownExpectation(f"base {base_id[:19]} already carries every patch of patches/{defn.patch_set}: "
                                     "it needs no hotfix, and no hotfix image is made from it")
    except UnknownExpectation:
        raise
    except PipelineError as exc:
        raise UnknownExpectation(f"cannot apply patches/{defn.patch_set} to base {base_id[:19]}: {exc}") from exc
    files = {
        rel: patchlib.sha256_bytes(data) for rel, data in sorted(patched.items()) if data != originals[rel]
    }
    source = f"patches/{defn.patch_set} applied to base {base_id[:19]} (chosen by {how})"
    if entry is not None:
        recorded = {rel: str(v.get("sha256")) for rel, v in (entry.data.get("files") or {}).items()}
        if recorded != files:
            differ = sorted(set(recorded.items()) ^ set(files.items()))
            raise UnknownExpectation(
                f"build record {entry.path.name} disagrees with patches/{defn.patch_set} applied to base "
                f"{base_id[:19]} (at {differ[0][0]}): the patch set changed since the build, or the record "
                "was edited"
            )
        source += " and agrees with the build record"
    return Expected(files, defn.package, facts.version or "", defn.tag, source, facts.site_dir, facts.cache_tag,
                    base_id)


def _from_record_alone(entry: records.Entry | None, defn: definitions.ImageDefinition,
                       patches: list[patchlib.Patch], base_id: str) -> Expected:
    if entry is None:
        raise UnknownExpectation(
            f"base {base_id[:19]} is not in the engine, and no build record of this image exists: "
            "cannot recompute what its patched files must be",
        )
    recorded_patches = (entry.data.get("inputs") or {}).get("patches") or {}
    current = {p.name: p.sha256 for p in patches}
    if recorded_patches != current:
        raise UnknownExpectation(
            f"base {base_id[:19]} is not in the engine and patches/{defn.patch_set} changed since build "
            f"record {entry.path.name}: cannot recompute what the patched files must be"
        )
    files = {rel: str(v.get("sha256")) for rel, v in (entry.data.get("files") or {}).items()}
    version = str((entry.data.get("base") or {}).get("package_version") or "")
    site_dir = str((entry.data.get("base") or {}).get("site_dir") or "")
    return Expected(files, defn.package, version, defn.tag,
                    f"build record {entry.path.name} (patch set unchanged; base no longer in the engine)",
                    site_dir, "", base_id)
