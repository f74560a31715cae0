"""What a patch set's pinned distributions do to an image: before, during and after its build.

The pins themselves come from ``patches/<set>/pins.txt`` (:mod:`pinfile`,
which also explains why a patch set pins versions). What the pinned
distributions must be comes from that file and the hashes of the wheels it
names, never from an image's labels. The wheels come from a wheelhouse folder
or are downloaded (:mod:`wheels`) for the image's own Python and platform
tags; each is checked against the pin's hashes here, and again by pip
(``--require-hashes``) inside the build. They are served to the one ``RUN``
step over loopback (:mod:`wheelserver`) and never copied into the image.

The rest of the pipeline reaches pins through this module, so the few names
of :mod:`pinfile` it needs are re-exported here.
"""

from __future__ import annotations

import html
import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from ..engine import Engine
from ..engine import labels as label_keys
from ..errors import PinError
from . import pinfile, wheels
from .patches import PINS_FILE, pins_path
from .pinfile import Accept, Pin
from .pinfile import PinSet as PinSet
from .pinfile import check_builder as check_builder
from .pinfile import load as load
from .sources import cache_dir

log = logging.getLogger(__name__)

BUILD_ARG = "VLLM_HOTFIX_WHEELS"
_MISSING = re.compile(r"^(\S+) (\S+) requires (\S+), which is not installed\.?$")
_CONFLICT = re.compile(r"^(\S+) (\S+) has requirement (.+), but you have (\S+) (\S+?)\.?$")
Progress = Callable[[str], None]


def cache(root: Path) -> Path:
    """Where downloaded pinned wheels are kept (under VLLM_HOTFIX_CACHE, default build/cache)."""
    return cache_dir(root) / "pin-wheels"


def cached_wheel(root: Path, pin: Pin) -> Path | None:
    """The wheel of ``pin`` in the pin cache whose sha256 is one the pin names; None where there is none."""
    folder = cache(root)
    for path in sorted(folder.glob("*.whl")) if folder.is_dir() else []:
        if wheels.matches(path.name, pin.name, pin.version) and wheels.sha256_file(path) in pin.hashes:
            return path
    return None


# -- the image's side ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Installed:
    version: str
    metadata: str
    files: tuple[str, ...]


@dataclass(frozen=True, slots=True)
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
    script = resources.files("vllm_hotfix.inimage.probes").joinpath("pinstate.py").read_bytes()
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


@dataclass(frozen=True, slots=True)
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
        return Complaint(line, "missing", canonicalize_name(m.group(1)), _name_of(m.group(3)))
    m = _CONFLICT.match(line)
    if m:
        return Complaint(line, "conflict", canonicalize_name(m.group(1)), _name_of(m.group(3)),
                         m.group(3).replace(" ", ""))
    return Complaint(line, "other", "", "")


def _name_of(requirement: str) -> str:
    """The canonical name of a requirement as pip check prints it."""
    try:
        return canonicalize_name(Requirement(requirement).name)
    except InvalidRequirement:
        return canonicalize_name(requirement.split()[0] if requirement.split() else requirement)


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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
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


def _fitting(folder: Path, pin: Pin, state: ImageState) -> list[Path]:
    return [p for p in wheels.find(folder, pin.name, pin.version) if wheels.rank(p, state.tags) is not None]


def download(pin: Pin, state: ImageState, folder: Path, say: Progress, context: str = "") -> None:
    """``pip download`` the pin's wheel for the image's Python and platform tags into ``folder``."""
    target = wheels.Target.of_tags(state.python, state.implementation, state.tags)
    say(f"    downloading {pin.spelled}=={pin.version} for {describe_image(state)} "
        f"({len(target.platforms)} platform tag(s))")
    wheels.download(pin.spelled, pin.version, folder, target, error=PinError, context=context,
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
        found = wheels.find(folder, pin.name, pin.version)
        best = wheels.best_fit(found, state.tags)
        if best is None and wheelhouse is None:
            download(pin, state, cache, say, f"{pinset.path}: {pin.where}: ")
            found = wheels.find(cache, pin.name, pin.version)
            best = wheels.best_fit(found, state.tags)
        if best is None:
            if found:
                raise PinError(f"{pinset.path}: {pin.where}: no wheel fits the image ({describe_image(state)}): "
                               f"{', '.join(p.name for p in found)}", pin=pin.name,
                               hint="add the wheel built for the image's Python and platform to the wheelhouse")
            raise PinError(f"{pinset.path}: {pin.where}: no wheel in {folder}", pin=pin.name,
                           hint="put the wheel there, or leave out --wheelhouse to download it")
        digest = wheels.sha256_file(best)
        if digest not in pin.hashes:
            raise PinError(f"{pinset.path}: {pin.where}: wheel {best.name} has sha256 {digest}, not one the pin "
                           "lists", pin=pin.name,
                           hint="a wrong hash in pins.txt or a different wheel than the one pinned; "
                                "never just copy the new hash in without knowing why it changed")
        if wheelhouse is not None:
            keep_in_cache(best, digest, cache)
        chosen.append(Wheel(pin, best, digest))
    return chosen


def keep_in_cache(wheel: Path, digest: str, cache: Path) -> None:
    """A wheelhouse's wheel kept in the pin cache too: the smoke judges the pip layer against the wheels there, by
    their hashes, long after the wheelhouse is gone."""
    kept = cache / wheel.name
    if kept.is_file() and wheels.sha256_file(kept) == digest:
        return
    cache.mkdir(parents=True, exist_ok=True)
    part = cache / f".{wheel.name}.{os.getpid()}.part"
    try:
        shutil.copyfile(wheel, part)
        os.replace(part, kept)
    except OSError as exc:
        raise PinError(f"cannot keep {wheel.name} in {cache}: {exc.strerror or exc}",
                       hint="set VLLM_HOTFIX_CACHE to a folder this user can write") from exc
    finally:
        part.unlink(missing_ok=True)  # a copy cut short (a full disk, Ctrl-C) leaves no half wheel behind


# -- serving the wheels to the build ----------------------------------------------------


@dataclass(frozen=True, slots=True)
class Prepared:
    """Everything about a patch set's pins known before the build."""

    pinset: PinSet
    before: ImageState
    before_check: tuple[Complaint, ...]
    wheels: tuple[Wheel, ...]

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

    def routes(self) -> dict[str, Path | bytes]:
        """What the loopback server answers: an index of the wheels, the wheels, one requirement file per pin."""
        out: dict[str, Path | bytes] = {}
        links = []
        for w in self.wheels:
            out[f"/wheels/{w.filename}"] = w.path
            links.append(f'<a href="{html.escape(w.filename)}#sha256={w.sha256}">{html.escape(w.filename)}</a><br>')
        out["/wheels/"] = ("<html><body>\n" + "\n".join(links) + "\n</body></html>\n").encode()
        for entry, pin in zip(self.entries(), self.pinset.pins, strict=True):
            out[f"/req/{entry['req']}"] = pin.requirement().encode()
        return out


def prepare(engine: Engine, pinset: PinSet, image_id: str, python: str, *, wheelhouse: Path | None,
            cache: Path, say: Progress) -> Prepared:
    """Read the base's side (versions, tags, ``pip check``) and find every wheel."""
    say(f"==> {len(pinset.pins)} pin(s) from {pinset.path.parent.name}/{PINS_FILE}: reading the base's "
        "distributions and pip check")
    if not engine.local:
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
    return Prepared(pinset, state, tuple(before_check), tuple(find_wheels(pinset, state, wheelhouse, cache, say)))


@contextmanager
def serve(prepared: Prepared | None) -> Iterator[dict[str, str]]:
    """Serve the wheels on 127.0.0.1 for the length of a build; yields its build arguments."""
    if prepared is None:
        yield {}
        return
    # Here: the HTTP server (and the email and TLS modules under it) only for a build with pins.
    from . import wheelserver

    with wheelserver.serve(prepared.routes()) as address:
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
    parsed: dict[str, list[Requirement]] = {}
    for line in requires:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        if req.marker is not None and "extra" in str(req.marker):
            continue
        parsed.setdefault(canonicalize_name(req.name), []).append(req)
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
    req = pinfile.exact(spec.strip())
    if req is None:
        raise PinError(f"--pin {spec!r}: write NAME==VERSION (one exact version)")
    pin = Pin(canonicalize_name(req[0]), req[1], (), 0, req[0])
    folder = wheelhouse if wheelhouse is not None else cache
    fitting = _fitting(folder, pin, state)
    if not fitting and wheelhouse is None:
        download(pin, state, cache, say, f"--pin {spec}: ")
        fitting = _fitting(cache, pin, state)
    if not fitting:
        raise PinError(f"--pin {spec}: no wheel fits the image ({describe_image(state)}) in {folder}", pin=pin.name)
    return pinfile.line(pin.spelled, pin.version, {wheels.sha256_file(p) for p in fitting})


def add(root: Path, patch_set: str, package: str, specs: Sequence[str], state: ImageState,
        wheelhouse: Path | None, say: Progress) -> Path:
    """Append a hash-checked line per ``NAME==VERSION`` to the set's pins.txt, all or nothing."""
    path = pins_path(root, patch_set)
    if not path.parent.is_dir():
        raise PinError(f"patches/{patch_set}: no such patch set")
    current = load(root, patch_set, package)
    taken = {p.name: p for p in current.pins} if current is not None else {}
    lines = []
    for spec in specs:
        req = pinfile.exact(spec.strip())
        name = canonicalize_name(req[0]) if req is not None else ""
        if name in taken:
            raise PinError(f"--pin {spec}: {path} already pins it ({taken[name].where})")
        if name == canonicalize_name(package):
            raise PinError(f"--pin {spec}: a hotfix patches {package}, it does not replace it")
        lines.append(pin_line(spec, state, cache(root), wheelhouse, say))
    pinfile.append(path, patch_set, lines)
    return path
