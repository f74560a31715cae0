"""The GPU host's programs without a GPU or an engine: the campaign's logic (DRY_RUN) and the record from fake reports.

What the GPU run executes is gpu-runs/campaign.py (gpu-host-serve.sh runs it); here its steps are walked in
this process with every engine-touching command printed instead of run, and gpu_host.py record is fed
reports and signed envelopes made here.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from conftest import REPO
from vllm_hotfix.trust import signing

SCRIPTS = REPO / "gpu-runs"
SERVE = SCRIPTS / "gpu-host-serve.sh"
RECORD = SCRIPTS / "gpu_host.py"


@functools.cache
def _module(name: str) -> Any:
    """A gpu-runs/ program as a module, loaded once: its main() runs here, without a process of its own."""
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up by name)
    spec.loader.exec_module(module)
    return module


def _main(name: str, *argv: str) -> subprocess.CompletedProcess[str]:
    """``python3 gpu-runs/NAME.py ARGV...`` in this process: its exit code, stdout and stderr."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = _module(name).main(list(argv))
    return subprocess.CompletedProcess([name, *argv], rc, out.getvalue(), err.getvalue())


def _campaign(parts: Path, out: Path, env: dict[str, str]) -> tuple[int, str]:
    """campaign.py PARTS OUTDIR with this environment, in this process: its exit code and console output (its
    stderr after its stdout)."""
    console, errors = io.StringIO(), io.StringIO()
    rc = _module("campaign").main([str(parts), str(out)], environ=env, stdout=console, stderr=errors)
    return rc, console.getvalue() + errors.getvalue()


@pytest.mark.parametrize("script", sorted(p.name for p in SCRIPTS.glob("*.sh")))
def test_scripts_parse(script: str) -> None:
    r = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr


def test_shellcheck_finds_no_warning_in_the_campaign_scripts() -> None:
    if shutil.which("shellcheck") is None:
        pytest.skip("no shellcheck on this machine")
    r = subprocess.run(["shellcheck", "-S", "warning", str(SERVE), str(SCRIPTS / "campaign-call.sh")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout


def _env(tmp_path: Path, steps: str, **more: str) -> dict[str, str]:
    # No manifest (whatever this checkout holds in gpu-parts/): the dry run says where a real one would refuse.
    return {**os.environ, "DRY_RUN": "1", "STEPS": steps, "GPU_HOST_WORK": str(tmp_path / "work"),
            "SOURCE_MANIFEST": str(tmp_path / "no-manifest.json"), "MODELS": "m0:0:2", **more}


def _dry(tmp_path: Path, steps: str, **more: str) -> tuple[list[list[str]], str, Path]:
    parts, out = tmp_path / "parts", tmp_path / "out"
    parts.mkdir(exist_ok=True)
    (parts / "SHA256SUMS").write_text("")
    rc, console = _campaign(parts, out, _env(tmp_path, steps, **more))
    assert rc == 0, console
    log = (out / "run.log").read_text()
    commands = [shlex.split(line[2:]) for line in log.splitlines() if line.startswith("+ ")]
    return commands, log, out


def _smokes(commands: list[list[str]]) -> dict[str, list[str]]:
    found = {}
    for argv in commands:
        if "smoke" in argv and "build.py" in argv:
            report = argv[argv.index("--report") + 1]
            found[Path(report).stem] = argv
    return found


def test_the_five_smokes_are_the_ones_the_record_needs(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "calls.log").write_text("[05:01:02] host up 95.10 s: start\n")  # campaign-call.sh's
    commands, log, top = _dry(tmp_path, "refimage reference patched patched2 unpatched1 unpatched record")
    out = top / "m0"  # the one model's folder
    smokes = _smokes(commands)
    # The base's first run beside the recordings (it warms the base's compile cache), then the patched image
    # alone: the first smoke of a new image on a warm base; then the base judged, and a second start.
    assert list(smokes) == ["reference", "unpatched-first", "patched", "unpatched", "patched-again"]
    # The base's first run has no reference yet (its answers are being recorded beside it): judged by form.
    assert "--reference" not in smokes["unpatched-first"]
    first = smokes["unpatched-first"]
    judged = smokes["unpatched"]
    strip = judged.index("--reference")
    assert first[3:] == [a.replace("unpatched.", "unpatched-first.") for a in judged[3:strip] + judged[strip + 2:]]
    answers = str(out / "answers.json")
    for which, argv in smokes.items():
        assert "--min-tokens" not in argv
        assert {"--gpu", "require", "--keep-going", "--serve-model"} <= set(argv)
        assert argv[argv.index("--attestation") + 1] == str(out / f"{which}.dsse.json")
        assert Path(argv[argv.index("--sign-key") + 1]).name == "signing-key.pem"
        assert argv[0] == "timeout"
        # vLLM sizes the KV cache from the given bytes (no free-memory measurement): the GPU checks overlap. The
        # server's arguments are the definition's [smoke] table's, so that `make smoke` is judged as these are.
        assert [a for a in argv if a.startswith("--serve-arg=")] == [
            f"--serve-arg={a}" for a in ("--max-model-len", "8192", "--enforce-eager", "--gpu-memory-utilization",
                                         "0.05", "--kv-cache-memory-bytes", "2147483648")]
        assert "--serve-arg=--tensor-parallel-size" not in argv  # one GPU unless TP says otherwise
    table = (REPO / "images" / "v0.25.1.toml").read_text()
    assert 'serve_args = ["--max-model-len", "8192", "--enforce-eager", "--gpu-memory-utilization", "0.05",\n' \
           '              "--kv-cache-memory-bytes", "2147483648"]' in table
    assert smokes["reference"][smokes["reference"].index("--record-reference") + 1] == answers
    assert "--reference" not in smokes["reference"]
    for which in ("patched", "patched-again", "unpatched"):
        assert smokes[which][smokes[which].index("--reference") + 1] == answers
    assert smokes["unpatched"][smokes["unpatched"].index("--definition") + 1] == "v0.25.1"
    # The reference comes from another image of the same definition: the assemble builder's.
    assert smokes["reference"][5].endswith(":v0.25.1-m3patch-assembled")
    assert smokes["unpatched"][5].endswith(":v0.25.1") and smokes["patched"][5].endswith(":v0.25.1-m3patch")
    assert smokes["patched-again"][5] == smokes["patched"][5]
    build = next(argv for argv in commands if "--builder" in argv)
    assert build[build.index("--builder") + 1] == "assemble" and build[-1].endswith("-m3patch-assembled")
    # Cold means the compile caches go first; the key stays on the host, its public half in OUTDIR.
    assert ["rm", "-rf", str(tmp_path / "work" / "cache" / "compile")] in commands
    assert (top / "signing-key.pub.pem").read_text().startswith("-----BEGIN PUBLIC KEY-----")
    assert not (top / "signing-key.pem").exists() and not (out / "signing-key.pem").exists()
    assert (tmp_path / "work" / "signing-key.pem").stat().st_mode & 0o777 == 0o600  # its maker's alone
    [record] = [argv for argv in commands if "record" in argv]
    assert {"--reference-run", "--inputs-from", "--public-key", "--reference", "--base",
            "--source-manifest"} <= set(record)
    assert record[record.index("--target-seconds") + 1] == "60"
    assert record[record.index("--calls") + 1] == str(top / "calls.log")  # which call of the lent host made what
    # The first model's warm verdict is its patched smoke alone; its make smoke ran in the queue, held to the
    # long command's verdict, not to the warm target.
    assert record[record.index("--warm") + 1] == "patched" and "--side-by-side" not in record
    assert record.count("--warm") == 1
    assert record[record.index("--make-smoke") + 1] == "patched_third"
    assert "smoke m0/reference: exit code 0" in log
    # This checkout is no clean commit with a manifest here: a real run would refuse before any step.
    assert "source check: would refuse" in log


def test_a_step_whose_report_is_there_is_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out" / "m0"
    out.mkdir(parents=True)
    (out / "reference.json").write_text("{}")
    (out / "answers.json").write_text("{}")
    commands, log, _ = _dry(tmp_path, "reference patched")
    assert list(_smokes(commands)) == ["patched"]
    assert "smoke m0/reference: done already" in log
    assert not any(argv[:2] == ["rm", "-rf"] for argv in commands)  # a done cold run keeps the warm caches


def test_without_dry_run_an_unclean_tree_is_refused_before_any_step(tmp_path: Path) -> None:
    (tmp_path / "m.json").write_text(json.dumps({"format": "vllm-hotfix-source/1", "commit": "c" * 40,
                                                 "tree": "0" * 40, "sender_clean": True,
                                                 "files": [["README.md", "100644", "0" * 40]], "ignore": []}))
    env = {**os.environ, "STEPS": "engine", "GPU_HOST_WORK": str(tmp_path / "work"),
           "SOURCE_MANIFEST": str(tmp_path / "m.json"), "PYTHON": sys.executable}
    # Through the entry the records name: it hands its arguments and environment to campaign.py (with the
    # interpreter PYTHON names, here the tests' own: `python3` on PATH may be a version manager's shim).
    r = subprocess.run(["bash", str(SERVE), str(tmp_path), str(tmp_path / "out")], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 1
    assert "error: source check against" in r.stdout and "not the clean commit it names" in r.stdout
    assert "differ ['README.md']" in r.stdout
    assert not (tmp_path / "work" / "signing-key.pem").exists() and not (tmp_path / "work" / "payload").exists()
    # An OUTDIR inside the checkout would be files beside the commit's: refused.
    rc, console = _campaign(tmp_path, REPO / "build" / "gpu-out-test", env)
    assert rc == 1 and "lies inside the checkout" in console
    assert not (REPO / "build" / "gpu-out-test").exists()  # refused before it was made: nothing left behind


def _make_smokes(commands: list[list[str]]) -> list[list[str]]:
    return [argv for argv in commands if "smoke" in argv and any(a.endswith("make") for a in argv[:3])]


def test_the_mutants_are_built_from_roots_of_their_own_and_judged_by_them(tmp_path: Path) -> None:
    """Every broken backport is built by the Dockerfile builder from its own project root and smoked, as the
    patched image is, by that root's patch set, against the same reference answers; the record names each. The
    ones named in RECORD_MUTANTS are built a second time by the assemble builder: recording images (badrecord)."""
    names = sorted(p.stem for p in (SCRIPTS / "mutants").glob("*.patch"))
    assert len(names) >= 6
    twice = ["decode-side-unfixed", "decode-write-unfixed"]
    commands, log, out = _dry(tmp_path, "mutants patched3 badrecord mutantsmoke record")
    roots = tmp_path / "work" / "mutant-roots"
    builds = []
    for argv in commands:  # (a command whose output goes to the log is printed there twice)
        if "build.py" in argv and "image" in argv and argv not in builds:
            builds.append(argv)
    expected = [(n, False) for n in names]
    for n in twice:
        expected.insert(expected.index((n, False)) + 1, (n, True))
    assert [(Path(argv[argv.index("--root") + 1]).name, "--builder" in argv) for argv in builds] == expected
    for argv in builds:
        name = Path(argv[argv.index("--root") + 1]).name
        assert argv[argv.index("--root") + 1] == str(roots / name)
        if "--builder" in argv:  # the second build: the assemble builder's, tagged apart
            assert argv[argv.index("--builder") + 1] == "assemble"
            assert argv[argv.index("--tag") + 1] == f"vllm-gpu-base:v0.25.1-mutant-{name}-assembled"
        else:  # the Dockerfile builder, as the patched image
            assert argv[argv.index("--tag") + 1] == f"vllm-gpu-base:v0.25.1-mutant-{name}"
    smokes = _smokes(commands)
    # The mutants every model is judged with first (a run cut short keeps them), then the first model's others.
    others = ["decode-side-unfixed", "prefill-write-unfixed", "read-unfixed"]
    assert list(smokes)[:5] == [*(f"badrecord-{n}" for n in twice), *(f"mutant-{n}" for n in others)]
    assert sorted(list(smokes)[2:]) == sorted(f"mutant-{n}" for n in names)
    answers = str(out / "m0" / "answers.json")
    for name in names:
        argv = smokes[f"mutant-{name}"]
        assert argv[argv.index("--root") + 1] == str(roots / name)
        assert argv[argv.index("--reference") + 1] == answers and "--definition" not in argv
        assert argv[5] == f"vllm-gpu-base:v0.25.1-mutant-{name}"
    for name in twice:  # recorded from the second build, by its own root, into a file of its own
        argv = smokes[f"badrecord-{name}"]
        assert argv[5] == f"vllm-gpu-base:v0.25.1-mutant-{name}-assembled"
        assert argv[argv.index("--root") + 1] == str(roots / name) and "--reference" not in argv
        assert argv[argv.index("--record-reference") + 1] == str(out / "m0" / f"badrecord-{name}.answers.json")
    # The first model's third start is `make smoke` with the definition's [smoke] table.
    [made] = _make_smokes(commands)
    assert made[made.index("smoke") + 1].startswith("PYTHON=")
    assert "IMAGE=vllm-gpu-base:v0.25.1-m3patch" in made and f"REFERENCE={answers}" in made
    [args] = [a for a in made if a.startswith("ARGS=")]
    assert args.split()[:3] == ["ARGS=--keep-going", "--base-repo", "vllm-gpu-base"]
    assert f"--report {out / 'm0' / 'patched-third.json'}" in args
    assert not any(a.startswith("--serve-arg") or a == "--gpu" for a in made)  # the table's, not flags
    [record] = [argv for argv in commands if "record" in argv]
    # (DRY_RUN writes no reports, so the record is named with none of them here.)
    assert "--mutant" not in record and "--patched-third" not in record and "--bad-recording" not in record


def test_three_models_share_the_images_and_each_gets_its_own_reference_smokes_and_record(tmp_path: Path) -> None:
    """The campaign: the images (base, patched, reference, every mutant and variant, two mutants' second builds)
    built once; per model its reference (all recorded first, side by side, cold), the right patch three times, the
    base, every variant and its broken backports, each under OUTDIR/NAME/, and a record per model naming how its
    model was made."""
    models = "a:0:2 b:1:3 c:2:4"
    commands, log, out = _dry(tmp_path, "image refimage mutants variants model reference unpatched1 patched makesmoke "
                              "badrecord golden unpatched patched2 variantsmoke mutantsmoke record", MODELS=models)
    mutants = sorted(p.stem for p in (SCRIPTS / "mutants").glob("*.patch"))
    variants = sorted(p.stem for p in (SCRIPTS / "variants").glob("*.patch"))
    others = ["decode-side-unfixed", "prefill-write-unfixed", "read-unfixed"]
    assert len(variants) >= 3 and set(others) <= set(mutants)
    builds: list[list[str]] = []
    for argv in commands:  # (a command whose output goes to the log is printed there twice)
        if "build.py" in argv and "image" in argv and argv not in builds:
            builds.append(argv)
    tags = [argv[argv.index("--tag") + 1] for argv in builds]
    assert len(tags) == len(set(tags)) == 2 + len(mutants) + 2 + len(variants)  # each image once, for every model
    roots = tmp_path / "work" / "variant-roots"
    for name in variants:
        [argv] = [a for a in builds if a[a.index("--tag") + 1] == f"vllm-gpu-base:v0.25.1-variant-{name}"]
        assert argv[argv.index("--root") + 1] == str(roots / name) and "--builder" not in argv
    # One build loop serves both kinds: each name says what is built from which root, then that it is done.
    for kind, names in (("mutant", mutants), ("variant", variants)):
        said = re.findall(rf"^\[[0-9:]+\] ({kind} \S+(?:: build\.py --root \S+| done))", log, re.MULTILINE)
        assert said == [line for n in names for line in
                        (f"{kind} {n}: build.py --root {tmp_path / 'work' / f'{kind}-roots' / n}", f"{kind} {n} done")]
    made: list[list[str]] = []
    for argv in commands:
        if "gpu-runs/tiny_minimax_m3.py" in argv and argv not in made:
            made.append(argv)
    assert [(a[a.index("--seed") + 1], a[a.index("--layers") + 1]) for a in made] == [("0", "2"), ("1", "3"),
                                                                                        ("2", "4")]
    smokes: dict[str, dict[str, list[str]]] = {}
    for argv in commands:
        if "smoke" in argv and "build.py" in argv:
            report = Path(argv[argv.index("--report") + 1])
            smokes.setdefault(report.parent.name, {})[report.stem] = argv
    assert list(smokes) == ["a", "b", "c"]
    for name, mine in smokes.items():
        first = name == "a"
        expected = {"reference", "patched", "unpatched", "patched-again", *(f"variant-{v}" for v in variants),
                    *(f"mutant-{m}" for m in (mutants if first else others))}
        # The first model's third start is `make smoke` (no build.py line of its own), its base also runs beside
        # the recordings, and its broken backports' second builds are recorded from.
        expected |= ({"unpatched-first", "badrecord-decode-side-unfixed", "badrecord-decode-write-unfixed"} if first
                     else {"patched-third"})
        assert set(mine) == expected
        answers = str(out / name / "answers.json")
        assert mine["reference"][mine["reference"].index("--record-reference") + 1] == answers
        for which, argv in mine.items():
            assert argv[argv.index("--serve-model") + 1] == str(tmp_path / "work" / "models" / name)
            if which not in ("reference", "unpatched-first") and not which.startswith("badrecord-"):
                assert argv[argv.index("--reference") + 1] == answers
        for v in variants:
            argv = mine[f"variant-{v}"]
            assert argv[argv.index("--root") + 1] == str(roots / v) and argv[5].endswith(f"-variant-{v}")
    [made_smoke] = _make_smokes(commands)
    assert f"MODEL={tmp_path / 'work' / 'models' / 'a'}" in made_smoke
    # The compile caches go once, before the recordings (all cold, side by side).
    order = [line for line in log.splitlines() if "rm -rf" in line or "/reference: exit code" in line]
    assert "rm -rf" in order[0] and sum("rm -rf" in line for line in order) == 1
    said = [line.split("smoke ")[1].split(":")[0] for line in log.splitlines() if ": exit code" in line]
    # The recordings (and the first model's base, warming its compile cache), then alone the first model's patched
    # image (the warm verdict), then first in the queue its make smoke, then side by side what each model's record
    # needs first (a run cut short by its budget loses the extras, not a model): every base and patched image, then
    # the bad recordings, the other starts, the variants, the mutants every model is judged with, the first model's
    # others.
    assert said[:6] == ["a/reference", "b/reference", "c/reference", "a/unpatched-first", "a/patched",
                        "a/patched-third"]
    assert said[6:13] == ["a/unpatched", "b/unpatched", "b/patched", "c/unpatched", "c/patched",
                          "a/badrecord-decode-side-unfixed", "a/badrecord-decode-write-unfixed"]
    assert said[13:18] == ["a/patched-again", "b/patched-again", "b/patched-third", "c/patched-again",
                           "c/patched-third"]
    assert said[18:18 + 3 * len(variants)] == [f"{m}/variant-{v}" for m in "abc" for v in variants]
    common = 18 + 3 * len(variants)
    assert said[common:common + 9] == [f"{m}/mutant-{n}" for m in "abc" for n in others]
    assert sorted(said[common + 9:]) == sorted(f"a/mutant-{n}" for n in mutants if n not in others)
    records = [argv for argv in commands if "record" in argv and "gpu_host.py" in " ".join(argv)]
    assert [Path(argv[argv.index("record") + 1]).parent.name for argv in records] == ["a", "b", "c"]
    assert records[2][records[2].index("--model-made") + 1] == "gpu-runs/tiny_minimax_m3.py --seed 2 --layers 4"
    # The golden forward of each model against that model's own reference answers.
    golden: list[list[str]] = []
    for argv in commands:
        if "gpu-runs/golden_run.py" in argv and argv not in golden:
            golden.append(argv)
    assert [(a[a.index("gpu-runs/golden_run.py") + 1], a[a.index("--reference") + 1], a[a.index("--out") + 1])
            for a in golden] == [(str(tmp_path / "work" / "models" / n), str(out / n / "answers.json"),
                                  str(out / n / "golden.json")) for n in "abc"]
    # Only the first model's record holds warm times: the others' smokes ran side by side.
    assert ["--side-by-side" in argv for argv in records] == [False, True, True]


def test_a_models_entry_that_is_not_name_seed_layers_is_refused(tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    rc, console = _campaign(parts, tmp_path / "out", _env(tmp_path, "model", MODELS="a:0:2 b/../x:1:2"))
    assert rc == 1 and "MODELS entry 'b/../x:1:2'" in console


def _report(image: str, image_id: str, status: str, seconds: float, phases: dict[str, float]) -> dict[str, Any]:
    return {"image": image, "image_id": image_id, "status": status, "gpu_verified": status == "pass",
            "started": f"2026-12-03T10:00:{int(seconds) % 60:02d}Z", "seconds": seconds, "phases": phases,
            "gpu": {"way": "cdi:nvidia.com/gpu=all", "devices": ["NVIDIA H200"], "verified": status == "pass"},
            "environment": {"compile_cache": {"base_id": "b" * 64, "gpu": "nvidia-h200", "host": "/x",
                                              "container": "/root/.cache"}},
            "checks": [{"name": "serve-sweep", "status": status, "detail": "d", "seconds": 1.0}],
            "sweep": {"levels": [], "reference": {"file": "answers.json", "sha256": "ab" * 32}}}


def _clean_checkout(folder: Path) -> tuple[Path, Path]:
    """A git checkout with one file, and the manifest of its clean HEAD (as the sending side makes it)."""
    folder.mkdir()
    subprocess.run(["git", "-C", str(folder), "init", "-q"], check=True)
    (folder / "README.md").write_text("x\n")
    subprocess.run(["git", "-C", str(folder), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(folder), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c"],
                   check=True)
    manifest = folder.parent / "source.json"
    r = _main("source_manifest", "make", str(manifest), "--root", str(folder))
    assert r.returncode == 0, r.stderr
    return folder, manifest


def test_record_from_fake_reports_keeps_phases_and_verifies_attestations(tmp_path: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    pub = tmp_path / "signing-key.pub.pem"
    pub.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                   serialization.PublicFormat.SubjectPublicKeyInfo))
    patched_id, base_id, ref_id = "sha256:" + "a" * 64, "sha256:" + "b" * 64, "sha256:" + "c" * 64
    reports = {
        "reference": _report("r", ref_id, "pass", 301.5, {"files": 20.0, "server_start": 188.0}),
        "patched": _report("p", patched_id, "pass", 87.25, {"files": 2.0, "server_start": 36.0, "sweep": 10.0}),
        "patched-again": _report("p", patched_id, "pass", 85.5, {"files": 2.0, "server_start": 35.0}),
        "unpatched-first": _report("b", base_id, "fail", 160.0, {"files": 1.0, "gpu_checks": 30.0}),
        "unpatched": _report("b", base_id, "fail", 150.0, {"files": 1.0, "gpu_checks": 30.0}),
    }
    args = []
    for which, report in reports.items():
        (tmp_path / f"{which}.json").write_text(json.dumps(report))
        envelope = signing.sign(signing.statement({report["image"]: report["image_id"]}, report), key)
        (tmp_path / f"{which}.dsse.json").write_bytes(envelope)
        args += ["--attestation", f"{which.replace('-', '_')}={tmp_path / f'{which}.dsse.json'}"]
    checkout, manifest = _clean_checkout(tmp_path / "checkout")
    call = tmp_path / "source-1.json"
    assert _main("source_manifest", "check", str(manifest), "--root", str(checkout), "--write",
                 str(call)).returncode == 0

    def record(*extra: str) -> subprocess.CompletedProcess[str]:
        return _main("gpu_host", "record", str(tmp_path / "record.json"), "--no-engine",
                     "--reference-run", str(tmp_path / "reference.json"),
                     "--patched", str(tmp_path / "patched.json"),
                     "--patched-again", str(tmp_path / "patched-again.json"),
                     "--unpatched", str(tmp_path / "unpatched.json"),
                     "--unpatched-first", str(tmp_path / "unpatched-first.json"), "--public-key", str(pub),
                     "--source-manifest", str(manifest), "--source-root", str(checkout),
                     "--source-call", str(call), *extra)

    # A correct variant's report (it passed, as the patched image did) and the golden run's output for the model.
    (tmp_path / "variant-copy.json").write_text(json.dumps(reports["patched"] | {"image": "v", "image_id": "sha256:"
                                                                                 + "7" * 64}))
    golden_run = {"noise": {"median_nats": 0.2}, "scoring": {"confident": 812, "agreeing": 812}}
    (tmp_path / "golden.json").write_text(json.dumps(golden_run))
    args += ["--variant", f"read-copies-transposed-view={tmp_path / 'variant-copy.json'}",
             "--golden-run", str(tmp_path / "golden.json"), "--model-made", "tiny_minimax_m3.py --seed 1 --layers 3"]
    r = record(*args)
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "record.json").read_text())
    assert rec["golden"] == golden_run and rec["inputs"]["golden_run"]["path"] == str(tmp_path / "golden.json")
    assert rec["model"]["made_with"] == "tiny_minimax_m3.py --seed 1 --layers 3"
    assert rec["variants"]["read-copies-transposed-view"]["Variant"] == "read-copies-transposed-view"
    assert "read-copies-transposed-view" in rec["findings"]["every_variant_passes"]["variants"]
    head = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD", "HEAD^{tree}"], capture_output=True,
                          text=True, check=True).stdout.split()
    assert rec["source"]["commit"] == head[0] and rec["source"]["tree"] == head[1] and rec["source"]["clean"] is True
    assert rec["source"]["calls"] == {"source-1.json": head[1]}
    assert rec["launcher"] == {"name": "docker", "version": None}
    assert rec["images"]["patched"]["phases"] == {"files": 2.0, "server_start": 36.0, "sweep": 10.0}
    assert rec["result"]["patched"][0].startswith(
        "pass (GPU-verified); smoke 87.2 s (at or under the 90 s target); phases: files 2.0 s, "
        "server_start 36.0 s, sweep 10.0 s; compile cache bbbbbbbbbbbb/nvidia-h200")
    assert "smoke 150.0 s (over the 90 s target)" in rec["result"]["unpatched"][0]
    assert rec["findings"]["reference_from_another_image"]["met"] is True
    assert rec["findings"]["warm_smoke_seconds"]["met"] is False and rec["findings"]["done"] is False
    signed = rec["images"]["unpatched"]["attestation"]
    assert signed["file"] == "unpatched.dsse.json" and signed["verified"] is True
    assert signed["key_id"] == signing.key_id(key.public_key()) and signed["status"] == "fail"
    assert set(rec["inputs"]["reports"]) == {"reference", "patched", "patched_again", "unpatched_first", "unpatched",
                                             "variant_read-copies-transposed-view"}
    # The base's first run is recorded with its time, and only the warm runs are held to the target.
    assert "smoke 160.0 s" in rec["result"]["unpatched_first"][0]
    # Warm: the smokes that ran alone; the second start may have shared the GPU (PARALLEL), so it is only shown.
    assert set(rec["findings"]["warm_smoke_seconds"]["seconds"]) == {"patched", "unpatched"}
    assert set(rec["findings"]["warm_smoke_seconds"]["side_by_side_seconds"]) == {"patched_again",
                                                                                   "variant_read-copies-transposed-view"}
    assert rec["images"]["unpatched_first"]["attestation"]["status"] == "fail"
    assert rec["gpu_devices"] == ["NVIDIA H200"]
    # A campaign's first model: its patched smoke and make smoke alone are the warm verdicts, the make smoke held to
    # the long command's verdict, a broken backport's recording refused by the golden, the host's clock read.
    (tmp_path / "record.json").unlink()
    bad = _report("m", "sha256:" + "9" * 64, "fail", 240.0, {"files": 3.0})
    bad["checks"].append({"name": "golden", "status": "fail", "detail": "a served token is not the golden's"})
    (tmp_path / "badrecord-decode-side-unfixed.json").write_text(json.dumps(bad))
    (tmp_path / "uptime").write_text("1432.50 20000.00\n")
    (tmp_path / "calls.log").write_text("[05:01:02] host up 95.10 s: part part-00 SHA256SUMS\n")
    r = record(*args, "--patched-third", str(tmp_path / "patched-again.json"),
               "--attestation", f"patched_third={tmp_path / 'patched-again.dsse.json'}", "--warm", "patched",
               "--warm", "patched-third", "--make-smoke", "patched_third", "--bad-recording",
               f"decode-side-unfixed={tmp_path / 'badrecord-decode-side-unfixed.json'}", "--host-uptime",
               str(tmp_path / "uptime"), "--calls", str(tmp_path / "calls.log"), "--target-seconds", "60")
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "record.json").read_text())
    found = rec["findings"]
    assert found["warm_verdict_alone"]["seconds"] == {"patched": 87.25, "patched_third": 85.5}
    assert found["warm_verdict_alone"]["met"] is False  # over the 60 s target
    assert found["make_smoke_same_verdict"]["met"] is True
    assert found["golden_refuses_bad_recordings"] == {
        "recordings": {"decode-side-unfixed": {"status": "fail", "golden": "fail",
                                               "golden_detail": "a served token is not the golden's",
                                               "answers_written": False, "met": True}}, "met": True}
    assert found["gpu_host_seconds"]["seconds"] == 1432.5 and found["gpu_host_seconds"]["met"] is True
    assert rec["calls"] == ["[05:01:02] host up 95.10 s: part part-00 SHA256SUMS"]
    # The recording image is no judged image: it is held to being refused, not to passing or failing a level.
    assert "badrecord_decode-side-unfixed" not in found.get("every_mutant_fails", {}).get("mutants", {})
    # A podman run's record names podman as what started the smokes.
    (tmp_path / "record.json").unlink()
    assert record(*args, "--launcher", "podman", "--launcher-version", "podman version 4.3.1").returncode == 0
    assert json.loads((tmp_path / "record.json").read_text())["launcher"] == {"name": "podman",
                                                                              "version": "podman version 4.3.1"}

    # An envelope of another run (here: the second start's, offered as the first's) is refused.
    (tmp_path / "record.json").unlink()
    swapped = [a.replace("patched=" + str(tmp_path / "patched.dsse.json"),
                         "patched=" + str(tmp_path / "patched-again.dsse.json")) for a in args]
    r = record(*swapped)
    assert r.returncode == 2 and "not the verdict of that run" in r.stderr
    assert not (tmp_path / "record.json").exists()
    # A checkout with a file beside the commit's, or a call that ran from another tree: no record.
    (checkout / "stray.py").write_text("")
    r = record(*args)
    assert r.returncode == 2 and "is not the clean commit" in r.stderr and "extra ['stray.py']" in r.stderr
    (checkout / "stray.py").unlink()
    other = json.loads(call.read_text())
    (tmp_path / "source-2.json").write_text(json.dumps({**other, "tree": "f" * 40}))
    r = record(*args, "--source-call", str(tmp_path / "source-2.json"))
    assert r.returncode == 2 and "calls source-2.json ran from another tree" in r.stderr
    # A first run of another image than the warm one is no first run of the base.
    (tmp_path / "unpatched-first.json").write_text(json.dumps({**reports["unpatched-first"], "image_id": ref_id}))
    r = record()
    assert r.returncode == 2 and "--unpatched-first" in r.stderr and "not the same image" in r.stderr
    (tmp_path / "unpatched-first.json").write_text(json.dumps(reports["unpatched-first"]))
    assert not (tmp_path / "record.json").exists()
    # An envelope signed with another key is refused too.
    other_key = ec.generate_private_key(ec.SECP256R1())
    report = reports["patched"]
    (tmp_path / "patched.dsse.json").write_bytes(signing.sign(signing.statement({"p": patched_id}, report),
                                                              other_key))
    r = record(*args)
    assert r.returncode == 2 and "signed with another key" in r.stderr


def _parts(folder: Path, record: str) -> None:
    """PARTS_DIR as bundle-serve.sh leaves it: a tar of vLLM's wheel (its RECORD as given) in two parts and their
    SHA256SUMS."""
    import hashlib
    import tarfile
    import zipfile

    wheel = io.BytesIO()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("vllm/__init__.py", "")
        z.writestr("vllm-0.25.1.dist-info/RECORD", record)
    packed = io.BytesIO()
    with tarfile.open(fileobj=packed, mode="w") as tar:
        info = tarfile.TarInfo("vllm-0.25.1-cp38-abi3-manylinux1_x86_64.whl")
        info.size = len(wheel.getvalue())
        tar.addfile(info, io.BytesIO(wheel.getvalue()))
    blob = packed.getvalue()
    folder.mkdir()
    sums = ""
    for i, chunk in enumerate((blob[: len(blob) // 2], blob[len(blob) // 2:])):
        (folder / f"part-0{i}").write_bytes(chunk)
        sums += f"{hashlib.sha256(chunk).hexdigest()}  part-0{i}\n"
    (folder / "SHA256SUMS").write_text(sums)


def test_unpack_refuses_damaged_parts_and_a_wheel_whose_record_lists_what_it_lacks(tmp_path: Path) -> None:
    """The integrity check would refuse GPU-verified for a file RECORD lists but the image lacks: the parts must
    drop its RECORD line, and a wheel that still lists one is refused before anything is unzipped."""
    parts = tmp_path / "parts"
    _parts(parts, "vllm/__init__.py,,\nvllm/_C.abi3.so,,\nvllm-0.25.1.dist-info/RECORD,,\n")
    rc, console = _campaign(parts, tmp_path / "out", _env(tmp_path, "unpack"))
    assert rc == 1 and "error: vLLM's wheel: see the line above" in console, console
    assert "RECORD lists vllm/_C.abi3.so, which the wheel lacks" in console
    assert not any((tmp_path / "work" / "src").iterdir())
    assert not (tmp_path / "work" / "payload" / ".complete").exists()  # the next run unpacks again
    # A part that is not the one SHA256SUMS names: nothing unpacked.
    (parts / "part-01").write_bytes(b"x")
    rc, console = _campaign(parts, tmp_path / "out", _env(tmp_path, "unpack"))
    assert rc == 1 and f"a part is missing or damaged (sha256sum -c in {parts})" in console
    assert "part-01: FAILED" in console


def test_tp_puts_every_server_on_that_many_gpus(tmp_path: Path) -> None:
    commands, _, _ = _dry(tmp_path, "reference patched unpatched", TP="2")
    smokes = _smokes(commands)
    assert list(smokes) == ["reference", "patched", "unpatched"]
    for argv in smokes.values():
        at = argv.index("--serve-arg=--tensor-parallel-size")
        assert argv[at + 1] == "--serve-arg=2"


def test_a_tp_that_is_no_number_of_gpus_is_refused(tmp_path: Path) -> None:
    parts = tmp_path / "parts"
    parts.mkdir()
    rc, console = _campaign(parts, tmp_path / "out", _env(tmp_path, "patched", TP="0"))
    assert rc == 1 and "TP=0: a whole number of GPUs" in console


def test_parallel_smokes_are_lowered_to_what_the_gpus_memory_lets_vllm_start(tmp_path: Path) -> None:
    """Each vLLM engine refuses to start below SERVE_MEM (0.05) of the GPU free, and a smoke starts two: on an
    80 GB GPU at most 4 smokes side by side, on a 141 GB one 7 (10 GiB held by each engine already running)."""
    fake = tmp_path / "bin"
    fake.mkdir()
    for total, asked, lowered in ((81559, "8", "lowered to 4: 79 GiB GPU"), (143771, "7", None)):
        (fake / "nvidia-smi").write_text(f"#!/bin/sh\necho {total}\n")
        (fake / "nvidia-smi").chmod(0o755)
        out = tmp_path / f"run-{total}"
        out.mkdir()
        _, log, _ = _dry(out, "patched2", PARALLEL=asked, PATH=f"{fake}:{os.environ['PATH']}")
        assert (f"PARALLEL={asked} {lowered}" in log) if lowered else "lowered" not in log, log


def test_the_queue_starts_a_smoke_as_soon_as_one_ends_never_more_than_parallel() -> None:
    """Not in batches that wait for their slowest: with two slots and the first job ended, the third starts while
    the second still runs. Each job waits on an event this test sets (a seam, no clock)."""
    import threading

    _module("campaign")  # puts gpu-runs/ on the path its modules import each other from
    queue = sys.modules["campaign_smoke"].Queue(2)
    release = {name: threading.Event() for name in "abc"}
    started = {name: threading.Event() for name in "abc"}
    running: list[str] = []
    most = [0]
    lock = threading.Lock()

    def job(name: str) -> None:
        with lock:
            running.append(name)
            most[0] = max(most[0], len(running))
        started[name].set()
        release[name].wait(60)
        with lock:
            running.remove(name)

    for name in "ab":
        queue.wait_for_a_slot()
        queue.start(lambda name=name: job(name))
    third = threading.Thread(target=lambda: (queue.wait_for_a_slot(), queue.start(lambda: job("c"))))
    third.start()
    assert started["a"].wait(60) and started["b"].wait(60)
    assert not started["c"].is_set()  # both slots taken: the third waits
    release["a"].set()
    assert started["c"].wait(60)  # a slot freed: the third starts while the second still runs
    assert "b" in running and "a" not in running
    release["b"].set()
    release["c"].set()
    third.join(60)
    queue.flush()
    assert most[0] == 2 and running == []


def test_the_gpu_only_step_smokes_the_patched_image_and_the_base_without_a_server(tmp_path: Path) -> None:
    commands, log, out = _dry(tmp_path, "gpuonly")
    smokes = _smokes(commands)
    assert list(smokes) == ["gpuonly-patched", "gpuonly-unpatched"]
    for argv in smokes.values():
        assert {"--gpu", "require", "--keep-going", "--base-repo"} <= set(argv)
        assert not any(a.startswith(("--serve", "--reference", "--record-reference")) for a in argv), argv
        assert argv[argv.index("--attestation") + 1].endswith(".dsse.json")
    assert smokes["gpuonly-patched"][5].endswith(":v0.25.1-m3patch")
    assert smokes["gpuonly-unpatched"][5].endswith(":v0.25.1")
    assert smokes["gpuonly-unpatched"][smokes["gpuonly-unpatched"].index("--definition") + 1] == "v0.25.1"
    assert "(no server)" in log


def test_a_campaign_call_keeps_its_parts_runs_detached_and_sends_back_what_came(tmp_path: Path) -> None:
    """gpu-runs/campaign-call.sh: a part is kept where the run reads parts; start copies the checkout and starts
    the campaign (campaign.py) in a session of its own; wait returns once it ended; every call notes the host's
    clock and packs the output folder into SEND_BACK."""
    import tarfile

    where = {"PARTS": tmp_path / "parts", "CHECKOUT": tmp_path / "checkout", "OUTDIR": tmp_path / "outdir"}
    back = tmp_path / "back"
    back.mkdir()
    env = {**os.environ, **{k: str(v) for k, v in where.items()}, "SEND_BACK": str(back), "DRY_RUN": "1",
           "STEPS": "model", "MODELS": "m0:0:2", "GPU_HOST_WORK": str(tmp_path / "work"),
           "SOURCE_MANIFEST": str(tmp_path / "none.json"),
           # The tests' interpreter by its path: `python3` on PATH may be a version manager's shell-script shim.
           "PYTHON": sys.executable}
    # A checkout of the campaign's own files, with a .git that `start` must leave behind (the copy stays small).
    home = tmp_path / "home"
    (home / "gpu-runs").mkdir(parents=True)
    for name in ["campaign-call.sh", "source_manifest.py", *(p.name for p in SCRIPTS.glob("campaign*.py"))]:
        shutil.copy2(SCRIPTS / name, home / "gpu-runs" / name)
    (home / ".git").mkdir()
    (home / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    call = home / "gpu-runs" / "campaign-call.sh"
    part = tmp_path / "part-00"
    part.write_bytes(b"x" * 10)
    (tmp_path / "SHA256SUMS").write_text("")

    def run(*args: str) -> str:
        r = subprocess.run(["bash", str(call), *args], capture_output=True, text=True, env=env, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout

    run("part", str(part), str(tmp_path / "SHA256SUMS"))
    assert (where["PARTS"] / "part-00").read_bytes() == b"x" * 10
    run("start")
    assert (where["CHECKOUT"] / "gpu-runs" / "campaign.py").is_file()
    assert not (where["CHECKOUT"] / ".git").exists()
    run("wait", "60")
    calls = (where["OUTDIR"] / "calls.log").read_text().splitlines()
    assert [line.split(": ", 1)[1].split(" ")[0] for line in calls] == ["part", "start:", "wait", "the"]
    assert all(re.match(r"^\[[0-9:]+\] host up [0-9.]+ s: ", line) for line in calls)
    run_log = (where["OUTDIR"] / "run.log").read_text()
    assert "steps: model" in run_log and run_log.rstrip().endswith("done")
    with tarfile.open(back / "campaign.tgz") as packed:
        names = set(packed.getnames())
    assert {"./run.log", "./calls.log", "./console.log"} <= names


def test_a_model_whose_recording_wrote_no_answers_is_passed_over_and_the_campaign_goes_on(tmp_path: Path) -> None:
    """The first model's recording is done (its report there) but wrote no answers: its smokes are not run, its
    patched image is still timed without answers to judge, and the next model's smokes run."""
    out = tmp_path / "out"
    for name in ("a", "b"):
        (out / name).mkdir(parents=True)
        (out / name / "reference.json").write_text("{}")
    (out / "b" / "answers.json").write_text("{}")
    commands, log, _ = _dry(tmp_path, "patched unpatched patched2 variantsmoke", MODELS="a:0:2 b:1:3",
                            VARIANTS="permute-write-side")
    assert f"no {out / 'a' / 'answers.json'}" in log and "a's base not run" in log, log
    smokes: dict[str, dict[str, list[str]]] = {}
    for argv in commands:
        if "smoke" in argv and "build.py" in argv:
            report = Path(argv[argv.index("--report") + 1])
            smokes.setdefault(report.parent.name, {})[report.stem] = argv
    assert list(smokes["a"]) == ["patched-unjudged"] and "--reference" not in smokes["a"]["patched-unjudged"]
    assert set(smokes["b"]) == {"patched", "unpatched", "patched-again", "variant-permute-write-side"}


def test_a_carried_site_key_signs_the_campaign_and_stays_its_owners_alone(tmp_path: Path) -> None:
    """SIGN_KEY_FROM: the campaign signs with the key the calls carried (the same site key across campaigns),
    written for its owner alone, and only the public half goes to OUTDIR; a key that cannot be read stops the
    campaign naming it."""
    key = ec.generate_private_key(ec.SECP256R1())
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    carried = tmp_path / "carried.pem"
    carried.write_bytes(pem)
    _, log, top = _dry(tmp_path, "refimage reference", SIGN_KEY_FROM=str(carried))
    made = tmp_path / "work" / "signing-key.pem"
    assert made.read_bytes() == pem and made.stat().st_mode & 0o777 == 0o600
    assert f"signing key from {carried}" in log and "signing key made" not in log
    public = serialization.load_pem_public_key((top / "signing-key.pub.pem").read_bytes())
    assert signing.key_id(public) == signing.key_id(key.public_key())
    other = tmp_path / "other.pem"
    other.write_bytes(ec.generate_private_key(ec.SECP256R1()).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    rc, console = _campaign(tmp_path / "parts", tmp_path / "out", _env(tmp_path, "refimage reference",
                                                                       SIGN_KEY_FROM=str(other)))
    assert rc != 0 and f"SIGN_KEY_FROM={other}: not the key this host signs with already" in console
    assert made.read_bytes() == pem  # the host's key stays as it was
    parts, out = tmp_path / "parts2", tmp_path / "out2"
    parts.mkdir()
    (parts / "SHA256SUMS").write_text("")
    rc, console = _campaign(parts, out, _env(tmp_path / "other", "refimage reference",
                                               SIGN_KEY_FROM=str(tmp_path / "absent.pem")))
    assert rc != 0 and f"SIGN_KEY_FROM={tmp_path / 'absent.pem'}" in console
    assert not (tmp_path / "other" / "work" / "signing-key.pem").exists()


def test_an_earlier_reference_comes_with_its_signature_and_its_recordings_verdict(tmp_path: Path) -> None:
    """REFERENCE_FROM's copy: the answers, and beside them the signature and the recording's signed verdict a
    smoke checks with the site key; a reference with neither beside it comes alone (the smoke then refuses it as
    unsigned)."""
    campaign = _module("campaign")
    earlier, here = tmp_path / "earlier", tmp_path / "here"
    earlier.mkdir()
    here.mkdir()
    for name, text in (("answers.json", "a"), ("answers.dsse.json", "s"), ("answers.verdict.dsse.json", "v")):
        (earlier / name).write_text(text)
    campaign.copy_reference(earlier / "answers.json", here / "answers.json")
    assert {p.name: p.read_text() for p in here.iterdir()} == {
        "answers.json": "a", "answers.dsse.json": "s", "answers.verdict.dsse.json": "v"}
    (earlier / "answers.dsse.json").unlink()
    (earlier / "answers.verdict.dsse.json").unlink()
    alone = tmp_path / "alone"
    alone.mkdir()
    campaign.copy_reference(earlier / "answers.json", alone / "answers.json")
    assert [p.name for p in alone.iterdir()] == ["answers.json"]


def test_an_earlier_reference_serves_only_over_the_base_it_was_recorded_on(tmp_path: Path) -> None:
    """REFERENCE_FROM on a host whose base is another image (a GPU host makes its base from its own filesystem):
    nothing is copied, run.log says why, and the model is one the recordings still make; over the same base the
    answers come with their signature."""
    from types import SimpleNamespace

    campaign = _module("campaign")
    earlier = tmp_path / "earlier"
    (earlier / "m0").mkdir(parents=True)
    model = {"sha256": "f" * 64}
    (earlier / "m0" / "inputs.json").write_text(json.dumps({"inputs": {"model": model}}))
    (earlier / "m0" / "answers.json").write_text(json.dumps({"settings": {"base_image_id": "sha256:" + "a" * 64}}))
    (earlier / "m0" / "answers.dsse.json").write_text("signed")
    lines: list[str] = []
    here = tmp_path / "here"
    here.mkdir()

    def host(base: str) -> tuple[Any, Any]:
        inputs = tmp_path / f"inputs-{base[-1]}.json"
        inputs.write_text(json.dumps({"inputs": {"model": model, "base": {"id": base}}}))
        settings = SimpleNamespace(env={"REFERENCE_FROM": str(earlier)}, dry_run=False, step=lambda n: True)
        c = SimpleNamespace(settings=settings, log=SimpleNamespace(line=lines.append, die=RuntimeError))
        return c, SimpleNamespace(name="m0", inputs=inputs, answers=here / "answers.json")

    c, m = host("sha256:" + "b" * 64)
    assert campaign.reference_from(c, m) is False
    assert not (here / "answers.json").exists()
    assert "recorded over base sha256:aaaa" in lines[-1] and "recorded again here" in lines[-1]
    c, m = host("sha256:" + "a" * 64)
    assert campaign.reference_from(c, m) is True
    assert sorted(p.name for p in here.iterdir()) == ["answers.dsse.json", "answers.json"]
