"""The journal: append-only entries under ``build/records/<kind>/``.

Four kinds of entry, each written once, atomically, under a name no other run
can choose (nanosecond time + random suffix), and never rewritten:

- ``build``: a build's inputs, the image it produced and the files it patched;
- ``verdict``: one smoke run's outcome for one exact image ID;
- ``push``: an image ID landed in a registry under a reference and digest;
- ``tag``: a local tag moved to an image ID (rollback, or a reused build).

A verdict entry is a :class:`~vllm_hotfix.verdicts.Verdict` as its
``to_dict`` writes it, and is read back through ``Verdict.from_dict``: an
entry of the wrong shape is a RecordError naming its file, never a guess.

Facts are read by asking: the newest verdict that judged this image ID, every
push of it, every build of a definition. Parallel runs therefore never lose
each other's entries (no read-modify-write), and no single field of a mutable
file decides whether an image may be pushed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .atomic import write_atomic
from .errors import Malformed, RecordError
from .verdicts import Verdict

KINDS = ("build", "verdict", "push", "tag")


def records_dir(root: Path) -> Path:
    return Path(os.environ.get("VLLM_HOTFIX_RECORDS") or root / "build" / "records")


def inputs_key(inputs: Mapping[str, Any]) -> str:
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


@dataclass(frozen=True, slots=True)
class Entry:
    kind: str
    path: Path
    data: Mapping[str, Any]

    @property
    def image_id(self) -> str:
        return str(self.data.get("image_id", ""))

    @property
    def seq(self) -> int:
        """Order of writing (nanoseconds since the epoch)."""
        return int(self.data.get("seq", 0))

    @property
    def created(self) -> str:
        return str(self.data.get("created", ""))


def _new_file(folder: Path, prefix: str, suffix: str = "") -> tuple[int, str]:
    """A new file (O_EXCL, mode 0600) only this process writes: tempfile.mkstemp, without its import."""
    path = str(folder / f"{prefix}{os.getpid()}-{os.urandom(6).hex()}{suffix}")
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), path


def append(root: Path, kind: str, data: Mapping[str, Any]) -> Entry:
    """Write one new entry; raise RecordError (nothing written) if it cannot.

    Verdicts go through :func:`append_verdict`, which writes only what a
    Verdict holds.
    """
    if kind not in KINDS or kind == "verdict":
        raise ValueError(f"not an entry kind for append: {kind!r}")
    return _append(root, kind, data)


def _append(root: Path, kind: str, data: Mapping[str, Any]) -> Entry:
    folder = records_dir(root) / kind
    seq = time.time_ns()
    # 48 random bits, as uuid4().hex[:12] gave (os.urandom: no uuid import, which loads `platform`).
    name = f"{seq:020d}-{os.urandom(6).hex()}.json"
    full = {"kind": kind, "seq": seq, "created": now_iso(), **data}
    path = folder / name
    text = json.dumps(full, indent=2, sort_keys=True) + "\n"
    # Exclusive: an entry is never rewritten, and a name clash (impossible in practice) fails loudly.
    write_atomic(path, text, exclusive=True, mode=0o600, error=RecordError)
    return Entry(kind, path, full)


def ensure_writable(root: Path) -> None:
    """Fail early, before any effect, if records cannot be written."""
    folder = records_dir(root)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = _new_file(folder, ".probe-")
        try:
            os.write(fd, b"{}\n" * 64)
        finally:
            os.close(fd)
            os.unlink(tmp)
    except OSError as exc:
        raise RecordError(f"records folder {folder} is not writable: {exc.strerror or exc}") from exc


def load(root: Path, kind: str) -> list[Entry]:
    """Every entry of one kind, oldest first."""
    folder = records_dir(root) / kind
    out: list[Entry] = []
    if not folder.is_dir():
        return out
    for path in folder.glob("*.json"):
        if path.name.startswith("."):
            continue
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue  # a foreign or damaged file is not an entry
        if isinstance(data, dict) and data.get("kind") == kind:
            if kind != "verdict":  # a verdict's shape is checked by Verdict.from_dict
                _check_shape(kind, path, data)
            out.append(Entry(kind, path, data))
    return sorted(out, key=lambda e: (e.seq, e.path.name))


# The fields of build, push and tag entries that are read, and the type each
# must have when present (None counts as absent): an edited or damaged entry
# is named, never read half-way into a Python error.
_COMMON: dict[str, type] = {"seq": int, "created": str, "image_id": str}
_SHAPES: dict[str, dict[str, type]] = {
    "build": {"inputs": dict, "inputs_key": str, "output_ref": str, "base": dict, "files": dict},
    "push": {"ref": str, "digest": str, "image": str, "image_ids": list},
    "tag": {"ref": str},
}
_TYPE_WORDS = {int: "a number", str: "a string", dict: "an object", list: "a list"}


def _check_shape(kind: str, path: Path, data: Mapping[str, Any]) -> None:
    wrong = None
    for field, want in {**_COMMON, **_SHAPES.get(kind, {})}.items():
        value: Any = data.get(field)
        if value is None:
            continue
        if not isinstance(value, want) or (want is int and isinstance(value, bool)):
            wrong = f"{field!r} is {json.dumps(value)[:60]}, not {_TYPE_WORDS[want]}"
        elif isinstance(value, dict) and field == "files" and not all(isinstance(v, dict) for v in value.values()):
            wrong = "'files' holds a value that is not an object"
        elif isinstance(value, list) and not all(isinstance(v, str) for v in value):
            wrong = "'image_ids' holds a value that is not a string"
        if wrong is not None:
            raise RecordError(f"{kind} entry {path} is malformed: {wrong}",
                              hint="the journal is written only by this tool: restore the file or move it away")


def _newest_first(entries: Iterable[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (e.seq, e.path.name), reverse=True)


# -- builds -------------------------------------------------------------------


def builds(root: Path, definition: str | None = None) -> list[Entry]:
    """Build entries (of one definition), newest first."""
    found = load(root, "build")
    if definition is not None:
        found = [e for e in found if (e.data.get("inputs") or {}).get("definition") == definition]
    return _newest_first(found)


def builds_of_image(root: Path, image_id: str) -> list[Entry]:
    return [e for e in builds(root) if e.image_id == image_id]


def builds_with_inputs(root: Path, key: str) -> list[Entry]:
    return [e for e in builds(root) if e.data.get("inputs_key") == key]


# -- verdicts -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class VerdictEntry:
    """A verdict as the journal holds it: where, when, and the verdict itself."""

    path: Path
    seq: int
    created: str
    verdict: Verdict

    @property
    def image_id(self) -> str:
        return self.verdict.image_id


def _verdict_entry(entry: Entry) -> VerdictEntry:
    try:
        verdict = Verdict.from_dict(entry.data)
        seq, created = entry.data.get("seq", 0), entry.data.get("created", "")
        if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(created, str):
            raise Malformed(f"seq {seq!r} / created {created!r} are not a number and a time")
    except Malformed as exc:
        raise RecordError(f"verdict entry {entry.path} is malformed: {exc}",
                          hint="the journal is written only by this tool: restore the file or move it away") \
            from exc
    return VerdictEntry(entry.path, seq, created, verdict)


def append_verdict(root: Path, verdict: Verdict) -> VerdictEntry:
    """Append a run's verdict on its exact image ID (never rewrites an earlier one)."""
    return _verdict_entry(_append(root, "verdict", verdict.to_dict()))


def load_verdicts(root: Path) -> list[VerdictEntry]:
    """Every verdict entry, oldest first, each checked for its shape."""
    return [_verdict_entry(e) for e in load(root, "verdict")]


def verdicts(root: Path, image_id: str, loaded: list[VerdictEntry] | None = None) -> list[VerdictEntry]:
    """Every verdict on this exact image ID, newest first (``loaded``: verdicts already read)."""
    every = load_verdicts(root) if loaded is None else loaded
    return sorted((e for e in every if e.image_id == image_id), key=lambda e: (e.seq, e.path.name), reverse=True)


def judgement(root: Path, image_id: str, loaded: list[VerdictEntry] | None = None) -> VerdictEntry | None:
    """The newest verdict that judged the image (pass or fail), if any."""
    return next((v for v in verdicts(root, image_id, loaded) if v.verdict.judged), None)


# -- pushes and tags ----------------------------------------------------------


def pushes(root: Path, image_id: str | None = None, loaded: list[Entry] | None = None) -> list[Entry]:
    found = load(root, "push") if loaded is None else loaded
    if image_id is not None:
        # An index push names each platform's image among its children.
        found = [e for e in found if e.image_id == image_id or image_id in (e.data.get("image_ids") or ())]
    return _newest_first(found)


def tags(root: Path, ref: str | None = None) -> list[Entry]:
    found = load(root, "tag")
    if ref is not None:
        found = [e for e in found if e.data.get("ref") == ref]
    return _newest_first(found)


def known_images(root: Path) -> set[str]:
    """Every image ID the tool built (its own outputs)."""
    return {e.image_id for e in load(root, "build")}
