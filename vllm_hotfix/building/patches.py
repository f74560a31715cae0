"""Patch sets: ``patches/<set>/series`` plus the patch files it names.

Every patch is validated with ``unidiff`` before anything is touched, then
applied with GNU ``patch -p1 --forward --fuzz=0`` in a scratch folder. A
patch that does not apply is classified, because each case asks something
different of the person reading the error:

* already present in the base (upstream shipped it): drop it;
* applies only with fuzz: refresh it against this release;
* conflicts: rewrite it.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import unidiff

from ..errors import PatchAlreadyApplied, PatchConflict, PatchError, PatchNeedsFuzz, StorageError

NEEDED = "needed"
INCLUDED = "included"
CONFLICTS = "conflicts"
PINS_FILE = "pins.txt"  # beside the series: see pins.py

# Patch file names go into image label keys (io.vllm-hotfix.patch.<name>) and
# Dockerfile lines: a conservative set, so that no name can add a label, expand
# a variable or end a quote there.
PATCH_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}\Z")
# git's mode lines: GNU patch drops a mode change without a word, so a patch
# holding one would build an image that is not what the patch says.
_MODE_LINE = re.compile(r"^(?:old mode|new mode|new file mode|deleted file mode) ([0-7]+)$", re.M)
# A hunk whose context the base's file does not hold: the runbook's next step.
CONFLICT_HINT = ("the base's file differs where this hunk goes: check-upstream --patches SET --base TAG says "
                 "whether upstream changed it; regenerate the patch against this release (new-patchset)")
_FAILED = re.compile(r"^Hunk #(\d+) FAILED at (\d+)")
_FUZZ = re.compile(r"^Hunk #(\d+) succeeded at (\d+) with fuzz (\d+)")
_FILE = re.compile(r"^(?:checking|patching) file (.+)$")


@dataclass(frozen=True, slots=True)
class Hunk:
    file: str
    number: int  # 1-based within its file, as GNU patch counts
    header: str  # "@@ -424,6 +424,9 @@"


@dataclass(frozen=True, slots=True)
class Patch:
    name: str
    path: Path
    text: str
    sha256: str
    header: str
    files: tuple[str, ...]  # paths relative to the package's parent (after -p1)
    hunks: tuple[Hunk, ...]

    def hunk(self, file: str, number: int) -> Hunk | None:
        for h in self.hunks:
            if h.file == file and h.number == number:
                return h
        return None


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def series_path(root: Path, set_name: str) -> Path:
    return root / "patches" / set_name / "series"


def pins_path(root: Path, set_name: str) -> Path:
    """The set's pinned distributions, if it has any (read by :mod:`pins`)."""
    return root / "patches" / set_name / PINS_FILE


def load_series(root: Path, set_name: str, package: str) -> list[Patch]:
    """Read and validate every patch the series names, in order."""
    series = series_path(root, set_name)
    if not series.is_file():
        raise PatchError(f"{series}: patch set {set_name} has no series file", patch=str(series))
    names: list[str] = []
    for lineno, data in enumerate(series.read_bytes().split(b"\n"), 1):
        try:
            raw = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise PatchError(f"{series}:{lineno}: not UTF-8 text (byte {data[exc.start]:#04x} at column "
                             f"{exc.start + 1})", patch=str(series)) from None
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not PATCH_NAME.match(line):
            raise PatchError(f"{series}:{lineno}: {line!r} is not a patch file name in {series.parent} "
                             "(letters, digits, '.', '_' and '-' only: the name becomes an image label)",
                             patch=str(series))
        if line in names:
            raise PatchError(f"{series}:{lineno}: {line} is listed twice")
        names.append(line)
    if not names:
        raise PatchError(f"{series}: names no patches", patch=str(series))
    return [load_patch(series.parent / name, package) for name in names]


def set_digest(series: Iterable[Patch], pins_sha256: str | None = None) -> str:
    """The patch set's digest: its patches in series order, each by name and sha256, and its pins.txt's sha256.

    What a signed verdict names as the patch set the host proved the image
    to be the product of, and what a verification policy may require: a
    patch renamed, reordered, edited, added or dropped, or a pin changed,
    changes it.
    """
    lines = [f"{patch.name} {patch.sha256}" for patch in series]
    lines.append(f"{PINS_FILE} {pins_sha256 or '-'}")
    return "sha256:" + hashlib.sha256("\n".join(lines).encode()).hexdigest()


# A hotfix is a handful of upstream hunks; anything near this size is a
# mistake (a whole file tree, a binary) and would take minutes to parse.
MAX_PATCH_BYTES = 4 * 1024 * 1024


def load_patch(path: Path, package: str) -> Patch:
    if not path.is_file():
        raise PatchError(f"{path}: listed in series but missing", patch=path.name)
    size = path.stat().st_size
    if size > MAX_PATCH_BYTES:
        raise PatchError(f"{path}: {size / 1e6:.1f} MB is larger than a hotfix patch may be "
                         f"({MAX_PATCH_BYTES // (1024 * 1024)} MiB)", patch=path.name)
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PatchError(f"{path}: not UTF-8 text", patch=path.name) from exc
    if "\r\n" in text:
        line = text[: text.index("\r\n")].count("\n") + 1
        raise PatchError(f"{path}: line {line} ends in CRLF (Windows line endings); vLLM's sources use LF",
                         patch=path.name, hint=f"convert it: sed -i 's/\\r$//' {path}")
    if not PATCH_NAME.match(path.name):
        raise PatchError(f"{path}: the file name may hold only letters, digits, '.', '_' and '-'", patch=path.name)
    mode = _MODE_LINE.search(text)
    if mode is not None:
        line = text[: mode.start()].count("\n") + 1
        raise PatchError(f"{path}: line {line} changes a file's mode ({mode.group(0)}); the tool applies content "
                         "only and would drop it", patch=path.name,
                         hint="drop the old mode / new mode lines, or diff with `git -c core.fileMode=false diff`")
    files, hunks = validate(text, path.name, package)
    first = re.search(r"^(--- |diff )", text, flags=re.M)
    header = text[: first.start()].strip() if first else ""
    return Patch(path.name, path, text, sha256_bytes(raw), header, files, hunks)


def _strip_one(name: str, patch: str) -> str:
    """Apply -p1 to a diff path, refusing anything that could escape."""
    if name.startswith("/"):
        raise PatchError(f"{patch}: absolute path {name!r} is not allowed", patch=patch, file=name)
    parts = PurePosixPath(name).parts
    if len(parts) < 2:
        raise PatchError(f"{patch}: path {name!r} has no a/ or b/ prefix to strip (-p1)", patch=patch, file=name)
    rest = parts[1:]
    if any(p in ("..", ".") for p in rest) or any(p == ".." for p in parts):
        raise PatchError(f"{patch}: path {name!r} contains '..' or '.'", patch=patch, file=name)
    return "/".join(rest)


def validate(text: str, name: str, package: str) -> tuple[tuple[str, ...], tuple[Hunk, ...]]:
    """Check a patch is a parseable diff touching only files inside ``package``."""
    try:
        parsed = unidiff.PatchSet(text)
    except unidiff.UnidiffParseError as exc:
        raise PatchError(f"{name}: malformed diff: {exc}", patch=name) from exc
    if len(parsed) == 0:
        raise PatchError(f"{name}: contains no diff", patch=name)
    files: list[str] = []
    hunks: list[Hunk] = []
    for pf in parsed:
        if pf.is_binary_file:
            raise PatchError(f"{name}: binary diff for {pf.path} is not supported", patch=name, file=pf.path)
        if pf.is_added_file or pf.is_removed_file:
            raise PatchError(
                f"{name}: {pf.path}: patches may only modify existing files (no creation or deletion)",
                patch=name,
                file=pf.path,
            )
        source = _strip_one(pf.source_file, name)
        target = _strip_one(pf.target_file, name)
        if source != target:
            raise PatchError(f"{name}: renames are not supported ({source} -> {target})", patch=name, file=source)
        if not source.startswith(package + "/") or not source.endswith(".py"):
            raise PatchError(
                f"{name}: {source} is outside the {package} package (or not a .py file)",
                patch=name,
                file=source,
            )
        if source in files:
            raise PatchError(f"{name}: {source} appears twice", patch=name, file=source)
        if len(pf) == 0:
            raise PatchError(f"{name}: {source} has no hunks", patch=name, file=source)
        files.append(source)
        for i, h in enumerate(pf, 1):
            hunks.append(
                Hunk(source, i, f"@@ -{h.source_start},{h.source_length} +{h.target_start},{h.target_length} @@")
            )
    return tuple(files), tuple(hunks)


# -- applying ---------------------------------------------------------------


def _patch(workdir: Path, patch: Patch, *args: str) -> tuple[int, str]:
    cmd = [
        "patch",
        "-p1",
        "--no-backup-if-mismatch",
        "--reject-file=-",  # never write .rej files
        "-d",
        str(workdir),
        "-i",
        str(patch.path),
        *args,
    ]
    # Messages are parsed: keep them in English; POSIXLY_CORRECT changes them.
    env = {k: v for k, v in os.environ.items() if k != "POSIXLY_CORRECT"}
    env["LC_ALL"] = "C"
    import subprocess  # here: a build whose patch results are cached runs no GNU patch

    try:
        proc = subprocess.run(
            cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=env, timeout=60
        )
    except FileNotFoundError as exc:
        raise PatchError("GNU patch is not installed (apt-get install patch)") from exc
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and _DISK_FULL.search(out):
        # patch writes its temporary copies in the scratch folder and TMPDIR: a
        # full disk there says nothing about whether the patch applies.
        said = next(ln.strip() for ln in out.splitlines() if _DISK_FULL.search(ln))
        # patch's own temporary files go to TMPDIR, which Python may have passed over for the scratch folder
        # (it falls back to /tmp where TMPDIR takes no file): name both, not the scratch folder alone.
        tmpdir = env.get("TMPDIR")
        where = f"the scratch folder {workdir}" + (f" or TMPDIR={tmpdir}" if tmpdir and not
                                                   str(workdir).startswith(tmpdir.rstrip("/") + "/") else "")
        raise StorageError(
            f"{patch.name}: cannot patch: a disk is full ({said}); patch writes in {where}",
            hint="free space there, or point TMPDIR at a disk with room")
    return proc.returncode, out


_DISK_FULL = re.compile(r"write error|No space left on device|Disk quota exceeded", re.I)


def classify(patch: Patch, workdir: Path) -> tuple[str, str]:
    """Say whether ``patch`` is needed, included or conflicts in ``workdir``.

    Touches nothing: every probe is a dry run. Returns (verdict, patch's output).
    """
    rc, out = _patch(workdir, patch, "--forward", "--fuzz=0", "--batch", "--dry-run")
    if rc == 0:
        return NEEDED, out
    # Not --batch here: with -R, --batch treats "looks unreversed" as "apply
    # it forward" and exits 0 on a tree that lacks the patch. -N with -R
    # refuses that case instead, so rc 0 really means every hunk is present.
    rc_rev, out_rev = _patch(workdir, patch, "-R", "-N", "-f", "--fuzz=0", "--dry-run")
    if rc_rev == 0:
        return INCLUDED, out_rev
    return CONFLICTS, out


def _first(regex: re.Pattern[str], output: str) -> tuple[str, int, int] | None:
    current = ""
    for line in output.splitlines():
        m = _FILE.match(line)
        if m:
            current = m.group(1).strip()
            continue
        m = regex.match(line)
        if m:
            return current, int(m.group(1)), int(m.group(2))
    return None


def _hunk_words(patch: Patch, file: str, number: int) -> str:
    h = patch.hunk(file, number)
    return f"hunk #{number} ({h.header})" if h else f"hunk #{number}"


def _reversed_files(output: str) -> list[str]:
    """The files a forward run skipped as already carrying their hunks ("Reversed (or previously applied)")."""
    found: list[str] = []
    current = ""
    for line in output.splitlines():
        m = _FILE.match(line)
        if m:
            current = m.group(1).strip()
        elif line.startswith("Reversed (or previously applied) patch detected") and current and current not in found:
            found.append(current)
    return found


def explain_failure(patch: Patch, workdir: Path, out: str) -> PatchError:
    """Turn a failed zero-fuzz forward dry run into the most useful error."""
    failed = _first(_FAILED, out)
    rc_fuzz, out_fuzz = _patch(workdir, patch, "--forward", "--batch", "--dry-run")
    fuzzed = _first(_FUZZ, out_fuzz)
    if rc_fuzz == 0 and fuzzed is not None:
        file, number, line = fuzzed
        return PatchNeedsFuzz(
            f"{patch.name}: {_hunk_words(patch, file, number)} of {file} applies only with fuzz "
            f"at line {line}; zero fuzz is required",
            patch=patch.name,
            file=file,
            hunk=number,
            hint="regenerate the patch against this release's files",
        )
    if failed is None and "Reversed (or previously applied)" in out:
        carried = _reversed_files(out)
        others = [f for f in patch.files if f not in carried]
        _rc, out_rev = _patch(workdir, patch, "-R", "-N", "-f", "--fuzz=0", "--dry-run")
        partial = _first(_FAILED, out_rev)
        if carried and others and (partial is None or partial[0] not in carried):
            # Whole files already carry the change and the rest apply as they are: the base has part of this
            # patch. (The reverse run's failure is then a hunk that applies going forward: not the fault.)
            return PatchConflict(
                f"{patch.name}: {', '.join(carried)} already carr{'ies' if len(carried) == 1 else 'y'} this "
                f"patch's change in the base; {', '.join(others)} do{'es' if len(others) == 1 else ''} not",
                patch=patch.name, file=carried[0],
                hint="the base carries part of this fix: rewrite the patch against this release (only the rest)",
            )
        # Some hunks are already there (partly shipped upstream): patch skips
        # the whole file going forward, so ask the reverse run which hunk is
        # neither old nor new text.
        if partial is not None:
            file, number, line = partial
            return PatchConflict(
                f"{patch.name}: {_hunk_words(patch, file, number)} of {file} does not apply "
                f"(at line {line}) and other hunks are already present in the base",
                patch=patch.name,
                file=file,
                hunk=number,
                hint="upstream may have shipped part of this fix: rewrite the patch against this release",
            )
    if failed is not None:
        file, number, line = failed
        return PatchConflict(
            f"{patch.name}: {_hunk_words(patch, file, number)} of {file} does not apply (at line {line})",
            patch=patch.name,
            file=file,
            hunk=number,
            hint=CONFLICT_HINT,
        )
    last = next((ln for ln in reversed(out.splitlines()) if ln.strip()), "patch failed")
    return PatchConflict(f"{patch.name}: does not apply: {last.strip()}", patch=patch.name, hint=CONFLICT_HINT)


def apply_series(patches: list[Patch], workdir: Path, *, skip_included: bool = False) -> list[Patch]:
    """Apply each patch in order, or raise naming the patch and hunk at fault.

    Each patch is dry-run first so a failing one never leaves a half-patched
    file behind, even in the scratch folder. Patches the tree already carries
    are collected, not applied: with ``skip_included`` they are returned,
    otherwise one error names them all. A tree that carries every patch is
    no error either way: it needs no hotfix, and every patch comes back as
    included (the caller says so and builds nothing). Returns the included patches.
    """
    included: list[Patch] = []
    for patch in patches:
        verdict, out = classify(patch, workdir)
        if verdict == INCLUDED:
            included.append(patch)
            continue
        if verdict == CONFLICTS:
            raise explain_failure(patch, workdir, out)
        rc, out = _patch(workdir, patch, "--forward", "--fuzz=0", "--batch")
        if rc != 0:
            raise explain_failure(patch, workdir, out)
    names = [p.name for p in included]
    if included and not skip_included and len(included) < len(patches):
        files = sorted({f for p in included for f in p.files})
        raise PatchAlreadyApplied(
            f"{', '.join(names)}: already present in the base ({', '.join(files)}); upstream ships "
            f"{'this fix' if len(names) == 1 else 'these fixes'}",
            patch=names[0],
            hint="drop them from the series, or build with --skip-included "
            "(check-upstream says which patches a release carries)",
        )
    return included


def modules_of(files: Iterable[str]) -> list[str]:
    """Dotted module names of the Python files among ``files`` (paths from site-packages), sorted."""
    out: set[str] = set()
    for path in files:
        parts = PurePosixPath(path).parts
        if not parts or not parts[-1].endswith(".py"):
            continue
        stem = parts[-1][: -len(".py")]
        names = list(parts[:-1]) + ([] if stem == "__init__" else [stem])
        if names and all(n.isidentifier() for n in names):
            out.add(".".join(names))
    return sorted(out)
