"""Bytecode for patched sources when the image cannot run: compiled on the host, or the stale files removed.

The base's own ``.pyc`` files of a patched source must not be used by the
image's Python. Nothing of the image runs here, so the choice is:

* ``compile``: fresh checked-hash pycs (the ones the assemble builder
  writes, by the same probe script and under the same source name), by a
  Python on this host of the image's version: the interpreter running the
  tool, or ``pythonX.Y`` on PATH, if its magic number is the one the base's
  own pycs carry. They replace the base's at the same names.
* ``whiteout``: a whiteout entry ``__pycache__/.wh.<name>.pyc`` for each pyc
  the base shows for a patched source; the image's Python then compiles the
  new source when it first imports it (and keeps the result where it may
  write).

``auto`` compiles when such a Python is at hand and whites out otherwise.
The image's version is told by the base's pycs (those of the patched files,
else any of the package's); a base without one has no stale bytecode in
the layers read, and then the hotfix adds none either.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..errors import BuildError, PatchError, UsageError
from .sources import probe_source, probe_timeout, scratch_tree

log = logging.getLogger(__name__)

MODES = ("auto", "compile", "whiteout")
SCRATCH = "/tmp/vllm-hotfix"  # the source name the assemble builder's probe compiles under (base.SCRATCH)


@dataclass(frozen=True)
class Choice:
    """What the hotfix layer does about bytecode, and why (one line, said and recorded)."""

    mode: str  # compiled, whiteouts, none
    why: str
    cache_tag: str = ""
    python: str = ""  # the interpreter that compiled (mode compiled)
    pycs: Mapping[str, Mapping[str, bytes]] = field(default_factory=dict)  # rel -> {pyc rel: bytes}
    whiteouts: tuple[str, ...] = ()  # pyc paths (relative to the site folder) to remove


def tag_of(name: str) -> str:
    """``indexer.cpython-311.opt-1.pyc`` -> ``cpython-311``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 3 else ""


def every_name(rel: str, cache_tag: str) -> list[str]:
    """Every bytecode file the image's Python could load for source ``rel`` (relative to the site folder): its pyc
    at optimisation levels 0, 1 and 2, for the image's cache tag."""
    folder, name = rel.rsplit("/", 1) if "/" in rel else ("", rel)
    stem = name.removesuffix(".py")
    cached = f"{folder}/__pycache__" if folder else "__pycache__"
    return [f"{cached}/{stem}.{cache_tag}{suffix}.pyc" for suffix in ("", ".opt-1", ".opt-2")]


def level_of(name: str) -> int:
    parts = name.split(".")
    return int(parts[2][len("opt-"):]) if len(parts) == 4 and parts[2].startswith("opt-") else 0


def version_of(cache_tag: str) -> str:
    """``cpython-311`` -> ``3.11`` (empty when it is not CPython's)."""
    digits = cache_tag.removeprefix("cpython-")
    return f"{digits[0]}.{digits[1:]}" if cache_tag.startswith("cpython-") and len(digits) >= 2 else ""


def _magic(python: str) -> bytes | None:
    if python == sys.executable:
        return importlib.util.MAGIC_NUMBER
    try:
        out = subprocess.run([python, "-c", "import importlib.util;print(importlib.util.MAGIC_NUMBER.hex())"],
                             capture_output=True, text=True, timeout=30)
        return bytes.fromhex(out.stdout.strip()) if out.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def find_python(cache_tag: str, magic: bytes) -> str | None:
    """An interpreter here whose bytecode is the image's: same cache tag and magic number."""
    version = version_of(cache_tag)
    candidates = [sys.executable] if sys.implementation.cache_tag == cache_tag else []
    named = shutil.which(f"python{version}") if version else None
    if named:
        candidates.append(named)
    for python in candidates:
        if _magic(python) == magic:
            return python
    return None


def choose(mode: str, pycs: Mapping[str, Mapping[str, bytes]], hint: tuple[str, bytes] | None) -> Choice:
    """What to do about the bytecode of the patched files, from the pycs the base shows for them.

    Whiting out, every name the image's Python could load for a patched file is whited out (levels 0, 1, 2 of
    its cache tag), not only the pycs of the layers read: a stale pyc in a layer the scan never read is hidden
    all the same."""
    if mode not in MODES:
        raise UsageError(f"--bytecode {mode!r}: one of {', '.join(MODES)}")
    stale = tuple(sorted(p for found in pycs.values() for p in found))
    known = [(p.rsplit("/", 1)[-1], data[:4]) for found in pycs.values() for p, data in found.items()
             if len(data) >= 16]
    if not known and hint is not None:
        known = [(hint[0], hint[1][:4])]
    if not known:
        if mode == "compile":
            # Not a docker build's failure (no engine is involved): the option cannot be honoured on this base.
            raise UsageError("--bytecode compile: no pyc in the base's layers read tells its Python's version",
                             hint="use --bytecode auto (the image compiles the patched sources on first import) "
                                  "or --bytecode whiteout")
        return Choice("none", "none: no pyc in the layers read tells the image's Python version, and none is "
                              "stale; the image compiles the patched sources when it first imports them")
    name, magic = known[0]
    tag = tag_of(name)
    python = find_python(tag, magic) if mode != "whiteout" else None
    if python is not None:
        return Choice("compiled", f"fresh checked-hash pycs compiled by {python} (the image's {tag})", tag, python)
    if mode == "compile":
        raise UsageError(f"--bytecode compile: no Python of the image's version ({tag}) on this host (looked for "
                         f"{sys.executable} and python{version_of(tag)} on PATH)",
                         hint=f"install python{version_of(tag)} here, or use --bytecode auto or whiteout")
    why = "--bytecode whiteout" if mode == "whiteout" else f"no Python of the image's version ({tag}) here"
    every = tuple(sorted({*stale, *(name for rel in pycs for name in every_name(rel, tag))}))
    return Choice("whiteouts", f"whiteouts of every pyc name of the {len(pycs)} patched file(s) ({len(every)}, "
                               f"{len(stale)} of them seen in the layers read; {why}); the image's Python compiles "
                               "the patched sources when it first imports them", tag, whiteouts=every)


def levels(pycs: Mapping[str, bytes], cache_tag: str) -> list[int]:
    """The optimisation levels the base holds a pyc of the image's own tag for (what the locate probe gives)."""
    return sorted({level_of(p.rsplit("/", 1)[-1]) for p in pycs if tag_of(p.rsplit("/", 1)[-1]) == cache_tag})


def compile_here(python: str, sources: Mapping[str, bytes], levels_of: Mapping[str, list[int]],
                 owner: Mapping[str, str]) -> dict[str, dict[str, bytes]]:
    """Each patched source compiled by ``python`` at level 0 and its base's levels, as the image would."""
    args = [f"{rel}={','.join(map(str, levels_of.get(rel, [])))}" for rel in sources]
    with scratch_tree(dict(sources)) as work:
        try:
            done = subprocess.run([python, "-c", probe_source("compile.py"), str(work), f"--as={SCRATCH}", *args],
                                  capture_output=True, text=True, timeout=probe_timeout())
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise BuildError(f"cannot compile the patched sources with {python}: {exc}") from None
    try:
        found = json.loads(done.stdout)
    except ValueError:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise BuildError(f"compiling the patched sources with {python} gave no answer", log_tail=tail) from None
    out: dict[str, dict[str, bytes]] = {}
    for rel in sources:
        entry = found.get(rel) or {}
        if "error" in entry or "pycs" not in entry:
            raise PatchError(f"{owner.get(rel, rel)}: patched {rel} does not compile: "
                             f"{entry.get('error', 'no answer')}", patch=owner.get(rel), file=rel)
        out[rel] = {pyc: base64.b64decode(b64) for pyc, b64 in entry["pycs"].items()}
    return out
