"""The journal: append-only entries under ``build/records/<kind>/``.

Four kinds of entry, each written once, atomically, and never rewritten:

- ``build``: a build's inputs, the image it produced and the files it patched;
- ``verdict``: one smoke run's outcome for one exact image ID;
- ``push``: an image ID landed in a registry under a reference and digest;
- ``tag``: a local tag moved to an image ID (rollback, or a reused build).

Order comes from the journal, never from a clock. Each entry carries a
``seq`` that the journal hands out: one more than the highest number present,
claimed by creating ``records/seq/<seq>`` with ``O_EXCL`` (a clash, another
writer taking the same number first, means counting again). Two writers
therefore never share a number, and a run whose clock is a day behind still
writes the newest entry. The claims are never removed: a writer that counted
before a claim was made must still find the name taken. Journals written
before this carried nanosecond times as ``seq``; new entries continue above
the highest of them. ``created`` is for people only and orders nothing.

An entry is named ``<seq, 20 digits>-<image ID hex>.json`` (``<seq>.json``
for an entry on no single image), so that an entry too damaged to read can
still be told apart, and its ``seq`` must agree with its name.

A verdict entry is a :class:`~vllm_hotfix.verdicts.Verdict` as its
``to_dict`` writes it, and is read back through ``Verdict.from_dict``.

An entry that cannot be read (truncated, not JSON, a wrong type, a ``seq``
its name contradicts) is never skipped in silence: it is a :class:`Damaged`
entry, attributed to the image its name or its data names where either can be
read. Whatever judges an image (the push gate, rollback, the reuse of a build)
stops with a RecordError naming the file when a damaged entry concerns that
image; one that names no readable image might be the image's newest verdict,
so it concerns every image. ``list`` shows such entries and goes on.

Facts are read by asking: the newest verdict that judged this image ID, every
push of it, every build of a definition. Parallel runs therefore never lose
each other's entries (no read-modify-write), and no single field of a mutable
file decides whether an image may be pushed.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import Malformed, RecordError
from ..verdicts import Verdict
from .atomic import claim, write_atomic

log = logging.getLogger(__name__)

KINDS = ("build", "verdict", "push", "tag", "job")  # job: a Kubernetes Job this host emitted or submitted
SEQ_DIR = "seq"  # the claimed sequence numbers, one empty file each
# Counting again after a clash: each retry means another writer got a number,
# so this many clashes in a row is a folder that refuses to behave, not a race.
CLAIM_TRIES = 1000

# <seq>[-<64 hex: image ID> | -<12 hex: random, older entries>].json
_NAME = re.compile(r"^(\d{1,40})(?:-([0-9a-f]{64}|[0-9a-f]{12}))?\.json$")
_LEADING_SEQ = re.compile(r"^(\d{1,40})(?:[-.]|$)")
_IMAGE_ID = re.compile(r"^(?:sha256:)?([0-9a-f]{64})$")

RESTORE_HINT = "the journal is written only by this tool: restore the file from a backup, or move it out of {folder}"


def records_dir(root: Path) -> Path:
    return Path(os.environ.get("VLLM_HOTFIX_RECORDS") or root / "build" / "records")


def inputs_key(inputs: Mapping[str, Any]) -> str:
    canonical = json.dumps(inputs, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _image_hex(value: object) -> str | None:
    """The 64 hex digits of an image ID (with or without ``sha256:``), else None."""
    m = _IMAGE_ID.match(value) if isinstance(value, str) else None
    return m.group(1) if m else None


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
        """Order of writing, as the journal handed it out (checked to be an int when read)."""
        return int(self.data.get("seq", 0))

    @property
    def created(self) -> str:
        return str(self.data.get("created", ""))


@dataclass(frozen=True, slots=True)
class Damaged:
    """A journal file that could not be read as an entry, and the images it may be about."""

    kind: str
    path: Path
    why: str
    images: frozenset[str]  # image ID hex digits its name or data gives; empty: cannot be told

    def concerns(self, image_id: str) -> bool:
        """Whether it may be about ``image_id``: one that names no image may be about any."""
        return not self.images or (_image_hex(image_id) or image_id) in self.images

    def error(self) -> RecordError:
        what = "verdict entry" if self.kind == "verdict" else f"journal entry ({self.kind})"
        return RecordError(f"{what} {self.path} {self.why}",
                           hint=RESTORE_HINT.format(folder=self.path.parent))


def _named_image(path: Path) -> str | None:
    """The image ID hex an entry's file name carries (older names carry none)."""
    m = _NAME.match(path.name)
    return m.group(2) if m and m.group(2) and len(m.group(2)) == 64 else None


def _sequence_in_name(name: str) -> int | None:
    m = _LEADING_SEQ.match(name)
    return int(m.group(1)) if m else None


def _highest(folder: Path) -> int:
    """The highest sequence number claimed or carried by any entry (0 for an empty journal)."""
    top = 0
    for sub in (SEQ_DIR, *KINDS):
        try:
            names = os.listdir(folder / sub)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise RecordError(f"cannot read the journal folder {folder / sub}: {exc.strerror or exc}") from exc
        for name in names:
            seq = _sequence_in_name(name)
            if seq is None and sub != SEQ_DIR and name.endswith(".json") and not name.startswith("."):
                # A name that does not carry its number (put there by hand): its data may.
                try:
                    data = json.loads((folder / sub / name).read_text(encoding="utf-8"))
                except (OSError, ValueError):
                    continue
                raw = data.get("seq") if isinstance(data, dict) else None
                seq = raw if isinstance(raw, int) and not isinstance(raw, bool) else None
            if seq is not None:
                top = max(top, seq)
    return top


def next_seq(root: Path) -> int:
    """Claim the journal's next sequence number: unique among every writer, whatever their clocks say."""
    folder = records_dir(root)
    claims = folder / SEQ_DIR
    for _ in range(CLAIM_TRIES):
        seq = _highest(folder) + 1
        if claim(claims / f"{seq:020d}", error=RecordError):
            return seq
    raise RecordError(f"could not claim a journal sequence number in {claims} after {CLAIM_TRIES} tries",
                      hint="another process keeps creating files there; check the records folder")


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


# What this process has journalled, oldest first: an interrupted command names what it finished before it stopped.
WRITTEN: list[Entry] = []


def _append(root: Path, kind: str, data: Mapping[str, Any]) -> Entry:
    folder = records_dir(root) / kind
    seq = next_seq(root)
    image = _image_hex(data.get("image_id"))
    name = f"{seq:020d}-{image}.json" if image else f"{seq:020d}.json"
    # The journal's own fields last: data can never carry a number of its choosing.
    full = {"created": now_iso(), **data, "kind": kind, "seq": seq}
    path = folder / name
    text = json.dumps(full, indent=2, sort_keys=True) + "\n"
    # Exclusive: an entry is never rewritten; the claimed number makes a clash a planted file, and loud.
    write_atomic(path, text, exclusive=True, mode=0o600, error=RecordError)
    entry = Entry(kind, path, full)
    WRITTEN.append(entry)
    return entry


def _unwritable_hint(exc: OSError, root: Path) -> str:
    """What to do about a journal that cannot be written, by why."""
    if exc.errno == errno.ENOSPC or exc.errno == errno.EDQUOT:
        return f"free space on the disk holding {records_dir(root)}; nothing was built or pushed"
    if exc.errno == errno.EROFS:
        return f"{root} is on a read-only file system: run from a copy on a writable one (--root FOLDER)"
    return (f"make {records_dir(root)} writable for this user (or run as its owner), or work in a project folder "
            "you can write (--root FOLDER); nothing was built or pushed")


def ensure_writable(root: Path) -> None:
    """Fail early, before any effect, if records cannot be written."""
    for folder in (records_dir(root), records_dir(root) / SEQ_DIR):  # an entry needs both
        try:
            folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = _new_file(folder, ".probe-")
            try:
                os.write(fd, b"{}\n" * 64)
            finally:
                os.close(fd)
                os.unlink(tmp)
        except OSError as exc:
            raise RecordError(f"records folder {folder} is not writable: {exc.strerror or exc}",
                              hint=_unwritable_hint(exc, root)) from exc


def _read_entry(kind: str, path: Path) -> Entry | Damaged:
    """One file of a kind folder, as an entry or as the damage that keeps it from being one."""
    m = _NAME.match(path.name)
    named_seq = int(m.group(1)) if m else None
    named_image = _named_image(path)
    images = {named_image} if named_image else set()

    def damaged(why: str) -> Damaged:
        return Damaged(kind, path, why, frozenset(images))

    try:
        raw = path.read_bytes()
    except OSError as exc:
        return damaged(f"cannot be read: {exc.strerror or exc}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        return damaged(f"is not a whole JSON entry (truncated or edited?): {exc}")
    if not isinstance(data, dict):
        return damaged(f"is malformed: a JSON {type(data).__name__}, not an object")
    hex_id = _image_hex(data.get("image_id"))
    if hex_id:
        images.add(hex_id)
    children = data.get("image_ids")  # an index push names each platform's image
    for child in children if isinstance(children, list) else ():
        hex_id = _image_hex(child)
        if hex_id:
            images.add(hex_id)
    seq, created = data.get("seq"), data.get("created", "")
    if data.get("kind") != kind:
        return damaged(f"is malformed: kind {data.get('kind')!r} in the {kind!r} folder")
    if not isinstance(seq, int) or isinstance(seq, bool) or not isinstance(created, str):
        return damaged(f"is malformed: seq {seq!r} / created {created!r} are not a number and a time")
    if named_seq is not None and seq != named_seq:
        return damaged(f"is malformed: its seq {seq} is not the {named_seq} its name says")
    if "image_id" in data and not isinstance(data["image_id"], str):
        return damaged(f"is malformed: image_id {data['image_id']!r} is not a string")
    if named_image and _image_hex(data.get("image_id")) not in (None, named_image):
        return damaged(f"is malformed: it names image {data.get('image_id')}, its file name another")
    if kind != "verdict":  # a verdict's shape is checked by Verdict.from_dict
        wrong = _wrong_field(kind, data)
        if wrong is not None:
            return damaged(f"is malformed: {wrong}")
    return Entry(kind, path, data)


def scan(root: Path, kind: str) -> tuple[list[Entry], list[Damaged]]:
    """Every entry of one kind, oldest first, and every file of that folder that is no readable entry."""
    folder = records_dir(root) / kind
    out: list[Entry] = []
    bad: list[Damaged] = []
    if not folder.is_dir():
        return out, bad
    for path in folder.glob("*.json"):
        if path.name.startswith("."):
            continue  # a file still being written, under its temporary name
        got = _read_entry(kind, path)
        if isinstance(got, Entry):
            out.append(got)
        else:
            bad.append(got)
    return sorted(out, key=lambda e: (e.seq, e.path.name)), sorted(bad, key=lambda d: d.path.name)


def load(root: Path, kind: str) -> list[Entry]:
    """Every readable entry of one kind, oldest first; each damaged one is named in a warning."""
    found, bad = scan(root, kind)
    for d in bad:
        warn(d, "; left out")
    return found


_warned: set[tuple[str, str]] = set()


def warn(d: Damaged, tail: str = "") -> None:
    """Name a damaged entry in a warning, once per process (a command may read the journal many times)."""
    key = (str(d.path), d.why)
    if key not in _warned:
        _warned.add(key)
        log.warning("journal entry %s %s%s", d.path, d.why, tail)


def damage(root: Path, image_id: str, kinds: Iterable[str] = KINDS) -> list[Damaged]:
    """Every damaged entry of ``kinds`` that may be about ``image_id``."""
    return [d for kind in kinds for d in scan(root, kind)[1] if d.concerns(image_id)]


def require_readable(root: Path, image_id: str, kinds: Iterable[str] = KINDS) -> None:
    """Raise RecordError naming the first damaged entry that may be about ``image_id``."""
    found = damage(root, image_id, kinds)
    if found:
        raise found[0].error()


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


def _wrong_field(kind: str, data: Mapping[str, Any]) -> str | None:
    """What is wrong with the type of a field this tool reads from a build, push or tag entry, if anything."""
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
            return wrong
    return None


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


def registry_digest(root: Path, ref: str) -> str | None:
    """The manifest digest the newest build made in a registry under ``ref`` names (``image --in-registry``)."""
    for entry in builds(root):
        where = entry.data.get("registry")
        digest = str(where.get("digest") or "") if isinstance(where, dict) else ""
        if digest.startswith("sha256:") and (entry.data.get("output_ref") == ref or ref.endswith("@" + digest)):
            return digest
    return None


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


@dataclass(frozen=True, slots=True)
class VerdictLog:
    """Every verdict entry read once: the readable ones, oldest first, and the damaged ones."""

    entries: tuple[VerdictEntry, ...]
    damaged: tuple[Damaged, ...]

    def damaged_for(self, image_id: str) -> list[Damaged]:
        return [d for d in self.damaged if d.concerns(image_id)]

    def of(self, image_id: str) -> list[VerdictEntry]:
        """The verdicts on this exact image ID, newest first; RecordError if one of them may be unreadable."""
        bad = self.damaged_for(image_id)
        if bad:
            raise bad[0].error()
        return sorted((e for e in self.entries if e.image_id == image_id),
                      key=lambda e: (e.seq, e.path.name), reverse=True)


def _verdict_entry(entry: Entry) -> VerdictEntry | Damaged:
    try:
        verdict = Verdict.from_dict(entry.data)
    except Malformed as exc:
        images = {h for h in (_image_hex(entry.data.get("image_id")), _named_image(entry.path)) if h}
        return Damaged("verdict", entry.path, f"is malformed: {exc}", frozenset(images))
    return VerdictEntry(entry.path, entry.seq, entry.created, verdict)


def append_verdict(root: Path, verdict: Verdict) -> VerdictEntry:
    """Append a run's verdict on its exact image ID (never rewrites an earlier one)."""
    got = _verdict_entry(_append(root, "verdict", verdict.to_dict()))
    if isinstance(got, Damaged):  # a Verdict always reads back; this would be a bug here
        raise got.error()
    return got


def load_verdicts(root: Path) -> VerdictLog:
    """Every verdict entry, each checked for its shape; the damaged ones kept apart, never dropped."""
    found, bad = scan(root, "verdict")
    good: list[VerdictEntry] = []
    for entry in found:
        got = _verdict_entry(entry)
        if isinstance(got, Damaged):
            bad.append(got)
        else:
            good.append(got)
    return VerdictLog(tuple(good), tuple(sorted(bad, key=lambda d: d.path.name)))


def verdicts(root: Path, image_id: str, loaded: VerdictLog | None = None) -> list[VerdictEntry]:
    """Every verdict on this exact image ID, newest first (``loaded``: verdicts already read).

    RecordError, naming the file, if a verdict entry that may be about this
    image cannot be read: the unreadable one might be the newest.
    """
    return (load_verdicts(root) if loaded is None else loaded).of(image_id)


def judgement(root: Path, image_id: str, loaded: VerdictLog | None = None) -> VerdictEntry | None:
    """The newest verdict that judged the image (pass or fail), if any."""
    return next((v for v in verdicts(root, image_id, loaded) if v.verdict.judged), None)


# -- pushes and tags ----------------------------------------------------------


def pushes(root: Path, image_id: str | None = None, loaded: list[Entry] | None = None) -> list[Entry]:
    found = load(root, "push") if loaded is None else loaded
    if image_id is not None:
        # An index push names each platform's image among its children.
        found = [e for e in found if e.image_id == image_id or image_id in (e.data.get("image_ids") or ())]
    return _newest_first(found)


def jobs(root: Path, nonce: str | None = None) -> list[Entry]:
    """The Kubernetes Jobs this host emitted or submitted (the run nonce each was given), newest first."""
    found = load(root, "job")
    if nonce is not None:
        found = [e for e in found if e.data.get("nonce") == nonce]
    return _newest_first(found)


def tags(root: Path, ref: str | None = None) -> list[Entry]:
    found = load(root, "tag")
    if ref is not None:
        found = [e for e in found if e.data.get("ref") == ref]
    return _newest_first(found)


def known_images(root: Path) -> set[str]:
    """Every image ID the tool built (its own outputs)."""
    return {e.image_id for e in load(root, "build")}
