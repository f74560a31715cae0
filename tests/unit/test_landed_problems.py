"""The push gate's re-check of an image's files answers in types, table-driven: which check, whether the image
differs or this host could not tell, the difference where there is one, and the refusal the gate makes of each."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest

from vllm_hotfix.building.pinfile import Pin, PinSet
from vllm_hotfix.engine import FileFact, Tree
from vllm_hotfix.errors import PushError
from vllm_hotfix.judges import identity, integrity, recheck
from vllm_hotfix.judges.difference import Difference
from vllm_hotfix.release.gate import landed_refusal
from vllm_hotfix.verdicts import Status

FAIL, INCOMPLETE = Status.FAIL, Status.INCOMPLETE
ENTRY = Difference("/s/pkg/a.so", "entry", "", "a file, mode 644, sha256 bb", "patch layer: /s/pkg/a.so is not the "
                                                                              "builder's (a file, mode 644, sha256 bb)")

IDENTITY_CASES = [
    # (what, the identity outcome, the problem: None, or (status, difference))
    ("a pass lets the other checks run", identity.Outcome("pass", "exactly what the builder writes"), None),
    ("the base itself skips identity", identity.Outcome("skip", "the image is the definition's base itself"), None),
    ("a file beside the patched one is the image's",
     identity.Outcome("fail", "not the product ...: patch layer: /s/pkg/a.so is not the builder's", difference=ENTRY),
     (FAIL, ENTRY)),
    ("an image no definition places is the image's, with no path to name",
     identity.Outcome("fail", "no base to compare it with: cannot tell what it is the product of"), (FAIL, None)),
    ("a base this host cannot find is the host's",
     identity.Outcome("incomplete", "no base to compare it with: base x is not in the engine"), (INCOMPLETE, None)),
]


@pytest.mark.parametrize("what, outcome, want", IDENTITY_CASES, ids=[c[0] for c in IDENTITY_CASES])
def test_identity_outcomes_become_problems_of_the_image_or_of_the_host(
        what: str, outcome: identity.Outcome, want: tuple[Status, Difference | None] | None) -> None:
    got = recheck.identity_problem(outcome)
    if want is None:
        assert got is None
        return
    assert got is not None and got.check == identity.CHECK == "layer-identity"
    assert (got.status, got.difference) == want and got.words == outcome.detail
    assert got.host_fault is (want[0] is INCOMPLETE) and str(got) == f"layer-identity: {outcome.detail}"


def _judged(missing: tuple[str, ...] = (), missing_base: tuple[str, ...] = ()) -> integrity.Judged:
    return integrity.Judged({"name": "integrity", "status": "pass", "detail": "ok"}, missing, missing_base)


def _checks(**statuses: str) -> tuple[dict[str, Any], ...]:
    return tuple({"name": name.replace("_", "-"), "status": status, "detail": f"{name} says {status}"}
                 for name, status in statuses.items())


LANDED = Difference("/s/pkg/m.py", "sha256", "aa" * 32, "bb" * 32, "/s/pkg/m.py has sha256 bbbb, expected aaaa")
VERSION = Difference("vllm", "version", "0.25.1", "0.25.2", "vllm 0.25.2 installed, base had 0.25.1")

FILE_CASES = [
    # (what, the file checks, the differences they name, GPU claimed, compiled missing (own, base's),
    #  the problem: None, or (check, status, path, field, expected, found) with None where no difference is named)
    ("all pass", _checks(patch_landed="pass", package_version="pass", integrity="pass"), {}, True, ((), ()), None),
    ("an altered patched file", _checks(patch_landed="fail", package_version="pass", integrity="fail"),
     {"patch-landed": LANDED}, False, ((), ()),
     ("patch-landed", FAIL, "/s/pkg/m.py", "sha256", "aa" * 32, "bb" * 32)),
    ("another version of the package", _checks(patch_landed="pass", package_version="fail", integrity="pass"),
     {"package-version": VERSION}, False, ((), ()), ("package-version", FAIL, "vllm", "version", "0.25.1", "0.25.2")),
    ("files that differ from RECORD name no single path", _checks(patch_landed="pass", integrity="fail"), {}, False,
     ((), ()), ("integrity", FAIL, None)),
    ("a check the host could not finish stays the host's", _checks(patch_landed="pass", integrity="incomplete"), {},
     False, ((), ()), ("integrity", INCOMPLETE, None)),
    ("compiled files missing, and no GPU claimed", _checks(integrity="pass"), {}, False, (("vllm/_C.so",), ()), None),
    ("compiled files missing under a GPU-verified verdict", _checks(integrity="pass"), {}, True,
     (("vllm/_C.so", "vllm/_moe.so"), ()),
     ("compiled-files", FAIL, "vllm/_C.so", "entry", "listed in RECORD", "")),
    ("the base's missing compiled files count too", _checks(integrity="pass"), {}, True, ((), ("vllm/_C.so",)),
     ("compiled-files", FAIL, "vllm/_C.so", "entry", "listed in RECORD", "")),
]


@pytest.mark.parametrize("what, checks, differences, gpu, missing, want", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_the_first_file_check_that_does_not_pass_is_the_problem(
        what: str, checks: tuple[dict[str, Any], ...], differences: dict[str, Difference], gpu: bool,
        missing: tuple[tuple[str, ...], tuple[str, ...]], want: tuple[Any, ...] | None) -> None:
    got = recheck.files_problem(integrity.FileChecks(checks, _judged(*missing), differences), gpu)
    if want is None:
        assert got is None
        return
    assert got is not None and (got.check, got.status) == want[:2]
    if want[2] is None:
        assert got.difference is None
    else:
        assert got.difference is not None and got.difference.as_dict() == dict(
            zip(("path", "field", "expected", "found"), want[2:], strict=True))
    if got.check == "compiled-files":
        assert got.words.startswith("its verdict says GPU-verified, but ") and "e.g. vllm/_C.so" in got.words
    else:
        assert got.words == next(c["detail"] for c in checks if c["name"] == got.check)


PINSET = PinSet(Path("patches/v0.25.1/pins.txt"), "v0.25.1",
                (Pin("quack-kernels", "0.6.4", ("a" * 64,), 3, "quack_kernels"),
                 Pin("nvidia-cutlass-dsl", "4.6.2", ("b" * 64,), 4, "nvidia-cutlass-dsl")), (), "c" * 64)

PIN_CASES = [
    # (what, each distribution's versions in the image, None or (path, found, words' middle))
    ("every pin once at its version", {"quack-kernels": ["0.6.4"], "nvidia-cutlass-dsl": ["4.6.2"]}, None),
    ("another version", {"quack-kernels": ["0.6.3"], "nvidia-cutlass-dsl": ["4.6.2"]},
     ("quack-kernels", "0.6.3", "quack_kernels is 0.6.3 in the image")),
    ("not installed", {"quack-kernels": ["0.6.4"]}, ("nvidia-cutlass-dsl", "", "nvidia-cutlass-dsl is not installed")),
    ("two copies, one of them right", {"quack-kernels": ["0.6.4", "0.6.3"], "nvidia-cutlass-dsl": ["4.6.2"]},
     ("quack-kernels", "0.6.3, 0.6.4", "quack_kernels is 0.6.3, 0.6.4 in the image")),
]


@pytest.mark.parametrize("what, copies, want", PIN_CASES, ids=[c[0] for c in PIN_CASES])
def test_a_pin_the_image_does_not_hold_once_at_its_version_is_the_images_difference(
        what: str, copies: dict[str, list[str]], want: tuple[str, str, str] | None) -> None:
    got = recheck.pins_difference(PINSET, copies)
    if want is None:
        assert got is None
        return
    path, found, words = want
    pin = next(p for p in PINSET.pins if p.name == path)
    assert got is not None and got.check == "pins" and got.status is FAIL and not got.host_fault
    assert got.difference is not None and got.difference.as_dict() == {"path": path, "field": "version",
                                                                       "expected": pin.version, "found": found}
    assert words in got.words and got.words.endswith(f"but v0.25.1/pins.txt {pin.where} pins {pin.version}")


SITE = "/site"
SOURCE = b"x = 1\n"
SHA = hashlib.sha256(SOURCE).hexdigest()
PYC = f"{SITE}/pkg/__pycache__/m.cpython-311.pyc"
TIMESTAMP_PYC = b"\x00" * 4 + b"\x00\x00\x00\x00" + b"\x00" * 8  # flags 0: a timestamp pyc, never re-checked

LANDED_CASES = [
    # (what, the entry at the patched path (None: absent), a pyc beside it, the first difference or None)
    ("the patched bytes", FileFact(f"{SITE}/pkg/m.py", "file", 6, SHA), False, None),
    ("missing", None, False, (f"{SITE}/pkg/m.py", "entry", "file", "")),
    ("a link in its place", FileFact(f"{SITE}/pkg/m.py", "link", 0, "", target="/elsewhere.py"), False,
     (f"{SITE}/pkg/m.py", "kind", "file", "link")),
    ("other bytes", FileFact(f"{SITE}/pkg/m.py", "file", 6, "cd" * 32), False,
     (f"{SITE}/pkg/m.py", "sha256", SHA, "cd" * 32)),
    ("a timestamp pyc beside it", FileFact(f"{SITE}/pkg/m.py", "file", 6, SHA), True,
     (PYC, "bytecode", "checked", "stale (timestamp")),
]


@pytest.mark.parametrize("what, fact, pyc, want", LANDED_CASES, ids=[c[0] for c in LANDED_CASES])
def test_a_patched_file_that_is_not_what_it_must_be_is_named_by_path_and_field(
        what: str, fact: FileFact | None, pyc: bool, want: tuple[str, str, str, str] | None) -> None:
    entries = {fact.path: fact} if fact is not None else {}
    kept = {}
    if pyc:
        entries[PYC] = FileFact(PYC, "file", len(TIMESTAMP_PYC), hashlib.sha256(TIMESTAMP_PYC).hexdigest())
        kept[PYC] = TIMESTAMP_PYC
    got = integrity.landed(Tree(entries, kept), SITE, {"pkg/m.py": SHA})
    if want is None:
        assert got.differences == () and got.problems == ()
        return
    first = got.differences[0]
    assert (first.path, first.field, first.expected) == want[:3] and first.found.startswith(want[3])
    assert got.problems[0] == str(first)


REFUSALS = [
    # (what, the problem, the refusal's words after "refusing to push IMG (ID): ", the hint's start)
    ("a difference in the image",
     recheck.LandedProblem("layer-identity", FAIL, "not the product of definition v0.25.1 ...", ENTRY),
     "layer-identity: not the product of definition v0.25.1 ...", "its verdict does not match its files"),
    ("an integrity failure", recheck.LandedProblem("integrity", FAIL, "3 file(s) differ from RECORD"),
     "integrity: 3 file(s) differ from RECORD", "its verdict does not match its files"),
    ("a base this host cannot find",
     recheck.LandedProblem("layer-identity", INCOMPLETE, "no base to compare it with: base x is not in the engine"),
     "its files could not be re-checked on this host: layer-identity: no base to compare it with: base x is not in "
     "the engine", "nothing is known against the image"),
    ("a pins.txt this host cannot use", recheck.LandedProblem("pins", INCOMPLETE, "pins.txt line 2: not NAME==VERSION"),
     "its files could not be re-checked on this host: pins: pins.txt line 2: not NAME==VERSION",
     "nothing is known against the image"),
    ("an expectation this host cannot recompute",
     recheck.LandedProblem("expectation", INCOMPLETE, "base x is not in the engine, and no build record"),
     "its files could not be re-checked on this host: expectation: base x is not in the engine, and no build record",
     "nothing is known against the image"),
]


@pytest.mark.parametrize("what, problem, words, hint", REFUSALS, ids=[r[0] for r in REFUSALS])
def test_the_push_gate_refuses_a_difference_and_a_host_fault_alike_but_says_which(
        what: str, problem: recheck.LandedProblem, words: str, hint: str) -> None:
    refusal = landed_refusal("img:x (sha256:0123456789ab)", problem)
    assert isinstance(refusal, PushError) and refusal.exit_code == 8  # nothing pushed: the gate's code either way
    assert str(refusal) == f"refusing to push img:x (sha256:0123456789ab): {words}"
    assert refusal.hint is not None and refusal.hint.startswith(hint)
    assert ("rebuild" in refusal.hint) is not problem.host_fault  # a sound image is never sent to be rebuilt
