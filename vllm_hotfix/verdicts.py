"""Smoke outcomes as typed data: the trust boundary between a run and the push gate.

A probe's checks arrive as JSON from inside an image (which may be hostile),
and a verdict comes back from a journal file (which may have been edited):
both are validated here into frozen :class:`Check` and :class:`Verdict`
values. :func:`judge` is the one place that decides what a run's checks
amount to; the push gate, ``list`` and rollback only read its answer.

The dictionaries :meth:`Verdict.to_dict` makes are the ``--report`` JSON and
the journal's verdict entries, unchanged in shape from the untyped days, so
entries written before still read.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from . import __version__
from .errors import Malformed, NotItsProduct, SmokeError, SmokeIncomplete

log = logging.getLogger(__name__)


class Status(StrEnum):
    """A check's outcome; a verdict is one of pass, fail or incomplete."""

    PASS = "pass"
    FAIL = "fail"
    SKIP = "skip"
    # The host, not the image, stopped the check (GPU required but none
    # usable, engine lost, a probe that timed out): neither a pass nor a fail.
    INCOMPLETE = "incomplete"


# What a whole run can come to; a skipped check alone never decides a run.
VERDICT_STATUSES = (Status.PASS, Status.FAIL, Status.INCOMPLETE)
# The check that settles, before any other, whether the image is its definition's product (judges.identity).
IDENTITY = "layer-identity"
# The verdict's format, named in every report and signed predicate: 2 judges answers (a golden check carrying its
# coverage, the reference check, the fixed-batch schedule). A verdict that names none is of format 1, written
# before answers were judged; the verification policy does not take it as a deploy pass unless it says so.
FORMAT = 2
EARLIER_FORMAT = 1


def _status(value: object, allowed: Sequence[Status], what: str) -> Status:
    if isinstance(value, str) and value in {s.value for s in allowed}:
        return Status(value)
    raise Malformed(f"{what} is {value!r}, not one of {', '.join(s.value for s in allowed)}")


def _typed(raw: Mapping[str, Any], key: str, kind: type | tuple[type, ...], default: Any) -> Any:
    """``raw[key]`` if it has the type, ``default`` if absent (or null where null is the default)."""
    if key not in raw or (raw[key] is None and default is None):
        return default
    value = raw[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    # bool is an int: a flag must not pass for a number, nor a number for a flag.
    if isinstance(value, kinds) and (bool in kinds or not isinstance(value, bool)):
        return value
    raise Malformed(f"{key!r} is {type(value).__name__} {value!r:.80}, not {'/'.join(k.__name__ for k in kinds)}")


# What a check ran against when a stand-in replaced the real code (``ran_against``).
STUB = "stub"
# What a check "ran against" when the code path it drives is not the one vLLM
# takes on the GPU in use (e.g. a Triton-path check on SM100, where vLLM takes
# the MSA path): nothing of the image ran, so it is no GPU evidence.
NOT_APPLICABLE = "not-applicable"


def _strings(raw: Mapping[str, Any], key: str) -> tuple[str, ...]:
    """``raw[key]`` as a tuple of strings (absent or null: empty); raise :class:`Malformed` otherwise."""
    items = _typed(raw, key, list, None) or []
    if not all(isinstance(item, str) for item in items):
        raise Malformed(f"{key!r} holds something other than strings: {items!r:.80}")
    return tuple(items)


def _import_errors(raw: Mapping[str, Any]) -> dict[str, str]:
    errors = _typed(raw, "import_errors", dict, None) or {}
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in errors.items()):
        raise Malformed(f"'import_errors' is not module -> error text: {errors!r:.80}")
    return dict(errors)


@dataclass(frozen=True, slots=True)
class Check:
    """One smoke check's outcome.

    ``ran_against`` is what the check exercised: the image's own code, named
    (``"vllm"``, ``"torch"``), or :data:`STUB` when the check replaced some of
    it with a stand-in; empty when the check does not say. ``stubs`` names each
    stand-in; ``import_errors`` each module of the image the check could not
    import, with the error. A GPU check counts towards GPU-verified only when
    it ran against the real code (:attr:`real`) and imported all it needed.
    """

    name: str
    status: Status
    detail: str = ""
    seconds: float = 0.0
    data: Any = None  # the probe's JSON facts for the report (a mapping, as a rule)
    ran_against: str = ""
    stubs: tuple[str, ...] = ()
    import_errors: Mapping[str, str] = field(default_factory=dict)  # module -> why it did not import

    @property
    def real(self) -> bool:
        """Whether the check says it ran against the image's own code, with nothing standing in."""
        return (bool(self.ran_against) and self.ran_against not in (STUB, NOT_APPLICABLE) and not self.stubs
                and not self.import_errors)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "status": self.status.value, "detail": self.detail,
                               "seconds": self.seconds}
        if self.data is not None:
            out["data"] = self.data
        # Only when said, so that entries of checks that never said read back unchanged.
        if self.ran_against:
            out["ran_against"] = self.ran_against
        if self.stubs:
            out["stubs"] = list(self.stubs)
        if self.import_errors:
            out["import_errors"] = dict(self.import_errors)
        return out

    @classmethod
    def from_dict(cls, raw: object) -> Check:
        """A check from JSON (a probe's output or a journal entry); raise :class:`Malformed`."""
        if not isinstance(raw, Mapping):
            raise Malformed(f"a check is {type(raw).__name__}, not an object")
        name = _typed(raw, "name", str, None)
        if not name:
            raise Malformed("a check has no name")
        return cls(
            name=name,
            status=_status(raw.get("status"), tuple(Status), f"check {name!r}: status"),
            detail=_typed(raw, "detail", str, ""),
            seconds=float(_typed(raw, "seconds", (int, float), 0.0)),
            data=raw.get("data"),
            ran_against=_typed(raw, "ran_against", str, ""),
            stubs=_strings(raw, "stubs"),
            import_errors=_import_errors(raw),
        )

    @classmethod
    def reported(cls, raw: object, seconds: float, name: str) -> Check:
        """A check as a probe or a runner reported it, timed ``seconds``; a malformed one is a failing check under
        its own name (else ``name``). The one reading of a reported check: the runner's of its probes, and the
        host's of the runner's report and of the probes it starts itself."""
        try:
            c = cls.from_dict(raw)
        except Malformed as exc:
            said = raw.get("name") if isinstance(raw, Mapping) and isinstance(raw.get("name"), str) else ""
            return cls(said or name, Status.FAIL, f"the probe reported a malformed check: {exc}", seconds)
        return cls(c.name, c.status, c.detail, seconds, c.data, c.ran_against, c.stubs, c.import_errors)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One smoke run's outcome on one exact image ID, and the facts the gate and ``list`` read."""

    image: str
    image_id: str
    status: Status
    checks: tuple[Check, ...]
    gpu_verified: bool
    platform: str = ""
    started: str = ""
    seconds: float = 0.0
    expected_from: str = ""
    tool_version: str = __version__
    format: int = FORMAT
    gpu: Mapping[str, Any] = field(default_factory=dict)
    host: Mapping[str, Any] = field(default_factory=dict)
    environment: Mapping[str, Any] = field(default_factory=dict)
    sweep: Mapping[str, Any] | None = None
    phases: Mapping[str, float] = field(default_factory=dict)  # wall seconds per phase, in the order run

    @property
    def passed(self) -> bool:
        return self.status is Status.PASS

    @property
    def judged(self) -> bool:
        """Whether the run judged the image (pass or fail); an incomplete run did not."""
        return self.status is not Status.INCOMPLETE

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if c.status is Status.FAIL]

    @property
    def incomplete(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if c.status is Status.INCOMPLETE]

    def to_dict(self) -> dict[str, Any]:
        """The report: what --report writes and what the journal keeps."""
        return {
            "format": self.format,
            "tool_version": self.tool_version,
            "image": self.image,
            "image_id": self.image_id,
            "status": self.status.value,
            "incomplete": self.incomplete,
            "gpu_verified": self.gpu_verified,
            "gpu": dict(self.gpu),
            "expected_from": self.expected_from,
            "host": dict(self.host),
            "platform": self.platform,
            "started": self.started,
            "seconds": self.seconds,
            "checks": [c.to_dict() for c in self.checks],
            "environment": dict(self.environment),
            "sweep": dict(self.sweep) if self.sweep is not None else None,
            "phases": dict(self.phases),
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> Verdict:
        """A verdict as the journal keeps it; raise :class:`Malformed` on a wrong type.

        The status is read as written, not judged again: the journal says what
        the run concluded, and a status that disagrees with the checks is the
        sign of an edited entry, which the gate's landed re-check catches.
        """
        image_id = _typed(raw, "image_id", str, None)
        if not image_id:
            raise Malformed("no image_id")
        checks = _typed(raw, "checks", list, [])
        sweep = _typed(raw, "sweep", dict, None)
        return cls(
            image=_typed(raw, "image", str, ""),
            image_id=image_id,
            status=_status(raw.get("status"), VERDICT_STATUSES, "status"),
            checks=tuple(Check.from_dict(c) for c in checks),
            gpu_verified=_typed(raw, "gpu_verified", bool, False),
            platform=_typed(raw, "platform", str, ""),
            started=_typed(raw, "started", str, ""),
            seconds=float(_typed(raw, "seconds", (int, float), 0.0)),
            expected_from=_typed(raw, "expected_from", str, ""),
            tool_version=_typed(raw, "tool_version", str, ""),
            format=_typed(raw, "format", int, EARLIER_FORMAT),
            gpu=_typed(raw, "gpu", dict, {}),
            host=_typed(raw, "host", dict, {}),
            environment=_typed(raw, "environment", dict, {}),
            sweep=sweep,
            phases=_phases(raw),
        )


def _phases(raw: Mapping[str, Any]) -> dict[str, float]:
    """``raw["phases"]`` as phase -> seconds (absent in entries written before phases were kept: empty)."""
    phases = _typed(raw, "phases", dict, None) or {}
    if not all(isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool)
               for k, v in phases.items()):
        raise Malformed(f"'phases' is not phase -> seconds: {phases!r:.80}")
    return {k: float(v) for k, v in phases.items()}


def outcome(checks: Sequence[Check]) -> Status:
    """fail if a check failed; incomplete if the host kept one from running; else pass."""
    states = {c.status for c in checks}
    if Status.FAIL in states:
        return Status.FAIL
    if Status.INCOMPLETE in states:
        return Status.INCOMPLETE
    return Status.PASS


def judge(
    image: str,
    image_id: str,
    checks: Sequence[Check],
    *,
    gpu_verified: bool,
    platform: str = "",
    started: str = "",
    seconds: float = 0.0,
    expected_from: str = "",
    gpu: Mapping[str, Any] | None = None,
    host: Mapping[str, Any] | None = None,
    environment: Mapping[str, Any] | None = None,
    sweep: Mapping[str, Any] | None = None,
    phases: Mapping[str, float] | None = None,
) -> Verdict:
    """A smoke run's checks (and the facts around them) as its verdict.

    ``gpu_verified`` says the GPU checks ran and passed; the gate reads it
    only on a verdict that passed.
    """
    status = outcome(checks)
    return Verdict(
        image=image, image_id=image_id, status=status, checks=tuple(checks),
        gpu_verified=gpu_verified, platform=platform, started=started,
        # Rounded as the report keeps it, so a verdict read back equals the one written.
        seconds=round(seconds, 3), expected_from=expected_from, gpu=dict(gpu or {}), host=dict(host or {}),
        environment=dict(environment or {}), sweep=sweep, phases=dict(phases or {}),
    )


@dataclass(frozen=True, slots=True)
class GpuJudgement:
    """What a run's GPU checks amount to: the checks as judged, and whether they verify the image."""

    checks: tuple[Check, ...]
    verified: bool
    why_unverified: str = ""  # one line; empty when verified
    # Each stand-in or unimportable module, named, the base's marked as such.
    not_real: tuple[str, ...] = ()
    # Each check whose code path is not the one vLLM takes on this GPU family, with why.
    not_applicable: tuple[str, ...] = ()


def _short(error: str) -> str:
    return error.strip().splitlines()[0][:200] if error.strip() else "no reason given"


def judge_gpu(
    checks: Sequence[Check], *, require: bool, base_import_errors: Mapping[str, str] | None = None
) -> GpuJudgement:
    """Judge the GPU checks of a run in which a GPU was confirmed reachable.

    Only a check that ran against the image's own code counts: one that says
    it ran against a stub, lists stand-ins, or does not say what it ran
    against is no evidence. Under ``require`` such a check fails, as does one
    that skipped; otherwise it becomes a skip and the image stays
    GPU-unverified. A module of the image that a check could not import fails
    the check whatever the mode: the image cannot run that code on this host.
    ``base_import_errors`` (the same modules imported in the image's base;
    None when the base was not probed) tells an import the base could not do
    either, named as the base's, from one the image broke.

    A check that says it is not applicable on this GPU family
    (``ran_against`` :data:`NOT_APPLICABLE`) never counts towards GPU-verified,
    whatever its status: it is a skip, and under ``require`` it leaves the run
    incomplete (this host cannot verify the patch; the image did nothing wrong).
    """
    judged: list[Check] = []
    not_real: list[str] = []
    not_applicable: list[str] = []
    for c in checks:
        if c.ran_against == NOT_APPLICABLE:
            not_applicable.append(f"{c.name}: {c.detail}")
            status = Status.INCOMPLETE if require else Status.SKIP
            lead = "--gpu require, but" if require else "not counted, image GPU-unverified:"
            judged.append(Check(c.name, status, f"{lead} not applicable on this GPU family ({c.detail})", c.seconds,
                                c.data, c.ran_against, c.stubs, c.import_errors))
            continue
        problems: list[str] = []
        broken = False
        for module, error in sorted(c.import_errors.items()):
            if base_import_errors is not None and module in base_import_errors:
                words = f"{module} does not import ({_short(error)}), in the base too: the base's deviation"
            else:
                broken = True
                tail = "its base imports it" if base_import_errors is not None else "the base was not probed"
                words = f"{module} does not import in the image ({_short(error)}); {tail}"
            problems.append(words)
            not_real.append(words)
        if c.ran_against == STUB or c.stubs:
            stubs = "; ".join(c.stubs) or "it reported ran_against=stub"
            problems.append(f"ran against a stub, not the image's code: {stubs}")
            not_real += [f"{c.name}: {stub}" for stub in c.stubs] or [f"{c.name}: ran against a stub"]
        elif not c.ran_against and c.status is Status.PASS:
            problems.append("does not say whether it ran against the image's code or a stub (ran_against)")
            not_real.append(f"{c.name}: ran_against not reported")
        status, detail = c.status, c.detail
        if broken or (problems and c.status is Status.FAIL):
            status = Status.FAIL
            detail = f"{'; '.join(problems)} (the check said {c.status.value}: {c.detail})"
        elif problems and c.status is not Status.INCOMPLETE:
            status = Status.FAIL if require else Status.SKIP
            lead = "--gpu require, but no GPU evidence" if require else "not counted, image GPU-unverified"
            detail = f"{lead}: {'; '.join(problems)} (the check said {c.status.value}: {c.detail})"
        elif c.status is Status.SKIP and require:
            # A GPU was confirmed reachable: a check that still cannot run is the image's failing.
            status = Status.FAIL
            detail = f"--gpu require, but the check did not run ({c.detail})"
        judged.append(Check(c.name, status, detail, c.seconds, c.data, c.ran_against, c.stubs, c.import_errors))
    bad = [c for c in judged if c.status is not Status.PASS]
    verified = bool(judged) and not bad
    why = ""
    if not verified:
        if not judged:
            why = "no GPU check reported"
        else:
            why = "; ".join(f"{c.name} {c.status.value}" for c in bad)
            if not_real:
                why += f" ({'; '.join(not_real)})"
            if not_applicable:
                why += f" (not applicable on this GPU family: {'; '.join(not_applicable)})"
    return GpuJudgement(tuple(judged), verified, why, tuple(not_real), tuple(not_applicable))


def rejudge_gpu(verdict: Verdict, said: Sequence[Check], *, require: bool,
                base_import_errors: Mapping[str, str] | None) -> Verdict:
    """``verdict`` with its GPU checks judged again from ``said`` (what they reported, before judgement).

    A runner judges its GPU checks inside the image, where the image's base
    cannot be asked; the host judges them again, with ``base_import_errors``
    where it could ask (:func:`judge_gpu`). Each judged check replaces the
    runner's of the same name (one the runner left out is added); compiled
    files the image lacks still keep it from being GPU-verified.
    """
    judged = judge_gpu(said, require=require, base_import_errors=base_import_errors)
    by_name = {c.name: c for c in judged.checks}
    checks = []
    for c in verdict.checks:
        mine = by_name.pop(c.name, None)
        if mine is None:
            checks.append(c)
            continue
        answered = (c.data or {}).get("answered_by") if isinstance(c.data, Mapping) else None
        data = {**(mine.data if isinstance(mine.data, Mapping) else {}), **({"answered_by": answered} if answered
                                                                           else {})}
        checks.append(Check(mine.name, mine.status, mine.detail, c.seconds, data, mine.ran_against, mine.stubs,
                            mine.import_errors))
    # A GPU check said but missing from the verdict's own list is judged all the same.
    checks += by_name.values()
    gpu = dict(verdict.gpu)
    verified = judged.verified and not gpu.get("compiled_missing")
    gpu["verified"] = verified
    for key, value in (("not_real", judged.not_real), ("not_applicable", judged.not_applicable)):
        if value:
            gpu[key] = list(value)
        else:
            gpu.pop(key, None)
    if verified:
        gpu.pop("why_unverified", None)
    elif not judged.verified:
        why = f"GPU checks through {gpu.get('way')}: {judged.why_unverified}"
        missing = gpu.get("compiled_missing")
        gpu["why_unverified"] = why + (f"; {len(missing)} compiled file(s) the installed RECORD lists are absent "
                                       "from the image" if missing else "")
    return judge(verdict.image, verdict.image_id, checks, gpu_verified=verified, platform=verdict.platform,
                 started=verdict.started, seconds=verdict.seconds, expected_from=verdict.expected_from, gpu=gpu,
                 host=verdict.host, environment=verdict.environment, sweep=verdict.sweep, phases=verdict.phases)


def require_pass(verdict: Verdict, subject: str, *, fail_hint: str, incomplete_hint: str) -> None:
    """Raise unless the verdict is a pass: SmokeError (the image failed) or SmokeIncomplete (the host)."""
    if verdict.status is Status.FAIL:
        identity = next((c for c in verdict.checks if c.name == IDENTITY and c.status is Status.FAIL), None)
        if identity is not None:
            raise NotItsProduct(f"{subject}: {identity.detail}", hint=fail_hint)
        message = f"smoke failed for {subject}: {', '.join(verdict.failed)}"
        not_real = verdict.gpu.get("not_real")
        if isinstance(not_real, list) and not_real:
            # What kept the GPU checks from counting, on the one line a person reads.
            message += f"; not GPU-verified: {'; '.join(map(str, not_real))}"
        raise SmokeError(message, hint=fail_hint)
    if verdict.status is Status.INCOMPLETE:
        raise SmokeIncomplete(
            f"smoke of {subject} is incomplete, neither pass nor fail: {'; '.join(verdict.incomplete)}",
            hint=incomplete_hint,
        )
