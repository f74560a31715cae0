"""Environment report probe: versions, GPUs and known-bad dependency combinations.

Run inside a container as ``python3 env_report.py [NAME ...]`` (NAMEs: more
distributions to report, e.g. the ones a patch set pins). Prints one JSON object
``{"checks": [...], "info": {...}}`` on stdout; exit code 1 when a check fails.
Stdlib only at top level: torch and quack are imported lazily, if present.

Checks:
* ``env-report``: always ``pass``; ``data`` holds the report (Python, CUDA
  runtime, package versions, GPUs).
* ``known-bad-deps``: ``fail`` when a combination from ``KNOWN_BAD`` is present
  AND its probe confirms it (e.g. ``quack.activation`` really lacks
  ``sub_packed_f32x2``); ``pass`` otherwise.
"""

from __future__ import annotations

import glob
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Callable
from typing import Any

# Distributions reported (importlib.metadata names); "absent" when missing.
PACKAGES: list[str] = [
    "torch",
    "torchvision",
    "flashinfer-python",
    "quack-kernels",
    "nvidia-cutlass-dsl",
    "triton",
    "vllm",
]

# Known-bad combinations, as data. Each entry:
#   id:        short id used in the check detail
#   versions:  dist name -> exact version (local suffixes like "+cu130" ignored)
#   cc_major:  compute-capability majors affected (None: any GPU, or none)
#   probe:     (module, attribute) that must be MISSING for the bug to be
#              confirmed; None: versions alone decide
#   symptom / ref: one line each, for humans
KNOWN_BAD: list[dict[str, Any]] = [
    {
        "id": "quack-0.6.5+cutlass-dsl-4.7.1-sm100",
        "versions": {"quack-kernels": "0.6.5", "nvidia-cutlass-dsl": "4.7.1"},
        "cc_major": [10],
        "probe": ("quack.activation", "sub_packed_f32x2"),
        "symptom": (
            "AttributeError: module 'quack.activation' has no attribute "
            "'sub_packed_f32x2' while compiling MiniMax-M3 MSA sparse attention "
            "(vllm/third_party/fmha_sm100) at engine start"
        ),
        "ref": "last known good: quack-kernels 0.6.4 + nvidia-cutlass-dsl 4.6.2",
    },
]


def _norm_version(v: str) -> str:
    """Drop a PEP 440 local suffix: '2.13.0+cu130' -> '2.13.0'."""
    return v.split("+", 1)[0].strip()


def dist_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
    except Exception as e:  # noqa: BLE001
        return f"error: {type(e).__name__}"


def has_attribute(module: str, attr: str) -> bool | None:
    """True/False when ``module`` imports; None when it cannot be imported."""
    try:
        mod = importlib.import_module(module)
    except Exception:  # noqa: BLE001  (ImportError and anything raised at import)
        return None
    return hasattr(mod, attr)


def flag_known_bad(
    versions: dict[str, str],
    capabilities: list[tuple[int, int]],
    probe: Callable[[str, str], bool | None],
    known_bad: list[dict[str, Any]] | None = None,
    unconfirmed: list[str] | None = None,
) -> list[str]:
    """Ids of the known-bad combinations present and confirmed.

    ``versions``: dist name -> version ("absent" when missing). ``capabilities``:
    (major, minor) per visible GPU. ``probe(module, attr)``: whether the attribute
    exists (None: module not importable). An entry with a probe is flagged only
    when the probe answers False (attribute missing); when it answers None the
    versions are present but unconfirmed: the entry is not flagged but goes
    into ``unconfirmed``, and the check cannot pass on it. An
    entry with ``cc_major`` needs a GPU of such a major; with no GPU info
    (empty ``capabilities``) a cc-restricted entry is still flagged when the
    probe confirms it, since the image may run on such a GPU later.
    """
    flagged: list[str] = []
    for entry in KNOWN_BAD if known_bad is None else known_bad:
        want: dict[str, str] = entry.get("versions", {})
        if any(_norm_version(versions.get(n, "absent")) != _norm_version(v) for n, v in want.items()):
            continue
        majors = entry.get("cc_major")
        if majors and capabilities and not any(c[0] in majors for c in capabilities):
            continue
        pr = entry.get("probe")
        if pr is not None:
            answer = probe(pr[0], pr[1])
            if answer is None and unconfirmed is not None:
                unconfirmed.append(str(entry["id"]))
            if answer is not False:
                continue
        flagged.append(str(entry["id"]))
    return flagged


def cuda_runtime_version() -> tuple[str | None, str]:
    """(version, source): torch.version.cuda, else the nvidia-cuda-runtime dist,
    else a libcudart found on disk."""
    try:
        import torch

        v = getattr(torch.version, "cuda", None)
        if v:
            return str(v), "torch.version.cuda"
    except Exception:  # noqa: BLE001
        pass
    for dist in (
        "nvidia-cuda-runtime",
        "nvidia-cuda-runtime-cu13",
        "nvidia-cuda-runtime-cu12",
    ):
        v = dist_version(dist)
        if v != "absent" and not v.startswith("error"):
            return v, f"dist {dist}"
    patterns = [
        "/usr/local/cuda*/lib64/libcudart.so.*",
        "/usr/local/cuda*/targets/*/lib/libcudart.so.*",
        "/usr/lib/x86_64-linux-gnu/libcudart.so.*",
        "/usr/lib/aarch64-linux-gnu/libcudart.so.*",
    ]
    for p in sys.path:
        patterns.append(os.path.join(p, "nvidia", "*", "lib", "libcudart.so.*"))
    for pat in patterns:
        hits = sorted(glob.glob(pat))
        if hits:
            name = os.path.basename(hits[-1])
            return name.split("libcudart.so.", 1)[1], f"file {hits[-1]}"
    return None, "not found"


def gpus() -> tuple[list[dict[str, Any]], str]:
    """GPU list and source: torch when CUDA is usable, else nvidia-smi, else none."""
    try:
        import torch

        if torch.cuda.is_available():
            out = []
            for i in range(torch.cuda.device_count()):
                major, minor = torch.cuda.get_device_capability(i)
                out.append(
                    {
                        "index": i,
                        "name": torch.cuda.get_device_name(i),
                        "capability": [major, minor],
                    }
                )
            return out, "torch"
    except Exception:  # noqa: BLE001
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            p = subprocess.run(
                [
                    smi,
                    "--query-gpu=name,compute_cap,driver_version",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            if p.returncode == 0:
                return parse_nvidia_smi(p.stdout), "nvidia-smi"
        except Exception:  # noqa: BLE001
            pass
    return [], "none"


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """Parse ``name, compute_cap, driver_version`` CSV lines."""
    out: list[dict[str, Any]] = []
    for i, line in enumerate(x for x in text.splitlines() if x.strip()):
        parts = [s.strip() for s in line.rsplit(",", 2)]
        item: dict[str, Any] = {"index": i, "name": parts[0]}
        if len(parts) == 3:
            try:
                ma, mi = parts[1].split(".")
                item["capability"] = [int(ma), int(mi)]
            except ValueError:
                item["capability"] = None
            item["driver"] = parts[2]
        out.append(item)
    return out


def driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        p = subprocess.run(
            [smi, "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        lines = [x.strip() for x in p.stdout.splitlines() if x.strip()]
        return lines[0] if p.returncode == 0 and lines else None
    except Exception:  # noqa: BLE001
        return None


def collect(extra: list[str] | None = None) -> dict[str, Any]:
    names = PACKAGES + [n for n in extra or [] if n not in PACKAGES]
    versions = {n: dist_version(n) for n in names}
    cuda, cuda_src = cuda_runtime_version()
    gpu_list, gpu_src = gpus()
    return {
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "cuda_runtime": cuda,
        "cuda_runtime_source": cuda_src,
        "driver": driver_version(),
        "packages": versions,
        "gpus": gpu_list,
        "gpu_source": gpu_src,
    }


def main(extra: list[str] | None = None) -> int:
    checks: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    extra = extra or []
    try:
        info = collect(extra)
        pinned = ", ".join(f"{n} {info['packages'][n]}" for n in extra)
        checks.append(
            {
                "name": "env-report",
                "status": "pass",
                "detail": (
                    f"python {info['python']}, cuda {info['cuda_runtime']}, "
                    f"torch {info['packages']['torch']}, "
                    f"vllm {info['packages']['vllm']}, {len(info['gpus'])} GPU(s)"
                    + (f"; pinned: {pinned}" if pinned else "")
                ),
                "data": info,
            }
        )
    except Exception as e:  # noqa: BLE001
        checks.append(
            {
                "name": "env-report",
                "status": "fail",
                "detail": f"could not collect: {type(e).__name__}: {e}",
            }
        )
    try:
        caps = [
            (int(g["capability"][0]), int(g["capability"][1]))
            for g in info.get("gpus", [])
            if g.get("capability")
        ]
        versions = info.get("packages") or {n: dist_version(n) for n in PACKAGES}
        unknown: list[str] = []
        flagged = flag_known_bad(versions, caps, has_attribute, unconfirmed=unknown)
        by_id = {e["id"]: e for e in KNOWN_BAD}
        if unknown and not flagged:
            # The versions are the known-bad pair and nothing here could tell otherwise: not a pass.
            detail = "; ".join(f"{u}: the versions match, but {by_id[u]['probe'][0]} cannot be imported here to "
                               "confirm or clear it; run smoke where it imports" for u in unknown)
            checks.append({"name": "known-bad-deps", "status": "incomplete", "detail": detail,
                           "data": {"flagged": [], "unconfirmed": unknown}})
        elif flagged:
            detail = "; ".join(f"{f}: {by_id[f]['symptom']}" for f in flagged)
            checks.append(
                {
                    "name": "known-bad-deps",
                    "status": "fail",
                    "detail": detail,
                    "data": {"flagged": flagged},
                }
            )
        else:
            checks.append(
                {
                    "name": "known-bad-deps",
                    "status": "pass",
                    "detail": f"none of {len(KNOWN_BAD)} known-bad combination(s) found",
                    "data": {"flagged": []},
                }
            )
    except Exception as e:  # noqa: BLE001
        checks.append(
            {
                "name": "known-bad-deps",
                "status": "fail",
                "detail": f"probe error: {type(e).__name__}: {e}",
            }
        )
    print(json.dumps({"checks": checks, "info": {"probe": "env_report"}}))
    return 1 if any(c["status"] == "fail" for c in checks) else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001
        print(
            json.dumps(
                {
                    "checks": [
                        {
                            "name": "env-report",
                            "status": "fail",
                            "detail": f"probe crashed: {type(e).__name__}: {e}",
                        }
                    ]
                }
            )
        )
        sys.exit(1)
