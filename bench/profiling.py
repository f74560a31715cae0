"""Where the tool's time goes: one ``image --rebuild`` under cProfile, by step.

Steps are read from the profile as the cumulative time of the functions that
implement them; a step whose function no longer exists reads 0. Interpreter
start is what the profile cannot see: timed separately as ``python -c pass``.
"""

from __future__ import annotations

import pstats
from pathlib import Path
from typing import Any

import common
from common import MACHINE_PYTHON, REPO, median, sh

# step -> (file suffix, function name), summed
STEPS: list[tuple[str, list[tuple[str, str]]]] = [
    ("imports (all, incl. lazy)", [("<frozen importlib._bootstrap>", "_find_and_load")]),
    ("plan: definition + patch parse", [("vllm_hotfix/building/pipeline.py", "plan")]),
    ("engine connect + ping", [("vllm_hotfix/engine/facade.py", "connect")]),
    ("resolve base (inspect)", [("vllm_hotfix/engine/facade.py", "resolve")]),
    ("probe container create/start/remove", [("vllm_hotfix/engine/containers.py", "box")]),
    ("probe execs (locate, compile)", [("vllm_hotfix/engine/containers.py", "exec")]),
    ("probe file reads (get_archive)", [("vllm_hotfix/engine/files.py", "read")]),
    ("probe file write (put_archive)", [("vllm_hotfix/engine/containers.py", "write")]),
    ("facts cache (read, check)", [("vllm_hotfix/building/sources.py", "_cached")]),
    ("GNU patch (dry run + apply)", [("vllm_hotfix/building/base.py", "apply_in_scratch")]),
    ("render Dockerfile + context",
     [("vllm_hotfix/building/render.py", "render"), ("vllm_hotfix/building/render.py", "context")]),
    ("engine build (dockerfile builder)", [("vllm_hotfix/engine/facade.py", "build")]),
    ("assemble: layer + config + archive", [("vllm_hotfix/tarball.py", "write"),
                                            ("vllm_hotfix/building/assemble.py", "image_config")]),
    ("engine history (base)", [("vllm_hotfix/engine/facade.py", "history")]),
    ("engine load", [("vllm_hotfix/engine/facade.py", "load")]),
    ("tag + record", [("vllm_hotfix/engine/facade.py", "tag"), ("vllm_hotfix/journal/records.py", "new")]),
]


def _ct(stats: dict[Any, Any], suffix: str, name: str) -> tuple[float, int]:
    total, calls = 0.0, 0
    for (filename, _line, func), (_cc, nc, _tt, ct, _callers) in stats.items():
        if func == name and (filename.endswith(suffix) or filename == suffix):
            total += ct
            calls += nc
    return total, calls


def process_start(repeat: int = 5) -> dict[str, float]:
    python = common.PYTHON
    bare = [sh([python, "-c", "pass"]).seconds for _ in range(repeat)]
    # Without site initialization (-S): how much of the start the .pth files
    # of this Python's site-packages take.
    nosite = [sh([python, "-S", "-c", "pass"]).seconds for _ in range(repeat)]
    machine = [sh([MACHINE_PYTHON, "-c", "pass"]).seconds for _ in range(repeat)]
    cli = [sh([python, "-c", "import vllm_hotfix.cli"], env={"PYTHONPATH": str(REPO)}).seconds
           for _ in range(repeat)]
    return {"python_bare_s": median(bare), "python_nosite_s": median(nosite), "python_import_cli_s": median(cli),
            "machine_python_bare_s": median(machine)}


def profile(root: Path, base_tag: str, ref: str, out: Path, cache: Path) -> dict[str, Any]:
    """Profile one real assembled build (facts cache ``cache``); return the per-step summary."""
    prof = out / "image-rebuild.prof"
    # cli.run under the profiler, as build.py calls it. The profile is the main thread's: a load opened
    # ahead (engine/pending_load.py) counts as the time the run waits for it in Engine.load.
    argv = ["--root", str(root), "image", "--base", base_tag, "--no-smoke", "--rebuild", "--tag", ref,
            "--builder", "assemble"]
    code = (f"import cProfile, sys\nsys.argv = ['build.py', *{argv!r}]\n"
            f"cProfile.run('import vllm_hotfix.cli as c; c.run()', {str(prof)!r})\n")
    run = sh([common.PYTHON, "-c", code], cwd=REPO, env={"VLLM_HOTFIX_CACHE": str(cache), "PYTHONPATH": str(REPO)})
    st = pstats.Stats(str(prof))
    raw = st.stats  # type: ignore[attr-defined]
    total = max(ct for (_f, _l, _n), (_cc, _nc, _tt, ct, _c) in raw.items())
    steps = []
    for label, funcs in STEPS:
        secs, calls = 0.0, 0
        for suffix, name in funcs:
            s, c = _ct(raw, suffix, name)
            secs += s
            calls += c
        steps.append({"step": label, "seconds": round(secs, 4), "calls": calls})
    # Engine round trips: every one goes through the SDK's session.
    http_s, http_n = _ct(raw, "requests/sessions.py", "request")
    return {
        "wall_s": run.seconds,
        "profiled_s": total,
        "steps": steps,
        "engine_round_trips": http_n,
        "engine_round_trips_s": round(http_s, 4),
        "build_steps": sum(1 for ln in run.output.splitlines() if ln.strip().startswith("Step ")),
    }
