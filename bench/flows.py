"""The ways to make the patched image, each timed as one command.

* dockerfile: ``python build.py image --definition TAG --no-smoke --rebuild --tag REF``
  (the default builder: the engine builds the rendered Dockerfile)
* assemble: the same with ``--builder assemble`` (layer and config written by
  the tool, loaded into the engine); ``assemble-cold`` runs it with an empty
  facts cache, so the probe container runs as on a base never seen before
* manual: the incident report's manual shell steps (docker create, docker cp of the
  touched files, docker rm, ``patch -p1 --forward``, ``docker build`` of a
  hand-written FROM/COPY Dockerfile)
* floor:  ``docker build`` of FROM base + one COPY of already-patched files
  (and the same fresh bytecode the tool ships), the least the engine can do.

Fairness: every flow builds FROM a bench-only base (the stand-in plus one
small layer of this run's own and a LABEL), so no image outside the run shares
its layer cache or its layers, and the image a run produced is removed (with
its intermediate layers) before the next run.
Each run's output is checked for "Using cache"; the count is reported.
"""

from __future__ import annotations

import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from common import (
    BASE_REPO,
    LABEL,
    SITE,
    BenchError,
    Cleanup,
    Run,
    build_stdin,
    build_steps,
    cache_hits,
    docker,
    settle,
    sh,
    tool,
)

M3_FILES = (
    "vllm/models/minimax_m3/common/indexer.py",
    "vllm/models/minimax_m3/common/sparse_attention.py",
)
PATCH = "0001-minimax-m3-topk-buffer-layout.patch"


@dataclass
class Timed:
    flow: str
    seconds: float
    cache_hits: int
    steps: int
    ref: str
    image_id: str = ""


def _timed(flow: str, run: Run, ref: str, image_id: str = "") -> Timed:
    return Timed(flow, run.seconds, cache_hits(run.output), build_steps(run.output), ref, image_id)


def run_tool(root: Path, base_tag: str, ref: str, cleanup: Cleanup, *, builder: str = "dockerfile",
             cache: Path | None = None, flow: str | None = None, python: str | None = None) -> Timed:
    """One `image --rebuild`; ``cache``: the facts cache folder (a fresh one makes the run cold)."""
    settle()
    cleanup.add(ref)
    env = {"VLLM_HOTFIX_CACHE": str(cache)} if cache is not None else None
    r = tool(root, "image", "--base", base_tag, "--no-smoke", "--rebuild", "--tag", ref, "--builder", builder,
             env=env, python=python)
    last = (r.stdout.strip().splitlines() or [''])[-1]
    if not last.startswith(f"built {ref} "):
        raise BenchError(f"tool did not build {ref}:\n{r.output[-2000:]}")
    return _timed(flow or builder, r, ref, last.split()[-1])


MANUAL_SCRIPT = """set -e
cd "$WORK"
mkdir -p src/vllm/models/minimax_m3/common
CID=$(docker create --label {label}.run=manual "$BASE")
docker cp "$CID:{site}/vllm/models/minimax_m3/common/indexer.py" \\
    src/vllm/models/minimax_m3/common/indexer.py
docker cp "$CID:{site}/vllm/models/minimax_m3/common/sparse_attention.py" \\
    src/vllm/models/minimax_m3/common/sparse_attention.py
docker rm -f "$CID" >/dev/null
cd src
patch -p1 --forward -i ../m3_topk_fix.patch
cd ..
docker build -t "$TARGET" .
"""

MANUAL_DOCKERFILE = """FROM {base}
COPY src/vllm/models/minimax_m3/common/indexer.py \\
     {site}/vllm/models/minimax_m3/common/indexer.py
COPY src/vllm/models/minimax_m3/common/sparse_attention.py \\
     {site}/vllm/models/minimax_m3/common/sparse_attention.py
"""


def prepare_manual(work: Path, base_ref: str) -> Path:
    """The seed's working folder: the patch and a hand-written Dockerfile."""
    work.mkdir(parents=True, exist_ok=True)
    repo = Path(__file__).resolve().parent.parent
    shutil.copy(repo / "patches/v0.25.1" / PATCH, work / "m3_topk_fix.patch")
    (work / "Dockerfile").write_text(MANUAL_DOCKERFILE.format(base=base_ref, site=SITE))
    (work / "manual.sh").write_text(MANUAL_SCRIPT.format(label=LABEL, site=SITE))
    return work


def run_manual(work: Path, base_ref: str, ref: str, cleanup: Cleanup) -> Timed:
    shutil.rmtree(work / "src", ignore_errors=True)
    settle()
    cleanup.add(ref)
    r = sh(["bash", str(work / "manual.sh")], env={"WORK": str(work), "BASE": base_ref, "TARGET": ref})
    if "Successfully tagged" not in r.output:
        raise BenchError(f"manual flow did not build {ref}:\n{r.output[-2000:]}")
    return _timed("manual", r, ref)


def prepare_floor(ctx: Path, base_ref: str, site_dir: str, files: dict[str, bytes]) -> Path:
    """A context with the already-patched files (and bytecode) laid out as in site_dir."""
    shutil.rmtree(ctx, ignore_errors=True)
    for rel, data in files.items():
        path = ctx / "files" / PurePosixPath(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (ctx / "Dockerfile").write_text(f"FROM {base_ref}\nCOPY files/ {site_dir}/\n")
    return ctx


def run_floor(ctx: Path, ref: str, cleanup: Cleanup) -> Timed:
    settle()
    cleanup.add(ref)
    r = docker("build", "-t", ref, str(ctx))
    return _timed("floor", r, ref)


def patched_files(root: Path, base_tag: str) -> tuple[str, dict[str, bytes]]:
    """The exact bytes the tool ships (sources and bytecode), keyed by path under site_dir.

    Uses the tool's own library once, outside any timing, so the floor copies
    the same content the tool's image gets.
    """
    from vllm_hotfix.building import base, pipeline
    from vllm_hotfix.engine import Engine
    from vllm_hotfix.registry.pulling import resolve

    engine = Engine.connect()
    plan = pipeline.plan(root, base_tag)
    info = resolve(engine, plan.base_ref, "never")
    # prepare() returns (facts, files, ...): later versions add items at the end.
    prepared = base.prepare(engine, plan.definition, plan.base_ref, info, plan.patches)
    facts, patched = prepared[0], prepared[1]
    out: dict[str, bytes] = {}
    for f in patched:
        out[f.rel] = f.data
        for pyc, data in f.bytecode:
            out[pyc] = data
    return facts.site_dir, out


def bench_base(cleanup: Cleanup, standin: str, tag: str) -> str:
    """The stand-in plus one small layer of this run's own and a LABEL: an ID and layers no image outside it shares.

    A LABEL alone gives a new image ID over the stand-in's very layers, and the
    engine keeps layers by their chain (the layer and every layer under it): an
    image anyone built FROM the stand-in with the same patched files (the
    Dockerfile builder's COPY layer is the assembled one, byte for byte) would
    hand every assembled load an existing layer, which the load then does not
    write. The file naming this run makes the chain new.
    """
    ref = cleanup.add(f"{BASE_REPO}:{tag}")
    build_stdin(f"FROM {standin}\nRUN echo {uuid.uuid4().hex} > /etc/vllm-hotfix-bench-base\n"
                f"LABEL {LABEL}.base={tag}\n", ref, "--network", "none")
    return ref

