"""The #49149 check's verdict logic, without a GPU.

What runs on a GPU (the installed indexer and sparse attention on vLLM's
Triton kernels) is proven on a GPU host (gpu-runs/); here: a host without
torch gets `skip`, and neither a timeout nor an unrelated fault is a pass or a
caught bug.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from conftest import REPO, TOPK_CHECK, load_script


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_script(TOPK_CHECK)


def test_without_torch_the_check_skips() -> None:
    probe = "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('torch') is None else 3)"
    if subprocess.run([sys.executable, "-c", probe]).returncode == 3:
        pytest.skip("torch is installed in this Python")
    p = subprocess.run([sys.executable, str(TOPK_CHECK)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    [c] = json.loads(p.stdout.strip().splitlines()[-1])["checks"]
    assert c["name"] == "topk-layout" and c["status"] == "skip" and "torch" in c["detail"]


def _rec(**result: object) -> dict[str, object]:
    return {"returncode": 0, "result": dict(result)}


def _attention(**over: object) -> dict[str, object]:
    right = {"tokens": 100, "judged": 98, "tied": 2, "off": 0, "decode_off": 0, "prefill_off": 0,
             "max_rel_err": 0.004, "floor_max_rel_err": 0.004, "rel_tol": 0.02, "first_off": None}
    return {**right, **over}


def test_outcomes_come_from_the_numbers(check: ModuleType) -> None:
    assert check.outcome({"timeout": "no result within 5 s"}) == "timeout"
    assert check.outcome({"error": "ModuleNotFoundError: No module named 'pydantic'"}) == "env-error"
    assert check.outcome(_rec(attention=_attention())) == "correct"
    # The worker's own word is not taken: its numbers are judged again.
    assert check.outcome(_rec(ok=True, attention=_attention(off=3))) == "wrong-attention"
    assert check.outcome(_rec(ok=False, attention=_attention())) == "correct"
    ima = "indexer forward (top-k write): AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert check.outcome(_rec(ok=False, error=ima)) == "illegal-memory-access"
    assert check.outcome(_rec(ok=False, error="reference top-k and attention (torch): RuntimeError: x")) == "fault"
    # Tokens off while the kernels fed the right blocks were off too: the comparison, not the code, is in doubt.
    assert check.outcome(_rec(attention=_attention(off=5, floor_max_rel_err=0.5))) == "inconclusive"
    # Too many tokens left out as ties, or none judged: no verdict either way.
    assert check.outcome(_rec(attention=_attention(judged=50, tied=50))) == "inconclusive"
    assert check.outcome(_rec(attention=_attention(tokens=0, judged=0, floor_max_rel_err=None))) == "inconclusive"


def test_a_wrong_scenario_is_summarized_by_its_first_token_off(check: ModuleType) -> None:
    rec = _rec(attention=_attention(off=7, prefill_off=7, max_rel_err=0.9,
                                    first_off={"token": 12, "side": "prefill", "rel_err": 0.9}))
    text = check.summarize(rec)
    assert "attention tokens off 7/98 judged" in text and "first prefill token 12 off by 0.9" in text
    assert "kernels fed the right blocks: 0.004" in text


@pytest.mark.parametrize(("kinds", "status", "lead"), [
    ({"tp1": "correct", "tp4": "correct"}, "pass", "the blocks a right top-k selects"),
    ({"tp1": "illegal-memory-access", "tp4": "timeout"}, "fail", "attends to the wrong blocks (tp1)"),
    ({"tp1": "wrong-attention"}, "fail", "attends to the wrong blocks"),
    ({"tp1": "correct", "tp4": "inconclusive"}, "fail", "inconclusive"),
    ({"tp1": "correct", "tp4": "timeout"}, "fail", "inconclusive"),
    ({"tp1": "timeout"}, "fail", "inconclusive"),
    ({"tp1": "fault"}, "fail", "inconclusive"),
    ({}, "fail", "inconclusive"),
])
def test_verdict(check: ModuleType, kinds: dict[str, str], status: str, lead: str) -> None:
    got_status, got_lead = check.verdict(kinds)
    assert got_status == status and lead in got_lead


def test_a_worker_that_times_out_is_inconclusive(check: ModuleType, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker (the check's own file, run with --worker) waits on an event nobody sets: it never
    # answers, so the timeout is what ends it, however fast or slow the machine starts a process.
    silent = tmp_path / "silent_worker.py"
    silent.write_text("import threading\nthreading.Event().wait()\n")
    monkeypatch.setattr(check, "__file__", str(silent))
    args = argparse.Namespace(device="cuda", seed=0, vllm_src=None, timeout=0.2, shapes="model")
    rec = check.run_worker(args, "tp1")
    assert check.outcome(rec) == "timeout"
    assert check.verdict({"tp1": check.outcome(rec)})[0] == "fail"
    assert "inconclusive" in check.summarize(rec)


# -- the path vLLM picks on the GPU in use (SM100: MSA, not the Triton path this check drives) --

@pytest.mark.parametrize(("capability", "topk", "path"), [
    ((9, 0), 16, "triton"),    # H100/H200
    ((8, 0), 16, "triton"),    # A100
    ((10, 0), 16, "msa"),      # B200/GB200
    ((10, 3), 16, "msa"),      # B300: the same family
    ((12, 0), 16, "triton"),   # consumer Blackwell is another family
    ((10, 0), 64, "triton"),   # a top-k count the MSA kernels do not take
    (None, 16, "triton"),
])
def test_path_for_a_faked_capability(check: ModuleType, capability: tuple[int, int] | None, topk: int,
                                     path: str) -> None:
    assert check.path_for(capability, topk) == {"indexer": path, "attention": path}


def test_not_cuda_is_never_msa(check: ModuleType) -> None:
    assert check.path_for((10, 0), 16, cuda=False) == {"indexer": "triton", "attention": "triton"}


def _selectors(capability: tuple[int, int], fail_msa_import: bool = False) -> tuple[ModuleType, ModuleType]:
    """Stand-ins for vLLM's two modules whose selectors follow vLLM's rule on a faked capability."""
    sm100 = capability[0] == 10

    class MiniMaxM3IndexerTritonImpl: ...
    class MiniMaxM3IndexerMSAImpl: ...
    class MiniMaxM3SparseTritonImpl: ...
    class MiniMaxM3SparseMSAImpl: ...

    def select_indexer_impl_cls(*, topk_blocks: int, indexer_kv_dtype: str = "bf16") -> type:
        if sm100 and topk_blocks in (4, 8, 16, 32):
            if fail_msa_import:
                raise ImportError("No module named 'fmha_sm100'")
            return MiniMaxM3IndexerMSAImpl
        return MiniMaxM3IndexerTritonImpl

    def select_main_impl_cls(*, topk_blocks: int, kv_cache_dtype: str) -> type:
        return MiniMaxM3SparseMSAImpl if sm100 and topk_blocks in (4, 8, 16, 32) else MiniMaxM3SparseTritonImpl

    ix, sa = ModuleType("ix"), ModuleType("sa")
    ix.select_indexer_impl_cls = select_indexer_impl_cls  # type: ignore[attr-defined]
    sa.select_main_impl_cls = select_main_impl_cls  # type: ignore[attr-defined]
    return ix, sa


def test_on_sm90_the_installed_selectors_pick_triton_and_the_check_applies(check: ModuleType) -> None:
    ix, sa = _selectors((9, 0))
    path = check.vllm_path(ix, sa, 16, (9, 0))
    assert path["indexer_impl"] == "MiniMaxM3IndexerTritonImpl" and path["attention"] == "triton"
    assert check.not_applicable(path) is None


def test_on_sm100_the_installed_selectors_pick_msa_and_the_check_does_not_apply(check: ModuleType) -> None:
    ix, sa = _selectors((10, 0))
    path = check.vllm_path(ix, sa, 16, (10, 0))
    assert (path["indexer"], path["attention"]) == ("msa", "msa")
    why = check.not_applicable(path)
    assert why is not None and why.startswith("not applicable on this GPU family")
    assert "MiniMaxM3IndexerMSAImpl" in why and "10.0" in why


def test_a_selector_that_raises_leaves_the_part_to_vllms_rule(check: ModuleType) -> None:
    ix, sa = _selectors((10, 0), fail_msa_import=True)
    path = check.vllm_path(ix, sa, 16, (10, 0))
    assert path["indexer"] == "msa" and "raised ImportError" in path["indexer_impl"]
    assert check.not_applicable(path) is not None


def test_the_check_reports_not_applicable_as_one_skip(check: ModuleType,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    ix, sa = _selectors((10, 0))
    path = check.vllm_path(ix, sa, 16, (10, 0))
    asked: list[str] = []

    def worker(_args: argparse.Namespace, scenario: str) -> dict[str, object]:
        asked.append(scenario)
        return {"returncode": 0, "scenario": scenario, "path": path, "not_applicable": check.not_applicable(path)}

    torch, triton = ModuleType("torch"), ModuleType("triton")
    torch.__version__ = "fake"  # type: ignore[attr-defined]
    torch.cuda = type("cuda", (), {"is_available": staticmethod(lambda: True)})  # type: ignore[attr-defined]
    triton.__version__ = "fake"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch", torch)
    monkeypatch.setitem(sys.modules, "triton", triton)
    monkeypatch.setattr(check, "run_worker", worker)
    assert check.main([]) == 0
    [c] = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["checks"]
    assert sorted(asked) == ["tp1", "tp1-nd3", "tp4"]  # side by side: every scenario asked at once
    assert c["status"] == "skip" and c["ran_against"] == "not-applicable"
    assert c["detail"].startswith("not applicable on this GPU family")
    assert c["data"]["path"]["capability"] == "10.0"


def test_both_v0251_patch_sets_run_the_one_check() -> None:
    # One file, not two copies that drift: the SM100 set's check is a link to the default set's.
    sm100 = REPO / "patches" / "v0.25.1-sm100" / "checks" / "gpu_topk_layout.py"
    assert sm100.is_symlink() and sm100.resolve() == TOPK_CHECK.resolve()


def _table() -> ModuleType:
    return load_script(REPO / "gpu-runs" / "topk_table.py")


def test_the_table_counts_a_fail_as_a_catch_only_when_some_scenario_caught_a_bug() -> None:
    table = _table()
    line = json.dumps({"checks": [{"name": "topk-layout", "status": "fail", "detail": "x",
                                   "data": {"outcomes": {"tp1": "wrong-attention", "tp4": "timeout"}}}]})
    got = table.judged("noise before\n" + line + "\n")
    assert got["status"] == "fail" and table.as_expected("fail", got) and not table.as_expected("pass", got)
    inconclusive = {"status": "fail", "outcomes": {"tp1": "timeout", "tp4": "fault"}}
    assert not table.as_expected("fail", inconclusive)  # a mutant that only timed out was not caught
    assert table.judged("Traceback ...")["status"] == "no answer"
    assert table.as_expected("pass", {"status": "pass", "outcomes": {"tp1": "correct"}})
