"""GPU checks fail closed: what counts towards GPU-verified, without an engine.

Only a check that ran against the image's own code counts; a stand-in, a check
that does not say, or a patched module the image cannot import keeps the image
from being GPU-verified, and under ``--gpu require`` fails the run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import REPO, TOPK_CHECK, load_script
from vllm_hotfix.building.patches import modules_of
from vllm_hotfix.errors import Malformed, SmokeError
from vllm_hotfix.verdicts import Check, Status, judge, judge_gpu, require_pass

TORCH = Check("gpu-torch", Status.PASS, "1 device(s)", ran_against="torch")
REAL = Check("topk-layout", Status.PASS, "read back what they wrote", ran_against="vllm")
STUBBED = Check("topk-layout", Status.PASS, "read back what they wrote", ran_against="stub",
                stubs=("vllm.models.minimax_m3: package shell, __init__ not run",),
                import_errors={"vllm.models.minimax_m3": "ImportError: vllm.vllm_flash_attn requires ..."})
IMPORTS_BAD = Check("model-imports", Status.FAIL, "1 of 2 module(s) do not import", ran_against="vllm",
                    import_errors={"vllm.models.minimax_m3.common.indexer": "ModuleNotFoundError: No module 'torch'"})


@pytest.mark.parametrize("require", [True, False])
def test_real_checks_that_pass_verify(require: bool) -> None:
    got = judge_gpu([TORCH, REAL], require=require)
    assert got.verified and got.why_unverified == "" and got.not_real == ()
    assert [c.status for c in got.checks] == [Status.PASS, Status.PASS]


def test_a_stub_under_require_fails_and_is_named() -> None:
    got = judge_gpu([TORCH, Check("topk-layout", Status.PASS, "ok", ran_against="stub",
                                  stubs=("vllm._C_stable_libtorch: empty module",))], require=True)
    assert not got.verified
    topk = got.checks[1]
    assert topk.status is Status.FAIL and "ran against a stub" in topk.detail
    assert "vllm._C_stable_libtorch" in topk.detail and "the check said pass" in topk.detail
    assert got.not_real == ("topk-layout: vllm._C_stable_libtorch: empty module",)


def test_a_stub_under_auto_is_a_skip_not_evidence() -> None:
    got = judge_gpu([TORCH, Check("topk-layout", Status.PASS, "ok", ran_against="stub")], require=False)
    assert not got.verified
    assert got.checks[1].status is Status.SKIP and "GPU-unverified" in got.checks[1].detail


def test_stubs_listed_with_ran_against_vllm_still_count_as_a_stub() -> None:
    c = Check("x", Status.PASS, ran_against="vllm", stubs=("something",))
    assert not c.real
    assert not judge_gpu([c], require=False).verified


@pytest.mark.parametrize("require", [True, False])
def test_a_check_that_does_not_say_what_it_ran_against_does_not_count(require: bool) -> None:
    got = judge_gpu([TORCH, Check("extra:mine", Status.PASS, "fine")], require=require)
    assert not got.verified
    assert got.checks[1].status is (Status.FAIL if require else Status.SKIP)
    assert "ran_against" in got.checks[1].detail


@pytest.mark.parametrize("require", [True, False])
def test_a_module_the_image_broke_fails_whatever_the_mode(require: bool) -> None:
    got = judge_gpu([TORCH, IMPORTS_BAD], require=require, base_import_errors={})
    assert not got.verified and got.checks[1].status is Status.FAIL
    assert "vllm.models.minimax_m3.common.indexer does not import in the image" in got.checks[1].detail
    assert "its base imports it" in got.checks[1].detail


def test_a_module_the_base_cannot_import_either_is_named_as_the_bases() -> None:
    base = {"vllm.models.minimax_m3.common.indexer": "ModuleNotFoundError: No module named 'torch'"}
    got = judge_gpu([TORCH, IMPORTS_BAD], require=True, base_import_errors=base)
    assert not got.verified and got.checks[1].status is Status.FAIL
    assert "in the base too: the base's deviation" in got.checks[1].detail
    assert any("the base's deviation" in n for n in got.not_real)


def test_without_the_base_every_import_failure_is_the_images() -> None:
    got = judge_gpu([STUBBED], require=False, base_import_errors=None)
    assert got.checks[0].status is Status.FAIL and "the base was not probed" in got.checks[0].detail


def test_a_skip_under_require_fails_and_failures_stay() -> None:
    got = judge_gpu([Check("gpu-triton", Status.SKIP, "triton not importable"),
                     Check("gpu-kernel", Status.FAIL, "bad", ran_against="torch")], require=True)
    assert [c.status for c in got.checks] == [Status.FAIL, Status.FAIL]
    assert "did not run" in got.checks[0].detail and got.checks[1].detail == "bad"
    assert judge_gpu([], require=True).verified is False


def test_the_failure_line_names_what_kept_it_from_gpu_verified() -> None:
    got = judge_gpu([TORCH, STUBBED], require=True, base_import_errors={})
    verdict = judge("img", "sha256:x", list(got.checks), gpu_verified=got.verified,
                    gpu={"mode": "require", "not_real": list(got.not_real)})
    with pytest.raises(SmokeError, match=r"topk-layout; not GPU-verified: vllm.models.minimax_m3 does not import"):
        require_pass(verdict, "img", fail_hint="F", incomplete_hint="I")


def test_provenance_fields_round_trip_and_old_entries_read() -> None:
    assert Check.from_dict(STUBBED.to_dict()) == STUBBED
    old = {"name": "topk-layout", "status": "pass", "detail": "", "seconds": 1.0}
    c = Check.from_dict(old)
    assert c.to_dict() == old and not c.real
    for bad in ({"ran_against": 3}, {"stubs": "x"}, {"stubs": [1]}, {"import_errors": {"m": 2}}):
        with pytest.raises(Malformed):
            Check.from_dict({**old, **bad})


def test_modules_of_the_patched_files() -> None:
    files = ["vllm/models/minimax_m3/common/indexer.py", "vllm/models/minimax_m3/__init__.py",
             "vllm/third_party/data.json", "vllm/bad-name/x.py"]
    assert modules_of(files) == ["vllm.models.minimax_m3", "vllm.models.minimax_m3.common.indexer"]


GPU_CHECK = REPO / "vllm_hotfix" / "inimage" / "probes" / "gpu_check.py"


def test_gpu_check_imports_each_module_and_names_those_that_fail() -> None:
    p = subprocess.run([sys.executable, str(GPU_CHECK), "--imports-only", "--modules", "json", "no_such_mod_x",
                        "xml.etree"], capture_output=True, text=True, timeout=60)
    [c] = json.loads(p.stdout.strip().splitlines()[-1])["checks"]
    assert p.returncode == 1 and c["name"] == "model-imports" and c["status"] == "fail"
    assert c["ran_against"] == "vllm" and list(c["import_errors"]) == ["no_such_mod_x"]
    assert "ModuleNotFoundError" in c["import_errors"]["no_such_mod_x"]


def test_gpu_check_names_modules_a_dying_importer_never_reached(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dies_on_import.py").write_text("import os\nos._exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    mod = load_script(GPU_CHECK)
    errors = mod.import_errors(["json", "dies_on_import", "xml"], 30)
    assert list(errors) == ["dies_on_import", "xml"]
    assert errors["xml"].startswith("the importing process exited 3")
    assert mod.import_errors([], 1) == {}


@pytest.fixture(scope="module")
def topk() -> ModuleType:
    return load_script(TOPK_CHECK)


def test_topk_check_reports_vllm_only_when_nothing_stood_in(topk: ModuleType) -> None:
    clean = {"import": {"stubs": [], "import_errors": {}, "indexer_file": "i.py"}, "result": {"ok": True}}
    assert topk.provenance({"tp1": clean, "tp4": clean}) == {"ran_against": "vllm"}
    shell = {"import": {"stubs": ["vllm.models.minimax_m3: package shell"], "indexer_file": "i.py",
                        "import_errors": {"vllm.models.minimax_m3": "ImportError: x"}}, "result": {"ok": True}}
    got = topk.provenance({"tp1": clean, "tp4": shell})
    assert got["ran_against"] == "stub" and got["import_errors"] == {"vllm.models.minimax_m3": "ImportError: x"}
    config = {"import": {"stubs": [], "import_errors": {}, "indexer_file": "i.py"},
              "result": {"ok": True, "stubs": ["vllm.config.VllmConfig: CompilationConfig alone (x)"]}}
    assert topk.provenance({"tp1": config})["ran_against"] == "stub"
    # A scenario with no record of its imports is never taken for the real code.
    got = topk.provenance({"tp1": clean, "tp4": {"timeout": "no result within 5 s"}})
    assert got["ran_against"] == "stub" and "tp4: did not get to load" in got["stubs"][0]
    # Nor one that failed while importing, with nothing recorded yet.
    broke = {"import": {"stubs": [], "import_errors": {}}, "error": "AttributeError: x"}
    assert topk.provenance({"tp1": broke})["ran_against"] == "stub"
    assert topk.provenance({})["ran_against"] == "stub"


def test_topk_worker_keeps_what_it_stubbed_when_the_import_fails(topk: ModuleType) -> None:
    # This Python has no vLLM: the worker's record still says which import failed.
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') is None else 3)"
    if subprocess.run([sys.executable, "-c", probe]).returncode == 3:
        pytest.skip("vllm is installed in this Python")
    p = subprocess.run([sys.executable, str(TOPK_CHECK), "--worker", "--scenario", "tp1", "--device", "cpu"],
                       capture_output=True, text=True, timeout=60)
    rec = json.loads(p.stdout.strip().splitlines()[-1])
    assert "error" in rec and "vllm._C_stable_libtorch" in rec["import"]["import_errors"]
    assert topk.provenance({"tp1": rec})["ran_against"] == "stub"


def test_the_host_judges_a_runners_gpu_checks_again_with_the_base() -> None:
    """The runner judged without the base; the host, which can ask the base, names the base's import as the base's."""
    from vllm_hotfix.verdicts import rejudge_gpu

    said = [TORCH, IMPORTS_BAD]
    inside = judge_gpu(said, require=False, base_import_errors=None)
    files = Check("patch-landed", Status.PASS, "2 patched file(s) match")
    runner = judge("img", "sha256:" + "a" * 64, [files, *inside.checks], gpu_verified=inside.verified,
                   gpu={"mode": "auto", "way": "cdi:nvidia.com/gpu=all", "verified": inside.verified,
                        "why_unverified": inside.why_unverified})
    assert "the base was not probed" in runner.checks[2].detail
    base = dict(IMPORTS_BAD.import_errors)
    again = rejudge_gpu(runner, said, require=False, base_import_errors=base)
    assert [c.name for c in again.checks] == ["patch-landed", "gpu-torch", "model-imports"]
    assert "in the base too: the base's deviation" in again.checks[2].detail
    assert again.checks[2].status is Status.FAIL  # the check itself said fail: it stays a failure
    assert again.gpu_verified is False and "model-imports fail" in again.gpu["why_unverified"]
    # Compiled files the image lacks keep it unverified whatever the GPU checks say.
    passing = judge("img", "sha256:" + "a" * 64, [files, TORCH], gpu_verified=True,
                    gpu={"mode": "auto", "way": "gpus", "verified": True, "compiled_missing": ["vllm/_C.abi3.so"]})
    assert rejudge_gpu(passing, [TORCH], require=False, base_import_errors=None).gpu_verified is False


def test_a_check_run_on_several_gpus_claims_only_what_every_run_claims() -> None:
    probe = load_script(GPU_CHECK)
    real = {"name": "topk-layout", "status": "pass", "detail": "ok", "ran_against": "vllm"}
    [both] = probe.merge_devices([[real], [dict(real, detail="ok too")]])
    assert both["ran_against"] == "vllm" and both["status"] == "pass"
    assert both["detail"] == "GPU 0: ok; GPU 1: ok too"
    # One GPU's run that does not say what it ran against leaves the merged check without the claim.
    [mixed] = probe.merge_devices([[real], [{k: v for k, v in real.items() if k != "ran_against"}]])
    assert "ran_against" not in mixed and mixed["status"] == "pass"
    assert judge_gpu([TORCH, Check.from_dict(mixed)], require=True).verified is False
    # A stand-in on one GPU stands against all; a check one GPU never reported fails.
    stubbed = dict(real, ran_against="stub", stubs=["vllm._C: empty module"])
    [stub] = probe.merge_devices([[real], [stubbed]])
    assert stub["ran_against"] == "stub" and stub["stubs"] == ["vllm._C: empty module"]
    [gone] = probe.merge_devices([[real], []])
    assert gone["status"] == "fail" and "GPU 1: not reported on this GPU" in gone["detail"]
