"""The image measures, the host judges, read from the imports.

What runs in the image (``vllm_hotfix/inimage/``) shares with the host only
data formats, constants and the sweep's sender; every judge of what the
image sent back lives on the host. So: a host module imports from
``inimage/`` only the shared modules named here, none of them defines a
judging function, and nothing in ``inimage/`` imports the host's judges,
trust or launchers (the runner folder never carries them).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import REPO

PACKAGE = REPO / "vllm_hotfix"
INIMAGE = PACKAGE / "inimage"

# What a host module may import from inimage/: the runner's wire format (its marks, mount and start flags), the
# probes' output format, the reference file format and reply types, the oracle's measures, the sweep's sender
# and its recording (serve-check asks a running server with them from the host).
SHARED = {
    "vllm_hotfix.inimage.runner",
    "vllm_hotfix.inimage.runner.probe_output",
    "vllm_hotfix.inimage.reference",
    "vllm_hotfix.inimage.oracle",
    "vllm_hotfix.inimage.sweep",
    "vllm_hotfix.inimage.recording",
}
# The judges that lived in inimage/ and moved to the host, by where they live now.
MOVED = {
    "vllm_hotfix.judges.sweep": ("judge", "judge_reply", "summarise", "percentile", "format_level",
                                 "failure_message", "as_check"),
    "vllm_hotfix.judges.oracle": ("Verdict", "exact", "moved"),
    "vllm_hotfix.trust.reference_fit": ("keep", "refuse_judged_image", "refuse_other_settings",
                                        "settings_difference"),
}
JUDGING = {name for names in MOVED.values() for name in names}
HOST_ONLY = ("vllm_hotfix.judges", "vllm_hotfix.trust", "vllm_hotfix.checking")


def _module(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> Iterator[tuple[str, tuple[str, ...], int]]:
    """Every import in ``path`` (at any depth: a function's own imports too), as (absolute module, names, line)."""
    here = _module(path)
    package = here if path.name == "__init__.py" else here.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, (), node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(node.level - 1):
                base = base.rpartition(".")[0]
            module = ".".join(p for p in (base if node.level else "", node.module or "") if p)
            yield module, tuple(a.name for a in node.names), node.lineno


def _host_files() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if INIMAGE not in p.parents)


def test_host_modules_import_only_the_shared_formats_of_inimage() -> None:
    wrong = []
    # A host file that imports from the folder names it in every form of import (absolute, relative, the package
    # and a name of it): the others are not parsed (all of them took half a second of a worker).
    for path in (p for p in _host_files() if "inimage" in p.read_text(encoding="utf-8")):
        for module, names, line in _imports(path):
            if module == "vllm_hotfix.inimage":
                # ``from ..inimage import reference``: each name is a module of the folder.
                targets = [f"{module}.{n}" for n in names]
            elif module.startswith("vllm_hotfix.inimage."):
                targets = [module]
                judging = sorted(set(names) & JUDGING)
                if judging:
                    wrong.append(f"{path.relative_to(REPO)}:{line} imports {', '.join(judging)} from {module}")
            else:
                continue
            wrong += [f"{path.relative_to(REPO)}:{line} imports {t}, not a shared module of inimage/"
                      for t in targets if t not in SHARED]
    assert not wrong, "\n".join(wrong)


def test_nothing_in_inimage_defines_a_judge() -> None:
    found = []
    for path in sorted(INIMAGE.rglob("*.py")):
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            names = ([node.name] if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else
                     [t.id for t in node.targets if isinstance(t, ast.Name)] if isinstance(node, ast.Assign) else [])
            found += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names if n in JUDGING]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("module", sorted(MOVED))
def test_the_moved_judges_live_on_the_host(module: str) -> None:
    loaded = importlib.import_module(module)
    assert all(callable(getattr(loaded, name, None)) for name in MOVED[module])


def test_nothing_in_inimage_imports_the_hosts_judges_trust_or_launchers() -> None:
    wrong = [f"{path.relative_to(REPO)}:{line} imports {module}"
             for path in sorted(INIMAGE.rglob("*.py")) for module, names, line in _imports(path)
             if any(module == h or module.startswith(h + ".") for h in HOST_ONLY)
             or module == "vllm_hotfix" and any(f"vllm_hotfix.{n}" in HOST_ONLY for n in names)]
    assert not wrong, "\n".join(wrong)


def test_the_rule_reads_relative_imports_at_any_depth() -> None:
    """The reader the rules stand on: a function's own relative import is found and resolved."""
    path = PACKAGE / "checking" / "launchers" / "plan.py"
    found = {module for module, _, _ in _imports(path)}
    assert "vllm_hotfix.judges" in found and "vllm_hotfix.inimage.reference" in found


def test_the_runner_folder_carries_no_judge_of_the_host() -> None:
    """What the launchers copy into the image: inimage/ and the shared types beneath every folder, never a module
    of judges/, trust/ or checking/; and every module an inimage/ file imports from the package is carried."""
    from vllm_hotfix.checking.launchers.base import PACKAGE_FILES

    carried = {_module(PACKAGE / rel) for rel in PACKAGE_FILES}
    assert not [m for m in carried if any(m == h or m.startswith(h + ".") for h in HOST_ONLY)]
    needed = {module for rel in PACKAGE_FILES for module, _, _ in _imports(PACKAGE / rel)
              if module.startswith("vllm_hotfix") and module != "vllm_hotfix"}
    # ``from . import serve`` names the package; the modules it reaches through it are carried by name.
    missing = sorted(m for m in needed if m not in carried and not (PACKAGE / m.replace(".", "/")[12:]).is_dir())
    assert not missing, missing
