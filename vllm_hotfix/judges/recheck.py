"""The push gate's re-check of an image's files, judged from what one pass read of it.

The gate reads the image's facts once (its layer identity, what its files
must be, the pins, every site folder on its ``sys.path`` and, where no
earlier judgement of its base is kept, the base's site folder:
:func:`vllm_hotfix.checking.launchers.facts.landed_problem`) and hands them
here. Each judge takes what it needs of them, in the order the gate names
a problem: layer identity, the pins, then the file checks (patch-landed,
package-version, integrity) and, where the verdict claims GPU-verified, the
compiled files. The answer is typed (:class:`LandedProblem`): the check,
whether the image differs or this host could not tell, and the difference
where there is one.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import groupby

from ..building.expected import Expected
from ..building.patches import PINS_FILE
from ..building.pinfile import PinSet
from ..sitefacts.site import SiteFiles
from ..verdicts import Status
from . import identity, integrity
from .difference import Difference

# What the re-check calls the parts it runs, beside layer identity's name and integrity's checks' (patch-landed,
# package-version, integrity), which keep theirs.
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


@dataclass(frozen=True, slots=True)
class ImageFacts:
    """What the re-check read of one image, once."""

    want: Expected  # what its files must be
    pinset: PinSet | None  # the definition's pins.txt, if it has one
    files: SiteFiles  # its site folder first, then every other site folder on the base's sys.path
    base: Mapping[str, Mapping[str, str]] | None = None  # its base's deviations, kept from an earlier judgement
    base_files: SiteFiles | None = None  # else its base's site folder, read in the same pass (None: no base)

    @property
    def roots(self) -> list[str]:
        """The pinned distributions, as pins.txt spells them: integrity reads them as the image's own."""
        return [p.spelled for p in self.pinset.pins] if self.pinset is not None else []


@dataclass(frozen=True, slots=True)
class Judgement:
    problem: LandedProblem | None  # None: the image's files are what they must be
    base: dict[str, dict[str, str]] | None = None  # the base's deviations, where judged here from its files


def judge(facts: ImageFacts, gpu_claimed: bool) -> Judgement:
    """The first problem the pins and the file checks find in ``facts`` (``gpu_claimed``: the verdict says
    GPU-verified, which an image lacking compiled files cannot be)."""
    if facts.pinset is not None:
        every = sorted(copy for found in facts.files.copies.values() for copy in found)
        versions = {name: [v for _, v in same] for name, same in groupby(every, key=lambda copy: copy[0])}
        problem = pins_difference(facts.pinset, versions)
        if problem is not None:
            return Judgement(problem)
    want = facts.want
    base, judged_base = facts.base, None
    if base is None and facts.base_files is not None:
        base = judged_base = integrity.base_deviations(facts.base_files, want.site_dir, want.package, facts.roots,
                                                       want.cache_tag)
    checked = integrity.judge_files(facts.files, want, facts.roots, base)
    return Judgement(files_problem(checked, gpu_claimed), judged_base)


def identity_problem(proven: identity.Outcome) -> LandedProblem | None:
    """Layer identity's outcome as the re-check's problem: a base this host could not find or read is its own
    fault (incomplete), a layer, file or config field that differs is the image's (fail)."""
    if proven.status not in (Status.FAIL, Status.INCOMPLETE):
        return None
    return LandedProblem(identity.CHECK, Status(proven.status), proven.detail, proven.difference)


def missing_compiled(judged: integrity.Judged) -> tuple[str, ...]:
    """Compiled files RECORD lists but the image lacks; the base's named so. They keep it from GPU-verified."""
    return (*judged.compiled_missing, *(f"{p} (the base's)" for p in judged.compiled_missing_base))


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


def pins_difference(pinset: PinSet, copies: Mapping[str, Sequence[str]]) -> LandedProblem | None:
    """The first pin whose distribution the image does not hold at exactly its version, once (``copies``: each
    distribution's versions found in the image's site folders)."""
    for pin in pinset.pins:
        have = sorted(copies.get(pin.name) or ())
        if have != [pin.version]:
            found = ", ".join(have)
            words = (f"{pin.spelled} is {found or 'not installed'} in the image (read from its layers), but "
                     f"{pinset.path.parent.name}/{PINS_FILE} {pin.where} pins {pin.version}")
            return LandedProblem(PINS, Status.FAIL, words, Difference(pin.name, "version", pin.version, found, words))
    return None
