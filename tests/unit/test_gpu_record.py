"""gpu-runs/gpu_host.py and gpu_record.py: the record's sentences and findings come from the reports, reused
inputs must hash the same, gpu-runs/source_manifest.py proves which commit ran, and verify_elsewhere.py requires
the record's own GPU."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import json
import shutil
import subprocess
from dataclasses import asdict
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from conftest import REPO
from vllm_hotfix.inimage import sweep
from vllm_hotfix.judges import sweep as judged


@functools.cache
def _module(name: str) -> ModuleType:
    """A gpu-runs/ program as a module, loaded once: its main() runs in this process."""
    spec = importlib.util.spec_from_file_location(name, REPO / "gpu-runs" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_host() -> ModuleType:
    return _module("gpu_record")


def _level(c: int, evidence: list[sweep.RequestEvidence]) -> sweep.Level:
    level = sweep.Level(c, len(evidence), per_request=evidence, wall_s=1.0)
    judged.summarise(level)
    return level


def _exact(levels: tuple[int, ...] = (1, 2, 4, 8, 16), wrong_from: int | None = None,
           died_at: int | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
    """An exact-levels check and its evidence as the host writes them (fixed_batches.judge's shape)."""
    out, first = [], None
    for c in levels:
        answered = 0 if died_at is not None and c >= died_at else 8
        wrong = answered if wrong_from is not None and c >= wrong_from else 0
        if (wrong or not answered) and first is None:
            first = c
        out.append({"concurrency": c, "requests": 8, "answered": answered, "identical": answered - wrong,
                    "wrong": wrong, "seconds": 1.0, "first_wrong": "request 0 (prompt 0): x" if wrong else None,
                    "replies": []})
    evidence = {"levels": out, "first_failed_level": first, "ended": "" if died_at is None else "RuntimeError: x"}
    check = {"name": "exact-levels", "status": "fail" if first else "pass", "detail": "d", "seconds": 0.0}
    return check, evidence


def _report(levels: list[sweep.Level], failed: int | None, exact: tuple[dict[str, Any], dict[str, Any]] | None = None,
            topk: str = "pass") -> dict[str, Any]:
    result = sweep.SweepResult("http://x", "/model", levels, failed_level=failed,
                               reference={"file": "ref.json", "sha256": "ab" * 32, "prompts": 24,
                                          "tolerance_nats": 0.08, "noise_multiple": 4.0})
    check, evidence = exact or _exact()
    status = "fail" if failed or check["status"] == "fail" or topk == "fail" else "pass"
    return {"image": "img:x", "image_id": "sha256:1", "status": status, "gpu_verified": True, "seconds": 90.0,
            "checks": [{"name": "topk-layout", "status": topk, "detail": "t", "seconds": 1.0},
                       {"name": "serve-sweep", "status": "fail" if failed else "pass", "detail": "d",
                        "seconds": 40.0}, check],
            "sweep": {**json.loads(json.dumps(result.to_dict())), "exact": evidence}}


def ok(c: int, i: int, **kw: Any) -> sweep.RequestEvidence:
    base = dict(http_status=200, latency_s=0.1, prompt_tokens=20, reply_tokens=32, finish_reason="length",
                reply_sha256="0" * 64, judged_by="exact" if c == 1 else "noise", passed=True,
                basis="reference" if c == 1 else "concurrency-1", max_logprob_diff=0.0, deviation_nats=0.0)
    return sweep.RequestEvidence(c, i, i, **{**base, **kw})  # type: ignore[arg-type]


def test_sentences_are_derived_from_the_evidence() -> None:
    host = _gpu_host()
    patched = _report([_level(1, [ok(1, 0), ok(1, 1)]),
                       _level(16, [ok(16, 0), ok(16, 1, divergence=4, token_divergence=4, gap_nats=0.021,
                                                  deviation_nats=0.021)])], None)
    patched["sweep"]["levels"][1]["tolerance_nats"] = 0.08
    unpatched = _report([_level(1, [ok(1, 0), ok(1, 1, passed=False, divergence=0, reply_tokens=1,
                                                 finish_reason="stop", error="wrong answer", deviation_nats=None),
                                    sweep.RequestEvidence(1, 2, 2, 500, 0.2, error="HTTP 500")])], 1)
    lines = host.image_sentences(host.image(patched))
    assert lines[0].startswith("pass (GPU-verified); smoke 90.0 s; phases: not reported; serve sweep pass, "
                               "judged by the oracle against ref.json")
    assert "tolerance above concurrency 1 0.08 nats = 4.0 x the recorded noise" in lines[0]
    assert lines[1] == ("concurrency 1: 2/2 passed; HTTP status 200 2; replies of 32 tokens (finish_reason length 2); "
                        "judged by exact 2; 0 wrong answer(s), 2 bitwise equal, 0 within noise (bit for bit; widest "
                        "deviation 0 nats)")
    assert lines[2].endswith("0 wrong answer(s), 1 bitwise equal, 1 within noise (within 0.08 nats of the "
                             "concurrency-1 reply; widest deviation 0.021 nats)")
    lines = host.image_sentences(host.image(unpatched))
    assert "failed at concurrency 1" in lines[0]
    assert lines[1] == ("concurrency 1: 1/3 passed; HTTP status 200 2, 500 1; replies of 1-32 tokens "
                        "(finish_reason length 1, stop 1); judged by exact 2, status 1; "
                        "1 wrong answer(s) (first difference at position 0), 1 bitwise equal, 0 within noise "
                        "(bit for bit; widest deviation 0 nats)")
    # Evidence travels as rows under named columns, one per request, and reads back the same.
    level = host.image(unpatched)["serve"]["levels"][0]
    assert level["per_request"]["columns"][0] == "level" and len(level["per_request"]["rows"]) == 3
    failed = asdict(sweep.RequestEvidence(1, 2, 2, 500, 0.2, error="HTTP 500"))
    assert host.rows_to_evidence(level)["per_request"][2] == failed
    assert set(host.EVIDENCE_COLUMNS) == set(failed)  # every field of the evidence is a column


def test_findings_answer_the_runs_questions_from_the_evidence() -> None:
    host = _gpu_host()
    every = [_level(c, [ok(c, 0), ok(c, 1)]) for c in (1, 2, 4, 8, 16)]
    patched = host.image({**_report(every, None), "image_id": "sha256:p", "seconds": 61.0})
    wrong = [ok(1, i, passed=False, divergence=3, error="wrong answer") for i in range(8)]
    base_levels = [_level(1, [*wrong, ok(1, 8), ok(1, 9), ok(1, 10, passed=False, divergence=0),
                              sweep.RequestEvidence(1, 11, 11, 400, 0.1, error="HTTP 400 nan")])]
    unpatched = host.image({**_report(base_levels, 1, _exact(wrong_from=1, died_at=8), topk="fail"),
                            "image_id": "sha256:b", "status": "fail", "seconds": 70.5})
    reference_run = host.image({**_report(every, None), "image_id": "sha256:r", "seconds": 200.0})
    sens = {"prompts": 24, "distinct_replies": 24, "median_first_token_gap_nats": 1.4}
    found = host.findings({"reference": reference_run, "patched": patched, "patched_again": patched,
                           "unpatched": unpatched}, {"prompt_sensitivity": sens}, 90.0)
    assert found["patched_passes_every_level"]["met"] and found["patched_again_passes_every_level"]["met"]
    # 9 of the 11 answered replies judged wrong (the HTTP 400 is not an answer): 82%.
    assert found["unpatched_wrong_at_concurrency_1"] == {"requests": 12, "answered": 11, "judged_wrong": 9,
                                                         "share": 0.8182, "at_least": 0.8, "met": True}
    assert found["warm_smoke_seconds"]["met"] and found["model_reads_its_prompt"]["met"]
    assert found["reference_from_another_image"]["met"] and found["done"] is True
    # A slow warm run, a reference from the judged image, a flat model, or a level missing: not done.
    slow = host.findings({"patched": patched, "unpatched": {**unpatched, "seconds": 91.0}, "reference": patched},
                         {"prompt_sensitivity": {**sens, "median_first_token_gap_nats": 0.014}}, 90.0)
    assert not slow["warm_smoke_seconds"]["met"] and not slow["reference_from_another_image"]["met"]
    assert not slow["model_reads_its_prompt"]["met"] and slow["done"] is False
    short = host.image({**_report(every[:4], None), "image_id": "sha256:p"})
    ok_, words = host.passes_every_level(short)
    assert not ok_ and "levels not run: [16]" in words
    assert any(line.startswith("unpatched_wrong_at_concurrency_1: met") for line in host.finding_sentences(found))
    # The base was wrong by its answers at every level where it answered (1, 2, 4; its engine died at 8).
    assert found["unpatched_wrong_by_answers_at_every_answering_level"]["met"]
    assert found["unpatched_wrong_by_answers_at_every_answering_level"]["answering_levels"] == [1, 2, 4]


def test_findings_show_each_mutant_caught_and_the_right_patch_exact_in_three_starts() -> None:
    host = _gpu_host()
    every = [_level(c, [ok(c, 0), ok(c, 1)]) for c in (1, 2, 4, 8, 16)]
    patched = host.image({**_report(every, None), "image_id": "sha256:p", "seconds": 61.0})
    # A backport wrong only under load: the HTTP sweep passed it, the exact judge failed it at 8.
    late = host.image({**_report(every, None, _exact(wrong_from=8)), "image_id": "sha256:m1"})
    # One the GPU check and the sweep caught (at 2), the exact judge too (at 2).
    early = host.image({**_report(every[:2], 2, _exact(wrong_from=2), topk="fail"), "image_id": "sha256:m2"})
    # A right patch whose third start was not exact at 16: a false failure.
    drifted = host.image({**_report(every, None, _exact(wrong_from=16)), "image_id": "sha256:p"})
    images = {"patched": patched, "patched_again": patched, "patched_third": patched, "mutant_late": late,
              "mutant_early": early}
    found = host.findings(images, {}, 90.0)
    assert found["right_patch_no_false_failure_in_3_starts"] == {"starts": 3, "false_failures": 0, "met": True}
    mutants = found["every_mutant_fails"]["mutants"]
    assert mutants["late"]["first_failing_level"] == 8 and mutants["late"]["failed_there_by"] == ["exact-levels"]
    assert mutants["late"]["sweep_first_level"] is None and mutants["late"]["topk_layout"] == "pass"
    assert mutants["early"]["failed_there_by"] == ["exact-levels", "serve-sweep"]
    assert mutants["early"]["topk_layout"] == "fail" and found["every_mutant_fails"]["met"]
    found = host.findings({**images, "patched_third": drifted, "mutant_right": patched}, {}, 90.0)
    assert found["right_patch_no_false_failure_in_3_starts"]["false_failures"] == 1
    assert not found["patched_third_passes_every_level"]["met"]
    assert "levels not bitwise the reference's under fixed batches: [16]" in \
        found["patched_third_passes_every_level"]["detail"]
    # A "mutant" that passed (the right patch under a mutant's name) is not caught: the suite's finding fails.
    assert not found["every_mutant_fails"]["mutants"]["right"]["met"] and not found["every_mutant_fails"]["met"]



def test_each_correct_variant_must_pass_as_the_right_patch_does() -> None:
    host = _gpu_host()
    every = [_level(c, [ok(c, 0), ok(c, 1)]) for c in (1, 2, 4, 8, 16)]
    right = host.image({**_report(every, None), "image_id": "sha256:v1"})
    # A correct backport the gate fails (its topk-layout said fail) is a false failure, as costly as a false pass.
    false_fail = host.image({**_report(every, None, topk="fail"), "image_id": "sha256:v2", "status": "fail"})
    found = host.findings({"variant_copy": right, "variant_permute": right}, {}, 90.0)
    assert found["every_variant_passes"]["met"] and set(found["every_variant_passes"]["variants"]) == {"copy",
                                                                                                     "permute"}
    found = host.findings({"variant_copy": right, "variant_permute": false_fail}, {}, 90.0)
    assert not found["every_variant_passes"]["variants"]["permute"]["met"] and not found["every_variant_passes"]["met"]
    assert found["done"] is False
    # A variant is an image judged: a reference recorded from it is not from another image.
    found = host.findings({"variant_copy": right, "reference": right}, {}, 90.0)
    assert not found["reference_from_another_image"]["met"]


def test_the_golden_check_is_kept_with_its_numbers() -> None:
    host = _gpu_host()
    golden = {"name": "golden", "status": "pass", "detail": "agree at 812 of 812 confident positions",
              "data": {"judged": 1024, "confident": 812, "agreeing": 812, "first_disagreement": None}}
    img = host.image({"checks": [golden], "image_id": "sha256:g"})
    assert img["golden"] == {"status": "pass", "detail": golden["detail"], "data": golden["data"]}
    assert host.image({"checks": [], "image_id": "sha256:g"})["golden"] is None


def _git_repo(folder: Path) -> Path:
    folder.mkdir()
    subprocess.run(["git", "-C", str(folder), "init", "-q"], check=True)
    (folder / "run.sh").write_text("echo hi\n")
    (folder / "run.sh").chmod(0o755)
    (folder / "pkg").mkdir()
    (folder / "pkg" / "a.py").write_text("A = 1\n")
    (folder / "pkg" / "link").symlink_to("a.py")
    (folder / ".gitignore").write_text("/build/\n__pycache__/\n")
    subprocess.run(["git", "-C", str(folder), "add", "-A"], check=True)
    subprocess.run(["git", "-C", str(folder), "-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "c"],
                   check=True)
    return folder


def test_source_manifest_proves_the_commit_that_ran(tmp_path: Path) -> None:
    src = _module("source_manifest")
    repo = _git_repo(tmp_path / "repo")
    out = tmp_path / "m.json"
    manifest = src.make(repo, out)
    tree = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD^{tree}"], capture_output=True, text=True,
                          check=True).stdout.strip()
    # The copy where it ran has no .git: the tree is built from its files' hashes, and is the commit's.
    copy = tmp_path / "copy"
    shutil.copytree(repo, copy, symlinks=True, ignore=shutil.ignore_patterns(".git"))
    (copy / "build").mkdir()
    (copy / "build" / "journal.json").write_text("{}")  # ignored: the tool's own output
    got = src.check(manifest, copy)
    assert got["tree"] == tree == manifest["tree"] and got["clean"] and got["commit"] == manifest["commit"]
    (copy / "pkg" / "a.py").write_text("A = 2\n")
    (copy / "stray.py").write_text("")
    got = src.check(manifest, copy)
    assert not got["clean"] and got["differ"] == ["pkg/a.py"] and got["extra"] == ["stray.py"]
    assert got["tree"] != tree
    # The sending side refuses to make a manifest of a tree with changes.
    (repo / "pkg" / "a.py").write_text("A = 3\n")
    with pytest.raises(SystemExit) as refused:
        src.main(["make", str(tmp_path / "n.json"), "--root", str(repo)])
    assert refused.value.code not in (0, None) and "has uncommitted changes" in str(refused.value.code)
    assert not (tmp_path / "n.json").exists()


def test_inputs_are_refused_when_their_hash_changed(tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 64)
    kept = tmp_path / "inputs.json"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = _module("gpu_host").main(["inputs", "--model", str(model), *args])
        return subprocess.CompletedProcess(args, rc, out.getvalue(), err.getvalue())

    r = run("--write", str(kept))
    assert r.returncode == 0, r.stderr
    assert json.loads(kept.read_text())["inputs"]["model"]["files"] == 2
    assert run("--check", str(kept)).returncode == 0
    (model / "model.safetensors").write_bytes(b"\1" * 64)
    r = run("--check", str(kept))
    assert r.returncode == 2
    assert r.stderr.startswith(f"error: model {model}: sha256 ") and f"but {kept} was made with" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_verify_elsewhere_requires_the_gpu_the_record_names(tmp_path: Path) -> None:
    """verify_elsewhere.py requires the GPU model of the record's own devices (a record's folder is named for it)."""
    gpu_product = _module("verify_elsewhere").gpu_product
    folders = [p.parent for p in sorted((REPO / "gpu-runs").glob("h*-*/record.json"))]
    assert folders
    for folder in folders:
        product = gpu_product(folder)
        assert product.startswith("NVIDIA ") and folder.name.split("-")[0].upper() in product.split(), folder
    (tmp_path / "record.json").write_text(json.dumps({"gpu_devices": ["NVIDIA H100 80GB HBM3", "NVIDIA H200"]}))
    with pytest.raises(SystemExit, match="name no single GPU model"):
        gpu_product(tmp_path)


def test_a_tensor_parallel_runs_topk_layout_is_kept_per_gpu() -> None:
    record = _module("gpu_record")
    one = {"outcomes": {"tp1": "correct"}, "runs": {"tp1": {"outcome": "correct", "seconds": 3.0,
                                                           "result": {"write_views": "[T,H,K]"}}}}
    bad = {"outcomes": {"tp1": "wrong-rows"}, "runs": {"tp1": {"outcome": "wrong-rows"}}}
    check = {"name": "topk-layout", "status": "fail", "detail": "GPU 0: ok; GPU 1: wrong",
             "data": {"per_gpu": [{"gpu": 0, "status": "pass", "data": one},
                                  {"gpu": 1, "status": "fail", "data": bad}]}}
    got = record.image({"checks": [check]})["topk_layout"]
    assert [g["gpu"] for g in got["per_gpu"]] == [0, 1]
    assert got["per_gpu"][0]["runs"]["tp1"] == {"outcome": "correct", "seconds": 3.0, "write_views": "[T,H,K]"}
    assert got["per_gpu"][1]["status"] == "fail" and got["per_gpu"][1]["outcomes"] == {"tp1": "wrong-rows"}
    # One GPU's run stays as it was.
    assert record.image({"checks": [{**check, "data": one}]})["topk_layout"]["outcomes"] == {"tp1": "correct"}


def test_a_model_whose_smokes_all_ran_side_by_side_has_no_warm_time_judged() -> None:
    host = _gpu_host()
    every = [_level(c, [ok(c, 0), ok(c, 1)]) for c in (1, 2, 4, 8, 16)]
    slow = host.image({**_report(every, None), "image_id": "sha256:p", "seconds": 190.0})
    found = host.findings({"patched": slow}, {}, 90.0, alone=False)
    assert "warm_smoke_seconds" not in found and found["warm_times"]["judged"] is False
    assert found["warm_times"]["side_by_side_seconds"] == {"patched": 190.0}
    assert found["patched_passes_every_level"]["met"]
    assert any(line.startswith("warm_times: (") for line in host.finding_sentences(found))
    # Alone, the same time misses the target.
    assert not host.findings({"patched": slow}, {}, 90.0)["warm_smoke_seconds"]["met"]


def _img(status: str = "pass", seconds: float = 55.0, golden: dict[str, Any] | None = None,
         checks: tuple[tuple[str, str], ...] = (("layer-identity", "pass"), ("exact-levels", "pass")),
         signed: bool = True) -> dict[str, Any]:
    img: dict[str, Any] = {"status": status, "seconds": seconds, "gpu_verified": True,
                           "checks": [{"name": n, "status": s} for n, s in checks], "golden": golden}
    if signed:
        img["attestation"] = {"verified": True}
    return img


def _coverage(judged: int, long_judged: int = 30) -> dict[str, Any]:
    return {"levels": {str(c): {"judged": judged, "positions": 100} for c in (1, 2, 4, 8, 16)},
            "classes": {"short": {"judged": judged, "positions": 100}, "long": {"judged": long_judged,
                                                                                  "positions": 100}}}


def test_the_campaign_findings_hold_warm_verdicts_coverage_make_smoke_and_bad_recordings() -> None:
    rec = _gpu_host()
    good = {"status": "pass", "data": {"coverage": _coverage(40)}}
    images = {"patched": _img(golden=good), "patched_third": _img(seconds=58.0, golden=good),
              "badrecord_decode-side-unfixed": _img("fail", golden={"status": "fail", "detail": "refused"}),
              "badrecord_read-unfixed": _img("fail", golden={"status": "pass", "detail": "passed its own"})}
    found = rec.campaign(images, warm=["patched", "patched_third"], make_smoke="patched_third",
                         bad={"badrecord_decode-side-unfixed": False, "badrecord_read-unfixed": False},
                         host_seconds=1401.2, host_target=1500.0, target=60.0)
    assert found["warm_verdict_alone"]["met"] and found["warm_verdict_alone"]["seconds"] == {
        "patched": 55.0, "patched_third": 58.0}
    assert found["golden_coverage"]["met"]
    assert found["make_smoke_same_verdict"]["met"]
    # A recording the golden passed is a recording of a wrong image kept: not met.
    bad = found["golden_refuses_bad_recordings"]
    assert not bad["met"] and bad["recordings"]["decode-side-unfixed"]["met"]
    assert not bad["recordings"]["read-unfixed"]["met"]
    assert found["gpu_host_seconds"] == {**found["gpu_host_seconds"], "seconds": 1401.2, "met": True}


def test_the_campaign_findings_are_not_met_by_slow_thin_or_different_runs() -> None:
    rec = _gpu_host()
    thin = {"status": "pass", "data": {"coverage": _coverage(40, long_judged=5)}}
    images = {"patched": _img(seconds=61.0, golden=thin),
              "patched_third": _img(seconds=50.0, golden=thin, checks=(("layer-identity", "pass"),))}
    found = rec.campaign(images, warm=["patched", "patched_third"], make_smoke="patched_third",
                         bad={"badrecord_x": True}, host_seconds=1600.0, host_target=1500.0, target=60.0)
    assert not found["warm_verdict_alone"]["met"]  # 61 s over the 60 s target
    assert not found["golden_coverage"]["met"]
    assert "long prompts" in found["golden_coverage"]["starts"]["patched"]["shortfall"]
    assert not found["make_smoke_same_verdict"]["met"]  # one check fewer than the long command's
    # Named, but no report of it among the images: nothing shows it was refused.
    assert found["golden_refuses_bad_recordings"] == {"recordings": {}, "met": False}
    assert not found["gpu_host_seconds"]["met"]
    # A recording whose answers were written was not refused, whatever its golden says.
    wrote = rec.refused_recording(_img("fail", golden={"status": "fail"}), wrote=True)
    assert not wrote["met"]
