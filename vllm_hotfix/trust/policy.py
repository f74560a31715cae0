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
verdict reports passed too, and the GPU checks verified. Answers must have
been judged: the ``golden`` check passed with its coverage at or above the
floor (:mod:`vllm_hotfix.golden.coverage`), the ``reference`` check passed
(the answers signed by a site key, recorded from another image), the
fixed-batch schedule at least :data:`LEVELS` x :data:`MIN_REQUESTS`
requests, and the verdict of the current format
(:data:`vllm_hotfix.verdicts.FORMAT`). A GPU-verified pass whose serve sweep,
``exact-levels`` or golden was skipped is not a deploy pass under it.
``allow_gpu_unverified`` lets the checks that need a GPU (:data:`GPU_BOUND`,
and a check the run's own GPU judgement set aside) be skipped or absent, as
on a host with no GPU, and the answer says so; it loosens nothing else.

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
from ..golden import coverage
from ..verdicts import FORMAT, IDENTITY, Status, Verdict

# The checks a definition's full smoke runs: the host's file facts, the image's Python (isolated), the GPU
# checks, the server's sweep and the fixed-batch levels (which run only where a reference is given).
CPU_CHECKS = (IDENTITY, "patch-landed", "package-version", "integrity", "import-location", "env-report",
              "known-bad-deps")
GPU_CHECKS = ("gpu-torch", "gpu-kernel", "gpu-triton", "model-imports")
SERVE_CHECKS = ("serve-sweep", "exact-levels")
# The answers judged: the golden forward's judgement of the replies, and the reference they were compared with.
ANSWER_CHECKS = ("golden", "reference")
FULL_SMOKE = (*CPU_CHECKS, *GPU_CHECKS, *SERVE_CHECKS, *ANSWER_CHECKS)
# What cannot run on a host without a GPU: the ``gpu`` check (skipped there), the GPU checks, the server and the
# answers it gives, and the compiled files whose absence only a GPU run turns into a fail.
GPU_BOUND = frozenset({"gpu", "compiled-files", *GPU_CHECKS, *SERVE_CHECKS, *ANSWER_CHECKS})
# The fixed-batch schedule a full smoke runs: these concurrency levels, each with at least this many requests.
LEVELS = (1, 2, 4, 8, 16)
MIN_REQUESTS = 32
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
    format: int = FORMAT  # the predicate's format (:data:`vllm_hotfix.verdicts.FORMAT`)
    judged_definition: str = ""  # the definition the run was judged against, where the predicate names it

    def check_named(self, name: str) -> Any:
        return next((c for c in self.verdict.checks if c.name == name), None)

    @property
    def schedule(self) -> tuple[tuple[int, int], ...]:
        """The fixed-batch schedule the host ran, as its ``exact-levels`` check names it: (concurrency, requests)
        per level, in order; empty where the check names none."""
        exact = self.check_named("exact-levels")
        data = exact.data if exact is not None and isinstance(exact.data, Mapping) else {}
        out = []
        for level in data.get("levels") or []:
            if isinstance(level, Mapping) and isinstance(level.get("concurrency"), int) \
                    and isinstance(level.get("requests"), int):
                out.append((int(level["concurrency"]), int(level["requests"])))
        return tuple(out)

    @property
    def gpu_set_aside(self) -> frozenset[str]:
        """The checks the run's own GPU judgement set aside (a stand-in, not applicable on this GPU family):
        named in the verdict's GPU facts as "NAME: why"."""
        names = set()
        for key in ("not_applicable", "not_real"):
            for said in self.verdict.gpu.get(key) or []:
                names.add(str(said).partition(":")[0].strip())
        return frozenset(names)

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
    names for it. ``gpu_may_skip``: a check that needs a GPU (:data:`GPU_BOUND`, or one the run's GPU judgement
    set aside) may be skipped; nothing else may."""

    allowed: Mapping[str, frozenset[str]] = field(default_factory=dict)
    gpu_may_skip: bool = False

    def describe(self) -> str:
        return "every check the run reports passed" + (" (skipped where it needs a GPU)" if self.gpu_may_skip
                                                       else "")

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        aside = facts.gpu_set_aside

        def allowed(name: str) -> frozenset[str]:
            if name in self.allowed:
                return self.allowed[name]
            loose = self.gpu_may_skip and (name in GPU_BOUND or name in aside)
            return frozenset({"pass", "skip"}) if loose else frozenset({"pass"})

        bad = [f"{c.name} {c.status.value}" for c in facts.verdict.checks if c.status.value not in allowed(c.name)]
        found = f"{len(facts.verdict.checks)} check(s)" + (f"; {', '.join(bad)}" if bad else ", all passed")
        return _answer(self.describe(), found, not bad and bool(facts.verdict.checks),
                       f"not every check passed: {', '.join(bad) or 'no check reported'}")


@dataclass(frozen=True, slots=True)
class GoldenCoverage:
    """A ``golden`` pass judged enough of the run: its coverage at or above the floor at every level of the run's
    schedule and for every prompt class (:func:`vllm_hotfix.golden.coverage.shortfall`). A golden check that did
    not pass is the check's own requirement to answer."""

    def describe(self) -> str:
        return (f"golden coverage at least {coverage.LEVEL_FLOOR:.0%} per level and "
                f"{', '.join(f'{k} {v:.0%}' for k, v in coverage.CLASS_FLOOR.items())} per prompt class")

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        golden = facts.check_named("golden")
        if golden is None or golden.status is not Status.PASS:
            return Success(self.describe(), f"golden {golden.status.value if golden else 'not run'}")
        data = golden.data if isinstance(golden.data, Mapping) else {}
        levels = tuple(level for level, _requests in facts.schedule)
        short = coverage.shortfall(data.get("coverage"), levels=levels)
        return _answer(self.describe(), short or "at or above the floor", short is None,
                       f"golden passed, but {short}")


@dataclass(frozen=True, slots=True)
class Schedule:
    """An ``exact-levels`` pass ran the full smoke's schedule: every level of :data:`LEVELS`, each with at least
    ``MIN_REQUESTS`` requests (the host's schedule, as the check's signed data names it)."""

    def describe(self) -> str:
        return f"schedule: concurrency {','.join(map(str, LEVELS))} x at least {MIN_REQUESTS} requests"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        exact = facts.check_named("exact-levels")
        if exact is None or exact.status is not Status.PASS:
            return Success(self.describe(), f"exact-levels {exact.status.value if exact else 'not run'}")
        ran = dict(facts.schedule)
        short = [f"concurrency {level} {'not run' if level not in ran else f'{ran[level]} requests'}"
                 for level in LEVELS if ran.get(level, 0) < MIN_REQUESTS]
        found = ", ".join(f"{level}x{n}" for level, n in facts.schedule) or "no schedule named"
        return _answer(self.describe(), found, not short, f"exact-levels ran a narrower schedule: {'; '.join(short)}")


@dataclass(frozen=True, slots=True)
class CurrentFormat:
    """The verdict is of the current format (one of an earlier format judged no answers)."""

    def describe(self) -> str:
        return f"verdict format {FORMAT}"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        return _answer(self.describe(), f"format {facts.format}", facts.format >= FORMAT,
                       f"a verdict of format {facts.format}, made before answers were judged (this tool signs "
                       f"format {FORMAT})",
                       "smoke it again with this tool (--sign-key), or accept earlier verdicts with a policy file "
                       "saying earlier_format = true")


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


def _words(name: str) -> list[str]:
    return name.casefold().split()


def _names(wanted: str, device: str) -> bool:
    """Whether ``wanted`` is ``device`` or a run of its whole words (``H100`` names "NVIDIA H100 80GB HBM3",
    ``H10`` does not)."""
    want, have = _words(wanted), _words(device)
    return bool(want) and any(have[i:i + len(want)] == want for i in range(len(have) - len(want) + 1))


@dataclass(frozen=True, slots=True)
class GpuProducts:
    """The run saw a GPU, and every GPU it saw is named by one of ``names``: the whole product name or a run of
    its whole words, never a part of one (``H100`` names "NVIDIA H100 80GB HBM3", ``H10`` does not), compared
    without regard to case or repeated spaces."""

    names: tuple[str, ...]

    def describe(self) -> str:
        return f"GPU product {' or '.join(self.names)}"

    def check(self, facts: Facts, now: dt.datetime) -> Result:
        devices = facts.devices
        other = [d for d in devices if not any(_names(n, d) for n in self.names)]
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
    golden_coverage: bool = True  # a golden pass the policy counts must meet the coverage floor
    schedule: bool = True  # an exact-levels pass the policy counts must have run the full smoke's schedule
    earlier_format: bool = False  # a verdict of an earlier format may answer
    source: str = "the default policy (the definition's full smoke)"

    def requirements(self) -> AllOf:
        """The requirements, a pass first; AllOf refuses a policy that requires nothing of the run: one by which
        no check need have run (every check it names may be skipped) asks nothing of the image, whatever else it
        says of the verdict (its format, definition, age or GPU)."""
        reqs: list[Requirement] = [CheckStatus(name, allowed) for name, allowed in sorted(self.checks.items())]
        substantive = any("skip" not in allowed for allowed in self.checks.values())
        if self.every_check:
            # Under allow_gpu_unverified a check that needs a GPU may be skipped (a patch set's GPU check on a host
            # without a GPU, or one not applicable to its GPU family), never failed; any other is passed.
            reqs.append(EveryCheck(dict(self.checks), self.allow_gpu_unverified))
            substantive = True
        if self.golden_coverage and "golden" in self.checks:
            reqs.append(GoldenCoverage())
        if self.schedule and "exact-levels" in self.checks:
            reqs.append(Schedule())
        if not self.earlier_format:
            reqs.append(CurrentFormat())
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
        return AllOf((Passed(), *reqs) if substantive else ())

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
