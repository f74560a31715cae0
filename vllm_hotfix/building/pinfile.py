"""Reading and writing a patch set's ``pins.txt``.

Some fixes are not source patches but versions: a dependency the base image
ships in a broken combination (quack-kernels 0.6.5 with vLLM 0.25.1's
vendored SM100 attention) or unpacked in a race (nvidia-cutlass-dsl's
sub-wheels before 4.6.0). A patch set may then carry ``pins.txt`` in pip's
hash-checking format, one distribution per requirement, installed in the order
written::

    quack-kernels==0.6.4 \\
        --hash=sha256:<64 hex>
    # accept: vllm -> nvidia-cutlass-dsl: why this conflict is deliberate

An ``# accept: REQUIRER -> REQUIREMENT: reason`` comment marks one complaint of
``pip check`` that the pins may add (pip itself reads it as a comment).
Requirements are read with ``packaging``, as pip reads them; only the
``--hash`` options and the accept comments, which are pip's and ours, are
read here. What the pins do to an image is :mod:`pins`'s.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from ..errors import PinError
from ..journal.atomic import write_atomic
from .patches import pins_path

_HASH = re.compile(r"^--hash=sha256:([0-9a-f]{64})$")
_ACCEPT = re.compile(r"^#\s*accept:\s*(\S+)\s*->\s*([^\s:]+)\s*:\s*(\S.*)$")
_ACCEPT_START = re.compile(r"^#\s*accept\b")


@dataclass(frozen=True, slots=True)
class Pin:
    name: str  # canonical
    version: str
    hashes: tuple[str, ...]
    line: int
    spelled: str  # the name as pins.txt writes it

    @property
    def where(self) -> str:
        return f"line {self.line}: {self.spelled}=={self.version}"

    def requirement(self) -> str:
        """The pin as a one-requirement file in pip's hash-checking format."""
        hashes = " ".join(f"--hash=sha256:{h}" for h in self.hashes)
        return f"{self.spelled}=={self.version} {hashes}\n"


@dataclass(frozen=True, slots=True)
class Accept:
    requirer: str  # canonical
    requirement: str  # canonical
    reason: str
    line: int

    def as_dict(self) -> dict[str, str]:
        return {"requirer": self.requirer, "requirement": self.requirement, "reason": self.reason}


@dataclass(frozen=True, slots=True)
class PinSet:
    path: Path
    patch_set: str
    pins: tuple[Pin, ...]
    accepts: tuple[Accept, ...]
    sha256: str

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pins]


def exact(text: str) -> tuple[str, str] | None:
    """(name as spelled, version) of ``NAME==VERSION``; None for anything else (extras, ranges, markers, URLs)."""
    try:
        req = Requirement(text)
    except InvalidRequirement:
        return None
    specs = list(req.specifier)
    if req.extras or req.marker is not None or req.url or len(specs) != 1:
        return None
    if specs[0].operator != "==" or specs[0].version.endswith(".*"):
        return None
    return req.name, specs[0].version


def load(root: Path, patch_set: str, package: str) -> PinSet | None:
    """The patch set's pins, validated; None when it has no pins.txt."""
    path = pins_path(root, patch_set)
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PinError(f"{path}: not UTF-8 text ({exc})") from exc
    pinset = parse(text, path, patch_set)
    pin = next((p for p in pinset.pins if p.name == canonicalize_name(package)), None)
    if pin is not None:
        raise PinError(f"{path}: {pin.where}: pins {package} itself; a hotfix patches {package}, "
                       "it does not replace it", pin=pin.name)
    return pinset


def parse(text: str, path: Path, patch_set: str = "") -> PinSet:
    pins: list[Pin] = []
    accepts: list[Accept] = []
    if "\r" in text:
        raise PinError(f"{path}: has CR line endings; write it with LF only")
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        start = i + 1
        line = lines[i].strip()
        # pip's continuation: a trailing backslash joins the next line.
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1].strip() + " " + lines[i].strip()
        i += 1
        if not line:
            continue
        if line.startswith("#"):
            m = _ACCEPT.match(line)
            if m:
                accepts.append(Accept(canonicalize_name(m.group(1)), canonicalize_name(m.group(2)),
                                      m.group(3).strip(), start))
            elif _ACCEPT_START.match(line):
                raise PinError(f"{path}: line {start}: malformed accept comment; write "
                               "`# accept: REQUIRER -> REQUIREMENT: reason`")
            continue
        words = line.split()
        req = exact(words[0])
        if req is None:
            raise PinError(f"{path}: line {start}: {words[0]!r} is not NAME==VERSION (one exact version, "
                           "no extras, ranges, markers or URLs)")
        spelled, version = req
        hashes = []
        for word in words[1:]:
            hm = _HASH.match(word)
            if not hm:
                raise PinError(f"{path}: line {start}: {spelled}: unexpected {word!r} "
                               "(only --hash=sha256:<64 hex> may follow the requirement)")
            hashes.append(hm.group(1))
        if not hashes:
            raise PinError(f"{path}: line {start}: {spelled}=={version} has no --hash=sha256:...; "
                           "every pin names the sha256 of its wheel(s)",
                           hint=f"new-patchset --definition TAG --pin {spelled}=={version} writes the line")
        name = canonicalize_name(spelled)
        if name in {p.name for p in pins}:
            raise PinError(f"{path}: line {start}: {spelled} is pinned twice")
        pins.append(Pin(name, version, tuple(hashes), start, spelled))
    if not pins:
        raise PinError(f"{path}: pins nothing; delete the file or add NAME==VERSION --hash=sha256:... lines")
    return PinSet(path, patch_set, tuple(pins), tuple(accepts), hashlib.sha256(text.encode()).hexdigest())


def check_builder(pinset: PinSet | None, builder: str) -> None:
    """Only a Dockerfile build can run pip; a builder that writes layers itself cannot."""
    if pinset is not None and builder != "dockerfile":
        raise PinError(
            f"{pinset.path}: patch set {pinset.patch_set} pins {len(pinset.pins)} distribution(s), which needs "
            f"pip to run in the image; --builder {builder} cannot do that",
            hint="build this definition with --builder dockerfile",
        )


def line(spelled: str, version: str, hashes: Iterable[str]) -> str:
    """A pins.txt line, one hash per continuation line as pip's own examples write them."""
    tail = "".join(f" \\\n    --hash=sha256:{h}" for h in sorted(hashes))
    return f"{spelled}=={version}{tail}\n"


def append(path: Path, patch_set: str, lines: Sequence[str]) -> None:
    """Add ``lines`` to the pin file, all or nothing, checking that what is written loads."""
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    text = old + "".join(lines)
    parse(text, path, patch_set)
    write_atomic(path, text, error=PinError)
