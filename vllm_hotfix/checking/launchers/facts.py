"""The file facts: what the host reads from an image's files and judges itself, never running the image.

Podman's store, a registry's blobs or the Docker engine: wherever the image
is started from, its files are read from there and judged the same way
(:func:`~vllm_hotfix.judges.integrity.check_image`). A smoke run's job carries the
finished checks (:func:`file_facts`); the host's verdict keeps them as the
host made them, whatever the runner reports. The push gate reads them again
right before a push (:func:`landed_problem`, :func:`pins_problem`), and answer
with a typed :class:`LandedProblem`: the check, whether the image differs or
the host could not tell, and the difference where there is one.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...building import definitions, expected, pins, sources
from ...engine import Engine, ImageInfo
from ...errors import DefinitionError, EngineError, PinError, UnknownExpectation
from ...judges import identity, installed, integrity
from ...judges.difference import Difference
from ...verdicts import Status


def missing_compiled(judged: integrity.Judged) -> tuple[str, ...]:
    """Compiled files RECORD lists but the image lacks; the base's named so. They keep it from GPU-verified."""
    return (*judged.compiled_missing, *(f"{p} (the base's)" for p in judged.compiled_missing_base))


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


def file_facts(root: Path, image: ImageInfo, files_from: integrity.FileSource, expect_from: Engine | None,
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


# What the push gate's re-check calls the parts it runs, beside layer identity's name and integrity's checks'
# (patch-landed, package-version, integrity), which keep theirs.
EXPECTATION = "expectation"  # what the patched files must be, recomputed from the patch set and the base
PINS = "pins"  # the versions pins.txt names, once each in the image's site folders
COMPILED_FILES = "compiled-files"  # the compiled files a GPU-verified image must have


@dataclass(frozen=True, slots=True)
class LandedProblem:
    """Why the re-check of an image's files stops a push: the check that found it, and whose fault it is.

    ``status`` is :attr:`Status.FAIL` where the image differs from what it
    must be, :attr:`Status.INCOMPLETE` where this host could not read or work
    out what the check needs (a base not found, a pins.txt or definition it
    cannot use, an expectation it cannot recompute): nothing is then known
    against the image, and it is never called a difference.
    """

    check: str  # identity.CHECK, EXPECTATION, PINS, COMPILED_FILES, or an integrity check's name
    status: Status
    words: str  # what the check says, after its name
    difference: Difference | None = None  # where a fail names one: the path, field, expected and found

    @property
    def host_fault(self) -> bool:
        return self.status is Status.INCOMPLETE

    def __str__(self) -> str:
        return f"{self.check}: {self.words}"


def identity_problem(proven: identity.Outcome) -> LandedProblem | None:
    """Layer identity's outcome as the re-check's problem: a base this host could not find or read is its own
    fault (incomplete), a layer, file or config field that differs is the image's (fail)."""
    if proven.status not in (Status.FAIL, Status.INCOMPLETE):
        return None
    return LandedProblem(identity.CHECK, Status(proven.status), proven.detail, proven.difference)


def files_problem(checked: integrity.FileChecks, gpu_claimed: bool) -> LandedProblem | None:
    """The first of the file checks that does not pass (each keeps its status), else, where the verdict claims
    GPU-verified, the compiled files RECORD lists that the image lacks."""
    for check in checked.checks:
        if check["status"] != Status.PASS:
            return LandedProblem(str(check["name"]), Status(check["status"]), str(check["detail"]),
                                 checked.differences.get(str(check["name"])))
    judged = checked.judged
    missing = missing_compiled(judged)
    if not (gpu_claimed and missing):
        return None
    first = (*judged.compiled_missing, *judged.compiled_missing_base)[0]
    words = (f"its verdict says GPU-verified, but {len(missing)} compiled file(s) the installed RECORD lists are "
             f"absent, e.g. {', '.join(missing[:integrity.EXAMPLES])}")
    return LandedProblem(COMPILED_FILES, Status.FAIL, words, Difference(first, "entry", "listed in RECORD", "", words))


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
    """
    proven = identity.prove(engine, root, image, say=say)
    problem = identity_problem(proven)
    if problem is not None:  # a base not found here proves nothing either way: no push
        return problem
    try:
        found = expected.for_image(engine, root, image, base_id=proven.base_id or None,
                                   definition=proven.base.definition.tag if proven.base is not None else None)
    except UnknownExpectation as exc:
        return LandedProblem(EXPECTATION, Status.INCOMPLETE, str(exc))
    if not found.site_dir:
        return LandedProblem(EXPECTATION, Status.INCOMPLETE, "the build record names no site folder to read the "
                                                             "image's files in: rebuild the image with this version "
                                                             "of the tool")
    sites = [p for p in proven.python_path if p.rstrip("/").endswith("-packages")]
    problem = pins_problem(engine, root, image, found, sites)
    if problem is not None:
        return problem
    try:
        pinned = pinned_names(root, found.definition)
    except (DefinitionError, PinError) as exc:
        return LandedProblem(PINS, Status.INCOMPLETE, str(exc))
    return files_problem(integrity.check_image(engine, sources.cache_dir(root), image.id, found, pinned, say),
                         gpu_claimed)


def pins_difference(pinset: pins.PinSet, copies: Mapping[str, Sequence[str]]) -> LandedProblem | None:
    """The first pin whose distribution the image does not hold at exactly its version, once (``copies``: each
    distribution's versions found in the image's site folders)."""
    for pin in pinset.pins:
        have = sorted(copies.get(pin.name) or ())
        if have != [pin.version]:
            found = ", ".join(have)
            words = (f"{pin.spelled} is {found or 'not installed'} in the image (read from its layers), but "
                     f"{pinset.path.parent.name}/{pins.PINS_FILE} {pin.where} pins {pin.version}")
            return LandedProblem(PINS, Status.FAIL, words, Difference(pin.name, "version", pin.version, found, words))
    return None


def pins_problem(engine: Engine, root: Path, image: ImageInfo, found: expected.Expected,
                 sites: Sequence[str] = ()) -> LandedProblem | None:
    """None if every distribution the definition's pins.txt names has its pinned version, once.

    Read from the image's layers, in its site folder and every other site
    folder on the base's ``sys.path`` (``sites``, as the host read it from the
    base): nothing of the image runs, so neither its Python nor anything its
    configuration would load answers for it. A definition or pins.txt this
    host cannot use is its own fault (incomplete), never the image's.
    """
    try:
        defn = definitions.load(root, found.definition)
        pinset = pins.load(root, defn.patch_set, defn.package)
    except (DefinitionError, PinError) as exc:
        return LandedProblem(PINS, Status.INCOMPLETE, str(exc))
    if pinset is None:
        return None
    copies: dict[str, list[str]] = {}
    for site in dict.fromkeys([found.site_dir, *sites]):
        if not site:
            continue
        tree = integrity.read_site(engine, image.id, site, integrity.keep_metadata, sources.cache_dir(root))
        for name, version in installed.copies(tree, site):
            copies.setdefault(name, []).append(version)
    return pins_difference(pinset, copies)
