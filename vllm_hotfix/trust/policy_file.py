"""A verification policy as its author writes it: a TOML or JSON file, and the command line's flags.

Every key a file may hold is named (:data:`FILE_KEYS`); any other is
refused, so that a misspelt requirement is never silently dropped, and a
file that requires nothing is refused as an empty policy. Flags add to the
file. The definition's full smoke is the default unless the file says
``full_smoke = false``.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import NotRegular, UsageError
from ..journal.atomic import opened_regular
from .policy import DEFAULT_SKEW, STATUSES, Policy, full_smoke

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800}


def duration(text: object, what: str) -> dt.timedelta:
    """``90``, ``90s``, ``15m``, ``12h``, ``7d``, ``2w`` as a duration; UsageError naming ``what`` otherwise, and
    for one longer than a duration can be (``inf``, ``1e300``, ``99999999999d``)."""
    seconds: float | None = None
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text >= 0:
        seconds = float(text)
    else:
        match = _DURATION.match(text) if isinstance(text, str) else None
        if match is not None:
            seconds = float(match.group(1)) * _UNITS[match.group(2)]
    if seconds is None:
        raise UsageError(f"{what} {text!r}: not a duration (a number of seconds, or e.g. 90s, 15m, 12h, 7d, 2w)")
    try:
        return dt.timedelta(seconds=seconds)
    except (OverflowError, ValueError):
        raise UsageError(f"{what} {text!r}: longer than any duration this tool can hold (at most "
                         f"{dt.timedelta.max.days} days)") from None


def _statuses(value: object, where: str) -> frozenset[str]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(s, str) and s in STATUSES for s in items):
        raise UsageError(f"{where}: {value!r} is not a status ({', '.join(STATUSES)}) or a list of them")
    return frozenset(items)


def _digest(value: object, where: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", value):
        raise UsageError(f"{where}: {value!r} is not a digest (sha256:<64 hex>)")
    return value


# The keys a policy file may hold; anything else is refused, so that a misspelt requirement is never dropped.
FILE_KEYS = ("full_smoke", "checks", "allow_gpu_unverified", "definition", "patch_set_digest", "base_digest",
             "reference_digest", "max_age", "gpu_products", "tool_version", "max_skew", "golden_coverage",
             "schedule", "earlier_format")
# A policy file is a few hundred bytes; one far larger is not one.
MAX_POLICY = 1024 * 1024


def read_file(path: Path) -> dict[str, Any]:
    """A policy file's table (TOML, or JSON for a name ending in ``.json``); UsageError naming the file."""
    try:
        # Opened without waiting: a FIFO given as the policy would block the read until someone wrote to it.
        with opened_regular(path) as (fh, st):
            if st.st_size > MAX_POLICY:
                raise UsageError(f"policy {path}: {st.st_size} bytes, too large for a policy file")
            text = fh.read(MAX_POLICY + 1).decode("utf-8")
    except NotRegular:
        raise UsageError(f"policy {path}: not a regular file (a FIFO, device or socket); give the policy's file") \
            from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"policy {path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"policy {path}: not {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}") from None
    if not isinstance(raw, dict):
        raise UsageError(f"policy {path}: not a table of requirements")
    unknown = sorted(set(raw) - set(FILE_KEYS))
    if unknown:
        raise UsageError(f"policy {path}: unknown key(s) {', '.join(unknown)} (known: {', '.join(FILE_KEYS)})")
    if not raw:
        raise UsageError(f"policy {path} requires nothing: an empty policy would accept any signed verdict",
                         hint="write full_smoke = true for the definition's full smoke, or name what to require")
    return raw


@dataclass(frozen=True, slots=True)
class Flags:
    """What the command line adds to (or sets instead of) a policy file's requirements."""

    checks: Sequence[str] = ()  # NAME or NAME=STATUS[|STATUS]
    allow_gpu_unverified: bool = False
    definition: str = ""
    patch_set_digest: str = ""
    base_digest: str = ""
    reference_digest: str = ""
    tool_version: str = ""
    max_age: str = ""
    gpu_products: Sequence[str] = ()
    max_skew: str = ""


@dataclass(frozen=True, slots=True)
class Pinned:
    """What this checkout says a definition's product is: its patch set's digest, and the base it pins."""

    patch_set_digest: str = ""
    base: Mapping[str, str] = field(default_factory=dict)  # platform -> the base's image ID


def pinned(root: Path, tag: str) -> Pinned:
    """Definition ``tag`` as this checkout has it (nothing where the checkout has no such definition: a host
    that verifies need not hold one): what a verdict about that definition's product must name. A definition
    this checkout holds whose patch set cannot be read is refused, never dropped."""
    from ..building import definitions, pins
    from ..building import patches as patchlib
    from ..errors import PipelineError

    if not definitions.definition_path(root, tag).is_file():
        return Pinned()
    try:
        defn = definitions.load(root, tag)
        series = patchlib.load_series(root, defn.patch_set, defn.package)
        pinset = pins.load(root, defn.patch_set, defn.package)
    except PipelineError as exc:
        raise UsageError(f"--definition {tag}: its patch set's digest cannot be made from this checkout: {exc}") \
            from None
    return Pinned(patchlib.set_digest(series, pinset.sha256 if pinset is not None else None),
                  dict(defn.base_digests))


def build(file: Path | None = None, flags: Flags | None = None, root: Path | None = None) -> Policy:
    """The policy of a file (if any) and the command line's flags; the definition's full smoke unless the file
    says ``full_smoke = false``. With a definition named and ``root`` holding it, its patch set's digest as
    ``root`` has it is required too (unless one is named), and the base it pins, where it pins one."""
    flags = flags or Flags()
    raw = read_file(file) if file is not None else {}
    where = f"policy {file}" if file is not None else "the command line"

    def text(key: str, flag: str) -> str:
        value = flag or raw.get(key, "")
        if not isinstance(value, str):
            raise UsageError(f"{where}: {key} {value!r} is not text")
        return value

    switches = {key: raw.get(key, default) for key, default in (
        ("full_smoke", True), ("allow_gpu_unverified", False), ("golden_coverage", True), ("schedule", True),
        ("earlier_format", False))}
    wrong = [key for key, value in switches.items() if not isinstance(value, bool)]
    if wrong:
        raise UsageError(f"{where}: {', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} true or false")
    whole, allow = switches["full_smoke"], switches["allow_gpu_unverified"]
    allow = allow or flags.allow_gpu_unverified
    checks = full_smoke(allow) if whole else {}
    table = raw.get("checks", {})
    if isinstance(table, list):
        table = {name: "pass" for name in table}
    if not isinstance(table, dict):
        raise UsageError(f"{where}: checks is a table of check name = status(es), or a list of names")
    for name, statuses in table.items():
        checks[str(name)] = _statuses(statuses, f"{where}: checks.{name}")
    for spec in flags.checks:
        name, eq, statuses = spec.partition("=")
        if not name.strip():
            raise UsageError(f"--require-check {spec!r}: name a check (NAME or NAME=STATUS|STATUS)")
        checks[name.strip()] = _statuses(statuses.split("|") if eq else "pass", f"--require-check {spec}")
    products = list(flags.gpu_products) or raw.get("gpu_products", [])
    if isinstance(products, str) or not isinstance(products, list) or not all(isinstance(p, str) for p in products):
        raise UsageError(f"{where}: gpu_products is a list of whole GPU product names")
    digests = {key: _digest(value, f"{where}: {key}") if value else ""
               for key, value in (("patch_set_digest", text("patch_set_digest", flags.patch_set_digest)),
                                  ("base_digest", text("base_digest", flags.base_digest)),
                                  ("reference_digest", text("reference_digest", flags.reference_digest)))}
    definition = text("definition", flags.definition)
    base_pins: Mapping[str, str] = {}
    if definition and root is not None:
        checkout = pinned(root, definition)
        digests["patch_set_digest"] = digests["patch_set_digest"] or checkout.patch_set_digest
        base_pins = checkout.base
    age = flags.max_age or raw.get("max_age")
    skew = flags.max_skew or raw.get("max_skew")
    return Policy(
        checks=checks, every_check=whole, gpu_verified=whole and not allow, allow_gpu_unverified=allow,
        definition=definition, base_pins=base_pins, tool_version=text("tool_version", flags.tool_version),
        max_age=duration(age, "--max-age" if flags.max_age else f"{where}: max age") if age not in (None, "")
        else None,
        gpu_products=tuple(p.strip() for p in products if p.strip()),
        golden_coverage=switches["golden_coverage"], schedule=switches["schedule"],
        earlier_format=switches["earlier_format"],
        max_skew=duration(skew, "--max-skew" if flags.max_skew else f"{where}: max skew") if skew not in (None, "")
        else DEFAULT_SKEW,
        source=(f"policy {file}" if file is not None else "the default policy (the definition's full smoke)")
        + (" and the command line" if file is not None and flags != Flags() else ""),
        **digests,
    )


def products(values: Iterable[str]) -> list[str]:
    """``--require-gpu`` values: each a whole product name, several in one value separated by commas."""
    return [p.strip() for value in values for p in value.split(",") if p.strip()]
