"""gpu-runs/batch_numerics.py: request 0's rows compared module by module, the first differing one named."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("batch_numerics", ROOT / "gpu-runs" / "batch_numerics.py")
assert spec and spec.loader
batch_numerics = importlib.util.module_from_spec(spec)
spec.loader.exec_module(batch_numerics)


def captures(*outputs):
    return [(name, name.title(), t) for name, t in outputs]


def test_the_first_module_whose_rows_of_request_0_differ_is_named_and_rows_of_others_are_ignored():
    one = captures(("embed", torch.arange(6.0).reshape(3, 2)), ("moe", torch.ones(3, 2)), ("router", torch.zeros(8)))
    moved = torch.ones(6, 2)
    moved[1, 1] += 1e-3  # request 0's second row
    moved[4, 0] += 5.0  # request 1: not request 0's, not compared
    four = captures(("embed", torch.cat([torch.arange(6.0).reshape(3, 2), torch.full((3, 2), 9.0)])),
                    ("moe", moved), ("router", torch.zeros(8)))
    got = batch_numerics.first_divergence(one, four, slice(0, 3), slice(0, 3), 3, 6)
    assert got["first"]["module"] == "moe" and got["first"]["class"] == "Moe"
    assert got["first"]["rows_differing"] == 1 and got["first"]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert (got["compared"], got["not_row_aligned"], got["differ"]) == (2, 1, 1)


def test_equal_rows_name_no_module_and_nan_equals_nan():
    a = torch.tensor([[float("nan"), 1.0]])
    got = batch_numerics.first_divergence(captures(("x", a)), captures(("x", torch.cat([a, a]))),
                                          slice(0, 1), slice(0, 1), 1, 2)
    assert got["first"] is None and got["compared"] == 1


def test_modules_that_ran_in_another_order_are_not_compared():
    got = batch_numerics.first_divergence(captures(("a", torch.ones(1)), ("b", torch.ones(1))),
                                          captures(("b", torch.ones(2)), ("a", torch.ones(2))),
                                          slice(0, 1), slice(0, 1), 1, 2)
    assert "another order" in got["error"] and got["compared"] == 0


def test_the_host_script_dry_runs_one_container_per_model(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(ROOT / "gpu-runs" / "gpu-host-numerics.sh"), str(out), "/m/one", "/m/two"],
                         env={"DRY_RUN": "1", "GPU_HOST_WORK": str(tmp_path / "work"), "PATH": "/usr/bin:/bin",
                              "PYTHON": sys.executable}, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stdout + run.stderr
    log = (out / "run.log").read_text()
    assert "source check would refuse" in log
    assert log.count("+ docker run") == 2 and "numerics-one.json" in log and "numerics-two.json" in log
