"""What a deployment requires of an image's signed verdict: a verification policy.

A policy is a handful of small requirements, each of which reads one fact the
host that signed proved (never the image's labels, which the signed
predicate keeps under ``claimed``) and answers with a typed
:class:`Success` or :class:`Failure` naming what was required and what was
found. :class:`AllOf` composes them and refuses to be empty: a policy that
requires nothing would let any signed verdict through, which is almost
certainly not what its author meant.

The default policy is a definition's full smoke: every check a full run's
plan runs (:data:`FULL_SMOKE`), present and passed, every other check the
verdict reports passed too, and the GPU checks verified. A GPU-verified pass
whose serve sweep or ``exact-levels`` was skipped is not a deploy pass under
it. ``allow_gpu_unverified`` lets the GPU-bound checks (:data:`GPU_BOUND`) be
skipped or absent, as on a host with no GPU, and the answer says so.

A policy comes from a TOML or JSON file and from flags, flags adding to the
file (:mod:`.policy_file`). Which verdict a policy is asked of (the newest of
those that cover it) is :mod:`.decide`'s.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import UsageError
from ..verdicts import IDENTITY, Status, Verdict

# The checks a definition's full smoke runs: the host's file facts, the image's Python (isolated), the GPU
# checks, the server's sweep and the fixed-batch levels (which run only where a reference is given).
CPU_CHECKS = (IDENTITY, "patch-landed", "package-version", "integrity", "import-location", "env-report",
              "known-bad-deps")
GPU_CHECKS = ("gpu-torch", "gpu-kernel", "gpu-triton", "model-imports")
SERVE_CHECKS = ("serve-sweep", "exact-levels")
FULL_SMOKE = (*CPU_CHECKS, *GPU_CHECKS, *SERVE_CHECKS)
# What cannot run on a host without a GPU: the ``gpu`` check (skipped there), the GPU checks, the server.
GPU_BOUND = frozenset({"gpu", *GPU_CHECKS, *SERVE_CHECKS})
# How far ahead of this host's clock a verdict may be dated before it is refused.
DEFAULT_SKEW = dt.timedelta(minutes=5)
STATUSES = ("pass", "fail", "skip")


@dataclass(frozen=True, slots=True)
class Facts:
    """What one signed verdict says, as typed values: the host's verdict, and what the host proved of the image."""

    verdict: Verdict
    definition: str = ""
    patch_set_digest: str = ""
    base_id: str = ""
    base_digests: tuple[str, ...] = ()
    reference: str = ""  # the sha256 of the reference the answers were judged against
    tool_version: str = ""
    run_at: dt.datetime | None = None  # when the judged run started

    @property
    def statuses(self) -> dict[str, str]:
        return {c.name: c.status.value for c in self.verdict.checks}

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(str(d) for d in self.verdict.gpu.get("devices") or [])


@dataclass(frozen=True, slots=True)
class Success:
    requirement: str
    found: str


@dataclass(frozen=True, slots=True)
class Failure:
    requirement: str
    found: str
    reason: str
    hint: str = ""  # the next step, for the one line a person reads after the error


Result = Success | Failure


class Requirement(Protocol):
    """One thing a policy requires of a verdict."""

    def describe(self) -> str: ...

    def check(self, facts: Facts, now: dt.datetime) -> Result: ...


SMOKE_AGAIN = "fix what failed (verify --json shows the verdict), rebuild and smoke it again with --sign-key"


def _answer(what: str, found: str, ok: bool, reason: str, hint: str = SMOKE_AGAIN) -> Result:
    return Success(what, found) if ok else Failure(what, found, reason, hint)


@dataclass(frozen=True, slots=True)
class Passed:
    """The verdict is a pass."""

    def describe(self) -> str:
        return "status pass"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        v = facts.verdict
        failed = [c for c in v.checks if c.status is Status.FAIL]
        # The first failing check names why (layer-identity: what the image is not), on the one line read.
        why = f": {failed[0].name}: {' '.join(failed[0].detail.split())[:300]}" if failed else ""
        return _answer(self.describe(), v.status.value, v.passed, f"{v.status.value!r}, not a pass{why}")


@dataclass(frozen=True, slots=True)
class CheckStatus:
    """A named check ran with one of ``allowed``; where skip is allowed, a check that is absent counts as one."""

    name: str
    allowed: frozenset[str]

    def describe(self) -> str:
        return f"check {self.name}: {' or '.join(sorted(self.allowed))}"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        found = facts.statuses.get(self.name)
        ok = found in self.allowed or (found is None and "skip" in self.allowed)
        return _answer(self.describe(), found or "not run", ok,
                       f"check {self.name} {found or 'not run'}, not {' or '.join(sorted(self.allowed))}")


@dataclass(frozen=True, slots=True)
class EveryCheck:
    """Every check the verdict reports passed (a plan's checks, whichever they are), or has a status ``allowed``
    names for it."""

    allowed: Mapping[str, frozenset[str]] = field(default_factory=dict)
    otherwise: frozenset[str] = frozenset({"pass"})  # for a check ``allowed`` does not name

    def describe(self) -> str:
        return "every check the run reports passed" + (" or skipped" if "skip" in self.otherwise else "")

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        bad = [f"{c.name} {c.status.value}" for c in facts.verdict.checks
               if c.status.value not in self.allowed.get(c.name, self.otherwise)]
        found = f"{len(facts.verdict.checks)} check(s)" + (f"; {', '.join(bad)}" if bad else ", all passed")
        return _answer(self.describe(), found, not bad and bool(facts.verdict.checks),
                       f"not every check passed: {', '.join(bad) or 'no check reported'}")


@dataclass(frozen=True, slots=True)
class GpuVerified:
    """The run's GPU checks verified the image."""

    def describe(self) -> str:
        return "GPU-verified"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        ok = facts.verdict.gpu_verified
        why = str(facts.verdict.gpu.get("why_unverified") or "")
        return _answer(self.describe(), "GPU-verified" if ok else "GPU-unverified", ok,
                       "not GPU-verified" + (f" ({why[:200]})" if why else ""),
                       "smoke it on a GPU host with --sign-key, or accept it with --allow-gpu-unverified")


@dataclass(frozen=True, slots=True)
class Equals:
    """A fact the host proved is the value required (definition, patch-set digest, reference, tool version)."""

    what: str
    attribute: str
    value: str

    def describe(self) -> str:
        return f"{self.what} {self.value}"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        found = str(getattr(facts, self.attribute))
        return _answer(self.describe(), found or "none proved", found == self.value,
                       f"{self.what} {found or 'none proved by the host'}, not {self.value}")


@dataclass(frozen=True, slots=True)
class BaseDigest:
    """The base the host found has this digest: its image ID (config digest) or a registry digest the host's
    engine held for it."""

    value: str

    def describe(self) -> str:
        return f"base digest {self.value}"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        known = [d for d in (facts.base_id, *facts.base_digests) if d]
        found = ", ".join(known) or "no base found"
        return _answer(self.describe(), found, self.value in known, f"base {found}, not {self.value}")


@dataclass(frozen=True, slots=True)
class PinnedBase:
    """The base the host found is the one the definition pins for the run's platform (its image ID)."""

    pins: Mapping[str, str]  # platform -> image ID, as images/<tag>.toml's [base.digests]

    def describe(self) -> str:
        return f"base pinned by the definition ({', '.join(f'{p} {d}' for p, d in sorted(self.pins.items()))})"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        platform = facts.verdict.platform
        want = self.pins.get(platform) or self.pins.get("/".join(platform.split("/")[:2]))
        found = f"{facts.base_id or 'no base found'} on {platform or 'no stated platform'}"
        return _answer(self.describe(), found, bool(want) and facts.base_id == want,
                       f"base {found}, not the one the definition pins ({want or 'none for that platform'})")


@dataclass(frozen=True, slots=True)
class MaxAge:
    """The judged run started no longer ago than ``limit``."""

    limit: dt.timedelta

    def describe(self) -> str:
        return f"run at most {_duration_text(self.limit)} ago"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        if facts.run_at is None:
            return Failure(self.describe(), "no run time", "the verdict does not say when its run was made",
                           "smoke it again with --sign-key: a new verdict says when it ran")
        age = now - facts.run_at
        found = f"run {_duration_text(age)} ago ({facts.run_at.isoformat()})"
        return _answer(self.describe(), found, age <= self.limit, f"{found}, older than {_duration_text(self.limit)}")


def _product(name: str) -> str:
    return " ".join(name.split()).casefold()


@dataclass(frozen=True, slots=True)
class GpuProducts:
    """The run saw a GPU, and every GPU it saw is one of ``names``: whole names, never a part of one
    (``H10`` is not ``NVIDIA H100 80GB HBM3``), compared without regard to case or repeated spaces."""

    names: tuple[str, ...]

    def describe(self) -> str:
        return f"GPU product {' or '.join(self.names)}"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        wanted = {_product(n) for n in self.names}
        devices = facts.devices
        other = [d for d in devices if _product(d) not in wanted]
        found = ", ".join(devices) or "no GPU"
        return _answer(self.describe(), found, bool(devices) and not other,
                       f"ran on {found}, not on {' or '.join(self.names)}",
                       f"smoke it with --sign-key on a host with {' or '.join(self.names)} GPUs")


@dataclass(frozen=True, slots=True)
class AllOf:
    """Every requirement; an empty list is refused, as no policy at all."""

    requirements: tuple[Requirement, ...]

    def __post_init__(self) -> None:
        if not self.requirements:
            raise UsageError("the verification policy requires nothing: an empty policy would accept any signed "
                             "verdict, which is almost certainly not what was meant",
                             hint="leave the defaults (the definition's full smoke) or name what to require")

    def check(self, facts: Facts, now: dt.datetime) -> list[Result]:
        return [r.check(facts, now) for r in self.requirements]


@dataclass(frozen=True, slots=True)
class Policy:
    """What is required of the newest signed verdict that covers it (:meth:`covers`)."""

    checks: Mapping[str, frozenset[str]] = field(default_factory=dict)  # name -> statuses allowed
    every_check: bool = True
    gpu_verified: bool = True
    allow_gpu_unverified: bool = False
    definition: str = ""
    patch_set_digest: str = ""
    base_digest: str = ""
    base_pins: Mapping[str, str] = field(default_factory=dict)  # the definition's pinned base, per platform
    reference_digest: str = ""
    tool_version: str = ""
    max_age: dt.timedelta | None = None
    gpu_products: tuple[str, ...] = ()
    max_skew: dt.timedelta = DEFAULT_SKEW
    source: str = "the default policy (the definition's full smoke)"

    def requirements(self) -> AllOf:
        """The requirements, a pass first; AllOf refuses a policy that requires nothing."""
        reqs: list[Requirement] = [CheckStatus(name, allowed) for name, allowed in sorted(self.checks.items())]
        if self.every_check:
            # Under allow_gpu_unverified a check the policy does not name may be skipped (a patch set's GPU check
            # on a host without a GPU, or one not applicable to its GPU family), never failed.
            otherwise = frozenset({"pass", "skip"}) if self.allow_gpu_unverified else frozenset({"pass"})
            reqs.append(EveryCheck(dict(self.checks), otherwise))
        if self.gpu_verified:
            reqs.append(GpuVerified())
        for what, attribute, value in (("definition", "definition", self.definition),
                                       ("patch-set digest", "patch_set_digest", self.patch_set_digest),
                                       ("reference digest", "reference", self.reference_digest),
                                       ("tool version", "tool_version", self.tool_version)):
            if value:
                reqs.append(Equals(what, attribute, value))
        if self.base_digest:
            reqs.append(BaseDigest(self.base_digest))
        if self.base_pins:
            reqs.append(PinnedBase(dict(self.base_pins)))
        if self.max_age is not None:
            reqs.append(MaxAge(self.max_age))
        if self.gpu_products:
            reqs.append(GpuProducts(self.gpu_products))
        return AllOf((Passed(), *reqs) if reqs else ())

    @property
    def scope(self) -> list[str]:
        """The checks a verdict must have run (to a pass or a fail) to cover this policy."""
        return sorted(name for name, allowed in self.checks.items() if "skip" not in allowed)

    def covers(self, facts: Facts) -> str | None:
        """None when the verdict covers this policy (ran every check in :attr:`scope`, against the reference it
        names); else what it left out, in words."""
        statuses = facts.statuses
        missing = [f"{name} {statuses.get(name, 'not run')}" for name in self.scope
                   if statuses.get(name) not in ("pass", "fail")]
        if self.reference_digest and facts.reference != self.reference_digest:
            missing.append(f"answers judged against {facts.reference or 'no reference'}, not "
                           f"{self.reference_digest}")
        return "; ".join(missing) or None

    def required(self) -> list[str]:
        return [r.describe() for r in self.requirements().requirements]

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "required": self.required(), "scope": self.scope,
                "allow_gpu_unverified": self.allow_gpu_unverified, "max_skew_s": self.max_skew.total_seconds()}


def full_smoke(allow_gpu_unverified: bool = False) -> dict[str, frozenset[str]]:
    """The default checks: a definition's full smoke, each passed; the GPU-bound ones may be skipped (or absent)
    under ``allow_gpu_unverified``."""
    loose = frozenset({"pass", "skip"})
    checks = {name: (loose if allow_gpu_unverified and name in GPU_BOUND else frozenset({"pass"}))
              for name in FULL_SMOKE}
    if allow_gpu_unverified:
        checks["gpu"] = loose
    return checks


def _duration_text(delta: dt.timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if abs(seconds) >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
