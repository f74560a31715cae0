"""The file facts: what the host reads from an image's files and judges itself, never running the image.

Podman's store, a registry's blobs or the Docker engine: wherever the image
is started from, its files are read from there and judged the same way
(:func:`~vllm_hotfix.judges.integrity.check_image`). A smoke run's job carries the
finished checks (:func:`file_facts`); the host's verdict keeps them as the
host made them, whatever the runner reports. The push gate reads them again
right before a push, in one pass (:func:`landed_problem`), and the judges of
:mod:`vllm_hotfix.judges.recheck` answer with a typed
:class:`~vllm_hotfix.judges.recheck.LandedProblem`: the check, whether the
image differs or the host could not tell, and the difference where there is
one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...building import definitions, expected, pins, sources
from ...engine import Engine, ImageInfo
from ...errors import DefinitionError, EngineError, PinError, UnknownExpectation
from ...judges import identity, integrity, recheck
from ...judges.recheck import EXPECTATION, PINS, LandedProblem, missing_compiled
from ...sitefacts import site
from ...sitefacts.site import FileSource, keep_metadata, keep_patched
from ...verdicts import Status


@dataclass(frozen=True, slots=True)
class FileFacts:
    """The file checks of a run whose other checks a runner makes elsewhere, and what they found."""

    checks: tuple[dict[str, Any], ...]
    expected_from: str
    compiled_missing: tuple[str, ...] = ()  # compiled files RECORD lists but the image lacks (the base's named so)
    landed: Mapping[str, str] | None = None  # package and site folder its Python must import it from


def landed_of(found: expected.Expected) -> dict[str, str] | None:
    """Where the image's Python must import the package from (the runner's import-location check)."""
    return {"package": found.package, "site_dir": found.site_dir} if found.site_dir else None


FILE_CHECKS = ("patch-landed", "package-version", "integrity")


def unread_file_checks(why: str) -> list[dict[str, Any]]:
    """The file checks as incomplete, saying ``why``: a run cannot pass without them."""
    return [{"name": name, "status": "incomplete", "detail": why, "data": {"answered_by": integrity.FILESYSTEM}}
            for name in FILE_CHECKS]


def pinned_names(root: Path, definition: str) -> list[str]:
    """The distributions the definition's patch set pins, as pins.txt spells them (integrity reads them as the
    image's own); DefinitionError or PinError when the definition or its pins.txt is unusable."""
    defn = definitions.load(root, definition)
    pinset = pins.load(root, defn.patch_set, defn.package)
    return [p.spelled for p in pinset.pins] if pinset is not None else []


def file_facts(root: Path, image: ImageInfo, files_from: FileSource, expect_from: Engine | None,
               say: Callable[[str], None] = lambda _l: None, proven: identity.Outcome | None = None) -> FileFacts:
    """The file checks alone, read from ``files_from`` (the store the launcher starts the image from).

    For ``--launcher podman|kubernetes``: the same expectation and judgement
    as a Docker run (:func:`~vllm_hotfix.judges.integrity.check_image`), only the
    files come from wherever the image is started. ``expect_from``: the Docker
    engine that may hold the base to recompute the expectation from (None:
    none; the build record alone then). Files that cannot be read make the
    checks incomplete: the run cannot pass without them. ``proven``: the
    image's identity, whose base and definition stand before its labels.
    """
    fs = {"answered_by": integrity.FILESYSTEM}
    base_id = proven.base_id or None if proven is not None else None
    tag = proven.base.definition.tag if proven is not None and proven.base is not None else None
    try:
        try:
            found: expected.Expected | str = expected.for_image(expect_from, root, image, base_id=base_id,
                                                                definition=tag)
        except EngineError as exc:
            say(f"    no Docker engine to read the base from ({str(exc).splitlines()[0]}): the build record alone")
            found = expected.for_image(None, root, image)
    except UnknownExpectation as exc:
        found = str(exc)
    if isinstance(found, str):
        return FileFacts(({"name": "patch-landed", "status": "fail", "detail": found, "data": fs},), "unknown")
    extra: list[dict[str, Any]] = []
    pinned: list[str] = []
    try:
        pinned = pinned_names(root, found.definition)
    except (DefinitionError, PinError) as exc:
        extra.append({"name": "pins", "status": "fail", "detail": str(exc)})
    try:
        files = integrity.check_image(files_from, sources.cache_dir(root), image.id, found, pinned, say)
    except EngineError as exc:
        why = f"the image's files could not be read: {str(exc).splitlines()[0]}"
        return FileFacts(tuple(unread_file_checks(why) + extra), found.source, landed=landed_of(found))
    judged = files.judged
    return FileFacts(tuple([{**c, "data": {**(c.get("data") or {}), **fs}} for c in files.checks] + extra),
                     found.source, missing_compiled(judged), landed_of(found))


def landed_problem(engine: Engine, root: Path, image: ImageInfo, say: Callable[[str], None] = lambda _line: None,
                   *, gpu_claimed: bool = False) -> LandedProblem | None:
    """The file checks alone, read from the image's layers: None if its files are what they must be.

    The patched files with the hashes the patch set and the base give, the
    whole installed distribution against its RECORD relative to the base, the
    pinned versions: neither an edited journal nor the image's own
    interpreter can vouch for its files. ``gpu_claimed``: the verdict says
    GPU-verified, which an image lacking compiled files cannot be. First of
    all, its layers and config must be what its builder makes of its base
    (:mod:`vllm_hotfix.judges.identity`), whatever the journal says. A file
    of the image that cannot be read raises the engine's error, as a read
    anywhere else does.

    One pass: what the files must be and the pins are worked out, every site
    folder the judges need (the image's, each other one on the base's
    ``sys.path``, and the base's where no judgement of it is kept) is read
    once, and the judges (:func:`vllm_hotfix.judges.recheck.judge`) get the
    facts. Nothing of the image runs, so neither its Python nor anything its
    configuration would load answers for it. A definition or pins.txt this
    host cannot use is its own fault (incomplete), never the image's.
    """
    proven = identity.prove(engine, root, image, say=say)
    problem = recheck.identity_problem(proven)
    if problem is not None:  # a base not found here proves nothing either way: no push
        return problem
    try:
        want = expected.for_image(engine, root, image, base_id=proven.base_id or None,
                                  definition=proven.base.definition.tag if proven.base is not None else None)
    except UnknownExpectation as exc:
        return LandedProblem(EXPECTATION, Status.INCOMPLETE, str(exc))
    if not want.site_dir:
        return LandedProblem(EXPECTATION, Status.INCOMPLETE, "the build record names no site folder to read the "
                                                             "image's files in: rebuild the image with this version "
                                                             "of the tool")
    try:
        defn = definitions.load(root, want.definition)
        pinset = pins.load(root, defn.patch_set, defn.package)
    except (DefinitionError, PinError) as exc:
        return LandedProblem(PINS, Status.INCOMPLETE, str(exc))
    cache = sources.cache_dir(root)
    roots = [p.spelled for p in pinset.pins] if pinset is not None else []
    key = sources.findings_key(want.package, want.site_dir, roots)
    based = bool(want.base_id) and want.base_id != image.id
    base = sources.cached_findings(cache, want.base_id, key) if based else None
    sites = [p for p in proven.python_path if p.rstrip("/").endswith("-packages")]
    reads = {image.id: (list(dict.fromkeys([want.site_dir, *sites])), keep_patched(want.site_dir, want.files))}
    if based and base is None:
        if engine.image(want.base_id) is None:
            say(f"    base {want.base_id[:19]} is not in the engine: every deviation counts as this image's")
        else:
            reads[want.base_id] = ([want.site_dir], keep_metadata)
    files = {ref: site.read(engine, ref, folders, keep, cache, say) for ref, (folders, keep) in reads.items()}
    judged = recheck.judge(recheck.ImageFacts(want, pinset, files[image.id], base, files.get(want.base_id)),
                           gpu_claimed)
    if judged.base is not None:
        sources.store_findings(cache, want.base_id, key, judged.base)
    return judged.problem
