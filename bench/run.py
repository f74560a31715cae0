#!/usr/bin/env python3
"""`make bench`: both builders against the manual flow and the engine's floor.

Sections (see bench/README.md):
  1. full build: assemble (warm and cold facts cache), dockerfile, manual,
     floor, interleaved rounds; the image ID of every assemble run
  2. unchanged rebuild (records), wall time including process start
  3. growth: base size (~0.2 / 2 / 8 GB) and patch width (1 / 10 / 100 files)
  4. bytes the image adds over its base vs the bytes of the patched files
  5. where the tool's time goes (cProfile of one `image --rebuild --builder assemble`)

It reports; it never fails on a number. It exits non-zero only when a step
could not run at all.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import common  # noqa: E402
import flows  # noqa: E402
import profiling  # noqa: E402
import synth  # noqa: E402
from common import (  # noqa: E402
    BASE_REPO,
    REPO,
    STANDIN,
    BenchError,
    Cleanup,
    docker,
    image_id,
    image_size,
    settle,
    sh,
    stats,
    tool,
)

RESULTS = REPO / "bench" / "results"
SIZES_GB = (0.2, 2.0, 8.0)
WIDTHS = (1, 10, 100)
TARGETS = {
    "assemble_over_floor": 1.0,
    "assemble_over_manual": 1.0,
    "dockerfile_over_manual": 1.0,
    "dockerfile_over_floor": 1.2,
    "unchanged_rebuild_s": 0.3,
    "size_growth_8g_over_0_2g": 1.2,
    "bytes_slack": 4096,
}


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def ensure_standin() -> str:
    found = image_id(STANDIN)
    if found is None:
        say(f"{STANDIN} missing: making the stand-in (about a minute)")
        tool(REPO, "standin", "--version", "0.25.1")
        found = image_id(STANDIN)
    if found is None:
        raise BenchError(f"no {STANDIN} and could not make it")
    return found


FLOWS = ("assemble", "dockerfile", "assemble-cold", "manual", "floor", "assemble-sys")
TOOLS = ("assemble", "dockerfile", "assemble-cold", "assemble-sys")


def section_full(root: Path, work: Path, cleanup: Cleanup, base_ref: str, rounds: int,
                 tag: str) -> dict[str, Any]:
    """1: every flow once per round, interleaved; the order rotates each round.

    The warm flows share one facts cache (made by the first run on this
    base); assemble-cold gets an empty one every run.
    """
    site_dir, files = flows.patched_files(root, "v0.25.1")
    floor_ctx = flows.prepare_floor(work / "floor-v0.25.1", base_ref, site_dir, files)
    manual_work = flows.prepare_manual(work / "manual", base_ref)
    warm = work / "facts-cache"
    # Untimed: fill the warm flows' facts cache for this base, so no timed
    # "assemble" or "dockerfile" run is the first on it.
    flows.run_tool(root, "v0.25.1", f"{BASE_REPO}-out:warmup-{tag}", cleanup, builder="assemble", cache=warm)
    cleanup.remove(f"{BASE_REPO}-out:warmup-{tag}")
    order = list(FLOWS)
    per_round: list[dict[str, Any]] = []
    sizes: dict[str, int] = {}
    ids: dict[str, list[str]] = {f: [] for f in TOOLS}
    base_size = image_size(base_ref)
    for r in range(rounds):
        times: dict[str, float] = {}
        hits: dict[str, int] = {}
        steps: dict[str, int] = {}
        for flow in order[r % len(order):] + order[: r % len(order)]:
            ref = f"{BASE_REPO}-out:{flow}-{tag}-{r}"
            if flow in TOOLS:
                cache = work / f"facts-cold-{r}" if flow == "assemble-cold" else warm
                # assemble-sys: the same as assemble, under the machine's own Python.
                t = flows.run_tool(root, "v0.25.1", ref, cleanup, builder=flow.split("-")[0], cache=cache,
                                   flow=flow, python=common.MACHINE_PYTHON if flow == "assemble-sys" else None)
                ids[flow].append(t.image_id)
            elif flow == "manual":
                t = flows.run_manual(manual_work, base_ref, ref, cleanup)
            else:
                t = flows.run_floor(floor_ctx, ref, cleanup)
            times[flow], hits[flow], steps[flow] = t.seconds, t.cache_hits, t.steps
            if r == 0:
                sizes[flow] = image_size(ref) - base_size
            cleanup.remove(ref)
        per_round.append({
            "round": r + 1,
            "seconds": times,
            "cache_hits": hits,
            "build_steps": steps,
            **{f"{a}_over_{b}": times[a] / times[b] for a, b in RATIOS},
        })
        say(f"  round {r + 1}: " + "  ".join(f"{k} {v:.2f}s" for k, v in times.items()))
    out: dict[str, Any] = {"rounds": per_round, "image_ids": ids}
    for flow in order:
        out[flow] = stats([p["seconds"][flow] for p in per_round])
    for a, b in RATIOS:
        out[f"{a}_over_{b}"] = stats([p[f"{a}_over_{b}"] for p in per_round])
    payload = sum(len(v) for v in files.values())
    out["bytes"] = {
        "patched_sources": sum(len(v) for k, v in files.items() if k.endswith(".py")),
        "bytecode": sum(len(v) for k, v in files.items() if k.endswith(".pyc")),
        "patched_plus_bytecode": payload,
        "added": sizes,
        "assemble_added_minus_payload": sizes.get("assemble", 0) - payload,
        "files": sorted(files),
    }
    return out


RATIOS = (("assemble", "manual"), ("assemble", "floor"), ("dockerfile", "manual"), ("dockerfile", "floor"),
          ("manual", "floor"), ("assemble-sys", "floor"))


def section_rebuild(root: Path, cleanup: Cleanup, tag: str, repeat: int) -> dict[str, Any]:
    """2: the second `image` with the same inputs reuses the recorded image."""
    ref = f"{BASE_REPO}-out:rebuild-{tag}"
    flows.run_tool(root, "v0.25.1", ref, cleanup, builder="assemble")  # the build whose record is reused
    times = []
    for _ in range(repeat):
        settle()
        r = tool(root, "image", "--base", "v0.25.1", "--no-smoke", "--tag", ref, "--builder", "assemble")
        if not (r.stdout.strip().splitlines() or [''])[-1].startswith(f"reused {ref} "):
            raise BenchError(f"unchanged rebuild did not reuse:\n{r.output[-1500:]}")
        times.append(r.seconds)
    cleanup.remove(ref)
    return {"wall": stats(times)}


def section_growth(root: Path, work: Path, cleanup: Cleanup, standin_id: str, base_ref: str,
                   reps: int, tag: str, sizes_gb: tuple[float, ...], notes: list[str]) -> dict[str, Any]:
    """3: tool and floor build time against base size and patch width."""
    # Bases of each size; made once, then found by label.
    standin_size = image_size(STANDIN)
    free = shutil.disk_usage("/").free
    size_bases: dict[str, str] = {}
    made: dict[str, float | None] = {}
    for gb in sizes_gb:
        name = f"fill-{gb:g}g"
        want = int(gb * 1024**3)
        existing = docker("images", "-q", f"{synth.FILLER_REPO}:{name}", check=False).output.strip()
        if not existing and want * 1.6 + 5 * 1024**3 > free:
            scaled = max((free - 5 * 1024**3) / 1.6, 0.2 * 1024**3)
            notes.append(f"disk: {free / 1024**3:.1f} GiB free; {name} scaled down to "
                         f"{scaled / 1024**3:.1f} GiB")
            want = int(scaled)
        ref, seconds = synth.filler(standin_id, name, want, standin_size, notes)
        made[name] = seconds
        free = shutil.disk_usage("/").free
        synth.definition(root, name, synth.FILLER_REPO, "v0.25.1")
        size_bases[name] = ref
    # Patch sets of each width against real vllm files of the stand-in.
    pkg = synth.extract_package(base_ref, Path(tempfile.mkdtemp(dir=work, prefix="pkg-")))
    chosen = synth.pick_files(pkg, max(WIDTHS))
    width_bases: dict[str, str] = {}
    for n in WIDTHS:
        name = f"n{n}"
        rels = chosen[:: max(WIDTHS) // n][:n]
        synth.patch_set(root, pkg, name, rels)
        synth.definition(root, name, BASE_REPO, name)
        ref = cleanup.add(f"{BASE_REPO}:{name}")
        docker("tag", base_ref, ref)
        width_bases[name] = ref
    # Floor contexts: the same bytes the tool ships.
    floors: dict[str, Path] = {}
    for name, ref in {**size_bases, **width_bases}.items():
        base_tag = name
        site_dir, files = flows.patched_files(root, base_tag)
        floors[name] = flows.prepare_floor(work / f"floor-{name}", ref, site_dir, files)
    cases = list(size_bases) + list(width_bases)
    for case in cases:  # untimed, as in section 1: fill the facts cache for each base
        flows.run_tool(root, case, f"{BASE_REPO}-out:warmup-{case}-{tag}", cleanup, builder="assemble",
                       cache=work / "facts-cache")
        cleanup.remove(f"{BASE_REPO}-out:warmup-{case}-{tag}")
    growth_flows = ("assemble", "dockerfile", "floor")
    results: dict[str, dict[str, list[float]]] = {c: {f: [] for f in (*growth_flows, "steps")} for c in cases}
    hits = 0
    for rep in range(reps):
        for case in cases:
            for flow in growth_flows[rep % 3:] + growth_flows[: rep % 3]:
                ref = f"{BASE_REPO}-out:{flow}-{case}-{tag}-{rep}"
                if flow != "floor":
                    t = flows.run_tool(root, case, ref, cleanup, builder=flow, cache=work / "facts-cache")
                    if flow == "dockerfile":
                        results[case]["steps"].append(t.steps)
                else:
                    t = flows.run_floor(floors[case], ref, cleanup)
                hits += t.cache_hits
                results[case][flow].append(t.seconds)
                cleanup.remove(ref)
        say(f"  growth rep {rep + 1}: " + "  ".join(
            f"{c} {results[c]['assemble'][-1]:.2f}/{results[c]['dockerfile'][-1]:.2f}/{results[c]['floor'][-1]:.2f}s"
            for c in cases))
    out: dict[str, Any] = {"cache_hits": hits, "fillers_made_s": made, "cases": {}}
    for case in cases:
        ref = size_bases.get(case) or width_bases[case]
        out["cases"][case] = {
            "base_bytes": image_size(ref),
            **{f: stats(results[case][f]) for f in growth_flows},
            "dockerfile_build_steps": results[case]["steps"][0] if results[case]["steps"] else None,
        }
    shutil.rmtree(pkg.parent, ignore_errors=True)
    return out


def verdicts(res: dict[str, Any]) -> list[dict[str, Any]]:
    full, growth = res["full"], res["growth"]["cases"]
    small, big = f"fill-{SIZES_GB[0]:g}g", f"fill-{SIZES_GB[-1]:g}g"
    growth_ratio = growth[big]["assemble"]["median"] / growth[small]["assemble"]["median"]
    floor_growth = growth[big]["floor"]["median"] / growth[small]["floor"]["median"]
    b = full["bytes"]
    distinct = {f: sorted(set(v)) for f, v in full["image_ids"].items() if f.startswith("assemble")}
    all_ids = {i for v in distinct.values() for i in v}
    same_bytes = b["added"].get("assemble") == b["added"].get("dockerfile")

    def ratio(a: str, b: str, limit: float) -> tuple[str, float, float, str]:
        med = full[f"{a}_over_{b}"]["median"]
        return (f"{a} / {b} <= {limit:g}", med, limit, f"{med:.2f} (median of per-round ratios)")

    rows = [
        ratio("assemble", "floor", TARGETS["assemble_over_floor"]),
        ratio("assemble", "manual", TARGETS["assemble_over_manual"]),
        ratio("dockerfile", "manual", TARGETS["dockerfile_over_manual"]),
        ratio("dockerfile", "floor", TARGETS["dockerfile_over_floor"]),
        ("unchanged rebuild <= 0.3 s", res["rebuild"]["wall"]["median"], TARGETS["unchanged_rebuild_s"],
         f"{res['rebuild']['wall']['median']:.3f} s"),
        ("assemble at 8 GB <= 1.2 x at 0.2 GB", growth_ratio, TARGETS["size_growth_8g_over_0_2g"],
         f"{growth_ratio:.2f}x (floor: {floor_growth:.2f}x)"),
        ("bytes added <= files + bytecode + 4 KiB", b["added"].get("assemble", 0),
         b["patched_plus_bytecode"] + TARGETS["bytes_slack"],
         f"{b['added'].get('assemble', 0)} B added vs {b['patched_plus_bytecode']} B payload "
         f"({b['assemble_added_minus_payload']:+d} B); dockerfile {b['added'].get('dockerfile', 0)} B"),
        ("one image ID for every assemble run", len(all_ids), 1,
         f"{len(all_ids)} distinct in {sum(len(v) for v in full['image_ids'].values() if v)} runs"),
        ("both builders add the same bytes", 0 if same_bytes else 1, 0,
         "yes" if same_bytes else "no"),
    ]
    return [{"target": t, "value": v, "limit": lim, "met": v <= lim, "figure": fig}
            for t, v, lim, fig in rows]


def table(res: dict[str, Any]) -> str:
    full = res["full"]
    n = full["assemble"]["n"]
    lines = ["", f"== 1. Full build of the v0.25.1 patched image ({n} interleaved rounds, medians; cache hits: "
             f"{sum(sum(r['cache_hits'].values()) for r in full['rounds'])}) =="]
    lines.append(f"  {'flow':<14} {'median s':>9} {'min':>7} {'max':>7} {'steps':>6}")
    for flow in FLOWS:
        s = full[flow]
        lines.append(f"  {flow:<14} {s['median']:>9.3f} {s['min']:>7.3f} {s['max']:>7.3f} "
                     f"{full['rounds'][0]['build_steps'][flow]:>6}")
    lines.append("  per-round ratios (assemble/floor, assemble/manual, dockerfile/floor): " + "  ".join(
        f"r{r['round']} {r['assemble_over_floor']:.2f} {r['assemble_over_manual']:.2f} "
        f"{r['dockerfile_over_floor']:.2f}" for r in full["rounds"]))
    lines.append("  median ratios: " + "  ".join(
        f"{a}/{b} {full[f'{a}_over_{b}']['median']:.2f}" for a, b in RATIOS))
    for flow, found in full["image_ids"].items():
        lines.append(f"  image IDs, {flow:<13}: " + "  ".join(f"r{i + 1} {v.removeprefix('sha256:')[:16]}"
                                                            for i, v in enumerate(found)))
    reb = res["rebuild"]["wall"]
    lines.append(f"\n== 2. Unchanged rebuild (records), wall incl. process start: median "
                 f"{reb['median']:.3f} s (min {reb['min']:.3f}, max {reb['max']:.3f}, n={reb['n']})")
    lines.append(f"     process start alone: python -c pass {res['start']['python_bare_s']:.3f} s "
                 f"(python -S, no site initialization: {res['start'].get('python_nosite_s', float('nan')):.3f} s; "
                 f"the machine's python: {res['start'].get('machine_python_bare_s', float('nan')):.3f} s), "
                 f"+ import vllm_hotfix.cli {res['start']['python_import_cli_s']:.3f} s")
    g = res["growth"]
    n = next(iter(g["cases"].values()))["assemble"]["n"]
    lines.append(f"\n== 3. Growth (assemble, dockerfile and floor, medians of {n}"
                 f"; cache hits: {g['cache_hits']}) ==")
    lines.append(f"  {'case':<10} {'base GB':>8} {'asm s':>8} {'dfile s':>8} {'floor s':>8} {'a/f':>6} {'d/f':>6}"
                 f" {'steps':>6}")
    for case, c in g["cases"].items():
        fl = c["floor"]["median"]
        lines.append(f"  {case:<10} {c['base_bytes'] / 1e9:>8.2f} {c['assemble']['median']:>8.3f} "
                     f"{c['dockerfile']['median']:>8.3f} {fl:>8.3f} {c['assemble']['median'] / fl:>6.2f} "
                     f"{c['dockerfile']['median'] / fl:>6.2f} {c['dockerfile_build_steps'] or 0:>6}")
    b = full["bytes"]
    lines.append(f"\n== 4. Bytes added over the base: assemble {b['added'].get('assemble')}  dockerfile "
                 f"{b['added'].get('dockerfile')}  manual "
                 f"{b['added'].get('manual')}  floor {b['added'].get('floor')};  patched sources "
                 f"{b['patched_sources']} + bytecode {b['bytecode']} = {b['patched_plus_bytecode']}")
    p = res["profile"]
    lines.append(f"\n== 5. Where the tool's time goes (cProfile of one image --rebuild --builder assemble, warm; wall "
                 f"{p['wall_s']:.3f} s, profiled {p['profiled_s']:.3f} s, {p['engine_round_trips']} engine "
                 f"round trips {p['engine_round_trips_s']:.3f} s, {p['build_steps']} build steps) ==")
    bare = res["start"]["python_bare_s"]
    lines.append(f"  {'interpreter start (python -c pass, unprofiled)':<48} {bare:>7.3f} s")
    for s in p["steps"]:
        lines.append(f"  {s['step']:<48} {s['seconds']:>7.3f} s  ({s['calls']} calls)")
    lines.append("\n== Targets ==")
    for v in res["verdicts"]:
        lines.append(f"  [{'met' if v['met'] else 'MISSED':>6}] {v['target']:<42} {v['figure']}")
    for n in res["notes"]:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7, help="interleaved rounds of section 1 (>= 5)")
    ap.add_argument("--reps", type=int, default=3, help="repetitions per growth case")
    ap.add_argument("--sizes", default=",".join(f"{s:g}" for s in SIZES_GB), help="base sizes in GB")
    ap.add_argument("--out", type=Path, default=None, help="results file (default bench/results/<date>.json)")
    ap.add_argument("--python", default="venv",
                    help="the tool's interpreter: venv (a virtual environment over the machine's packages, "
                         "the default), machine (this Python), or a path")
    args = ap.parse_args(argv)
    sizes = tuple(float(s) for s in args.sizes.split(","))
    globals()["SIZES_GB"] = sizes
    started = time.perf_counter()
    tag = uuid.uuid4().hex[:8]
    notes: list[str] = []
    cleanup = Cleanup()
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-bench-"))
    root = work / "root"
    res: dict[str, Any] = {}
    try:
        say(f"disk: {shutil.disk_usage('/').free / 1024**3:.1f} GiB free on /; load {os.getloadavg()}")
        # As `pip install` does: every tool run then starts from bytecode, also
        # where PYTHONDONTWRITEBYTECODE is set (each start would otherwise
        # compile the package from source).
        sh([sys.executable, "-m", "compileall", "-q", str(REPO / "vllm_hotfix")])
        if args.python == "venv":
            common.PYTHON = common.tool_venv(work / "venv")
        elif args.python != "machine":
            common.PYTHON = args.python
        res["python"] = {"tool": common.PYTHON, "machine": common.MACHINE_PYTHON}
        standin_id = ensure_standin()
        common.copy_definitions(root)
        base_ref = flows.bench_base(cleanup, standin_id, "v0.25.1")
        synth.definition(root, "v0.25.1", BASE_REPO, "v0.25.1")
        load_before = os.getloadavg()
        say("== 1. full build: " + " / ".join(FLOWS))
        res["full"] = section_full(root, work, cleanup, base_ref, max(args.rounds, 1), tag)
        say("== 2. unchanged rebuild")
        res["rebuild"] = section_rebuild(root, cleanup, tag, 5)
        res["start"] = profiling.process_start()
        say("== 3. growth: base size and patch width")
        res["growth"] = section_growth(root, work, cleanup, standin_id, base_ref, args.reps, tag, sizes,
                                       notes)
        say("== 5. profile")
        ref = cleanup.add(f"{BASE_REPO}-out:profile-{tag}")
        res["profile"] = profiling.profile(root, "v0.25.1", ref, work, work / "facts-cache")
        cleanup.remove(ref)
        res["verdicts"] = verdicts(res)
        others = docker("ps", "-q", check=False).output.split()
        res["environment"] = {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "docker": docker("version", "-f", "{{.Server.Version}}").output.strip(),
            "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(),
            "other_containers_running_at_end": len(others),
            "fairness": "every flow builds FROM a bench-only base (stand-in + one layer of this run's own + "
                        "one LABEL) and each run's image is removed with its intermediate layers before the "
                        "next run; layer-cache hits are counted and reported (expected 0)",
        }
        res["notes"] = notes
        res["bench_wall_s"] = time.perf_counter() - started
        print(table(res))
        RESULTS.mkdir(parents=True, exist_ok=True)
        out = args.out or RESULTS / f"{dt.date.today().isoformat()}.json"
        out.write_text(json.dumps(res, indent=2, sort_keys=True) + "\n")
        print(f"\nresults: {out.relative_to(REPO) if out.is_relative_to(REPO) else out}  "
              f"(bench wall {res['bench_wall_s']:.0f} s)")
        return 0
    except BenchError as exc:
        say(f"bench error: {exc}")
        return 1
    finally:
        cleanup.all()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
