"""GPU probe: torch sees the GPUs, and small kernels run correctly on them.

Run inside a container (or on a GPU machine) as
``python3 gpu_check.py [--extra DIR_OR_FILE ...] [--timeout S] [--extra-args ARGS]
[--modules MODULE ...] [--imports-only]``.
Prints one JSON object ``{"checks": [...], "info": {...}}``; exit code 1 when
any check fails. Stdlib only at top level; torch and triton are imported lazily.

Checks:
* ``gpu-torch``: torch imports, ``torch.cuda.is_available()`` and at least one
  device; ``data`` lists every device's name and compute capability.
* ``gpu-kernel``: a 512x512 float32 matmul on each device against a float64 CPU
  reference, relative error (Frobenius) < 1e-3. TF32 is switched off for it.
* ``gpu-triton``: when triton imports, a tiny Triton add kernel against torch
  (exact); ``skip`` when triton is absent.
* ``model-imports`` (with ``--modules``): each named module of the image
  imports, in a process of its own (a crash in a compiled extension is
  reported, not fatal); ``fail`` with ``import_errors`` naming each module
  that does not and why.
When torch is absent or CUDA is unavailable, these are ``skip`` (the image may
be probed on a host without GPUs); torch importable but broken is a ``fail``.

Every check says what it ran against (``ran_against``: ``torch``,
``triton``, ``vllm``, or ``stub`` when a stand-in replaced some of the
image's code) so that the tool can refuse evidence from anything but the
image's own code; an extra script reports it the same way, with ``stubs``
and ``import_errors`` where it fell back.

``--imports-only``: only ``model-imports`` (to ask the image's base the same).

``--extra``: more check scripts (files, or every ``*.py`` in a directory,
sorted) run with the same python as subprocesses, side by side with each
other, with ``model-imports`` and with the torch checks (``--timeout`` each, default
600 s); their ``checks`` are merged into the output. A script that times out,
crashes or prints no JSON yields a failing check named after the script.
``--extra-args`` is split (shlex) and appended to every extra script's
arguments (e.g. ``--extra-args "--vllm-src /path"``).

``--devices N`` (a tensor-parallel server's GPUs): each extra script runs on
each of the first N GPUs, side by side, each seeing one
(``CUDA_VISIBLE_DEVICES``); a check is reported once, with the worst status
of the GPUs (fail, then skip, then pass), every GPU's detail, and each run
under ``data.per_gpu``.

Every child Python (the importer, each extra script) starts as this probe
did: with its flags for no site module, no user site and no bytecode, and
(without the site module) its ``sys.path`` as ``PYTHONPATH``, so a ``.pth``
file or ``sitecustomize`` the runner keeps out of this probe stays out of its
children too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from typing import Any

MATMUL_N = 512
MATMUL_RTOL = 1e-3


# Imports each module named in argv in this order, one JSON line per module
# as it goes, so a process that dies on one still tells about the ones before.
IMPORTER = r"""
import importlib, json, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
        error = None
    except BaseException as e:
        error = (type(e).__name__ + ": " + str(e))[:500]
    print(json.dumps({"module": name, "error": error}), flush=True)
"""


def check(name: str, status: str, detail: str, data: dict[str, Any] | None = None,
          ran_against: str | None = None) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "status": status, "detail": detail}
    if data is not None:
        c["data"] = data
    if ran_against:
        c["ran_against"] = ran_against
    return c


def python(args: list[str]) -> list[str]:
    """A child Python's command line, with the isolation flags this probe was started with."""
    flags = [flag for flag, on in (("-s", sys.flags.no_user_site), ("-S", sys.flags.no_site),
                                   ("-B", sys.flags.dont_write_bytecode)) if on]
    return [sys.executable, *flags, *args]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A child's environment: this one, and where this probe runs without the site module, its sys.path as
    PYTHONPATH (all the child, started the same way, finds)."""
    path = {"PYTHONPATH": os.pathsep.join(p for p in sys.path if p)} if sys.flags.no_site else {}
    return {**os.environ, **path, **(extra or {})}


def import_errors(modules: list[str], timeout: float) -> dict[str, str]:
    """module -> why it does not import, for each of ``modules`` that does not."""
    if not modules:
        return {}
    try:
        p = subprocess.run(python(["-c", IMPORTER, *modules]), capture_output=True, text=True,
                           timeout=timeout, check=False, env=child_env())
        out, why = p.stdout, f"the importing process exited {p.returncode}"
        tail = " | ".join((p.stderr or "").strip().splitlines()[-2:])[-300:]
        if tail:
            why += f": {tail}"
    except subprocess.TimeoutExpired as e:
        raw = e.stdout or ""
        out = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        why = f"importing took longer than {timeout:g} s"
    answered: dict[str, str | None] = {}
    for line in out.splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("module"), str):
            answered[rec["module"]] = rec.get("error") if isinstance(rec.get("error"), str) else None
    errors: dict[str, str] = {}
    for name in modules:
        if name not in answered:
            errors[name] = why  # never reached: the process died or hung before it
        elif answered[name] is not None:
            errors[name] = str(answered[name])
    return errors


def check_imports(modules: list[str], timeout: float) -> dict[str, Any]:
    errors = import_errors(modules, timeout)
    c = check("model-imports", "pass", f"{len(modules)} module(s) import: {', '.join(modules)}",
              {"modules": modules}, ran_against="vllm")
    if errors:
        c["status"] = "fail"
        c["detail"] = f"{len(errors)} of {len(modules)} module(s) do not import: " + "; ".join(
            f"{m} ({e.splitlines()[0][:160] if e else ''})" for m, e in errors.items())
        c["import_errors"] = errors
    return c


def check_torch() -> tuple[list[dict[str, Any]], Any]:
    """gpu-torch; returns (checks, torch module or None when GPU checks can't run)."""
    try:
        import torch
    except ImportError as e:
        return [check("gpu-torch", "skip", f"torch not importable: {e}")], None
    except Exception as e:  # noqa: BLE001
        return [check("gpu-torch", "fail", f"importing torch raised {type(e).__name__}: {e}")], None
    try:
        if not torch.cuda.is_available():
            return [
                check(
                    "gpu-torch",
                    "skip",
                    f"torch {torch.__version__} (cuda {torch.version.cuda}): "
                    "torch.cuda.is_available() is False",
                )
            ], None
        n = torch.cuda.device_count()
        devices: list[dict[str, Any]] = []
        for i in range(n):
            major, minor = torch.cuda.get_device_capability(i)
            devices.append({"index": i, "name": torch.cuda.get_device_name(i), "capability": [major, minor]})
        if n < 1:
            return [check("gpu-torch", "fail", "CUDA available but device_count() == 0")], None
        names = ", ".join(f"{d['name']} (sm_{d['capability'][0]}{d['capability'][1]})" for d in devices)
        data = {"torch": torch.__version__, "cuda": torch.version.cuda, "devices": devices}
        return [check("gpu-torch", "pass", f"{n} device(s): {names}", data, "torch")], torch
    except Exception as e:  # noqa: BLE001
        return [check("gpu-torch", "fail", f"{type(e).__name__}: {e}")], None


def check_matmul(torch: Any) -> dict[str, Any]:
    try:
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        g = torch.Generator().manual_seed(0)
        a = torch.randn(MATMUL_N, MATMUL_N, generator=g, dtype=torch.float32)
        b = torch.randn(MATMUL_N, MATMUL_N, generator=g, dtype=torch.float32)
        ref = a.double() @ b.double()
        errs = []
        for i in range(torch.cuda.device_count()):
            dev = torch.device("cuda", i)
            c = (a.to(dev) @ b.to(dev)).cpu().double()
            torch.cuda.synchronize(dev)
            errs.append(float((c - ref).norm() / ref.norm()))
        torch.backends.cuda.matmul.allow_tf32 = prev
        worst = max(errs)
        status = "pass" if worst < MATMUL_RTOL else "fail"
        return check(
            "gpu-kernel",
            status,
            f"fp32 {MATMUL_N}x{MATMUL_N} matmul vs fp64 CPU: max rel err {worst:.2e} (< {MATMUL_RTOL:g})",
            {"rel_err_per_device": errs, "tolerance": MATMUL_RTOL},
            "torch",
        )
    except Exception as e:  # noqa: BLE001
        return check("gpu-kernel", "fail", f"{type(e).__name__}: {e}")


def check_triton(torch: Any) -> dict[str, Any]:
    try:
        import triton
        import triton.language as tl
    except ImportError as e:
        return check("gpu-triton", "skip", f"triton not importable: {e}")
    except Exception as e:  # noqa: BLE001
        return check("gpu-triton", "fail", f"importing triton raised {type(e).__name__}: {e}")
    try:

        @triton.jit
        def _add(x_ptr, y_ptr, o_ptr, n, BLOCK: tl.constexpr):
            offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + offs, mask=mask)
            y = tl.load(y_ptr + offs, mask=mask)
            tl.store(o_ptr + offs, x + y, mask=mask)

        n = 98_765
        x = torch.randn(n, device="cuda")
        y = torch.randn(n, device="cuda")
        o = torch.empty_like(x)
        t0 = time.time()
        _add[(triton.cdiv(n, 1024),)](x, y, o, n, BLOCK=1024)
        torch.cuda.synchronize()
        secs = time.time() - t0
        ok = bool(torch.equal(o, x + y))
        return check(
            "gpu-triton",
            "pass" if ok else "fail",
            f"triton {triton.__version__} add kernel, {n} elements: "
            + ("equal to torch" if ok else "DIFFERS from torch"),
            {"triton": triton.__version__, "first_launch_s": round(secs, 3)},
            "triton",
        )
    except Exception as e:  # noqa: BLE001
        return check("gpu-triton", "fail", f"{type(e).__name__}: {e}")


def extra_scripts(paths: list[str]) -> list[str]:
    out: list[str] = []
    for p in paths:
        if os.path.isdir(p):
            out += sorted(
                os.path.join(p, f) for f in os.listdir(p) if f.endswith(".py") and not f.startswith("_")
            )
        else:
            out.append(p)
    return out


def run_extra(script: str, timeout: float, extra_args: list[str],
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Run one extra check script (``env``: more of its environment); return its checks (or one failing
    check)."""
    base = os.path.splitext(os.path.basename(script))[0]
    if not os.path.isfile(script):
        return [check(f"extra:{base}", "fail", f"no such file: {script}")]
    t0 = time.time()
    try:
        p = subprocess.run(
            python([script, *extra_args]),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            env=child_env(env),
        )
    except subprocess.TimeoutExpired:
        return [check(f"extra:{base}", "fail", f"timed out after {timeout:g}s")]
    except Exception as e:  # noqa: BLE001
        return [check(f"extra:{base}", "fail", f"could not run: {type(e).__name__}: {e}")]
    secs = round(time.time() - t0, 2)
    parsed = parse_last_json(p.stdout)
    if parsed is None or not isinstance(parsed.get("checks"), list):
        tail = " | ".join((p.stderr or p.stdout or "").strip().splitlines()[-4:])[-600:]
        return [check(f"extra:{base}", "fail", f"exit {p.returncode}, no JSON checks: {tail}")]
    checks = []
    for c in parsed["checks"]:
        if not isinstance(c, dict) or "name" not in c or c.get("status") not in ("pass", "fail", "skip"):
            checks.append(check(f"extra:{base}", "fail", f"malformed check: {str(c)[:200]}"))
            continue
        c = dict(c)
        c.setdefault("data", {})
        if isinstance(c["data"], dict):
            c["data"].setdefault("script", script)
            c["data"].setdefault("seconds", secs)
        checks.append(c)
    if p.returncode != 0 and not any(c["status"] == "fail" for c in checks):
        checks.append(check(f"extra:{base}", "fail", f"exit {p.returncode} with no failing check"))
    if isinstance(parsed.get("info"), dict):
        checks_info = parsed["info"]
        for c in checks:
            if isinstance(c.get("data"), dict):
                c["data"].setdefault("script_info", checks_info)
                break
    return checks


RANK = {"fail": 0, "skip": 1, "pass": 2}


def visible(count: int) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` value that shows each of the first ``count`` GPUs of this process alone."""
    given = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return [given[i] if i < len(given) else str(i) for i in range(count)]


def on_devices(script: str, timeout: float, extra_args: list[str], count: int) -> list[dict[str, Any]]:
    """One extra script on each of the first ``count`` GPUs, side by side, its checks merged by name."""
    from concurrent.futures import ThreadPoolExecutor

    devices = visible(count)
    with ThreadPoolExecutor(max_workers=count) as pool:
        runs = list(pool.map(lambda d: run_extra(script, timeout, extra_args, {"CUDA_VISIBLE_DEVICES": d}),
                             devices))
    return merge_devices(runs)


def merge_devices(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Checks of the same script on several GPUs (``runs[i]``: GPU i's), one per name: the worst status,
    every GPU's detail, each GPU's check under ``data.per_gpu``; a check a GPU did not report fails."""
    names: list[str] = []
    for run in runs:
        names += [c["name"] for c in run if c["name"] not in names]
    merged = []
    for name in names:
        per = [next((c for c in run if c["name"] == name), None) for run in runs]
        seen = [c if c is not None else check(name, "fail", "not reported on this GPU") for c in per]
        worst = min(seen, key=lambda c: RANK.get(c["status"], 0))
        out = {k: v for k, v in worst.items() if k not in ("detail", "data")}
        out["detail"] = "; ".join(f"GPU {i}: {c['detail']}" for i, c in enumerate(seen))
        out["data"] = {"per_gpu": [{"gpu": i, **c} for i, c in enumerate(seen)]}
        # What any GPU's run stood on instead of the image's code stands against the merged check, and where
        # the runs do not agree on what they ran against, none of their claims stands.
        said = {c.get("ran_against") for c in seen}
        if "stub" in said:
            out["ran_against"] = "stub"
        elif len(said) > 1:
            out.pop("ran_against", None)
        stubs = sorted({str(s) for c in seen for s in c.get("stubs") or ()})
        if stubs:
            out["stubs"] = stubs
        errors = {m: e for c in seen for m, e in (c.get("import_errors") or {}).items()}
        if errors:
            out["import_errors"] = errors
        merged.append(out)
    return merged


def parse_last_json(text: str) -> dict[str, Any] | None:
    for line in reversed((text or "").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                return obj
    try:
        obj = json.loads(text)
        return obj if isinstance(obj, dict) else None
    except ValueError:
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU probe")
    ap.add_argument("--extra", nargs="*", default=[], help="extra check scripts or dirs")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per extra script")
    ap.add_argument("--extra-args", default="", help="arguments appended to every extra script")
    ap.add_argument("--modules", nargs="*", default=[], help="modules of the image that must import")
    ap.add_argument("--imports-only", action="store_true", help="only the model-imports check")
    ap.add_argument("--devices", type=int, default=1, help="run each extra script on each of the first N GPUs")
    args = ap.parse_args(argv)

    info: dict[str, Any] = {"probe": "gpu_check", "python": sys.version.split()[0]}
    if args.imports_only:
        checks = [check_imports(args.modules, args.timeout)]
        print(json.dumps({"checks": checks, "info": info}))
        return 1 if checks[0]["status"] == "fail" else 0
    # The imports and each extra script are processes of their own: they run side by side with the torch
    # checks here (the GPU checks' wall time is the longest of them, not their sum), reported in this order.
    from concurrent.futures import ThreadPoolExecutor

    extra_args = shlex.split(args.extra_args)
    scripts = extra_scripts(args.extra)
    with ThreadPoolExecutor(max_workers=1 + len(scripts)) as pool:
        imports = pool.submit(check_imports, args.modules, args.timeout) if args.modules else None
        extras = [pool.submit(run_extra, script, args.timeout, extra_args) if args.devices <= 1
                  else pool.submit(on_devices, script, args.timeout, extra_args, args.devices) for script in scripts]
        checks, torch = check_torch()
        if torch is not None:
            checks.append(check_matmul(torch))
            checks.append(check_triton(torch))
        else:
            reason = checks[0]["detail"]
            checks.append(check("gpu-kernel", "skip", f"no usable GPU: {reason}"))
            checks.append(check("gpu-triton", "skip", f"no usable GPU: {reason}"))
        if imports is not None:
            checks.append(imports.result())
        for done in extras:
            checks += done.result()
    print(json.dumps({"checks": checks, "info": info}))
    return 1 if any(c["status"] == "fail" for c in checks) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException as e:  # noqa: BLE001
        print(json.dumps({"checks": [check("gpu-torch", "fail", f"probe crashed: {type(e).__name__}: {e}")]}))
        sys.exit(1)
