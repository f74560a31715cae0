"""The verification policy and the scope and time rule, through `verify` on signed verdict files."""

from __future__ import annotations

import datetime as dt
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from conftest import REPO, cli, copy_tracked
from vllm_hotfix.errors import UsageError
from vllm_hotfix.trust import decide, policy, policy_file, signing
from vllm_hotfix.verdicts import FORMAT

IMAGE_ID = "sha256:" + "ab" * 32
BASE_ID = "sha256:" + "ba" * 32
PATCH_SET = "sha256:" + "5e" * 32
REFERENCE = "sha256:" + "4e" * 32
H100 = "NVIDIA H100 80GB HBM3"
NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)
# A GPU-verified run without --serve-model: the sweep skipped, exact-levels, golden and reference never ran.
GPU_ONLY = (*policy.CPU_CHECKS, *policy.GPU_CHECKS, "serve-sweep")


@pytest.fixture(autouse=True)
def _now() -> None:
    """Times are "minutes from now" as each test starts, not as the module was imported: a worker may import it
    minutes before it runs a test, and a verdict meant to lie a minute ahead would lie in the past by then."""
    global NOW
    NOW = dt.datetime.now(dt.UTC).replace(microsecond=0)


def _at(minutes: float) -> str:
    """A time ``minutes`` from now (negative: ago), as a predicate spells it."""
    return (NOW + dt.timedelta(minutes=minutes)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def report(*, skip: tuple[str, ...] = (), fail: tuple[str, ...] = (), only: tuple[str, ...] | None = None,
           gpu_verified: bool = True, devices: tuple[str, ...] = (H100,), definition: str = "v0.25.1",
           started: float = -60, seconds: float = 60, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """A host's judged report of a smoke (every check of the full smoke passed unless said otherwise)."""
    names = [*(only if only is not None else policy.FULL_SMOKE), *extra]
    checks = [{"name": n, "status": "fail" if n in fail else "skip" if n in skip else "pass", "detail": "x"}
              for n in names]
    by_name = {c["name"]: c for c in checks}
    if "golden" in by_name:
        by_name["golden"]["data"] = {"coverage": coverage_of(0.5)}
    if "exact-levels" in by_name:
        by_name["exact-levels"]["data"] = {"levels": [{"concurrency": c, "requests": 32} for c in policy.LEVELS]}
    identity = next((c for c in checks if c["name"] == "layer-identity"), None)
    if identity is not None:
        identity["data"] = {"base_id": BASE_ID, "base_found_by": "build record", "definition": definition,
                            "base_ref": "vllm/vllm-openai:v0.25.1", "base_digests": [],
                            "patch_set": definition, "patch_set_digest": PATCH_SET, "patches": {"0001.patch": "ff"}}
    return {"format": FORMAT, "image_id": IMAGE_ID, "image": "ops/vllm:fix", "status": "fail" if fail else "pass",
            "platform": "linux/amd64",
            "gpu_verified": gpu_verified and not fail, "gpu": {"devices": list(devices)}, "checks": checks,
            "seconds": seconds, "started": _at(started),
            "sweep": {"reference": {"sha256": REFERENCE.removeprefix("sha256:")}}}


def coverage_of(share: float, positions: int = 1536) -> dict[str, Any]:
    """A golden check's coverage (as vllm_hotfix.golden.coverage reads it): ``share`` judged at every level and
    of both prompt classes."""
    entry = {"judged": int(positions * share), "positions": positions}
    return {"levels": {str(c): dict(entry) for c in policy.LEVELS}, "classes": {"short": dict(entry),
                                                                                  "long": dict(entry)}}


@pytest.fixture
def key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


@pytest.fixture
def pub(tmp_path: Path, key: ec.EllipticCurvePrivateKey) -> str:
    path = tmp_path / "site.pub"
    path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    return str(path)


def sign(folder: Path, key: ec.EllipticCurvePrivateKey, name: str, rep: dict[str, Any],
         labels: dict[str, str] | None = None, signed: float | None = None) -> str:
    """The envelope smoke would write for ``rep``, signed at ``signed`` minutes from now (default: its end)."""
    started = dt.datetime.fromisoformat(rep["started"])
    at = signed if signed is not None else (started - NOW).total_seconds() / 60 + rep["seconds"] / 60
    pred = signing.predicate(rep, labels or {}, _at(at), rep["started"])
    path = folder / f"{name}.dsse.json"
    path.write_bytes(signing.sign(signing.statement({"ops/vllm:fix": IMAGE_ID}, pred), key))
    return str(path)


def verify(tmp_path: Path, pub: str, *files: str, args: tuple[str, ...] = ()) -> Any:
    """``verify`` of the files; for definition v0.25.1 unless ``args`` name one (or a policy file)."""
    given = [a for f in files for a in ("--attestation", f)]
    named = ("--definition", "v0.25.1") if not {"--definition", "--policy"} & set(args) else ()
    return cli("verify", IMAGE_ID, "--key", pub, *given, *named, *args, root=tmp_path)


def test_the_default_policy_refuses_a_pass_without_answers(tmp_path: Path, key: Any, pub: str) -> None:
    # GPU-verified, but no --serve-model: the sweep skipped, exact-levels never ran. Not a deploy pass.
    gpu_only = sign(tmp_path, key, "gpu-only", report(skip=("serve-sweep",), only=GPU_ONLY))
    r = verify(tmp_path, pub, gpu_only)
    assert r.rc == 24 and "covers what the policy requires" in r.last_error, r.err
    assert "serve-sweep skip" in r.last_error and "exact-levels not run" in r.last_error
    # --json says what was required and what each verdict left out, with the refusal.
    r = verify(tmp_path, pub, gpu_only, args=("--json",))
    out = json.loads(r.out)
    assert r.rc == 24 and out["status"] == "refused" and out["exit_code"] == 24
    assert "check exact-levels: pass" in out["policy"]["required"] and "serve-sweep" in out["policy"]["scope"]
    assert out["verdicts"][0]["covers"] == "exact-levels not run; golden not run; reference not run; serve-sweep skip"
    # A verdict that covers and misses a requirement: each requirement with what was found.
    r = verify(tmp_path, pub, sign(tmp_path, key, "h100", report()), args=("--json", "--require-gpu", "H10"))
    found = {f["requirement"]: (f["found"], f["met"]) for f in json.loads(r.out)["found"]}
    assert r.rc == 24 and found["GPU product H10"] == (H100, False) and found["status pass"] == ("pass", True)
    # A check the plan ran beyond the fixed list (a patch set's GPU check) counts too: skipped, not a deploy pass.
    skipped = sign(tmp_path, key, "na", report(extra=("topk-layout",), skip=("topk-layout",)))
    r = verify(tmp_path, pub, skipped)
    assert r.rc == 24 and "not every check passed: topk-layout skip" in r.last_error, r.err
    # The full smoke passes.
    assert verify(tmp_path, pub, sign(tmp_path, key, "full", report(extra=("topk-layout",)))).rc == 0
    # The policy may say so: the sweep's skip accepted where it names it.
    r = verify(tmp_path, pub, gpu_only, args=tuple(a for name in policy.SERVE_CHECKS + policy.ANSWER_CHECKS
                                                   for a in ("--require-check", f"{name}=pass|skip")))
    assert r.rc == 0, r.err
    # Every check the policy counts that did not run is named, though the run was GPU-verified.
    assert "exact-levels, golden, reference, serve-sweep not run" in r.out, r.out


def test_allow_gpu_unverified_accepts_a_cpu_hosts_verdict_and_says_so(tmp_path: Path, key: Any, pub: str) -> None:
    cpu = sign(tmp_path, key, "cpu", report(only=(*policy.CPU_CHECKS, "gpu", "serve-sweep"),
                                            skip=("gpu", "serve-sweep"), gpu_verified=False, devices=()))
    r = verify(tmp_path, pub, cpu)
    assert r.rc == 24 and "--allow-gpu-unverified" in r.err.splitlines()[-1], r.err
    r = verify(tmp_path, pub, cpu, args=("--allow-gpu-unverified",))
    assert r.rc == 0, r.err
    assert "GPU-unverified, accepted under --allow-gpu-unverified" in r.out and "exact-levels" in r.out
    # A CPU check failed is no pass under it either.
    bad = sign(tmp_path, key, "bad", report(only=(*policy.CPU_CHECKS, "gpu"), skip=("gpu",), fail=("integrity",),
                                            gpu_verified=False, devices=()), signed=1)
    r = verify(tmp_path, pub, bad, args=("--allow-gpu-unverified",))
    assert r.rc == 24 and "integrity" in r.last_error


def test_gpu_products_are_whole_words(tmp_path: Path, key: Any, pub: str) -> None:
    full = sign(tmp_path, key, "full", report())
    r = verify(tmp_path, pub, full, args=("--require-gpu", "H10"))
    assert r.rc == 24 and f"ran on {H100}, not on H10" in r.last_error, r.err
    # A run of whole words of the device's name names it (docs/gpu-verification.md's example); a part of one not.
    r = verify(tmp_path, pub, full, args=("--require-gpu", "H100"))
    assert r.rc == 0, r.err
    assert verify(tmp_path, pub, full, args=("--require-gpu", "h100  80gb")).rc == 0
    assert verify(tmp_path, pub, full, args=("--require-gpu", "80GB H100")).rc == 24
    assert verify(tmp_path, pub, full, args=("--require-gpu", "nvidia  h100 80gb hbm3")).rc == 0
    assert verify(tmp_path, pub, full, args=("--require-gpu", f"NVIDIA H200,{H100}")).rc == 0


def test_a_narrower_newer_pass_does_not_outrank_a_full_fail(tmp_path: Path, key: Any, pub: str) -> None:
    # The case: a full smoke started at 10:00 whose exact-levels failed at 10:30; a GPU-only pass
    # started at 10:05 (and over at 10:06).
    full_fail = sign(tmp_path, key, "full-fail", report(started=-60, seconds=1800, fail=("exact-levels",)))
    gpu_pass = sign(tmp_path, key, "gpu-pass", report(started=-55, seconds=60,
                                                      only=(*policy.CPU_CHECKS, *policy.GPU_CHECKS)))
    r = verify(tmp_path, pub, full_fail, gpu_pass, args=("--allow-gpu-unverified",))
    assert r.rc == 24 and "full-fail" in r.last_error and "exact-levels" in r.last_error, r.err
    # Ordered by when the run ended: the full fail ended last even though it started first.
    r = verify(tmp_path, pub, full_fail, gpu_pass, args=("--json", "--allow-gpu-unverified"))
    assert r.rc == 24


def test_a_newer_fail_of_a_counted_check_blocks_whatever_its_scope(tmp_path: Path, key: Any, pub: str) -> None:
    full = sign(tmp_path, key, "full", report(started=-120))
    narrow_fail = sign(tmp_path, key, "narrow-fail", report(started=-30, only=policy.CPU_CHECKS,
                                                             fail=("integrity",)))
    r = verify(tmp_path, pub, full, narrow_fail)
    assert r.rc == 24 and "narrow-fail" in r.last_error and "'fail', not a pass: integrity" in r.last_error, r.err
    assert "the older signed pass" in r.last_error and "does not count" in r.last_error
    # An older narrow fail does not: the newer full pass covers and passes it.
    old_fail = sign(tmp_path, key, "old-fail", report(started=-300, only=policy.CPU_CHECKS, fail=("integrity",)))
    assert verify(tmp_path, pub, full, old_fail).rc == 0


def test_a_verdict_dated_in_the_future_is_refused(tmp_path: Path, key: Any, pub: str) -> None:
    ahead = sign(tmp_path, key, "ahead", report(started=24 * 60))
    r = verify(tmp_path, pub, ahead)
    assert r.rc == 24 and "ahead of this host's clock" in r.last_error, r.err
    # Within the stated skew it stands.
    near = sign(tmp_path, key, "near", report(started=1, seconds=30))
    assert verify(tmp_path, pub, near).rc == 0
    assert verify(tmp_path, pub, near, args=("--max-skew", "10s")).rc == 24


def test_age_definition_digests_and_tool_version(tmp_path: Path, key: Any, pub: str) -> None:
    old = sign(tmp_path, key, "old", report(started=-3 * 24 * 60))
    assert verify(tmp_path, pub, old, args=("--max-age", "7d")).rc == 0
    r = verify(tmp_path, pub, old, args=("--max-age", "2d"))
    assert r.rc == 24 and "older than 2d" in r.last_error, r.err
    full = sign(tmp_path, key, "full", report())
    for flag, good, bad in (("--definition", "v0.25.1", "v0.26.0"),
                            ("--patch-set-digest", PATCH_SET, "sha256:" + "00" * 32),
                            ("--base-digest", BASE_ID, "sha256:" + "00" * 32),
                            ("--reference-digest", REFERENCE, "sha256:" + "00" * 32),
                            ("--tool-version", signing.__version__, "9.9.9")):
        assert verify(tmp_path, pub, full, args=(flag, good)).rc == 0, flag
        r = verify(tmp_path, pub, full, args=(flag, bad))
        assert r.rc == 24 and bad in r.last_error, (flag, r.err)


def test_a_policy_reads_what_the_host_proved_never_the_labels(tmp_path: Path, key: Any, pub: str) -> None:
    # Identity failed (judged against the SM100 variant): the host proved no patch set, and names the definition and
    # patch-set digest it judged the image against; the labels claim another definition, and are kept apart.
    rep = report(fail=("layer-identity",), definition="v0.25.1-sm100")
    labels = {"io.vllm-hotfix.definition": "v0.25.1", "org.opencontainers.image.base.digest": "sha256:" + "11" * 32,
              "io.vllm-hotfix.patches": json.dumps({"0001.patch": "ff"})}
    pred = signing.predicate(rep, labels, _at(0))
    assert pred["patch_set"] == {} and pred["patches"] == {}
    assert pred["definition"] == "v0.25.1-sm100" and pred["patch_set_digest"] == PATCH_SET
    assert pred["claimed"]["definition"] == "v0.25.1"
    assert pred["claimed"]["base"]["digest"] == "sha256:" + "11" * 32
    assert pred["base"] == {"id": BASE_ID, "name": "vllm/vllm-openai:v0.25.1", "digests": []}
    assert pred["scope"]["ran"] == sorted(policy.FULL_SMOKE) and pred["scope"]["reference"] == REFERENCE[7:]
    # A pass with labels naming another definition and base: the policy reads the host's facts.
    lied = sign(tmp_path, key, "lied", report(), labels={**labels, "io.vllm-hotfix.definition": "v0.26.0"})
    assert verify(tmp_path, pub, lied, args=("--definition", "v0.25.1", "--base-digest", BASE_ID)).rc == 0
    r = verify(tmp_path, pub, lied, args=("--base-digest", "sha256:" + "11" * 32))
    assert r.rc == 24 and "not sha256:1111" in r.last_error
    assert verify(tmp_path, pub, lied, args=("--definition", "v0.26.0")).rc == 24
    # A verdict signed before `claimed` existed took these from the labels: it proves none of them.
    before = {k: v for k, v in pred.items() if k != "claimed"} | {"definition": "v0.25.1"}
    facts = decide.facts(before, "old")
    assert facts.definition == "" and facts.patch_set_digest == ""


def test_policy_files_and_empty_policies(tmp_path: Path, key: Any, pub: str) -> None:
    full = sign(tmp_path, key, "full", report())
    empty = tmp_path / "empty.toml"
    empty.write_text("")
    r = verify(tmp_path, pub, full, args=("--policy", str(empty)))
    assert r.rc == 64 and "requires nothing" in r.last_error and str(empty) in r.last_error, r.err
    nothing = tmp_path / "nothing.json"
    nothing.write_text(json.dumps({"full_smoke": False}))
    r = verify(tmp_path, pub, full, args=("--policy", str(nothing)))
    assert r.rc == 64 and "requires nothing" in r.last_error, r.err
    with pytest.raises(UsageError, match="requires nothing"):
        policy.AllOf(())
    typo = tmp_path / "typo.toml"
    typo.write_text('definiton = "v0.25.1"\n')
    r = verify(tmp_path, pub, full, args=("--policy", str(typo)))
    assert r.rc == 64 and "unknown key(s) definiton" in r.last_error, r.err
    # A narrow policy: these checks, this GPU, no more.
    narrow = tmp_path / "narrow.toml"
    narrow.write_text('full_smoke = false\nchecks = ["layer-identity", "gpu-torch"]\ndefinition = "v0.25.1"\n'
                      f'gpu_products = ["{H100}"]\nmax_age = "1d"\n')
    gpu_only = sign(tmp_path, key, "gpu-only", report(only=("layer-identity", "gpu-torch")))
    r = verify(tmp_path, pub, gpu_only, args=("--policy", str(narrow), "--json"))
    assert r.rc == 0, r.err
    out = json.loads(r.out)
    assert out["policy"]["source"] == f"policy {narrow}"
    assert out["policy"]["required"] == ["status pass", "check gpu-torch: pass", "check layer-identity: pass",
                                         f"verdict format {FORMAT}", "definition v0.25.1", "run at most 1d ago",
                                         f"GPU product {H100}"]
    assert {f["requirement"]: f["found"] for f in out["found"]}["check gpu-torch: pass"] == "pass"
    assert all(f["met"] for f in out["found"]) and out["verdicts"][0]["covers"] == "yes"
    assert verify(tmp_path, pub, gpu_only, args=("--policy", str(narrow), "--require-gpu", "NVIDIA H200")).rc == 24


def test_could_not_check_is_not_a_refusal(tmp_path: Path, key: Any, pub: str) -> None:
    one = sign(tmp_path, key, "one", report(), signed=0)
    two = sign(tmp_path, key, "two", report(gpu_verified=False), signed=0)
    r = verify(tmp_path, pub, one, two, args=("--allow-gpu-unverified",))
    assert r.rc == 25 and "at the same instant" in r.last_error, r.err


@pytest.mark.parametrize(("text", "seconds"), [("90", 90), ("90s", 90), ("15m", 900), ("12h", 43200),
                                               ("7d", 604800), ("2w", 1209600), (30, 30)])
def test_durations(text: object, seconds: int) -> None:
    assert policy_file.duration(text, "x").total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "7 days", "-1d", "d", True])
def test_bad_durations_are_named(text: object) -> None:
    with pytest.raises(UsageError, match="not a duration"):
        policy_file.duration(text, "max age")


def test_a_definition_of_this_checkout_requires_its_patch_set_and_its_pinned_base(tmp_path: Path, key: Any,
                                                                                  pub: str) -> None:
    copy_tracked(REPO, ("images", "patches"), tmp_path)
    full = sign(tmp_path, key, "full", report())
    # The checkout's patch set is not the one the host proved (PATCH_SET): refused, naming both.
    r = verify(tmp_path, pub, full, args=("--definition", "v0.25.1", "--json"))
    assert r.rc == 24 and "patch-set digest" in json.loads(r.out)["error"], r.out
    digest = policy_file.pinned(tmp_path, "v0.25.1").patch_set_digest
    assert digest.startswith("sha256:") and digest != PATCH_SET
    # Given the host's digest, the definition's pinned base decides: pinned to another base, refused.
    toml = tmp_path / "images/v0.25.1.toml"
    toml.write_text(toml.read_text() + f'\n[base.digests]\n"linux/amd64" = "sha256:{"cc" * 32}"\n')
    r = verify(tmp_path, pub, full, args=("--definition", "v0.25.1", "--patch-set-digest", PATCH_SET))
    assert r.rc == 24 and "not the one the definition pins" in r.last_error, r.err
    toml.write_text(toml.read_text().replace("cc" * 32, BASE_ID.removeprefix("sha256:")))
    r = verify(tmp_path, pub, full, args=("--definition", "v0.25.1", "--patch-set-digest", PATCH_SET, "--json"))
    assert r.rc == 0, r.err
    assert f"base pinned by the definition (linux/amd64 {BASE_ID})" in json.loads(r.out)["policy"]["required"]


def test_none_covering_is_one_short_line_of_the_newest(tmp_path: Path, key: Any, pub: str) -> None:
    # Three verdicts that each leave out part of the full smoke: the line named the whole scope and all three
    # (847 characters with a registry's places); now the newest alone, the rest in --json.
    partial = [sign(tmp_path, key, f"partial-{n}-of-a-long-named-series-of-runs", report(
        skip=("serve-sweep",), only=policy.FULL_SMOKE[:-1], started=-60 - n)) for n in range(3)]
    r = verify(tmp_path, pub, *partial, args=("--definition", "v0.25.1"))
    assert r.rc == 24 and "covers what the policy requires: the newest, " in r.last_error, r.err
    assert "partial-0-of" in r.last_error and "partial-1-of" not in r.last_error
    assert len(r.last_error) <= 400, (len(r.last_error), r.last_error)
    assert "verify --json lists what each verdict left out" in r.err
    r = verify(tmp_path, pub, *partial, args=("--definition", "v0.25.1", "--json"))
    assert len(json.loads(r.out)["verdicts"]) == 3


def test_the_default_policy_requires_answers_judged_and_a_policy_may_say_otherwise(tmp_path: Path, key: Any,
                                                                                   pub: str) -> None:
    def golden(share: float) -> dict[str, Any]:
        rep = report()
        next(c for c in rep["checks"] if c["name"] == "golden")["data"] = {"coverage": coverage_of(share)}
        return rep

    no_golden = report(only=tuple(n for n in policy.FULL_SMOKE if n != "golden"))
    unchecked_reference = report(skip=("reference",))
    narrow_schedule = report()
    next(c for c in narrow_schedule["checks"] if c["name"] == "exact-levels")["data"] = {
        "levels": [{"concurrency": c, "requests": 8} for c in (1, 2, 4)]}
    earlier = {k: v for k, v in report().items() if k != "format"}
    cases = {"no-golden": (no_golden, "golden not run"),
             "golden-none": (golden(0), "the golden judged 0 of 1536 positions at concurrency 1"),
             "golden-1-of-6144": (golden(1 / 1536), "the golden judged 1 of 1536 positions at concurrency 1"),
             "no-reference": (unchecked_reference, "reference skip"),
             "narrow-schedule": (narrow_schedule, "concurrency 8 not run"),
             "earlier-format": (earlier, "a verdict of format 1")}
    for name, (rep, why) in cases.items():
        r = verify(tmp_path, pub, sign(tmp_path, key, name, rep))
        assert r.rc == 24 and why in r.last_error, (name, r.err)
    assert verify(tmp_path, pub, sign(tmp_path, key, "full", report())).rc == 0
    # Accepted only under a policy that says so.
    lenient = tmp_path / "lenient.toml"
    lenient.write_text('definition = "v0.25.1"\nchecks = { golden = ["pass", "skip"], reference = ["pass", "skip"] }'
                       '\ngolden_coverage = false\nschedule = false\nearlier_format = true\n')
    for name, (rep, _why) in cases.items():
        r = verify(tmp_path, pub, sign(tmp_path, key, name, rep), args=("--policy", str(lenient)))
        assert r.rc == 0, (name, r.err)


def test_allow_gpu_unverified_loosens_only_what_needs_a_gpu_and_an_older_fail_needs_a_wider_pass(
        tmp_path: Path, key: Any, pub: str) -> None:
    # The case: a full smoke whose exact-levels failed, then a GPU-verified pass without the sweep.
    full_fail = sign(tmp_path, key, "full-fail", report(started=-120, seconds=60, fail=("exact-levels",)))
    narrow = sign(tmp_path, key, "narrow-pass", report(started=-30, seconds=60, only=GPU_ONLY,
                                                       skip=("serve-sweep",)))
    r = verify(tmp_path, pub, full_fail, narrow, args=("--allow-gpu-unverified",))
    assert r.rc == 24 and "full-fail" in r.last_error and "is not cleared" in r.last_error, r.err
    assert "exact-levels" in r.last_error and "every check the failing run ran" in r.err.splitlines()[-1]
    # A later run of equal scope that passed clears it.
    again = sign(tmp_path, key, "full-pass", report(started=-10, seconds=60))
    r = verify(tmp_path, pub, full_fail, narrow, again, args=("--allow-gpu-unverified",))
    assert r.rc == 0, r.err
    # A check that needs no GPU may not be skipped under it (a patch set's CPU check, the runner's report).
    cpu = report(only=(*policy.CPU_CHECKS, "gpu", "runner"), skip=("gpu", "runner"), gpu_verified=False, devices=())
    r = verify(tmp_path, pub, sign(tmp_path, key, "cpu", cpu), args=("--allow-gpu-unverified",))
    assert r.rc == 24 and "runner skip" in r.last_error, r.err
    # Every counted check that did not run is named, as not run.
    cpu = report(only=(*policy.CPU_CHECKS, "gpu"), skip=("gpu",), gpu_verified=False, devices=())
    r = verify(tmp_path, pub, sign(tmp_path, key, "cpu-ok", cpu), args=("--allow-gpu-unverified",))
    assert r.rc == 0 and "exact-levels, golden, gpu, gpu-kernel" in r.out, r.out


def test_verify_names_what_the_image_is_for(tmp_path: Path, key: Any, pub: str) -> None:
    full = sign(tmp_path, key, "full", report())
    r = cli("verify", IMAGE_ID, "--key", pub, "--attestation", full, root=tmp_path)
    assert r.rc == 64 and "no definition named" in r.last_error and "--definition TAG" in r.err, r.err
    r = cli("push", "ops/vllm:fix", "--registry", "127.0.0.1:5000/ops", "--require-attestation", pub, root=tmp_path)
    assert r.rc == 64 and "no definition named" in r.last_error, r.err
    # A definition this checkout holds that pins no base: said in one line.
    copy_tracked(REPO, ("images", "patches"), tmp_path)
    digest = policy_file.pinned(tmp_path, "v0.25.1").patch_set_digest
    r = verify(tmp_path, pub, full, args=("--definition", "v0.25.1", "--patch-set-digest", digest))
    notes = [line for line in r.err.splitlines() if "pins no base digest" in line]
    assert len(notes) == 1 and "v0.25.1" in notes[0], r.err


def test_a_future_dated_verdict_that_is_no_fail_is_left_out(tmp_path: Path, key: Any, pub: str) -> None:
    full = sign(tmp_path, key, "full", report())
    ahead = sign(tmp_path, key, "ahead", report(started=24 * 60, skip=("exact-levels",)))
    r = verify(tmp_path, pub, full, ahead)
    assert r.rc == 0 and "ahead" in r.err and "left out" in r.err, r.err
    # A fail dated ahead still refuses.
    ahead_fail = sign(tmp_path, key, "ahead-fail", report(started=24 * 60, fail=("integrity",)))
    r = verify(tmp_path, pub, full, ahead_fail)
    assert r.rc == 24 and "ahead-fail" in r.last_error, r.err


def test_overflowing_durations_are_usage_errors(tmp_path: Path, key: Any, pub: str) -> None:
    full = sign(tmp_path, key, "full", report())
    r = verify(tmp_path, pub, full, args=("--max-age", "99999999999d"))
    assert r.rc == 64 and "longer than any duration" in r.last_error and "Traceback" not in r.err, r.err
    for name, text in (("inf.toml", "max_age = inf"), ("big.toml", "max_skew = 1e300"),
                       ("big.json", '{"max_age": 1e400}'), ("days.toml", 'max_age = "99999999999d"')):
        path = tmp_path / name
        path.write_text(text)
        r = verify(tmp_path, pub, full, args=("--policy", str(path)))
        assert r.rc == 64 and str(path) in r.err and "Traceback" not in r.err, (name, r.err)
        assert len(r.err.strip().splitlines()) <= 2, r.err
        r = cli("push", "ops/vllm:fix", "--registry", "127.0.0.1:5000/ops", "--require-attestation", pub,
                "--policy", str(path), "--definition", "v0.25.1", root=tmp_path)
        assert r.rc == 64 and "Traceback" not in r.err, (name, r.err)


def test_a_fifo_as_the_policy_is_refused_at_once(tmp_path: Path, key: Any, pub: str) -> None:
    full = sign(tmp_path, key, "full", report())
    fifo = tmp_path / "policy.toml"
    os.mkfifo(fifo)  # nobody writes to it: a read would wait for ever
    r = verify(tmp_path, pub, full, args=("--policy", str(fifo)))
    assert r.rc == 64 and "not a regular file" in r.last_error, r.err


def test_a_run_that_cannot_be_placed_in_time_is_refused(tmp_path: Path, key: Any, pub: str) -> None:
    far = report()
    far["started"] = "9999-12-31T23:59:00.000000Z"
    long = report(seconds=1e12)
    for name, rep in (("year-9999", far), ("1e12s", long)):
        r = verify(tmp_path, pub, sign(tmp_path, key, name, rep, signed=0))
        assert r.rc == 24 and "past any date" in r.last_error and "Traceback" not in r.err, (name, r.err)


def test_a_narrower_fail_ending_with_the_covering_pass_cannot_be_ordered(tmp_path: Path, key: Any,
                                                                         pub: str) -> None:
    full = sign(tmp_path, key, "full", report(started=-10, seconds=60))
    narrow_fail = sign(tmp_path, key, "narrow-fail", report(started=-10, seconds=60, only=policy.CPU_CHECKS,
                                                             fail=("integrity",)))
    r = verify(tmp_path, pub, full, narrow_fail)
    assert r.rc == 25 and "same instant" in r.last_error, r.err


def test_a_policy_requiring_only_skippable_checks_requires_nothing(tmp_path: Path, key: Any, pub: str) -> None:
    full = sign(tmp_path, key, "full", report())
    for text in ('full_smoke = false\nchecks = { "nobody-runs" = "skip" }\n',
                 'full_smoke = false\nchecks = { "x" = ["pass", "skip"] }\nearlier_format = true\n'):
        path = tmp_path / "skip.toml"
        path.write_text(text)
        r = verify(tmp_path, pub, full, args=("--policy", str(path), "--definition", "v0.25.1"))
        assert r.rc == 64 and "requires nothing" in r.last_error, (text, r.err)


def test_a_fail_judged_against_another_definition_does_not_block(tmp_path: Path, key: Any, pub: str) -> None:
    full = sign(tmp_path, key, "full", report(started=-120))
    other = sign(tmp_path, key, "sm100-fail", report(started=-30, fail=("integrity",), definition="v0.25.1-sm100"))
    assert verify(tmp_path, pub, full, other, args=("--definition", "v0.25.1")).rc == 0
    # Judged against the definition asked of, it blocks.
    same = sign(tmp_path, key, "fail", report(started=-30, fail=("integrity",)))
    r = verify(tmp_path, pub, full, same, args=("--definition", "v0.25.1"))
    assert r.rc == 24 and "'fail', not a pass: integrity" in r.last_error, r.err
