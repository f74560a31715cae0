"""Facts about an image's installed files, judged from its filesystem, never by running it.

An image's own Python may be anything (a script that prints a pass for any
question), so what the files of an image are is read from its layers
(:meth:`~vllm_hotfix.engine.Engine.read_files`: a container created, never
started) and judged here, on the host:

- :func:`landed`: each patched file holds the bytes the patch set and the base
  say it must (:mod:`.expected`), as a regular file, and every bytecode file
  Python could load for it is a checked-hash pyc (Python itself re-checks
  those against the source; an unchecked or timestamp pyc could serve other code);
- :func:`scan` / :func:`judge`: every file the installed distributions' RECORDs
  list (the package's distribution and those it requires, found in the same
  site folder) has its RECORD hash, except the patched files, which must have
  theirs; files under the package that no RECORD lists are named; compiled
  files (``.so``) RECORD lists but the image lacks are named and keep the run
  from being GPU-verified. Deviations the base already had (the same facts
  read from the base) are named as the base's.

Everything here but :func:`check_image` and :func:`base_findings` is pure:
trees in, findings out. The files come read from the image's layers once
(:mod:`vllm_hotfix.sitefacts.site`); what each installed distribution
requires in the image's environment is read in :mod:`.installed`.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import logging
import posixpath
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..engine import FileFact, Tree
from ..sitefacts import site
from ..sitefacts.dists import Dist, canonical, distributions
from ..sitefacts.site import FileSource, SiteFiles
from .difference import Difference
from .installed import Environment, closure, environment

if TYPE_CHECKING:
    from ..building.expected import Expected

log = logging.getLogger(__name__)

FILESYSTEM, IMAGE_PYTHON = "filesystem", "image-python"
LIMIT = 2000  # deviations kept per kind; enough for any base worth patching
EXAMPLES = 5  # named in a check's detail
_COMPILED = re.compile(r"\.(so(\.\d+)*|pyd|dylib)$")

# Deviation kinds that fail an image even when its base already had them.
KNOWN_BAD = {
    "conflicting_claims": "two distributions claim one path with different content (sub-wheels unpacked at "
                          "the same time, or one distribution overwriting another's files): an inherited case "
                          "breaks the image all the same",
}
KINDS = ("mismatched", "conflicting_claims", "missing_py", "missing_compiled", "unlisted", "malformed_record")
WORDS = {
    "mismatched": "file(s) differ from RECORD",
    "conflicting_claims": "path(s) claimed with different content",
    "missing_py": ".py file(s) missing",
    "missing_compiled": "compiled file(s) listed in RECORD but absent",
    "unlisted": "file(s) under the package that no RECORD lists",
    "malformed_record": "RECORD row(s) of the wrong shape (left out of the check)",
}


def record_hash(hex_digest: str) -> str:
    """A sha256 as RECORD writes it (urlsafe base64, no padding)."""
    return base64.urlsafe_b64encode(bytes.fromhex(hex_digest)).rstrip(b"=").decode()


def compiled(path: str) -> bool:
    return bool(_COMPILED.search(path))


# -- the landed check ---------------------------------------------------------


def pyc_state(pyc: bytes, source: FileFact, source_bytes_hash: str | None = None) -> str:
    """Whether Python could load ``pyc`` for ``source`` and run other code than the source says.

    'checked' for a checked-hash pyc (Python re-hashes the source before using
    it); where this host's Python has the pyc's magic, the hash is also
    compared here and a mismatch is 'stale (hash mismatch)', which Python would
    not load either.
    """
    if len(pyc) < 16:
        return "truncated (ignored by Python)"
    flags = int.from_bytes(pyc[4:8], "little")
    if flags & 0b1:
        if not flags & 0b10:
            return "stale (hash-based, unchecked: Python loads it whatever the source)"
        return "checked"
    mtime = int.from_bytes(pyc[8:12], "little")
    size = int.from_bytes(pyc[12:16], "little")
    if size == (source.size & 0xFFFFFFFF) and mtime == (source.mtime & 0xFFFFFFFF):
        return "stale (timestamp-based: Python loads it unchecked, not made by the build)"
    return "stale (timestamp mismatch)"


def pyc_hash_matches(pyc: bytes, source: bytes) -> bool | None:
    """Whether a checked pyc's source hash is that of ``source``; None when this host's Python has another magic."""
    if pyc[:4] != importlib.util.MAGIC_NUMBER:
        return None
    return pyc[8:16] == importlib.util.source_hash(source)


@dataclass(frozen=True, slots=True)
class Landed:
    differences: tuple[Difference, ...]  # in the order the check names them
    files: Mapping[str, Any]

    @property
    def problems(self) -> tuple[str, ...]:
        return tuple(str(d) for d in self.differences)


def landed(tree: Tree, site_dir: str, expected: Mapping[str, str], cache_tag: str = "",
           sources: Mapping[str, bytes] | None = None) -> Landed:
    """Each patched file (relative to ``site_dir``) has its expected sha256 and no pyc that could serve other code.

    ``tree`` holds the folders of the patched files with their ``__pycache__``
    and the bytes of those pycs (see :func:`~vllm_hotfix.sitefacts.site.keep_patched`); ``sources``, when
    given, the patched files' bytes, to compare checked pycs' source hashes.
    """
    differences: list[Difference] = []
    files: dict[str, Any] = {}
    for rel, sha in sorted(expected.items()):
        path = posixpath.join(site_dir, rel)
        fact = tree.file(path)
        if fact is None or fact.kind != "file":
            what = "missing" if fact is None else f"a {fact.kind}" + (f" to {fact.target}" if fact.target else "")
            differences.append(Difference(path, "entry" if fact is None else "kind", "file",
                                          fact.kind if fact is not None else "",
                                          f"{path} is {what}, not a regular file"))
            files[rel] = {"kind": fact.kind if fact else "missing"}
            continue
        pycs = {}
        stale: list[Difference] = []
        for pyc_path in pycs_of(tree, path, cache_tag):
            state = pyc_state(tree.kept.get(pyc_path, b""), fact)
            if state == "checked" and sources is not None and rel in sources:
                if pyc_hash_matches(tree.kept.get(pyc_path, b""), sources[rel]) is False:
                    state = "stale (hash mismatch)"
            name = posixpath.basename(pyc_path)
            pycs[name] = state
            if state.startswith("stale"):
                stale.append(Difference(pyc_path, "bytecode", "checked", state, f"{name} for {rel} is {state}"))
        files[rel] = {"sha256": fact.sha256, "bytecode": pycs}
        if fact.sha256 != sha:
            words = f"{path} has sha256 {fact.sha256[:12]}, expected {sha[:12]} (altered after the build?)"
            differences.append(Difference(path, "sha256", sha, fact.sha256, words))
        differences.extend(stale)
    return Landed(tuple(differences), files)


def pycs_of(tree: Tree, source_path: str, cache_tag: str = "") -> list[str]:
    """The pyc files in the image that Python could load for ``source_path`` (any cache tag when unknown)."""
    folder, name = posixpath.split(source_path)
    stem = name.removesuffix(".py")
    prefix = posixpath.join(folder, "__pycache__", f"{stem}.{cache_tag}." if cache_tag else f"{stem}.")
    return sorted(p for p, f in tree.entries.items() if p.startswith(prefix) and p.endswith(".pyc")
                  and f.kind in ("file", "hardlink", "link"))


# -- integrity ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Findings:
    """Deviations by kind (key -> observed content or detail), and what was looked at."""

    deviations: Mapping[str, Mapping[str, str]]
    checked: int = 0
    missing_other: int = 0
    distributions: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    installed: bool = True

    def to_dict(self) -> dict[str, dict[str, str]]:
        """What a later judgement of an image built FROM this one compares against (cacheable)."""
        return {k: dict(sorted(v.items())[:LIMIT]) for k, v in self.deviations.items()}


def judge_shared(claims: Mapping[str, list[tuple[str, str]]], on_disk: Mapping[str, str],
                 parents: Mapping[str, set[str]]) -> tuple[dict[str, str], list[str], set[tuple[str, str]]]:
    """Shared paths: (failing path -> what is wrong, notes, (dist, path) pairs whose RECORD hash lost to another's).

    Sub-wheels of one distribution (all required by one parent) that ship the
    same paths pass when every such path holds the same one's content
    (installed one after the other); a mix (unpacked at the same time), a file
    that is neither's, or distributions that are not sub-wheels of one
    overwriting each other's files fail.
    """
    winners: dict[tuple[str, ...], dict[str, list[str]]] = {}
    failures: dict[str, str] = {}
    lost: set[tuple[str, str]] = set()
    for path, owners in claims.items():
        if len({h for _, h in owners}) < 2 or path not in on_disk:
            continue
        names = tuple(sorted({n for n, _ in owners}))
        holder = sorted({n for n, h in owners if h == on_disk[path]})
        if not holder:
            failures[path] = f"{posixpath.basename(path)} claimed by {' and '.join(names)} matches neither"
            continue
        winners.setdefault(names, {}).setdefault(holder[0], []).append(path)
        lost.update((n, path) for n, h in owners if h != on_disk[path])
    notes = []
    for names, by_holder in sorted(winners.items()):
        count = sum(len(v) for v in by_holder.values())
        siblings = set.intersection(*(set(parents.get(n, set())) for n in names))
        if len(by_holder) > 1:
            split = ", ".join(f"{len(v)} hold {k}'s" for k, v in sorted(by_holder.items()))
            for path in (p for v in by_holder.values() for p in v):
                failures[path] = (f"{posixpath.basename(path)}: the {count} path(s) claimed with different content "
                                  f"by {' and '.join(names)} are a mix ({split}): unpacked at the same time")
        elif not siblings:
            for path in next(iter(by_holder.values())):
                failures[path] = f"{posixpath.basename(path)} claimed by {' and '.join(names)}"
        else:
            winner = next(iter(by_holder))
            notes.append(f"{count} path(s) claimed by {' and '.join(names)} consistently hold {winner}'s content "
                         "(installed after the other)")
    return failures, notes, lost


def _observed(fact: FileFact) -> str:
    """What a file is, as a deviation's value: its RECORD hash, or what it is instead of a file."""
    if fact.kind in ("file", "hardlink") and fact.sha256:
        return record_hash(fact.sha256)
    return f"{fact.kind}" + (f" -> {fact.target}" if fact.target else "")


def scan(tree: Tree, site_dir: str, package: str, patched: Mapping[str, str] | None = None,
         roots: Sequence[str] = (), env: Environment | None = None) -> Findings:
    """:func:`scan_installed` of the distributions whose dist-info ``tree`` holds directly in ``site_dir``."""
    return scan_installed(tree, distributions(tree, site_dir), site_dir, package, patched, roots, env)


def scan_installed(tree: Tree, installed: Mapping[str, Dist], site_dir: str, package: str,
                   patched: Mapping[str, str] | None = None, roots: Sequence[str] = (),
                   env: Environment | None = None) -> Findings:
    """Every RECORD-listed file of ``package``'s distribution and what it requires, against the tree.

    ``installed``: the distributions of ``site_dir`` (read from ``tree``).
    ``env``: the image's environment, which decides the requirements whose
    markers name one (default: what ``site_dir`` says of its Python).
    """
    patched = patched or {}
    site_dir = posixpath.normpath(site_dir)
    dists, parents = closure(installed, [package, *roots], env or environment(site_dir))
    dev: dict[str, dict[str, str]] = {k: {} for k in KINDS}
    if canonical(package) not in dists:
        return Findings(dev, installed=False)
    want_patched = {posixpath.join(site_dir, rel): record_hash(sha) for rel, sha in patched.items()}
    claims: dict[str, list[tuple[str, str]]] = {}
    listed: set[str] = set()
    mismatched: list[tuple[str, str, str]] = []  # (dist, rel, path)
    on_disk: dict[str, str] = {}
    missing_other = checked = 0
    for name, dist in sorted(dists.items()):
        for problem in dist.record_problems:
            dev["malformed_record"][f"{name}: RECORD {problem}"] = ""
        for path, want in dist.rows:
            listed.add(path)
            rel = posixpath.relpath(path, site_dir)
            if not want:
                continue
            want = want_patched.get(path, want)
            claims.setdefault(path, []).append((name, want))
            fact = tree.file(path)
            if fact is None:
                if path.endswith(".py"):
                    dev["missing_py"][f"{name}: {rel}"] = ""
                elif compiled(path):
                    dev["missing_compiled"][f"{name}: {rel}"] = ""
                else:
                    missing_other += 1
                continue
            checked += 1
            on_disk.setdefault(path, _observed(fact))
            if on_disk[path] != want:
                mismatched.append((name, rel, path))
    dev["conflicting_claims"], notes, lost = judge_shared(claims, on_disk, parents)
    for name, rel, path in mismatched:
        # A file holding another claimant's content is judged as a shared path, not as a mismatch. The
        # observed content is part of the deviation: a file the base had altered, altered again, is new.
        if (name, path) not in lost:
            dev["mismatched"][f"{name}: {rel}"] = on_disk[path]
    package_dir = posixpath.join(site_dir, package)
    allowed = {p for path in want_patched for p in _pycache_prefixes(path)}
    for path, fact in tree.entries.items():
        if (fact.kind == "dir" or not path.startswith(package_dir + "/") or path in listed
                or path in want_patched or any(path.startswith(p) for p in allowed)):
            continue
        dev["unlisted"][posixpath.relpath(path, site_dir)] = _observed(fact)
    return Findings(dev, checked, missing_other, tuple(sorted(dists)), tuple(notes))


def _pycache_prefixes(source_path: str) -> list[str]:
    folder, name = posixpath.split(source_path)
    return [posixpath.join(folder, "__pycache__", name.removesuffix(".py") + ".")]


def _example(kind: str, key: str, value: str) -> str:
    return value if kind == "conflicting_claims" else key


@dataclass(frozen=True, slots=True)
class Judged:
    """An integrity check's outcome: the check as a probe would report it, and the compiled files missing."""

    check: dict[str, Any]
    compiled_missing: tuple[str, ...] = ()  # the image's own
    compiled_missing_base: tuple[str, ...] = ()  # the base had them missing too
    findings: Findings = field(default_factory=lambda: Findings({}))


def judge(found: Findings, package: str, base: Mapping[str, Mapping[str, str]] | None) -> Judged:
    """The integrity check of ``found``, relative to the base's deviations (None: every one is the image's)."""
    if not found.installed:
        return Judged({"name": "integrity", "status": "fail", "detail": f"{package} is not installed",
                       "data": {"answered_by": FILESYSTEM}}, findings=found)
    new: dict[str, list[str]] = {}
    inherited: dict[str, list[str]] = {}
    for kind in KINDS:
        before = (base or {}).get(kind) or {}
        for key, value in sorted(found.deviations.get(kind, {}).items()):
            same = key in before and before[key] == value
            (inherited if same else new).setdefault(kind, []).append(_example(kind, key, value))
    if base is None:
        # No base to tell them apart: compiled files missing are named and stop GPU-verified, but
        # an image that is not a hotfix of a known base has no hotfix to blame them on.
        if "missing_compiled" in new:
            inherited["missing_compiled"] = new.pop("missing_compiled")
    problems = [f"{len(v)} {WORDS[k]}, e.g. {', '.join(v[:EXAMPLES])}" for k, v in new.items()]
    if base is not None and new:
        problems[0] = "new in this image (the base lacks them): " + problems[0]
    bad_inherited = {k: v for k, v in inherited.items() if k in KNOWN_BAD}
    problems += [f"inherited from the base but known-bad: {len(v)} {WORDS[k]}, e.g. {v[0]} ({KNOWN_BAD[k]})"
                 for k, v in bad_inherited.items()]
    whose = "the base's, not the hotfix's" if base is not None else "not the hotfix's (no base to compare with)"
    notes = [f"{len(v)} {WORDS[k]} already in the base, e.g. {', '.join(v[:EXAMPLES])}" if base is not None
             else f"{len(v)} {WORDS[k]}, e.g. {', '.join(v[:EXAMPLES])}"
             for k, v in inherited.items() if k not in KNOWN_BAD]
    dists = len(found.distributions)
    if problems:
        detail = "; ".join(problems)
    else:
        detail = f"{found.checked} files of {dists} distribution(s) match RECORD"
        if notes:
            detail = f"{found.checked} files of {dists} distribution(s) checked, no deviation of this image's own"
        if found.missing_other:
            detail += f" ({found.missing_other} data files listed but absent)"
        if found.notes:
            detail += f"; {found.notes[0]}"
    if notes:
        detail += f"; {whose}: " + "; ".join(notes)
    check = {
        "name": "integrity",
        "status": "fail" if problems else "pass",
        "detail": detail,
        "data": {
            "answered_by": FILESYSTEM,
            "distributions": list(found.distributions),
            "checked": found.checked,
            "relative_to_base": base is not None,
            "new": {k: v[:50] for k, v in new.items()},
            "inherited": {k: v[:50] for k, v in inherited.items()},
            "shadowed": list(found.notes[:50]),
            "missing_other": found.missing_other,
        },
    }
    own = tuple(_rel(k) for k in new.get("missing_compiled", ()))
    based = tuple(_rel(k) for k in inherited.get("missing_compiled", ()))
    return Judged(check, own, based, found)


def _rel(key: str) -> str:
    """``dist: path`` -> path."""
    return key.split(": ", 1)[-1]


def digest(findings: Mapping[str, Mapping[str, str]]) -> str:
    """A content hash of a deviations mapping (what the base's cached facts are checked by)."""
    text = repr(sorted((k, sorted(v.items())) for k, v in findings.items()))
    return hashlib.sha256(text.encode()).hexdigest()


# -- one image's file facts, as smoke and push judge them ----------------------


@dataclass(frozen=True, slots=True)
class FileChecks:
    """The checks read from an image's layers: patch-landed, package-version, integrity."""

    checks: tuple[dict[str, Any], ...]
    judged: Judged
    # The first difference of each failing check that names one (patch-landed, package-version).
    differences: Mapping[str, Difference] = field(default_factory=dict)

    def problems(self) -> list[str]:
        return [f"{c['name']}: {c['detail']}" for c in self.checks if c["status"] != "pass"]


def base_findings(engine: FileSource, cache: Path | None, base_id: str, package: str, site_dir: str,
                  roots: Sequence[str] = (), say: Callable[[str], None] = lambda _l: None, cache_tag: str = "",
                  ) -> dict[str, dict[str, str]] | None:
    """The base's own deviations (cached per base image ID), or None when the base is not in the engine."""
    from ..building import sources  # here: only a judgement relative to a base needs the cache

    key = sources.findings_key(package, site_dir, list(roots))
    found = sources.cached_findings(cache, base_id, key)
    if found is not None:
        return found
    if engine.image(base_id) is None:
        say(f"    base {base_id[:19]} is not in the engine: every deviation counts as this image's")
        return None
    read = base_deviations(site.read(engine, base_id, [site_dir], cache=cache, say=say), site_dir, package, roots,
                           cache_tag)
    sources.store_findings(cache, base_id, key, read)
    return read


def base_deviations(files: SiteFiles, site_dir: str, package: str, roots: Sequence[str] = (), cache_tag: str = "",
                    ) -> dict[str, dict[str, str]]:
    """The base's own deviations, from its site folder as read (what :func:`judge` compares an image's with)."""
    env = environment(site_dir, cache_tag, files.architecture)
    return scan_installed(files.tree, files.dists[site_dir], site_dir, package, roots=roots, env=env).to_dict()


def check_image(engine: FileSource, cache: Path | None, image_id: str, want: Expected, roots: Sequence[str] = (),
                say: Callable[[str], None] = lambda _l: None) -> FileChecks:
    """Read the image's site folder once and judge its patched files and its installed distributions."""
    site_dir = want.site_dir
    if not site_dir:
        return no_site_folder()
    files = site.read(engine, image_id, [site_dir], site.keep_patched(site_dir, want.files), cache, say)
    base = None
    if want.base_id and want.base_id != image_id:
        base = base_findings(engine, cache, want.base_id, want.package, site_dir, roots, say, want.cache_tag)
    return judge_files(files, want, roots, base)


def no_site_folder() -> FileChecks:
    """The file checks of an image whose build record names no site folder to read."""
    why = "the build record names no site folder: rebuild the image with this version of the tool"
    failed = [{"name": n, "status": "fail", "detail": why, "data": {"answered_by": FILESYSTEM}}
              for n in ("patch-landed", "integrity")]
    return FileChecks(tuple(failed), Judged(failed[1]))


def judge_files(files: SiteFiles, want: Expected, roots: Sequence[str] = (),
                base: Mapping[str, Mapping[str, str]] | None = None) -> FileChecks:
    """The image's patched files and installed distributions judged from its site folder as read (``base``: the
    base's own deviations, None where there is no base to tell them apart)."""
    site_dir = want.site_dir
    tree = files.tree
    sources = {rel: tree.kept[posixpath.join(site_dir, rel)] for rel in want.files
               if posixpath.join(site_dir, rel) in tree.kept}
    put = landed(tree, site_dir, want.files, want.cache_tag, sources)
    checks: list[dict[str, Any]] = [{
        "name": "patch-landed",
        "status": "fail" if put.problems else "pass",
        "detail": "; ".join(put.problems) if put.problems else
        f"{len(want.files)} patched file(s) in {site_dir} match (read from the image's layers)",
        "data": {"answered_by": FILESYSTEM, "site_dir": site_dir, "files": dict(put.files)},
    }]
    installed = files.dists[site_dir]
    dist = installed.get(canonical(want.package))
    have = dist.version if dist is not None else None
    checks.append({"name": "package-version", "status": "pass" if have == want.version else "fail",
                   "detail": f"{want.package} {have} installed, base had {want.version}",
                   "data": {"answered_by": FILESYSTEM}})
    differences = {"patch-landed": put.differences[0]} if put.differences else {}
    if have != want.version:
        differences["package-version"] = Difference(want.package, "version", want.version, have or "",
                                                    checks[-1]["detail"])
    env = environment(site_dir, want.cache_tag, files.architecture)
    judged = judge(scan_installed(tree, installed, site_dir, want.package, want.files, roots, env), want.package,
                   base)
    checks.append(judged.check)
    return FileChecks(tuple(checks), judged, differences)
