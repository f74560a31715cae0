"""The broken backports of gpu-runs/mutants/ and the correct ones of gpu-runs/variants/: each builds as the
patched image does, from a project root of its own, on a real engine and a stand-in base with vLLM 0.25.1's real
sources, and is judged by its own patch set.

What only a GPU can show (each one failing the topk-layout check, the exact judge or the sweep, and at which
level) is in the GPU record; here: every mutant applies with the tool's patch step, lands other bytes than the
real patch and than every other mutant or variant, and a smoke by its own root passes the file checks that a smoke
by the project's root fails, so on a GPU host only the GPU checks, the exact judge and the sweep can catch it.
"""

from __future__ import annotations

import importlib.util
import shutil
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from conftest import REPO, cli
from vllm_hotfix.building import wheels
from vllm_hotfix.engine import Engine


def _mutants() -> ModuleType:
    spec = importlib.util.spec_from_file_location("mutants", REPO / "gpu-runs" / "mutants.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_mutant_builds_from_its_root_and_is_judged_by_it(engine: Engine, base_v0251: str, project: Path,
                                                                tmp_path: Path, unique: str) -> None:
    mutants = _mutants()
    names = mutants.names() + mutants.variant_names()
    assert len(mutants.names()) >= 6 and len(mutants.variant_names()) >= 3
    made: dict[str, str] = {}
    try:
        r = cli("image", "--definition", "v0.25.1", "--tag", f"hotfix-test/mutant-{unique}:real", "--pull", "never",
                "--no-smoke", root=project)
        assert r.rc == 0, r.err
        made["real"] = r.out.split()[-1]
        for name in names:
            root = mutants.root(name, tmp_path / name, source=project)
            # Never a definition of the project: only its own root offers it.
            assert not (project / "patches" / "v0.25.1" / f"{name}.patch").exists()
            r = cli("image", "--definition", "v0.25.1", "--tag", f"hotfix-test/mutant-{unique}:{name}", "--pull",
                    "never",
                    "--no-smoke", root=root)
            assert r.rc == 0, (name, r.err)
            made[name] = r.out.split()[-1]
        assert len(set(made.values())) == len(made), made  # every mutant and variant lands bytes of its own
        name = "decode-side-unfixed"
        mine = cli("smoke", f"hotfix-test/mutant-{unique}:{name}", "--gpu", "off", root=tmp_path / name)
        assert mine.rc == 0, mine.err
        assert "pass patch-landed" in mine.err
        # By the project's patch set it is not that patch set's product: refused before any check runs (exit 14),
        # the first differing file named.
        theirs = cli("smoke", f"hotfix-test/mutant-{unique}:{name}", "--gpu", "off", root=project)
        assert theirs.rc == 14 and "fail layer-identity" in theirs.err, theirs.err
        assert "minimax_m3/common/" in theirs.last_error and "the builder writes" in theirs.last_error
    finally:
        for key in made:
            engine.remove_image(f"hotfix-test/mutant-{unique}:{key}")


def test_check_applies_every_mutant_and_variant_to_the_real_sources(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """``mutants.py check`` on vLLM 0.25.1's sources from the PyPI wheel: each applies with the tool's patch step
    at zero fuzz and lands files of its own; a variant equal to the real patch is refused."""
    whl = wheels.release(REPO, "0.25.1", lambda _l: None)
    with zipfile.ZipFile(whl) as zf:
        zf.extractall(tmp_path / "src", [n for n in zf.namelist() if n.startswith("vllm/models/minimax_m3/")])
    mutants = _mutants()
    assert mutants.check(tmp_path / "src") == 0
    # A variant that is the real patch under another name is refused (in a copy of the variants' folder).
    variants = tmp_path / "variants"
    shutil.copytree(mutants.VARIANTS, variants)
    real = (REPO / "patches" / "v0.25.1" / "0001-minimax-m3-topk-buffer-layout.patch").read_text()
    (variants / "zz-twin.patch").write_text("Variant: twin\nDiffers: no\nWhy-correct: the real patch\nExpected: no\n\n"
                                            + real[real.index("--- a/"):])
    mutants.VARIANTS = variants
    capsys.readouterr()
    assert mutants.check(tmp_path / "src") == 1
    assert "zz-twin: leaves the files as the real patch does" in capsys.readouterr().err
