"""Pinned Python distributions of a patch set: ``patches/<set>/pins.txt``.

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

What the pinned distributions must be comes from this file and the hashes of
the wheels it names, never from an image's labels. The wheels come from a
wheelhouse folder or are downloaded for the image's own Python and platform
tags; each is checked against the pin's hashes here, and again by pip
(``--require-hashes``) inside the build. They are served to the one ``RUN``
step over loopback and never copied into the image.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .engine import Engine
from .engine import labels as label_keys
from .errors import PinError
from .patches import PINS_FILE, pins_path

log = logging.getLogger(__name__)

BUILD_ARG = "VLLM_HOTFIX_WHEELS"
_REQ = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9.+!_-]*)$")
_HASH = re.compile(r"^--hash=sha256:([0-9a-f]{64})$")
_ACCEPT = re.compile(r"^#\s*accept:\s*(\S+)\s*->\s*([^\s:]+)\s*:\s*(\S.*)$")
_MISSING = re.compile(r"^(\S+) (\S+) requires (\S+), which is not installed\.?$")
_CONFLICT = re.compile(r"^(\S+) (\S+) has requirement (.+), but you have (\S+) (\S+?)\.?$")
_REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
Progress = Callable[[str], None]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# -- pins.txt ---------------------------------------------------------------------


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Accept:
    requirer: str  # canonical
    requirement: str  # canonical
    reason: str
    line: int

    def as_dict(self) -> dict[str, str]:
        return {"requirer": self.requirer, "requirement": self.requirement, "reason": self.reason}


@dataclass(frozen=True)
class PinSet:
    path: Path
    patch_set: str
    pins: tuple[Pin, ...]
    accepts: tuple[Accept, ...]
    sha256: str

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pins]


def cache(root: Path) -> Path:
    """Where downloaded pinned wheels are kept (under VLLM_HOTFIX_CACHE, default build/cache)."""
    import os

    return Path(os.environ.get("VLLM_HOTFIX_CACHE", root / "build" / "cache")) / "pin-wheels"


def path_of(root: Path, patch_set: str) -> Path:
    return pins_path(root, patch_set)


def load(root: Path, patch_set: str, package: str) -> PinSet | None:
    """The patch set's pins, validated; None when it has no pins.txt."""
    path = path_of(root, patch_set)
    if not path.is_file():
        return None
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PinError(f"{path}: not UTF-8 text ({exc})") from exc
    pinset = parse(text, path, patch_set)
    pinset = PinSet(pinset.path, patch_set, pinset.pins, pinset.accepts, hashlib.sha256(raw).hexdigest())
    if canonical(package) in pinset.names:
        pin = next(p for p in pinset.pins if p.name == canonical(package))
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
                accepts.append(Accept(canonical(m.group(1)), canonical(m.group(2)), m.group(3).strip(), start))
            elif re.match(r"^#\s*accept\b", line):
                raise PinError(f"{path}: line {start}: malformed accept comment; write "
                               "`# accept: REQUIRER -> REQUIREMENT: reason`")
            continue
        words = line.split()
        m = _REQ.match(words[0])
        if not m:
            raise PinError(f"{path}: line {start}: {words[0]!r} is not NAME==VERSION (one exact version, "
                           "no extras, ranges, markers or URLs)")
        hashes = []
        for word in words[1:]:
            hm = _HASH.match(word)
            if not hm:
                raise PinError(f"{path}: line {start}: {m.group(1)}: unexpected {word!r} "
                               "(only --hash=sha256:<64 hex> may follow the requirement)")
            hashes.append(hm.group(1))
        if not hashes:
            raise PinError(f"{path}: line {start}: {m.group(1)}=={m.group(2)} has no --hash=sha256:...; "
                           "every pin names the sha256 of its wheel(s)",
                           hint=f"new-patchset --base TAG --pin {m.group(1)}=={m.group(2)} writes the line")
        name = canonical(m.group(1))
        if name in {p.name for p in pins}:
            raise PinError(f"{path}: line {start}: {m.group(1)} is pinned twice")
        pins.append(Pin(name, m.group(2), tuple(hashes), start, m.group(1)))
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


# -- the image's side ----------------------------------------------------------------


@dataclass(frozen=True)
class Installed:
    version: str
    metadata: str
    files: tuple[str, ...]


@dataclass(frozen=True)
class ImageState:
    python: str
    implementation: str
    pip: str | None
    tags: tuple[str, ...]
    dists: Mapping[str, tuple[Installed, ...]]
    existing: tuple[str, ...] = ()

    def version(self, name: str) -> str | None:
        found = self.dists.get(name) or ()
        return found[0].version if len(found) == 1 else (None if not found else "several")


def probe(engine: Engine, image: str, python: str, names: Sequence[str],
          paths: Sequence[str] | None = None) -> ImageState:
    from importlib import resources

    script = resources.files("vllm_hotfix.probes").joinpath("pinstate.py").read_bytes()
    files = {"vllm-hotfix-pins/pinstate.py": script}
    argv = [python, "/tmp/vllm-hotfix-pins/pinstate.py", json.dumps(sorted(names))]
    if paths is not None:
        files["vllm-hotfix-pins/paths.json"] = json.dumps(sorted(paths)).encode()
        argv.append("/tmp/vllm-hotfix-pins/paths.json")
    res = engine.run(image, argv, files=files, timeout=300)
    try:
        data = json.loads(res.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (res.stderr.strip().splitlines() or [f"exit {res.exit_code}"])[-1]
        raise PinError(f"{image[:19]}: cannot read its installed distributions with {python}: {tail}") from None
    dists = {
        name: tuple(Installed(str(c["version"]), str(c["metadata"]), tuple(c["files"])) for c in copies)
        for name, copies in data["dists"].items()
    }
    return ImageState(data["python"], data["implementation"], data["pip"], tuple(data["tags"]), dists,
                      tuple(data.get("existing") or ()))


@dataclass(frozen=True)
class Complaint:
    """One line of ``pip check``, with the identity used to tell old from new."""

    line: str
    kind: str  # missing, conflict or other
    requirer: str
    requirement: str
    spec: str = ""  # the requirement as the requirer states it

    @property
    def key(self) -> tuple[str, ...]:
        # A missing distribution is the base's gap whoever requires it. A
        # conflict is the same one while the same requirer states the same
        # requirement, whichever version of it is installed.
        if self.kind == "missing":
            return ("missing", self.requirement)
        if self.kind == "conflict":
            return ("conflict", self.requirer, self.spec)
        return ("other", re.sub(r"\d[\w.+!-]*", "N", self.line))


def parse_complaint(line: str) -> Complaint:
    m = _MISSING.match(line)
    if m:
        return Complaint(line, "missing", canonical(m.group(1)), canonical(_name_of(m.group(3))))
    m = _CONFLICT.match(line)
    if m:
        return Complaint(line, "conflict", canonical(m.group(1)), canonical(_name_of(m.group(3))),
                         m.group(3).replace(" ", ""))
    return Complaint(line, "other", "", "")


def _name_of(requirement: str) -> str:
    m = _REQ_NAME.match(requirement)
    return m.group(1) if m else requirement


def pip_check(engine: Engine, image: str, python: str) -> list[Complaint]:
    """``pip check`` in the image: its complaints (none when it exits 0)."""
    res = engine.run(image, [python, "-m", "pip", "check", "--disable-pip-version-check"], timeout=300)
    lines = [ln.strip() for ln in res.stdout.splitlines() if ln.strip()]
    if res.exit_code == 0:
        return []
    if not lines or "No module named pip" in res.stderr:
        tail = (res.stderr.strip().splitlines() or [f"exit {res.exit_code}"])[-1]
        raise PinError(f"{image[:19]}: `{python} -m pip check` did not run: {tail}")
    return [parse_complaint(ln) for ln in lines if not ln.startswith("No broken requirements")]


@dataclass(frozen=True)
class CheckOutcome:
    base_only: tuple[str, ...]  # complaints the base already had
    accepted: tuple[tuple[str, str], ...]  # (complaint, reason)
    added: tuple[str, ...]  # complaints the pins added, not accepted

    def as_dict(self) -> dict[str, Any]:
        return {"base": list(self.base_only), "accepted": [{"complaint": c, "reason": r} for c, r in self.accepted],
                "added": list(self.added)}


def judge_complaints(before: Sequence[Complaint], after: Sequence[Complaint], accepts: Sequence[Accept]
                     ) -> CheckOutcome:
    old = {c.key for c in before}
    base_only, accepted, added = [], [], []
    for c in after:
        if c.key in old:
            base_only.append(c.line)
            continue
        why = next((a.reason for a in accepts if a.requirer == c.requirer and a.requirement == c.requirement),
                   None)
        if why is not None:
            accepted.append((c.line, why))
        else:
            added.append(c.line)
    return CheckOutcome(tuple(base_only), tuple(accepted), tuple(added))


# -- wheels -----------------------------------------------------------------------------


def wheel_tags(filename: str) -> tuple[str, str, set[str]] | None:
    """(canonical name, version, tags) of a wheel file name; None if it is not one."""
    if not filename.endswith(".whl"):
        return None
    parts = filename[:-4].split("-")
    if len(parts) not in (5, 6):
        return None
    name, version, py, abi, plat = parts[0], parts[1], parts[-3], parts[-2], parts[-1]
    tags = {f"{a}-{b}-{c}" for a in py.split(".") for b in abi.split(".") for c in plat.split(".")}
    return canonical(name), version, tags


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class Wheel:
    pin: Pin
    path: Path
    sha256: str

    @property
    def filename(self) -> str:
        return self.path.name


def describe_image(state: ImageState) -> str:
    plat = state.tags[0].split("-")[-1] if state.tags else "?"
    return f"Python {state.python} ({state.implementation}) on {plat}"


def _candidates(folder: Path, pin: Pin) -> list[Path]:
    out = []
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        parsed = wheel_tags(path.name)
        if parsed and parsed[0] == pin.name and parsed[1] == pin.version:
            out.append(path)
    return out


def _best_fit(paths: list[Path], tags: Sequence[str]) -> Path | None:
    rank = {t: i for i, t in enumerate(tags)}
    scored = []
    for path in paths:
        parsed = wheel_tags(path.name)
        assert parsed is not None
        hits = [rank[t] for t in parsed[2] if t in rank]
        if hits:
            scored.append((min(hits), path.name, path))
    return min(scored)[2] if scored else None


def download(pin: Pin, state: ImageState, folder: Path, say: Progress) -> None:
    """``pip download`` the pin's wheel for the image's Python and platform tags into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    interpreters = sorted({t.split("-")[0] for t in state.tags})
    abis = sorted({t.split("-")[1] for t in state.tags})
    platforms = sorted({t.split("-")[2] for t in state.tags})
    impl = "cp" if state.implementation == "cpython" else "py"
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", str(folder), "--python-version", state.python, "--implementation", impl]
    for abi in abis:
        cmd += ["--abi", abi]
    for plat in platforms:
        cmd += ["--platform", plat]
    cmd.append(f"{pin.spelled}=={pin.version}")
    say(f"    downloading {pin.spelled}=={pin.version} for {describe_image(state)} "
        f"({len(interpreters)} interpreter, {len(platforms)} platform tag(s))")
    import subprocess  # here: only a download runs pip

    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()] or ["no output"]
        raise PinError(f"{pin.where}: no wheel fits the image ({describe_image(state)}) on the package "
                       f"index: {last[-1].removeprefix('ERROR: ')}", pin=pin.name,
                       hint="check the version exists for this Python and platform, or pass --wheelhouse DIR")


def find_wheels(pinset: PinSet, state: ImageState, wheelhouse: Path | None, cache: Path, say: Progress
                ) -> list[Wheel]:
    """One checked wheel per pin, from ``wheelhouse`` or else downloaded into ``cache``."""
    if not state.tags:
        raise PinError(f"{pinset.path}: the base image has no pip for Python {state.python}; pins need pip "
                       "inside the image", hint="use a base image with pip, or drop pins.txt")
    if wheelhouse is not None and not wheelhouse.is_dir():
        raise PinError(f"--wheelhouse {wheelhouse}: no such folder")
    chosen: list[Wheel] = []
    for pin in pinset.pins:
        folder = wheelhouse if wheelhouse is not None else cache
        found = _candidates(folder, pin)
        best = _best_fit(found, state.tags)
        if best is None and wheelhouse is None:
            download(pin, state, cache, say)
            found = _candidates(cache, pin)
            best = _best_fit(found, state.tags)
        if best is None:
            if found:
                raise PinError(f"{pinset.path}: {pin.where}: no wheel fits the image ({describe_image(state)}): "
                               f"{', '.join(p.name for p in found)}", pin=pin.name,
                               hint="add the wheel built for the image's Python and platform to the wheelhouse")
            raise PinError(f"{pinset.path}: {pin.where}: no wheel in {folder}", pin=pin.name,
                           hint="put the wheel there, or leave out --wheelhouse to download it")
        digest = sha256_file(best)
        if digest not in pin.hashes:
            raise PinError(f"{pinset.path}: {pin.where}: wheel {best.name} has sha256 {digest}, not one the pin "
                           "lists", pin=pin.name,
                           hint="a wrong hash in pins.txt or a different wheel than the one pinned; "
                                "never just copy the new hash in without knowing why it changed")
        chosen.append(Wheel(pin, best, digest))
    return chosen


def wheel_record(path: Path) -> dict[str, str]:
    """path -> urlsafe-b64 sha256 of every hashed file in a wheel's RECORD."""
    import csv
    import zipfile

    with zipfile.ZipFile(path) as zf:
        name = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1), None)
        if name is None:
            raise PinError(f"{path.name}: no RECORD; not a wheel")
        rows = csv.reader(zf.read(name).decode("utf-8").splitlines())
        return {r[0]: r[1][len("sha256="):] for r in rows if len(r) >= 2 and r[1].startswith("sha256=")}


# -- serving the wheels to the build ----------------------------------------------------


@dataclass
class Prepared:
    """Everything about a patch set's pins known before the build."""

    pinset: PinSet
    before: ImageState
    before_check: list[Complaint]
    wheels: list[Wheel] = field(default_factory=list)

    def entries(self) -> list[dict[str, str]]:
        """Per pin, in file order: what the template and the labels show."""
        out = []
        for i, pin in enumerate(self.pinset.pins, 1):
            wheel = next((w for w in self.wheels if w.pin == pin), None)
            out.append({
                "name": pin.spelled,
                "before": self.before.version(pin.name) or "absent",
                "after": pin.version,
                "req": f"{i:02d}-{pin.name}.txt",
                "wheel": wheel.filename if wheel else "",
                "sha256": wheel.sha256 if wheel else "",
            })
        return out

    def labels(self) -> dict[str, str]:
        pins = {e["name"]: {k: e[k] for k in ("before", "after", "wheel", "sha256")} for e in self.entries()}
        return {
            label_keys.PINS: json.dumps(pins, sort_keys=True),
            label_keys.PINS_SHA256: self.pinset.sha256,
            label_keys.PINS_ACCEPTED: json.dumps([a.as_dict() for a in self.pinset.accepts], sort_keys=True),
        }


def prepare(engine: Engine, pinset: PinSet, image_id: str, python: str, *, wheelhouse: Path | None,
            cache: Path, say: Progress, wheels: bool = True) -> Prepared:
    """Read the base's side (versions, tags, ``pip check``) and, with ``wheels``, find every wheel."""
    say(f"==> {len(pinset.pins)} pin(s) from {pinset.path.parent.name}/{PINS_FILE}: reading the base's "
        "distributions and pip check")
    if wheels and not engine.local:
        raise PinError(f"{pinset.path}: pins are installed from wheels served on this machine's loopback, which "
                       f"the engine at {engine.address} cannot reach",
                       hint="build patch sets with pins on the engine's own machine (unset DOCKER_HOST)")
    state = probe(engine, image_id, python, pinset.names)
    if state.pip is None:
        raise PinError(f"{pinset.path}: base {image_id[:19]} has no pip for {python}; pins need pip inside "
                       "the image", hint="use a base with pip, or drop pins.txt")
    several = [n for n in pinset.names if len(state.dists.get(n) or ()) > 1]
    if several:
        where = ", ".join(c.metadata for c in state.dists[several[0]])
        raise PinError(f"base {image_id[:19]} has {several[0]} installed more than once ({where}); "
                       "pip would replace only one of them")
    before_check = pip_check(engine, image_id, python)
    prepared = Prepared(pinset, state, before_check)
    if wheels:
        prepared.wheels = find_wheels(pinset, state, wheelhouse, cache, say)
    return prepared


@contextmanager
def serve(prepared: Prepared | None) -> Iterator[dict[str, str]]:
    """Serve the wheels on 127.0.0.1 for the length of a build; yields its build arguments."""
    if prepared is None:
        yield {}
        return
    # Here: the HTTP server (and the email and TLS modules under it) only for a build with pins.
    from . import wheelserver

    with wheelserver.serve(prepared) as address:
        yield {BUILD_ARG: address}


# -- after the build --------------------------------------------------------------------


def verify(engine: Engine, image_id: str, prepared: Prepared, python: str, say: Progress) -> dict[str, Any]:
    """Check the built image against the pins; raise PinError on the first thing wrong.

    Each pinned distribution has exactly the pinned version, once; every file
    the base's old version listed and the new one does not is gone; ``pip
    check`` adds no complaint the pin file does not accept.
    """
    pinset = prepared.pinset
    old_files: set[str] = set()
    for pin in pinset.pins:
        for copy in prepared.before.dists.get(pin.name) or ():
            if copy.version != pin.version:
                old_files.update(copy.files)
                old_files.add(copy.metadata)
    state = probe(engine, image_id, python, pinset.names, sorted(old_files))
    for pin in pinset.pins:
        copies = state.dists.get(pin.name) or ()
        versions = sorted(c.version for c in copies)
        if versions != [pin.version]:
            raise PinError(f"{pinset.path}: {pin.where}: the built image has {pin.spelled} "
                           f"{', '.join(versions) or 'not installed'}, not exactly {pin.version}", pin=pin.name)
    kept = set(state.existing)
    for copy in (c for pin in pinset.pins for c in state.dists.get(pin.name) or ()):
        kept -= set(copy.files) | {copy.metadata}
    if kept:
        raise PinError(f"{pinset.path}: {len(kept)} file(s) of the replaced versions are still in the image, "
                       f"e.g. {sorted(kept)[0]}")
    after_check = pip_check(engine, image_id, python)
    outcome = judge_complaints(prepared.before_check, after_check, pinset.accepts)
    for line, why in outcome.accepted:
        say(f"    pip check: accepted by {PINS_FILE}: {line} ({why})")
    if outcome.base_only:
        say(f"    pip check: {len(outcome.base_only)} complaint(s) the base already had (not the pins')")
    if outcome.added:
        raise PinError(f"{pinset.path}: the pins break a requirement: pip check says \"{outcome.added[0]}\"",
                       hint=f"pin a version that fits, or mark it `# accept: REQUIRER -> REQUIREMENT: reason` "
                            f"in {PINS_FILE} if it is deliberate"
                            + (f" ({len(outcome.added) - 1} more)" if len(outcome.added) > 1 else ""))
    return {
        "file": f"patches/{pinset.patch_set}/{PINS_FILE}",
        "sha256": pinset.sha256,
        "pins": prepared.entries(),
        "pip_check": outcome.as_dict(),
        "old_files_removed": len(old_files),
    }


# -- check-upstream -----------------------------------------------------------------


def judge_release(pinset: PinSet, requires: Sequence[str], release: str) -> list[dict[str, str]]:
    """Per pin, what a release's own requirements (``Requires-Dist`` lines) say of it.

    ``included``: the release requires exactly the pinned version; ``allowed``:
    its range admits the pin but does not fix it; ``contradicts``: its range
    excludes the pin; ``unconstrained``: it does not require the distribution.
    """
    from packaging.requirements import InvalidRequirement, Requirement

    parsed: dict[str, list[Requirement]] = {}
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and "extra" in str(req.marker):
            continue
        parsed.setdefault(canonical(req.name), []).append(req)
    out = []
    for pin in pinset.pins:
        reqs = parsed.get(pin.name, [])
        if not reqs:
            out.append({"pin": f"{pin.spelled}=={pin.version}", "verdict": "unconstrained",
                        "detail": f"{release} does not require {pin.spelled} itself"})
            continue
        specs = [str(r.specifier) or "any version" for r in reqs]
        if not all(r.specifier.contains(pin.version, prereleases=True) for r in reqs):
            verdict = "contradicts"
        elif all(s.operator in ("==", "===") and s.version == pin.version for r in reqs for s in r.specifier) \
                and any(r.specifier for r in reqs):
            verdict = "included"
        else:
            verdict = "allowed"
        out.append({"pin": f"{pin.spelled}=={pin.version}", "verdict": verdict,
                    "detail": f"{release} requires {pin.spelled} {', '.join(specs)}"})
    return out


# -- new-patchset --pin -------------------------------------------------------------------


def pin_line(spec: str, state: ImageState, cache: Path, wheelhouse: Path | None, say: Progress) -> str:
    """The pins.txt line for ``NAME==VERSION``: the sha256 of each wheel that fits the image."""
    m = _REQ.match(spec.strip())
    if not m:
        raise PinError(f"--pin {spec!r}: write NAME==VERSION (one exact version)")
    pin = Pin(canonical(m.group(1)), m.group(2), (), 0, m.group(1))
    folder = wheelhouse if wheelhouse is not None else cache
    fitting = [p for p in _candidates(folder, pin) if _best_fit([p], state.tags) is not None]
    if not fitting and wheelhouse is None:
        download(pin, state, cache, say)
        fitting = [p for p in _candidates(cache, pin) if _best_fit([p], state.tags) is not None]
    if not fitting:
        raise PinError(f"--pin {spec}: no wheel fits the image ({describe_image(state)}) in {folder}", pin=pin.name)
    hashes = sorted({sha256_file(p) for p in fitting})
    tail = "".join(f" \\\n    --hash=sha256:{h}" for h in hashes)
    return f"{pin.spelled}=={pin.version}{tail}\n"


def add(root: Path, patch_set: str, package: str, specs: Sequence[str], state: ImageState,
        wheelhouse: Path | None, say: Progress) -> Path:
    """Append a hash-checked line per ``NAME==VERSION`` to the set's pins.txt, all or nothing."""
    path = path_of(root, patch_set)
    if not path.parent.is_dir():
        raise PinError(f"patches/{patch_set}: no such patch set")
    current = load(root, patch_set, package)
    taken = {p.name: p for p in current.pins} if current is not None else {}
    lines = []
    for spec in specs:
        m = _REQ.match(spec.strip())
        if m and canonical(m.group(1)) in taken:
            raise PinError(f"--pin {spec}: {path} already pins it ({taken[canonical(m.group(1))].where})")
        if m and canonical(m.group(1)) == canonical(package):
            raise PinError(f"--pin {spec}: a hotfix patches {package}, it does not replace it")
        lines.append(pin_line(spec, state, cache(root), wheelhouse, say))
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    text = old + "".join(lines)
    parse(text, path, patch_set)  # what is written must load
    part = path.with_name(path.name + ".part")
    part.write_text(text, encoding="utf-8")
    part.replace(path)
    return path
