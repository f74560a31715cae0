"""Synthetic inputs: filler bases of several sizes, patch sets of several widths.

Filler bases are the stand-in plus FILLER_LAYERS layers of random bytes (the
same layer count at every size, so only the bytes change). They take minutes
to make at 8 GB, so they are kept in the engine between bench runs and found
again by a label that names the stand-in's ID and the sizes.
"""

from __future__ import annotations

import difflib
import shutil
import subprocess
import tempfile
from pathlib import Path

from common import (
    FILLER_REPO,
    LABEL,
    SITE,
    BenchError,
    build_stdin,
    docker,
    image_id,
)

FILLER_LAYERS = 4
GiB = 1024**3


def definition(root: Path, tag: str, repository: str, patch_set: str) -> None:
    """images/<tag>.toml in a bench --root: a base of vLLM 0.25.1 with patch set ``patch_set``."""
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "images" / f"{tag}.toml").write_text(
        f'[base]\nrepository = "{repository}"\ntag = "{tag}"\n\n'
        f'[package]\nname = "vllm"\nversion = "0.25.1"\n\n'
        f'[patches]\nset = "{patch_set}"\n\n[output]\nsuffix = "bench"\n'
    )


def filler(standin_id: str, name: str, total_bytes: int, standin_size: int,
           log: list[str]) -> tuple[str, float | None]:
    """A base of about ``total_bytes``; returns (ref, seconds spent making it or None if cached)."""
    ref = f"{FILLER_REPO}:{name}"
    add = max(total_bytes - standin_size, FILLER_LAYERS * 1024**2)
    per_layer = add // FILLER_LAYERS
    key = f"{standin_id.removeprefix('sha256:')[:12]}-{FILLER_LAYERS}x{per_layer}"
    found = docker("images", "-q", "--no-trunc", "--filter", f"label={LABEL}.filler={key}",
                   check=False).output.split()
    if found:
        if image_id(ref) != found[0]:
            docker("tag", found[0], ref)
        return ref, None
    lines = [f"FROM {standin_id}"]
    for i in range(FILLER_LAYERS):
        # Random bytes: nothing in the engine can compress or deduplicate them away.
        lines.append(f"RUN mkdir -p /opt/bench-filler && "
                     f"head -c {per_layer} /dev/urandom > /opt/bench-filler/{i}")
    lines.append(f"LABEL {LABEL}.filler={key}")
    log.append(f"making filler base {ref} ({FILLER_LAYERS} x {per_layer / GiB:.2f} GiB); kept for later runs")
    run = build_stdin("\n".join(lines) + "\n", ref, "--network", "none", "--rm", "--force-rm", timeout=1800)
    return ref, run.seconds


def extract_package(base_ref: str, dest: Path) -> Path:
    """Copy the image's vllm sources out once (untimed), to write patches against."""
    cid = docker("create", "--label", f"{LABEL}.run=extract", base_ref).output.strip()
    try:
        docker("cp", f"{cid}:{SITE}/vllm", str(dest / "vllm"))
    finally:
        docker("rm", "-f", cid, check=False)
    return dest / "vllm"


def pick_files(pkg: Path, count: int) -> list[str]:
    """``count`` real vllm modules spread evenly over the package, deterministically."""
    candidates = []
    for path in sorted(pkg.rglob("*.py")):
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines(keepends=True)
        if len(lines) >= 40 and text.endswith("\n") and "minimax_m3" not in str(path):
            candidates.append(str(path.relative_to(pkg.parent)))
    if len(candidates) < count:
        raise BenchError(f"only {len(candidates)} candidate files in {pkg}")
    step = len(candidates) / count
    return [candidates[int(i * step)] for i in range(count)]


def _hunk(rel: str, text: str, n: int) -> str:
    lines = text.splitlines(keepends=True)
    # After line 20: past any coding line and module docstring start; a comment
    # line is valid anywhere except after a backslash continuation.
    at = 20
    while lines[at - 1].rstrip("\n").endswith("\\"):
        at += 1
    new = lines[:at] + [f"# vllm-hotfix bench: synthetic hunk {n}\n"] + lines[at:]
    return "".join(difflib.unified_diff(lines, new, fromfile=f"a/{rel}", tofile=f"b/{rel}", n=3))


def patch_set(root: Path, pkg: Path, name: str, rels: list[str]) -> None:
    """patches/<name>/: one small patch (one hunk) per file, and its series."""
    folder = root / "patches" / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    names = []
    for i, rel in enumerate(rels, 1):
        text = (pkg.parent / rel).read_text(encoding="utf-8")
        patch = f"Synthetic bench patch {i} of {len(rels)}\n\n" + _hunk(rel, text, i)
        fname = f"{i:04d}-synthetic.patch"
        (folder / fname).write_text(patch)
        names.append(fname)
    (folder / "series").write_text("".join(n + "\n" for n in names))
    # Check the set applies with GNU patch, zero fuzz, as the tool will.
    with tempfile.TemporaryDirectory(prefix="bench-check-") as tmp:
        for rel in rels:
            (Path(tmp) / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(pkg.parent / rel, Path(tmp) / rel)
        for fname in names:
            subprocess.run(["patch", "-s", "-p1", "--forward", "--fuzz=0", "-d", tmp, "-i",
                            str(folder / fname)], check=True, capture_output=True)
