"""Where a package's files come from: a base image (asked through its own
Python) or a release's wheel, and the scratch folder they are patched in.

A base image is immutable by ID, so what its Python said about it (package
location, Python version, the folders above the package, the bytes of each
file a patch set touched, the bytecode compiled for patched sources) is kept
in a cache folder keyed by that ID. A second build on the same base, or a
changed patch set, starts no container unless a file was never read or a
source was never compiled. The cache is content-addressed and checked on
every read (:mod:`vllm_hotfix.journal.cache` says how, and why a hash alone would not
do): an entry that fails a check is a miss, named in one warning, and is read
from the image again.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import os
import re
from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..engine import Box, Engine, ImageInfo
from ..errors import BaseImageError, StorageError, UpstreamError
from ..journal.cache import Store
from ..layers import Folder  # a folder above the package, as a layer must restate it

log = logging.getLogger(__name__)

CACHE_FORMAT = 5  # 5: the base Python's install scheme (scheme)


def scratch_prefix() -> str:
    """Scratch folders carry the run's ID (tests set one) so leaks can be traced, and the process's, so that a
    killed run's is removed by the next run and an interrupted one's by itself (:mod:`..journal.leftovers`)."""
    from ..journal import leftovers

    return leftovers.staging_prefix(leftovers.SCRATCH)


@contextmanager
def scratch_tree(files: Mapping[str, bytes | None]) -> Iterator[Path]:
    """A temp folder holding ``files`` (None: absent) at their relative paths; removed after."""
    import tempfile  # here: a build whose facts and patch results are cached makes no scratch tree

    try:
        made = tempfile.TemporaryDirectory(prefix=scratch_prefix())
    except OSError as exc:
        raise scratch_error(Path(tempfile.gettempdir()), exc) from exc
    with made as tmp:
        work = Path(tmp)
        try:
            for rel, data in files.items():
                if data is not None:
                    (work / rel).parent.mkdir(parents=True, exist_ok=True)
                    (work / rel).write_bytes(data)
        except OSError as exc:
            raise scratch_error(work, exc) from exc
        yield work


def scratch_error(folder: Path, exc: OSError) -> StorageError:
    """The scratch folder (under TMPDIR) cannot be written: its disk is full, or it is not writable."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
    why = "its disk is full" if full else "it cannot be written"
    return StorageError(f"cannot write the scratch folder {folder}: {why} ({exc.strerror or exc})",
                        hint="free space there, or point TMPDIR at a disk with room")


def probe_source(name: str) -> str:
    from importlib import resources  # here: only a probe needs its script

    return resources.files("vllm_hotfix.inimage.probes").joinpath(name).read_text(encoding="utf-8")


PROBE_TIMEOUT_MAX = 86400  # a day: beyond it a thread's join overflows, and no probe of a base needs it


def probe_timeout() -> int:
    """Seconds a probe of the base may take (VLLM_HOTFIX_PROBE_TIMEOUT, default 120; the CLI refuses a value out
    of 1..PROBE_TIMEOUT_MAX before any work, and a library caller's is clamped to it)."""
    try:
        return min(PROBE_TIMEOUT_MAX, max(1, int(os.environ.get("VLLM_HOTFIX_PROBE_TIMEOUT", "120"))))
    except ValueError:
        return 120


def run_probe(box: Box, python: str, script: str, args: list[str], ref: str) -> dict[str, Any]:
    limit = probe_timeout()
    result = box.exec([python, "-c", probe_source(script), *args], timeout=limit)
    if result.exit_code == 124:
        raise BaseImageError(f"{ref}: probe {script} with {python} timed out after {limit} s",
                             hint="the image's Python hangs at start; check the image")
    try:
        data = json.loads(result.stdout)
    except ValueError:
        err = (result.stderr or result.stdout).strip().splitlines()
        raise BaseImageError(
            f"{ref}: probe {script} failed in the image with {python}: "
            f"{err[-1] if err else 'exit ' + str(result.exit_code)}"
        ) from None
    if not isinstance(data, dict):
        raise BaseImageError(f"{ref}: probe {script} printed no JSON object")
    return data


@dataclass(frozen=True, slots=True)
class BaseFacts:
    """What the base image says about itself, by its own Python."""

    ref: str
    image: ImageInfo
    python: str
    python_version: str
    cache_tag: str
    site_dir: str  # the folder holding the package folder
    package_dir: str
    version: str | None
    machine: str = ""  # platform.machine() of the image's Python: the architecture that compiled the bytecode
    folders: tuple[Folder, ...] = ()  # "/" excluded, down to site_dir included
    # The engine's history of the image, oldest first (created, created by, comment, size)
    history: tuple[Mapping[str, Any], ...] = ()
    sys_path: tuple[str, ...] = ()  # the folders the base's Python puts on sys.path at start-up
    scheme: Mapping[str, str] = field(default_factory=dict)  # its install scheme: purelib, platlib, scripts, ...


def content(info: Mapping[str, Any]) -> bytes | None:
    """A file's bytes as the locate probe read them (regular files only)."""
    data = info.get("data_b64")
    return base64.b64decode(data) if data is not None else None


def cache_dir(root: Path) -> Path:
    return Path(os.environ.get("VLLM_HOTFIX_CACHE", root / "build" / "cache"))


def patch_key(patches: list[tuple[str, str]], originals: Mapping[str, bytes], skip_included: bool) -> str:
    """What a patch run's result depends on: each patch (name, sha256) in order and each file's bytes."""
    parts = [f"{n}={h}" for n, h in patches]
    parts += [f"{rel}={hashlib.sha256(originals[rel]).hexdigest()}" for rel in sorted(originals)]
    return _key(*parts, f"skip_included={skip_included}")


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


class ImageReader:
    """One base image's package files and facts: from the cache, else from a probe
    container started at most once per reader and removed when it closes."""

    def __init__(self, engine: Engine, image: ImageInfo, ref: str, package: str, python: str,
                 cache: Path | None) -> None:
        self.engine = engine
        self.image = image
        self.ref = ref
        self.package = package
        self.python = python
        self._store = Store.open(cache, image.id) if cache is not None else None
        self._stack = ExitStack()
        self._box: Box | None = None
        self.containers = 0  # probe containers started (0 when the cache answered everything)

    def __enter__(self) -> ImageReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def box(self) -> Box:
        if self._box is None:
            # The probe timeout bounds every engine call for the probe too: a frozen engine ends the run then.
            self._box = self._stack.enter_context(self.engine.box(self.image.id, self.python,
                                                                  deadline=probe_timeout()))
            self.containers += 1
        return self._box

    # -- facts and original files ------------------------------------------

    def _facts_name(self) -> str:
        return f"facts-{_key(self.package, self.python)}"

    def _cached(self) -> dict[str, Any] | None:
        """The cached facts, each file's bytes back as the probe gave them; a file that fails its check is left out."""
        if self._store is None:
            return None
        data = self._store.read(self._facts_name())
        if data is None:
            return None
        # The index is this host's, and still must name this image, package and Python.
        if (data.get("format"), data.get("image_id"), data.get("package"), data.get("python")) != (
            CACHE_FORMAT, self.image.id, self.package, self.python
        ):
            log.info("ignoring facts cache %s: made for another image or format", self._facts_name())
            return None
        files: dict[str, Any] = {}
        for rel, info in (data.get("files") or {}).items():
            if not isinstance(info, dict):
                continue
            info = dict(info)
            if "sha256" in info:
                raw = self._store.get(info["sha256"], f"{rel} of {self.image.id}")
                if raw is None:
                    continue  # a miss: the probe reads this file again
                info["data_b64"] = base64.b64encode(raw).decode("ascii")
            files[rel] = info
        data["files"] = files
        return data

    def _store_facts(self, data: dict[str, Any]) -> None:
        if self._store is None:
            return
        files = {}
        for rel, info in data["files"].items():
            kept = {k: v for k, v in info.items() if k != "data_b64"}
            raw = content(info)
            if raw is not None:
                kept["sha256"] = self._store.put(raw)
            files[rel] = kept
        self._store.write(self._facts_name(), {**data, "files": files})

    def locate(self, rels: list[str]) -> tuple[BaseFacts, dict[str, dict[str, Any]]]:
        """The base's facts and, per path in ``rels``, what the locate probe says of it."""
        data = self._cached()
        known: dict[str, Any] = (data or {}).get("files") or {}
        missing = [rel for rel in rels if rel not in known]
        if data is None or missing:
            log.info("probe: locate %d file(s) in %s", len(rels if data is None else missing), self.image.id)
            probed = run_probe(self.box(), self.python, "locate.py",
                               [self.package, *(rels if data is None else missing)], self.ref)
            if "error" in probed:
                raise BaseImageError(f"{self.ref}: {probed['error']} with {self.python}")
            asked = rels if data is None else missing
            lacking = [k for k in ("python", "cache_tag", "site_dir", "package_dir", "files") if k not in probed]
            if lacking or not isinstance(probed.get("files"), dict) or set(asked) - set(probed["files"]):
                raise BaseImageError(
                    f"{self.ref}: probe locate.py with {self.python} answered without "
                    f"{', '.join(lacking) or 'every file'}: is it the image's Python interpreter?"
                )
            if data is None:
                data = {k: v for k, v in probed.items() if k != "files"}
                data.update(format=CACHE_FORMAT, image_id=self.image.id, package=self.package, python=self.python)
                keep = ("Created", "CreatedBy", "Comment", "Size")
                data["history"] = [{k: h.get(k) for k in keep} for h in self.engine.history(self.image.id)]
            for rel, info in probed["files"].items():
                known[rel] = info
            data["files"] = known
            self._store_facts(data)
        facts = BaseFacts(
            ref=self.ref,
            image=self.image,
            python=self.python,
            python_version=data["python"],
            cache_tag=data["cache_tag"],
            site_dir=data["site_dir"],
            package_dir=data["package_dir"],
            version=data.get("version"),
            machine=str(data.get("machine") or ""),
            folders=tuple(Folder(*d) for d in data.get("dirs", ())),
            history=tuple(data.get("history") or ()),
            sys_path=tuple(str(p) for p in data.get("sys_path") or ()),
            scheme={str(k): str(v) for k, v in (data.get("scheme") or {}).items()},
        )
        return facts, {rel: known[rel] for rel in rels}

    # -- patch results -----------------------------------------------------

    def cached_patched(self, key: str) -> tuple[dict[str, bytes], list[str]] | None:
        """The files a patch series made of this base's files, and the patches it found included."""
        if self._store is None:
            return None
        data = self._store.read(f"patched/{key}")
        if data is None or data.get("image_id") != self.image.id or data.get("key") != key:
            return None
        files = {}
        for rel, digest in (data.get("files") or {}).items():
            raw = self._store.get(digest, f"patched {rel} of {self.image.id}")
            if raw is None:
                return None
            files[rel] = raw
        return files, list(data.get("included") or [])

    def store_patched(self, key: str, files: Mapping[str, bytes], included: list[str]) -> None:
        if self._store is not None:
            self._store.write(f"patched/{key}", {
                "image_id": self.image.id,
                "key": key,
                "files": {rel: self._store.put(b) for rel, b in files.items()},
                "included": included,
            })

    # -- bytecode ----------------------------------------------------------

    def _pyc_name(self, rel: str, source: bytes, levels: str) -> str:
        return f"pyc/{_key(self.python, rel, hashlib.sha256(source).hexdigest(), levels)}"

    def cached_bytecode(self, rel: str, source: bytes, levels: str) -> dict[str, bytes] | None:
        if self._store is None:
            return None
        data = self._store.read(self._pyc_name(rel, source, levels))
        if data is None or data.get("image_id") != self.image.id or data.get("rel") != rel:
            return None
        pycs = {}
        for name, digest in (data.get("pycs") or {}).items():
            raw = self._store.get(digest, f"{name} of {self.image.id}")
            if raw is None:
                return None
            pycs[name] = raw
        return pycs or None

    def store_bytecode(self, rel: str, source: bytes, levels: str, pycs: Mapping[str, bytes]) -> None:
        if self._store is None:
            return
        self._store.write(self._pyc_name(rel, source, levels), {
            "image_id": self.image.id,
            "rel": rel,
            "source_sha256": hashlib.sha256(source).hexdigest(),
            "levels": levels,
            "pycs": {n: self._store.put(b) for n, b in pycs.items()},
        })


def image_files(
    engine: Engine, package: str, python: str, ref: str, image: ImageInfo, rels: list[str],
    cache: Path | None = None,
) -> tuple[BaseFacts, dict[str, bytes | None]]:
    """The files ``rels`` as the image's Python would import them, no version check.

    A path that is missing, or is not a regular file reached without links,
    reads as None: for a question like "does this release carry the patch?"
    that is an answer (it does not), not an error.
    """
    with ImageReader(engine, image, ref, package, python, cache) as reader:
        facts, info = reader.locate(rels)
    return facts, {rel: content(info[rel]) for rel in rels}


def wheel_files(wheel: Path, package: str, rels: list[str]) -> tuple[str | None, dict[str, bytes | None]]:
    """The files ``rels`` (paths from the package's parent) out of a wheel zip, and its version."""
    import zipfile  # here: only wheel reads need it

    try:
        with zipfile.ZipFile(wheel) as zf:
            names = set(zf.namelist())
            version = None
            for name in names:
                if name.startswith(f"{package}-") and name.endswith(".dist-info/METADATA"):
                    m = re.search(r"^Version: *(\S+)", zf.read(name).decode("utf-8", "replace"), re.M)
                    version = m.group(1) if m else None
            return version, {rel: zf.read(rel) if rel in names else None for rel in rels}
    except (OSError, zipfile.BadZipFile) as exc:
        raise UpstreamError(f"{wheel}: cannot read the wheel: {exc}") from exc


# -- the base's file facts, judged from its filesystem --------------------------


def cached_findings(cache: Path | None, image_id: str, key: str) -> dict[str, dict[str, str]] | None:
    """The deviations read from a base image's files before, if this host's cache index for them still verifies."""
    store = Store.open(cache, image_id) if cache is not None else None
    data = store.read(f"integrity-{key}") if store is not None else None
    if data is None or (data.get("image_id"), data.get("key")) != (image_id, key):
        return None
    found = data.get("deviations")
    return found if isinstance(found, dict) else None


def store_findings(cache: Path | None, image_id: str, key: str, found: Mapping[str, Mapping[str, str]]) -> None:
    store = Store.open(cache, image_id) if cache is not None else None
    if store is not None:
        store.write(f"integrity-{key}", {"image_id": image_id, "key": key, "deviations": dict(found)})


def findings_key(package: str, site_dir: str, roots: list[str]) -> str:
    # Requirements followed by their markers in the image's environment (packaging), not by a pattern.
    return _key(package, site_dir, *sorted(roots), "requirements=markers")
