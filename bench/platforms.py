#!/usr/bin/env python3
"""`make bench-platforms`: wall time of `image` + `push`, one platform vs two, on stand-ins.

Needs a Docker engine that keeps local images' platforms (26.1, API 1.45:
DOCKER_HOST) with qemu registered for the other architecture, and a registry
(--registry, default 127.0.0.1:5000). It publishes a two-platform stand-in
index there (once), then for each round and each case builds with --rebuild
(so nothing is reused) into a fresh output tag and pushes into a fresh
repository path (so every layer is uploaded), timing each command as a user
runs it. The bases are pulled once, before the first round, and reused.

It reports; it never fails on a number.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from common import REPO, copy_definitions  # noqa: E402

# case -> (image --platform, push --platform or None for a plain single-image push)
CASES = {
    "one platform, plain push (no index)": ("linux/amd64", None),
    "one platform, index of one": ("linux/amd64", "linux/amd64"),
    "two platforms, index of two": ("all", "all"),
}


def tool(*args: str, root: Path) -> tuple[float, str]:
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "build.py"), "--root", str(root), *args],
                          capture_output=True, text=True)
    took = time.monotonic() - start
    if proc.returncode != 0:
        sys.exit(f"{' '.join(args[:2])} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return took, proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--registry", default="127.0.0.1:5000")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    run = uuid.uuid4().hex[:8]
    root = Path(tempfile.mkdtemp(prefix="vllm-hotfix-bench-platforms-"))
    try:
        copy_definitions(root)
        where = f"{args.registry}/bench-{run}"
        took, _ = tool("standin", "--version", "0.25.1", "--platform", "linux/amd64,linux/arm64",
                       "--publish", where, root=root)
        print(f"publish the two-platform stand-in index: {took:.1f} s")
        base_repo = f"{where}/vllm-openai"
        results: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}
        for rnd in range(args.rounds):
            for n, (case, (plat, push_plat)) in enumerate(CASES.items()):
                out = f"bench-{run}/out:r{rnd}-c{n}"
                t_image, _ = tool("image", "--base", "v0.25.1", "--base-repo", base_repo, "--platform", plat,
                                  "--tag", out, "--rebuild", root=root)
                dest = ["--registry", f"{where}/push-r{rnd}-c{n}", "--allow-gpu-unverified"]
                if push_plat is None:
                    t_push, _ = tool("push", f"{out}-x86_64", *dest, root=root)
                else:
                    t_push, _ = tool("push", out, "--platform", push_plat, *dest, root=root)
                results[case].append({"image_s": round(t_image, 1), "push_s": round(t_push, 1),
                                      "total_s": round(t_image + t_push, 1)})
                print(f"round {rnd + 1} {case}: image {t_image:.1f} s + push {t_push:.1f} s "
                      f"= {t_image + t_push:.1f} s")
        print(json.dumps({"engine": os.environ.get("DOCKER_HOST", "default"), "results": results}, indent=2))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        remove_refs(f"bench-{run}/")
    return 0


def remove_refs(marker: str) -> None:
    """Remove every tag and pulled digest reference this run made (and the layers only they hold)."""
    ids = subprocess.run(["docker", "image", "ls", "-q", "--no-trunc"], capture_output=True, text=True).stdout.split()
    if not ids:
        return
    found = subprocess.run(["docker", "image", "inspect", *sorted(set(ids))], capture_output=True, text=True).stdout
    refs = [ref for image in json.loads(found or "[]")
            for ref in (image.get("RepoTags") or []) + (image.get("RepoDigests") or []) if marker in ref]
    for ref in refs:
        subprocess.run(["docker", "image", "rm", ref], capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
