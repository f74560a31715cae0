"""The topk-layout check against every backport of #49149 onto v0.25.1 we hold: a table of what it said.

    python3 gpu-runs/topk_table.py prepare VLLM_SRC DEST [--wheels]
    python3 gpu-runs/topk_table.py run DEST [--vllm-src VLLM_SRC] [--out DIR] [--device cpu --shapes small]

``prepare`` (where the tool runs: it applies each patch with the tool's own
patch step, ``patch -p1 --forward --fuzz=0``) writes, for vLLM 0.25.1 as
shipped (``base``), the real patch (``real``), every correct variant of
``gpu-runs/variants/`` and every mutant of ``gpu-runs/mutants/``, the files
the patch leaves, under ``DEST/NAME/``, and ``DEST/manifest.json`` (kind and
the verdict each must get: ``pass`` for the real patch and the variants,
``fail`` for the base and the mutants); VLLM_SRC's ``vllm/**/*.py`` and
dist-info as ``DEST/vllm-src.tar.gz`` (about 6 MB); with ``--wheels``, the
wheels importing vLLM's indexer and sparse attention and building a
``VllmConfig`` needs beyond a GPU host's torch Python (CPython 3.12, x86_64;
the list bundle.sh's ``wheels/base`` holds) in ``DEST/wheels/``, from PyPI.
DEST is what a GPU host needs besides this checkout.

``run`` (on a GPU host with torch, Triton and CUDA; no Docker, no vLLM install,
standard library only) makes, per name, a tree of VLLM_SRC's files (links)
with that name's files in their place, runs
``patches/v0.25.1/checks/gpu_topk_layout.py --vllm-src TREE`` on it, prints
one row per name (the check's status, each scenario's outcome, whether it is
the expected verdict) and writes ``DIR/NAME.json`` (the check's output) and
``DIR/table.md``. It exits 0 only when every name got its expected verdict,
and a fail counts only as a caught bug (``wrong-attention`` or
``illegal-memory-access`` in some scenario), never an inconclusive one.
``--device cpu --shapes small`` runs the same in Triton's interpreter on a
CPU (float32, small shapes; minutes per name). ``--wheels DIR`` installs the
wheels there (vLLM's requirements the host's Python lacks) into a folder of
the run's own, put on the check's PYTHONPATH (default: ``DEST/wheels`` where it
exists); without ``--vllm-src`` the sources come from ``DEST/vllm-src.tar.gz``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
CHECK = REPO / "patches" / "v0.25.1" / "checks" / "gpu_topk_layout.py"
CAUGHT = ("wrong-attention", "illegal-memory-access")
# What importing vLLM's indexer and sparse attention and building a VllmConfig needs beyond a GPU host's torch
# Python (bundle.sh's wheels/base).
BASE_WHEELS = ("annotated-types==0.8.0", "cachetools==8.0.2", "cbor2==6.3.0", "httpcore2==2.16.2", "httpx2==2.16.2",
               "jiter==0.19.0", "msgspec==0.23.0", "openai==3.57.0", "openai-harmony==0.0.8", "pybase64==1.5.1",
               "pydantic==2.14.4", "pydantic_core==2.50.5", "pyzmq==27.3.0", "sniffio==1.3.1", "truststore==0.10.5",
               "typing-inspection==0.4.5")


def prepare(src: Path, dest: Path, wheels: bool = False) -> dict[str, Any]:
    """``DEST/NAME/<file>`` for every name and ``DEST/manifest.json``; returns the manifest."""
    sys.path.insert(0, str(HERE))
    import mutants

    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    manifest: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        real = mutants.applied(REPO, src, work)
        rows: list[tuple[str, str, str, dict[str, bytes]]] = [
            ("base", "unpatched", "fail", {f: (src / f).read_bytes() for f in real}),
            ("real", "real patch", "pass", real),
        ]
        rows += [(n, "variant", "pass", mutants.applied(mutants.root(n, work / "root"), src, work))
                 for n in mutants.variant_names()]
        rows += [(n, "mutant", "fail", mutants.applied(mutants.root(n, work / "root"), src, work))
                 for n in mutants.names()]
    for name, kind, expected, files in rows:
        for rel, data in files.items():
            (dest / name / rel).parent.mkdir(parents=True, exist_ok=True)
            (dest / name / rel).write_bytes(data)
        manifest[name] = {"kind": kind, "expected": expected, "files": sorted(files)}
    (dest / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    with tarfile.open(dest / "vllm-src.tar.gz", "w:gz") as tar:
        for top in sorted(p for p in src.iterdir() if p.name == "vllm" or p.name.endswith(".dist-info")):
            for path in sorted(top.rglob("*")):
                if path.is_file() and (path.suffix == ".py" or top.name.endswith(".dist-info")):
                    tar.add(path, arcname=str(path.relative_to(src)))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", "--platform", "manylinux_2_28_x86_64",
                        "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
                        "-d", str(dest / "wheels"), *BASE_WHEELS], check=True)
    return manifest


def tree_for(src: Path, prepared: Path, name: str, files: list[str], into: Path) -> Path:
    """A folder that reads as VLLM_SRC with ``name``'s files in place: links to every other file."""
    tree = into / name
    for top in sorted(p for p in src.iterdir() if p.name == "vllm" or p.name.endswith(".dist-info")):
        shutil.copytree(top, tree / top.name, copy_function=os.symlink)
    for rel in files:
        (tree / rel).unlink()
        shutil.copy2(prepared / name / rel, tree / rel)
    return tree


def judged(output: str) -> dict[str, Any]:
    """The check's one JSON line, reduced to its verdict and each scenario's outcome."""
    doc: dict[str, Any] = {}
    for line in reversed(output.splitlines()):
        if line.strip().startswith("{"):
            try:
                doc = json.loads(line)
                break
            except ValueError:
                continue
    check = next((c for c in doc.get("checks", []) if c.get("name") == "topk-layout"), None)
    if check is None:
        return {"status": "no answer", "outcomes": {}, "detail": output.strip()[-300:]}
    return {"status": check.get("status"), "outcomes": (check.get("data") or {}).get("outcomes") or {},
            "detail": check.get("detail", ""), "ran_against": check.get("ran_against")}


def as_expected(expected: str, got: dict[str, Any]) -> bool:
    """pass for pass; for fail, a caught bug in some scenario (an inconclusive fail is not a catch)."""
    if expected == "pass":
        return got["status"] == "pass"
    return got["status"] == "fail" and any(o in CAUGHT for o in got["outcomes"].values())


def install_wheels(wheels: Path, into: Path) -> Path:
    """The wheels unpacked into one folder (what ``pip install --target --no-deps`` makes of them, less scripts):
    a host's Python without pip takes them too."""
    site = into / "site"
    for wheel in sorted(wheels.glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
    return site


def run(prepared: Path, args: argparse.Namespace) -> int:
    manifest: dict[str, Any] = json.loads((prepared / "manifest.json").read_text())
    names = [n for n in manifest if not args.only or n in args.only]
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ)
        wheels = args.wheels or (prepared / "wheels" if (prepared / "wheels").is_dir() else None)
        if wheels:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(install_wheels(wheels, Path(tmp))),
                                                              env.get("PYTHONPATH")]))
        src = args.vllm_src
        if src is None:
            src = Path(tmp) / "vllm-src"
            with tarfile.open(prepared / "vllm-src.tar.gz") as tar:
                tar.extractall(src, filter="data")
        for name in names:
            entry = manifest[name]
            tree = tree_for(src, prepared, name, entry["files"], Path(tmp) / "trees")
            cmd = [sys.executable, str(CHECK), "--vllm-src", str(tree), "--device", args.device,
                   "--shapes", args.shapes, "--timeout", str(args.timeout)]
            start = time.monotonic()
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
            seconds = time.monotonic() - start
            (out / f"{name}.json").write_text(p.stdout)
            got = judged(p.stdout)
            ok = as_expected(entry["expected"], got)
            rows.append((name, entry["kind"], entry["expected"], got, ok, seconds))
            print(f"{'ok  ' if ok else 'MISS'} {name:38} {entry['kind']:10} expected {entry['expected']:4} got "
                  f"{got['status']:4} {' '.join(f'{s}={o}' for s, o in got['outcomes'].items())} ({seconds:.0f} s)",
                  flush=True)
            shutil.rmtree(tree)
    lines = ["| name | kind | expected | check | " + " | ".join(scenario_names(rows)) + " | as expected |",
             "| --- | --- | --- | --- | " + " | ".join("---" for _ in scenario_names(rows)) + " | --- |"]
    for name, kind, expected, got, ok, _ in rows:
        cells = [got["outcomes"].get(s, "") for s in scenario_names(rows)]
        lines.append(f"| `{name}` | {kind} | {expected} | {got['status']} | " + " | ".join(cells)
                     + f" | {'yes' if ok else 'NO'} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if rows and all(r[4] for r in rows) else 1


def scenario_names(rows: list[Any]) -> list[str]:
    seen: list[str] = []
    for row in rows:
        seen += [s for s in row[3]["outcomes"] if s not in seen]
    return seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("src", type=Path, help="the parent of vLLM 0.25.1's vllm/ package")
    p.add_argument("dest", type=Path)
    p.add_argument("--wheels", action="store_true", help="also download the wheels a GPU host's Python lacks")
    r = sub.add_parser("run")
    r.add_argument("prepared", type=Path, help="what prepare wrote")
    r.add_argument("--vllm-src", type=Path, default=None,
                   help="the parent of vLLM 0.25.1's vllm/ and dist-info (default: PREPARED/vllm-src.tar.gz)")
    r.add_argument("--out", type=Path, default=Path("topk-table"))
    r.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    r.add_argument("--shapes", choices=("model", "small"), default="model")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds per scenario")
    r.add_argument("--wheels", type=Path, default=None, help="wheels to put on the check's PYTHONPATH")
    r.add_argument("--only", nargs="*", default=None, help="these names only")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        manifest = prepare(args.src, args.dest, args.wheels)
        print(f"{len(manifest)} trees' files under {args.dest}: {', '.join(manifest)}")
        return 0
    return run(args.prepared, args)


if __name__ == "__main__":
    sys.exit(main())
