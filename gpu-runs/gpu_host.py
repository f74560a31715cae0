"""Helpers for running the pipeline on a GPU host through its own Docker engine.

    python3 gpu-runs/gpu_host.py base REF --vllm-src DIR --wheels DIR [--python PY] [--paths P ...] [--cuda]
    python3 gpu-runs/gpu_host.py record OUT --patched REPORT --unpatched REPORT [--timings RUN_LOG]

``base`` makes a GPU base image from the host's own filesystem (its Python,
torch and Triton, its system libraries) by ``tar`` piped to ``docker import``,
then adds vLLM's sources with their dist-info to that Python's site-packages
and installs the given wheels there, without a network. The imported
filesystem stays tagged ``REF-hostfs`` so a later base (e.g. with the full
vLLM wheel) can start from it. The console scripts of the distributions in
--vllm-src (``vllm``, the entrypoint) are written into the Python's bin folder.
With --cuda the host's CUDA toolkit (the folder holding ``nvcc``) comes along
and CUDA_HOME names it, as in the upstream image, where FlashInfer compiles its
kernels at first use.

``record`` folds two smoke reports (``build.py smoke --report``) into the run
record committed under gpu-runs/.

Uses the tool's own engine module; DOCKER_HOST selects the engine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from vllm_hotfix.engine import Engine  # noqa: E402
from vllm_hotfix.tarball import tar_bytes  # noqa: E402

# What a GPU host's Python needs at run time; caches and docs are left out.
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEFAULT_PATHS = ["bin", "sbin", "lib", "lib64", "usr", "etc", "opt/torch"]
# Bytecode stays: without it every container would recompile torch on import.
EXCLUDES = ["usr/local/cuda*", "usr/share/doc", "usr/share/man", "var/cache"]


def _site(python: str) -> tuple[str, str]:
    """The Python's site-packages and the installation it runs from (a venv's base_prefix)."""
    code = "import sys, sysconfig; print(sysconfig.get_paths()['purelib']); print(sys.base_prefix)"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    site, prefix = out.stdout.split("\n")[:2]
    return site, prefix


def _chunks(proc: subprocess.Popen[bytes]) -> Iterator[bytes]:
    assert proc.stdout is not None
    while True:
        block = proc.stdout.read(1 << 20)
        if not block:
            return
        yield block


def _tree(folder: Path, prefix: str) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            files[f"{prefix}/{path.relative_to(folder).as_posix()}"] = path.read_bytes()
    return files


def _cuda_root() -> str | None:
    """The CUDA toolkit folder holding the host's nvcc (through links), or None."""
    import shutil

    for candidate in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if candidate and os.path.isfile(os.path.join(candidate, "bin", "nvcc")):
            return os.path.realpath(candidate)
    nvcc = shutil.which("nvcc")
    return os.path.dirname(os.path.dirname(os.path.realpath(nvcc))) if nvcc else None


def _console_scripts(src: Path, python: str) -> dict[str, bytes]:
    """bin/NAME launchers for the console_scripts of every dist-info under src.

    As pip writes them, with the ``__main__`` guard: vLLM starts its engine core
    with multiprocessing's spawn, whose child imports the launcher again and
    must not run the command a second time.
    """
    import configparser

    scripts: dict[str, bytes] = {}
    for ep in sorted(src.glob("*.dist-info/entry_points.txt")):
        cp = configparser.ConfigParser(delimiters=("=",))
        cp.optionxform = str  # type: ignore[assignment,method-assign]
        cp.read_string(ep.read_text(encoding="utf-8"))
        if not cp.has_section("console_scripts"):
            continue
        for name, target in cp.items("console_scripts"):
            module, _, attr = target.strip().partition(":")
            scripts[name] = (
                f"#!{python}\nimport sys\nfrom {module} import {attr.split('.')[0]}\n\n"
                f"if __name__ == \"__main__\":\n    sys.exit({attr}())\n"
            ).encode()
    return scripts


def base(args: argparse.Namespace) -> int:
    engine = Engine.connect(timeout=1800)
    # Not resolved: a venv's python is a link, and the venv is what the base must run.
    python = args.python
    bindir = os.path.dirname(args.python)
    site, prefix = _site(args.python)
    hostfs = f"{args.ref}-hostfs"
    cuda = _cuda_root() if args.cuda else None
    if args.cuda and cuda is None:
        print("error: --cuda: no nvcc on this host (CUDA_HOME, /usr/local/cuda, PATH)", file=sys.stderr)
        return 1
    excludes = [e for e in EXCLUDES if not (cuda and e.startswith("usr/local/cuda"))]
    t0 = time.monotonic()
    stage = engine.image(hostfs)
    if stage is None or args.rebuild:
        paths = [p for p in args.paths if os.path.lexists(os.path.join("/", p))]
        if cuda and not any(cuda == f"/{p}" or cuda.startswith(f"/{p}/") for p in paths):
            paths.append(cuda.lstrip("/"))
        # The interpreter a venv links to must come along, wherever it is installed.
        if not any(prefix == f"/{p}" or prefix.startswith(f"/{p}/") for p in paths):
            paths.append(prefix.lstrip("/"))
        cmd = ["tar", "-C", "/", "-cf", "-", *[f"--exclude={e}" for e in excludes], *paths]
        print(f"importing the host's {' '.join(paths)} as {hostfs}", flush=True)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        path_env = f"{bindir}:{SYSTEM_PATH}"
        stage = engine.import_stream(_chunks(proc), hostfs, changes=[f"ENV PATH={path_env}"])
        # tar exits 1 when a file changed while read (logs, /etc/mtab): not fatal here.
        if proc.wait() not in (0, 1):
            print(f"error: tar of the host filesystem failed (exit {proc.returncode})", file=sys.stderr)
            return 1
    imported = time.monotonic() - t0
    files = _tree(Path(args.vllm_src), "vllm-src")
    with tempfile.TemporaryDirectory() as extra:
        # Installed by the host's own pip (same Python as the base), so the image needs
        # no pip of its own; --target writes each distribution's RECORD as usual.
        wheels = sorted(str(w) for w in Path(args.wheels).glob("*.whl"))
        if wheels:
            subprocess.run([python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                            "--disable-pip-version-check", "--target", extra, *wheels], check=True)
        files.update({k: v for k, v in _tree(Path(extra), "site-extra").items()
                      if not k.startswith("site-extra/bin/")})
    scripts = _console_scripts(Path(args.vllm_src), python)
    files.update({f"scripts/{name}": body for name, body in scripts.items()})
    env = [
        # Hosts whose GPUs others share keep NVLink multicast off in every program.
        "NCCL_NVLS_ENABLE=0", "TORCH_SYMM_MEM_DISABLE_MULTICAST=1", "NVSHMEM_DISABLE_NVLS=1",
    ]
    if cuda:
        env += [f"CUDA_HOME={cuda}", f"PATH={bindir}:{cuda}/bin:{SYSTEM_PATH}"]
    files["Dockerfile"] = (
        f"FROM {stage.id}\n"
        f"COPY vllm-src/ {site}/\n"
        + (f"COPY site-extra/ {site}/\n" if any(k.startswith("site-extra/") for k in files) else "")
        + (f"COPY scripts/ {bindir}/\nRUN chmod 0755 {' '.join(f'{bindir}/{n}' for n in scripts)}\n" if scripts else "")
        + "".join(f"ENV {e.split('=', 1)[0]}={e.split('=', 1)[1]}\n" for e in env)
        + "RUN mkdir -p /tmp && chmod 1777 /tmp\n"
        # The upstream image's entrypoint: anything that forgets to override it fails as there.
        'ENTRYPOINT ["vllm", "serve"]\n'
    ).encode()
    image_id = engine.build(tar_bytes(files), progress=lambda line: print(f"  {line}", flush=True))
    engine.tag(image_id, args.ref)
    info = engine.image(args.ref)
    assert info is not None
    print(json.dumps({"ref": args.ref, "id": info.id, "hostfs": stage.id, "site": site, "size": info.size,
                      "import_seconds": round(imported, 1), "seconds": round(time.monotonic() - t0, 1)}))
    return 0


def _image(report: dict[str, Any]) -> dict[str, Any]:
    return {
        "ref": report.get("image"),
        "id": report.get("image_id"),
        "status": report.get("status"),
        "gpu_verified": report.get("gpu_verified"),
        "gpu": report.get("gpu"),
        "seconds": report.get("seconds"),
        "checks": [{"name": c.get("name"), "status": c.get("status"), "detail": c.get("detail")}
                   for c in report.get("checks", [])],
        "topk_layout": _topk(report),
        "serve": _serve(report),
    }


def _serve(report: dict[str, Any]) -> dict[str, Any] | None:
    """The serve sweep: per level latency and throughput, and how the server ended."""
    check = next((c for c in report.get("checks", []) if c.get("name") == "serve-sweep"), None)
    if check is None:
        return None
    sweep = report.get("sweep") or {}
    return {
        "status": check.get("status"),
        "detail": check.get("detail"),
        "seconds": check.get("seconds"),
        "model": sweep.get("model"),
        "failed_level": sweep.get("failed_level"),
        "levels": sweep.get("levels"),
        "server_log_tail": (check.get("data") or {}).get("server_log")
        or (sweep.get("server_log") or "").splitlines()[-40:],
    }


def _topk(report: dict[str, Any]) -> dict[str, Any] | None:
    """Per scenario: how it ended, the views the installed code used, the row counts."""
    check = next((c for c in report.get("checks", []) if c.get("name") == "topk-layout"), None)
    if check is None:
        return None
    data = check.get("data") or {}
    runs: dict[str, Any] = {}
    for scenario, run in (data.get("runs") or {}).items():
        result = run.get("result") or {}
        entry = {k: run[k] for k in ("outcome", "seconds", "fault", "timeout") if k in run}
        entry.update({k: result[k] for k in ("impls", "config", "write_views", "read_views", "decode", "prefill",
                                             "attention", "error", "read_out_of_bounds") if k in result})
        runs[scenario] = entry
    stubs = next((r.get("import", {}).get("stubs") for r in (data.get("runs") or {}).values() if r.get("import")), None)
    return {"outcomes": data.get("outcomes"), "stubs": stubs, "runs": runs}


def record(args: argparse.Namespace) -> int:
    patched = json.loads(Path(args.patched).read_text())
    unpatched = json.loads(Path(args.unpatched).read_text())
    facts = Engine.connect().facts()
    rec: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "engine": {"version": facts.server_version, "api": facts.api_version,
                   "cdi_spec_dirs": list(facts.cdi_spec_dirs), "runtimes": list(facts.runtimes)},
        "gpu_request_way": (patched.get("gpu") or {}).get("way"),
        "images": {"patched": _image(patched), "unpatched": _image(unpatched)},
    }
    if args.timings and Path(args.timings).exists():
        # The run log's own timestamped lines, not the build output between them.
        rec["timings"] = [ln for ln in Path(args.timings).read_text().splitlines() if ln.startswith(("[", "  gpu:"))]
    Path(args.out).write_text(json.dumps(rec, indent=2, sort_keys=True) + "\n")
    for kind, img in rec["images"].items():
        print(f"{kind}: {img['ref']} {img['id']} {img['status']} (gpu_verified {img['gpu_verified']})")
        for c in img["checks"]:
            print(f"  {c['status']:<4} {c['name']}: {str(c['detail'])[:400]}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("base", help="make a GPU base image from this host's filesystem")
    b.add_argument("ref")
    b.add_argument("--vllm-src", required=True, help="folder holding vllm/ and its dist-info")
    b.add_argument("--wheels", required=True, help="folder of wheels to install into the base")
    b.add_argument("--python", default=sys.executable, help="the host Python the base runs (default: this one)")
    b.add_argument("--paths", nargs="+", default=DEFAULT_PATHS, help="top-level paths of / to import")
    b.add_argument("--rebuild", action="store_true", help="import the filesystem again even if REF-hostfs exists")
    b.add_argument("--cuda", action="store_true", help="bring the host's CUDA toolkit (nvcc) and set CUDA_HOME")
    r = sub.add_parser("record", help="fold two smoke reports into a run record")
    r.add_argument("out")
    r.add_argument("--patched", required=True)
    r.add_argument("--unpatched", required=True)
    r.add_argument("--timings", default=None)
    args = ap.parse_args(argv)
    return base(args) if args.cmd == "base" else record(args)


if __name__ == "__main__":
    sys.exit(main())
