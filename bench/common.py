"""Helpers shared by the benchmark: commands, timing, statistics, cleanup.

The benchmark reaches the engine through the docker CLI (as the manual flow
and ops do) and runs the tool as a user would: ``python build.py ...`` in a
fresh process, so every figure includes process start.
"""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vllm_hotfix.engine import labels

REPO = Path(__file__).resolve().parent.parent
BUILD_PY = REPO / "build.py"
MACHINE_PYTHON = sys.executable
# The interpreter the tool runs under: run.py points it at tool_venv()'s (or --python).
PYTHON = sys.executable
SITE = "/usr/local/lib/python3.12/dist-packages"
STANDIN = "vllm/vllm-openai:v0.25.1"
BENCH_REPO = "vllm-hotfix-bench"  # every image the bench makes lives under this name
FILLER_REPO = f"{BENCH_REPO}/filler"
BASE_REPO = f"{BENCH_REPO}/base"
LABEL = labels.BENCH


def copy_definitions(root: Path) -> None:
    """The project's own images/ and patches/ (what git tracks) copied to ``root``.

    A user's own patch sets and definitions in the checkout (untracked) would
    change what is measured; an unpacked archive without git is copied whole.
    """
    folders = ("images", "patches")
    try:
        listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--", *folders], capture_output=True,
                                check=True, timeout=60).stdout.decode().split("\0")
    except (OSError, subprocess.CalledProcessError):
        if (REPO / ".git").exists():
            raise
        listed = [str(p.relative_to(REPO)) for f in folders for p in (REPO / f).rglob("*") if p.is_file()]
    for name in listed:
        if name and (REPO / name).is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, root / name)


class BenchError(RuntimeError):
    """A step of the benchmark could not run (never raised for a slow figure)."""


@dataclass
class Run:
    seconds: float
    output: str  # stdout then stderr
    rc: int
    stdout: str = ""


def sh(cmd: Sequence[str], *, cwd: Path | None = None, check: bool = True,
       env: dict[str, str] | None = None, timeout: float = 900) -> Run:
    """Run a command; time it from fork to exit."""
    full_env = dict(os.environ, **(env or {}))
    start = time.perf_counter()
    proc = subprocess.run(list(cmd), cwd=cwd, capture_output=True, text=True, env=full_env,
                          timeout=timeout)
    seconds = time.perf_counter() - start
    out = proc.stdout + proc.stderr
    if check and proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-15:])
        raise BenchError(f"{' '.join(cmd[:6])} ... exited {proc.returncode}:\n{tail}")
    return Run(seconds, out, proc.returncode, proc.stdout)


def build_stdin(dockerfile: str, ref: str, *extra: str, timeout: float = 900) -> Run:
    """``docker build`` of a Dockerfile given on stdin (no context)."""
    start = time.perf_counter()
    proc = subprocess.run(["docker", "build", *extra, "-t", ref, "-"], input=dockerfile,
                          capture_output=True, text=True, timeout=timeout)
    run = Run(time.perf_counter() - start, proc.stdout + proc.stderr, proc.returncode)
    if run.rc != 0:
        raise BenchError(f"cannot build {ref}: {run.output.strip()[-800:]}")
    return run


def docker(*args: str, check: bool = True, cwd: Path | None = None) -> Run:
    return sh(["docker", *args], check=check, cwd=cwd)


def tool(root: Path, *args: str, check: bool = True, env: dict[str, str] | None = None,
         python: str | None = None) -> Run:
    return sh([python or PYTHON, str(BUILD_PY), "--root", str(root), *args], check=check, env=env)


def tool_venv(where: Path) -> str:
    """A virtual environment to run the tool in, as a user's own install would: its interpreter.

    It sees the packages installed for the machine's Python (the tool's
    dependencies) through one path file, but runs none of the start-up hooks
    (.pth files) other packages put into the machine's site-packages, which
    every start of the machine's Python pays for.
    """
    import site

    sh([MACHINE_PYTHON, "-m", "venv", "--without-pip", str(where)])
    python = str(where / "bin" / "python")
    purelib = sh([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    dirs = [d for d in [*site.getsitepackages(), site.getusersitepackages()] if Path(d).is_dir()]
    (Path(purelib) / "machine-packages.pth").write_text("".join(f"{d}\n" for d in dirs))
    sh([python, "-c", "import click, jinja2, unidiff, docker"])  # the tool's dependencies are found
    return python


def settle() -> None:
    """Flush dirty pages from the previous step so it does not bill the next."""
    os.sync()


def image_id(ref: str) -> str | None:
    r = docker("image", "inspect", "-f", "{{.Id}}", ref, check=False)
    return r.output.strip() if r.rc == 0 else None


def image_size(ref: str) -> int:
    return int(docker("image", "inspect", "-f", "{{.Size}}", ref).output.strip())


def cache_hits(output: str) -> int:
    """Build steps the engine answered from its layer cache (must be 0 here)."""
    return output.count("Using cache")


def build_steps(output: str) -> int:
    return sum(1 for line in output.splitlines() if line.strip().startswith("Step "))


@dataclass
class Cleanup:
    """Images and tags this run made; removed at the end, whatever happens."""

    refs: list[str] = field(default_factory=list)

    def add(self, ref: str) -> str:
        self.refs.append(ref)
        return ref

    def remove(self, ref: str) -> None:
        # rmi of the last tag also deletes the untagged intermediate images of
        # its build (the classic builder's layer cache for that build).
        docker("rmi", "-f", ref, check=False)
        if ref in self.refs:
            self.refs.remove(ref)

    def all(self) -> None:
        for ref in reversed(list(self.refs)):
            self.remove(ref)
        # Containers of a flow that died half-way (the manual flow's docker create).
        r = docker("ps", "-aq", "--filter", f"label={LABEL}.run", check=False)
        for cid in r.output.split():
            docker("rm", "-f", cid, check=False)


def stats(values: Sequence[float]) -> dict[str, float | int | list[float]]:
    vals = sorted(values)
    if not vals:
        return {"n": 0}
    q = statistics.quantiles(vals, n=4) if len(vals) >= 2 else [vals[0]] * 3
    return {
        "n": len(vals),
        "median": statistics.median(vals),
        "min": vals[0],
        "max": vals[-1],
        "iqr": q[2] - q[0],
        "values": [round(v, 4) for v in values],
    }


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")
