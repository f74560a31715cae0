"""The broken backports of gpu-runs/mutants/: each builds as the patched image does, from a project root of its
own, on a real engine and a stand-in base with vLLM 0.25.1's real sources, and is judged by its own patch set.

What only a GPU can show (each one failing the topk-layout check, the exact judge or the sweep, and at which
level) is in the GPU record; here: every mutant applies with the tool's patch step, lands other bytes than the
real patch and than every other mutant, and a smoke by its own root passes the file checks that a smoke by the
project's root fails, so on a GPU host only the GPU checks, the exact judge and the sweep can catch it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from conftest import REPO, cli
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
    names = mutants.names()
    assert len(names) >= 6
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
        assert len(set(made.values())) == len(made), made  # every mutant lands bytes of its own
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
