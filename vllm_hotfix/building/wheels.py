"""Wheels: reading their file names, telling which fits an interpreter, and ``pip download``.

The one place that runs ``pip download``: a pinned distribution's wheel for
an image's own Python and platform (:mod:`pinwheels`), the stand-in's
dependencies (:mod:`standin`) and a vLLM release's wheel (:func:`release`,
for ``check-upstream --from-wheel``, ``new-patchset`` and the stand-ins).
Names, versions and tags are read with ``packaging``, as pip reads them.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform as pyplatform
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from packaging.tags import parse_tag
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from .. import dist_record
from ..errors import PinError, PipelineError, UpstreamError
from ..journal.atomic import one_writer
from .sources import cache_dir

if TYPE_CHECKING:
    from .platforms import Platform

log = logging.getLogger(__name__)

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Target:
    """The interpreter a wheel must fit, as ``pip download`` is told it (for another machine than this one)."""

    python: str  # "3.12"
    implementation: str = "cp"  # pip's --implementation: cp, py, pp ...
    abis: tuple[str, ...] = ()
    platforms: tuple[str, ...] = ()

    @classmethod
    def of_tags(cls, python: str, implementation: str, tags: Iterable[str]) -> Target:
        """The target of an interpreter that accepts ``tags`` (``sys.implementation.name`` as ``implementation``)."""
        parsed = [t for tag in tags for t in parse_tag(tag)]
        return cls(python, "cp" if implementation == "cpython" else "py",
                   tuple(sorted({t.abi for t in parsed})), tuple(sorted({t.platform for t in parsed})))

    def pip_args(self) -> list[str]:
        args = ["--python-version", self.python, "--implementation", self.implementation]
        for abi in self.abis:
            args += ["--abi", abi]
        for plat in self.platforms:
            args += ["--platform", plat]
        return args

    def describe(self) -> str:
        plats = ", ".join(self.platforms[:2]) + (", ..." if len(self.platforms) > 2 else "")
        return f"Python {self.python} ({self.implementation}) on {plats or 'any platform'}"


def host_machine() -> str:
    """This machine's architecture as wheel platform tags spell it (x86_64, aarch64)."""
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(pyplatform.machine(), pyplatform.machine())


def _version(text: str) -> Version | None:
    try:
        return Version(text)
    except InvalidVersion:
        return None


def parse(filename: str) -> tuple[str, Version, frozenset[str]] | None:
    """(canonical name, version, tags) of a wheel's file name; None if it is not one."""
    try:
        name, version, _build, tags = parse_wheel_filename(filename)
    except (InvalidWheelFilename, InvalidVersion):
        return None
    return str(name), version, frozenset(str(t) for t in tags)


def matches(filename: str, name: str, version: str) -> bool:
    """Whether ``filename`` is a wheel of distribution ``name`` at ``version`` (compared as pip compares)."""
    parsed = parse(filename)
    return parsed is not None and parsed[0] == canonicalize_name(name) and parsed[1] == _version(version)


def find(folder: Path, name: str, version: str) -> list[Path]:
    """The wheels of ``name`` ``version`` in ``folder``, by file name."""
    if not folder.is_dir():
        return []
    return [p for p in sorted(folder.glob("*.whl")) if matches(p.name, name, version)]


def rank(path: Path, tags: Sequence[str]) -> int | None:
    """How well a wheel fits an interpreter whose accepted ``tags`` come best first: lower is better, None: not."""
    parsed = parse(path.name)
    order = {t: i for i, t in enumerate(tags)}
    hits = [order[t] for t in parsed[2] if t in order] if parsed else []
    return min(hits) if hits else None


def best_fit(paths: Iterable[Path], tags: Sequence[str]) -> Path | None:
    """The wheel pip would pick among ``paths`` for an interpreter that accepts ``tags``; None if none fits."""
    scored = [(r, p.name, p) for p in paths if (r := rank(p, tags)) is not None]
    return min(scored)[2] if scored else None


def for_machine(paths: Iterable[Path], machine: str) -> list[Path]:
    """The wheels among ``paths`` built for ``machine`` (x86_64, aarch64) or for any platform."""
    out = []
    for path in paths:
        parsed = parse(path.name)
        plats = {t.rsplit("-", 1)[-1] for t in parsed[2]} if parsed else set()
        if any(p == "any" or p.endswith(f"_{machine}") for p in plats):
            out.append(path)
    return out


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def record(path: Path) -> dict[str, str]:
    """path -> urlsafe-b64 sha256 of every hashed file in a wheel's RECORD."""
    with zipfile.ZipFile(path) as zf:
        name = next((n for n in zf.namelist() if n.endswith(".dist-info/RECORD") and n.count("/") == 1), None)
        if name is None:
            raise PinError(f"{path}: no RECORD; not a wheel")
        rows = dist_record.read(zf.read(name))
        if rows.problems:
            raise PinError(f"{path}: {name} is not a RECORD: {rows.problems[0]}")
        return rows.sha256s()


def download(
    name: str,
    version: str,
    folder: Path,
    target: Target | None = None,
    *,
    error: type[PipelineError] = UpstreamError,
    context: str = "",
    hint: str | None = None,
) -> list[Path]:
    """``pip download`` the wheel(s) of ``name==version`` (no dependencies) into ``folder``.

    For ``target``'s interpreter, or this machine's without one. Returns the
    wheels of that version now in ``folder``. A failure raises ``error``,
    one line that starts with ``context`` and names the distribution and
    the last thing pip said.

    pip writes into a scratch folder beside ``folder`` and each wheel is
    moved in whole, so another process looking in ``folder`` meanwhile sees
    a wheel complete or not at all.
    """
    spec = f"{name}=={version}"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise error(f"{context}cannot download {spec} into {folder}: {exc.strerror or exc}", hint=hint) from exc
    for_what = f" for {target.describe()}" if target is not None else ""
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as scratch:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", "-d", scratch]
        if target is not None:
            cmd += target.pip_args()
        cmd.append(spec)
        log.debug("%s", " ".join(cmd))
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            said = [ln.strip() for ln in proc.stderr.splitlines() if ln.strip()] or [f"pip exited {proc.returncode}"]
            raise error(f"{context}cannot download {spec}{for_what} from the package index: "
                        f"{said[-1].removeprefix('ERROR: ')}", hint=hint)
        for got in Path(scratch).glob("*.whl"):
            try:
                os.replace(got, folder / got.name)
            except OSError as exc:
                raise error(f"{context}cannot move {got.name} into {folder}: {exc.strerror or exc}",
                            hint=hint) from exc
    found = find(folder, name, version)
    if not found:
        raise error(f"{context}pip download {spec}{for_what} gave no wheel of it in {folder}", hint=hint)
    return found


def release(root: Path, version: str, progress: Progress, plat: Platform | None = None) -> Path:
    """The vLLM ``version`` wheel of ``plat`` (default: this machine's) from PyPI, downloaded once into the cache."""
    machine = plat.machine if plat is not None else host_machine()
    folder = cache_dir(root) / "wheels"
    found = for_machine(find(folder, "vllm", version), machine)  # a wheel in the folder is whole (see download)
    if found:
        return found[0]
    with one_writer(folder / f"vllm-{version}-{machine}"):
        found = for_machine(find(folder, "vllm", version), machine)  # another process may have fetched it
        if found:
            return found[0]
        progress(f"downloading the vllm=={version} {machine} wheel from PyPI (about 250-310 MB)")
        # pip picks the running machine's wheel unless told otherwise; abi3 wheels fit any CPython 3.
        target = Target("3.12", "cp", ("abi3",), (plat.wheel_tag,)) if plat is not None else None
        got = download("vllm", version, folder, target,
                       hint="check the release exists (pip index versions vllm) and PyPI is reachable")
        found = for_machine(got, machine)
        if not found:
            raise UpstreamError(f"pip download vllm=={version} gave no {machine} wheel in {folder}")
        return found[0]
