#!/usr/bin/env python3
"""`make bench-registry`: `image --in-registry` against `docker pull` of the base alone, side by side.

For each base size (default 1 and 4 GiB) it makes a stand-in base whose
every layer is its own (the Debian root file system imported with a marker
file, so that no image the engine holds shares a layer with it), laid out
as vLLM images are: the root file system, FILLER_LAYERS layers of random
bytes (vLLM's dependencies stand in), then vLLM's Python sources and
dist-info, then the stand-in's .pth file. It pushes it to a registry of its
own (Debian's docker-registry on a free loopback port, removed at the end)
and removes it from the engine. Then, in interleaved rounds, from a state
where the engine holds none of it:

- **in-registry**: `python build.py image --definition v0.25.1 --base-repo REG/... --in-registry --tag
  REG/bench-rN/...` in a fresh process, into a fresh repository, then the new tag read back (manifest,
  config); the time is to the end of that read;
- **pull**: `docker pull` of the base alone, the base removed again after it.

Bytes read from the registry come from the tool's own count (what its
readers took from each response) and, in one more run per size, from a
relay in front of the registry that counts every byte it forwarded to the
tool. Two last cases (one round each) put the filler layers above vLLM's
instead, and lay the base out as vLLM's own docker/Dockerfile lays out
vllm/vllm-openai (vLLM installed in one step with torch and every
requirement, then FlashInfer, then the OpenAI server's extras): what a
layout with big layers at or above the package costs, a first build and a
repeat one.

It reports; it never fails on a number.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from common import REPO, BenchError, copy_definitions, docker, median, sh  # noqa: E402

RESULTS = REPO / "bench" / "results"
FILLER_LAYERS = 4
BYTECODE = "the tool's modules compiled (compileall) before the rounds, as Python caches them after a first run"
GiB = 1024**3
SITE = "/usr/local/lib/python3.12/dist-packages"
ACCEPT = "application/vnd.docker.distribution.manifest.v2+json, application/vnd.oci.image.manifest.v1+json"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Registry:
    """Debian's docker-registry on a free loopback port, its storage in ``folder``."""

    def __init__(self, folder: Path) -> None:
        self.addr = f"127.0.0.1:{free_port()}"
        config = folder / "registry.yml"
        config.write_text("version: 0.1\nlog: {level: error}\n"
                          f"storage: {{filesystem: {{rootdirectory: {folder / 'data'}}}}}\n"
                          f"http: {{addr: {self.addr}}}\n")
        exe = shutil.which("docker-registry")
        if exe is None:
            raise BenchError("docker-registry is not installed (apt-get install docker-registry)")
        self.proc = subprocess.Popen([exe, "serve", str(config)], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                if requests.get(f"http://{self.addr}/v2/", timeout=1).ok:
                    return
            except requests.RequestException:
                time.sleep(0.1)
        raise BenchError("the bench's registry did not start")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


class Relay:
    """A TCP relay in front of the registry that counts the bytes it forwards to the client."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream.split(":")
        self.to_client = 0
        self._lock = threading.Lock()
        self._server = socket.socket()
        self._server.bind(("127.0.0.1", 0))
        self._server.listen(16)
        self.addr = f"127.0.0.1:{self._server.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:
                return
            server = socket.create_connection((self.upstream[0], int(self.upstream[1])))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, counted: bool) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
                if counted:
                    with self._lock:
                        self.to_client += len(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._server.close()


def unique_rootfs(work: Path, run: str) -> str:
    """The stand-ins' Debian root file system with a marker file, imported: a bottom layer no image shares."""
    from vllm_hotfix.building import standin
    from vllm_hotfix.building.sources import cache_dir
    from vllm_hotfix.engine import Engine

    engine = Engine.connect()
    standin.rootfs(engine, REPO, print)  # makes the cached root file system tar once
    source = cache_dir(REPO) / f"rootfs-{standin.ROOTFS}.tar"
    tar = work / "rootfs.tar"
    shutil.copy(source, tar)
    marker = work / "bench-marker"
    marker.write_text(f"vllm-hotfix registry bench {run}\n")
    with tarfile.open(tar, "a") as t:
        t.add(marker, arcname="./etc/vllm-hotfix-bench-marker")
    ref = f"vllm-hotfix-bench/registry-rootfs:{run}"
    sh(["docker", "import", str(tar), ref], timeout=600)
    tar.unlink()
    return ref


def make_base(work: Path, rootfs: str, ref: str, filler_bytes: int, filler_above: bool,
              upstream: bool = False) -> None:
    """The stand-in laid out as a vLLM image: root file system, filler, vLLM, .pth (or the filler on top).

    ``upstream``: laid out as vLLM's own docker/Dockerfile lays out vllm/vllm-openai: the vLLM wheel installed
    in the same step as torch and every requirement (one layer: here 80% of the filler, under the site folder
    as torch/ and nvidia/, both sorting before vllm/), then a layer of FlashInfer (15%, flashinfer/), then
    the OpenAI server's extra requirements (5%, accelerate/)."""
    from vllm_hotfix.building import standin, wheels
    from vllm_hotfix.tarball import tar_bytes

    whl = wheels.release(REPO, "0.25.1", print)
    files = {f"site/{k}": v for k, v in standin.wheel_sources(whl, "0.25.1").items()}
    files["vllm-standin.pth"] = (SITE + "\n").encode()
    per = filler_bytes // FILLER_LAYERS
    filler = [f"RUN mkdir -p /opt/bench-filler && head -c {per} /dev/urandom > /opt/bench-filler/{i}"
              for i in range(FILLER_LAYERS)]
    own = [f"COPY site/ {SITE}/", "COPY vllm-standin.pth /usr/lib/python3/dist-packages/"]
    body = [*own, *filler] if filler_above else [*filler, *own]
    if upstream:
        big, flash, extras = int(filler_bytes * 0.8), int(filler_bytes * 0.15), int(filler_bytes * 0.05)
        body = ["COPY site/ /tmp/wheel-site/", "COPY vllm-standin.pth /usr/lib/python3/dist-packages/",
                # One step: torch and the CUDA libraries beside vLLM's own files, as `uv pip install dist/*.whl`.
                f"RUN mkdir -p {SITE}/torch/lib {SITE}/nvidia/cu13 && head -c {big // 2} /dev/urandom > "
                f"{SITE}/torch/lib/libtorch_cuda.so && head -c {big - big // 2} /dev/urandom > "
                f"{SITE}/nvidia/cu13/libcublas.so && cp -a /tmp/wheel-site/. {SITE}/ && rm -rf /tmp/wheel-site",
                f"RUN mkdir -p {SITE}/flashinfer && head -c {flash} /dev/urandom > {SITE}/flashinfer/libflash.so",
                f"RUN mkdir -p {SITE}/accelerate && head -c {extras} /dev/urandom > {SITE}/accelerate/data.bin"]
    files["Dockerfile"] = ("\n".join([f"FROM {rootfs}", *body, 'ENTRYPOINT ["vllm", "serve"]']) + "\n").encode()
    context = work / "context.tar"
    context.write_bytes(tar_bytes(files))
    with context.open("rb") as fh:
        built = subprocess.run(["docker", "build", "-q", "--network", "none", "-t", ref, "-"], stdin=fh,
                               capture_output=True, text=True, timeout=1800)
    context.unlink()
    if built.returncode != 0:
        raise BenchError(f"cannot build {ref}: {built.stderr.strip()[-800:]}")


def layers_of(reg: str, name: str, tag: str) -> list[int]:
    doc = requests.get(f"http://{reg}/v2/{name}/manifests/{tag}", headers={"Accept": ACCEPT}, timeout=30).json()
    return [int(layer["size"]) for layer in doc["layers"]]


def in_registry(root: Path, base_repo: str, out: str, cache: Path) -> tuple[float, dict[str, Any]]:
    """One timed run of the tool, to the new tag read back from the registry; ``cache`` its VLLM_HOTFIX_CACHE
    (a fresh folder: a first build; the folder of an earlier run: a repeat build, its layer facts known)."""
    start = time.perf_counter()
    run = sh([sys.executable, str(REPO / "build.py"), "--root", str(root), "image", "--base", "v0.25.1",
              "--base-repo", base_repo, "--in-registry", "--rebuild", "--tag", out, "--json"],
             env={"VLLM_HOTFIX_RECORDS": str(root / "records"), "VLLM_HOTFIX_CACHE": str(cache)})
    data = json.loads(run.stdout)
    host, _, path = out.partition("/")
    name, _, tag = path.rpartition(":")
    res = requests.get(f"http://{host}/v2/{name}/manifests/{tag}", headers={"Accept": ACCEPT}, timeout=30)
    config = res.json()["config"]["digest"]
    blob = requests.get(f"http://{host}/v2/{name}/blobs/{config}", timeout=30).content
    took = time.perf_counter() - start
    if res.headers.get("Docker-Content-Digest") != data["digest"] or \
            "sha256:" + hashlib.sha256(blob).hexdigest() != config:
        raise BenchError(f"{out} does not read back as the image the tool made")
    return took, data


def pull(ref: str) -> float:
    absent(ref)
    start = time.perf_counter()
    docker("pull", "-q", ref)
    took = time.perf_counter() - start
    absent(ref)
    return took


def absent(ref: str) -> None:
    docker("rmi", "-f", ref, check=False)
    if docker("image", "inspect", ref, check=False).rc == 0:
        raise BenchError(f"{ref} is still in the engine")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1,4", help="base sizes in GiB (default 1,4)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-save", action="store_true")
    args = ap.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    run = uuid.uuid4().hex[:8]
    work = Path(tempfile.mkdtemp(prefix="vllm-hotfix-bench-registry-"))
    root = work / "project"
    copy_definitions(root)
    (work / "registry").mkdir()
    reg = Registry(work / "registry")
    relay = Relay(reg.addr)
    refs: list[str] = []
    results: dict[str, Any] = {"started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                               "command": " ".join(["python", *sys.argv]),
                               "bytecode": BYTECODE, "cases": {}}
    # The tool as a user's machine runs it from its second run on: with its modules' bytecode cached (where
    # PYTHONDONTWRITEBYTECODE is set, Python would compile all of them from source in every run).
    sh([sys.executable, "-m", "compileall", "-q", str(REPO / "vllm_hotfix")])
    try:
        rootfs = unique_rootfs(work, run)
        refs.append(rootfs)
        # The last two: one round each, the filler above vLLM's layer, and the upstream image's own layout.
        cases = [(f"{size:g}GiB", size, False) for size in sizes] + [
            (f"{sizes[0]:g}GiB-filler-above", sizes[0], True), (f"{sizes[0]:g}GiB-upstream-layout", sizes[0], True)]
        for name, size, above in cases:
            local = f"vllm-hotfix-bench/registry-base-{name.lower()}:{run}"
            make_base(work, rootfs, local, int(size * GiB), above and "filler" in name, "upstream" in name)
            refs.append(local)
            base_repo = f"{reg.addr}/{name.lower()}/vllm-openai"
            docker("tag", local, f"{base_repo}:v0.25.1")
            start = time.perf_counter()
            docker("push", "-q", f"{base_repo}:v0.25.1")
            pushed = time.perf_counter() - start
            absent(f"{base_repo}:v0.25.1")
            absent(local)
            refs.remove(local)
            sizes_ = layers_of(reg.addr, f"{name.lower()}/vllm-openai", "v0.25.1")
            vllm_layer = sizes_[-2] if not above else sizes_[1] if "filler" in name else sizes_[-3]
            case: dict[str, Any] = {"base_compressed_bytes": sum(sizes_), "layers": sizes_,
                                    "vllm_layer_bytes": vllm_layer, "push_s": round(pushed, 1), "rounds": []}
            print(f"== {name}: base {sum(sizes_) / GiB:.2f} GiB compressed in {len(sizes_)} layers "
                  f"(vLLM's layer {vllm_layer / 2**20:.2f} MiB), pushed in {pushed:.0f} s")
            for rnd in range(1 if above else args.rounds):
                order = ["in-registry", "pull"] if rnd % 2 == 0 else ["pull", "in-registry"]
                row: dict[str, Any] = {}
                for flow in order:
                    os.sync()
                    if flow == "pull":
                        row["pull_s"] = round(pull(f"{base_repo}:v0.25.1"), 3)
                    else:
                        # A first build (a fresh cache), then a repeat build on the layers it learnt.
                        cache = work / f"cache-{name.lower()}-{rnd}"
                        took, data = in_registry(root, base_repo, f"{reg.addr}/bench-r{rnd}/{name.lower()}:out",
                                                 cache)
                        image = data["images"][0]
                        row.update(in_registry_s=round(took, 3), read_bytes=image["read"]["bytes"],
                                   layers_read=image["read"]["layers"], image_id=image["image_id"])
                        took, data = in_registry(root, base_repo, f"{reg.addr}/bench-r{rnd}/{name.lower()}:again",
                                                 cache)
                        image = data["images"][0]
                        row.update(repeat_s=round(took, 3), repeat_read_bytes=image["read"]["bytes"])
                row["ratio"] = round(row["in_registry_s"] / row["pull_s"], 4)
                row["repeat_ratio"] = round(row["repeat_s"] / row["pull_s"], 4)
                case["rounds"].append(row)
                print(f"   round {rnd + 1}: in-registry {row['in_registry_s']:.2f} s, docker pull "
                      f"{row['pull_s']:.2f} s, ratio {row['ratio']:.3f}; read {row['read_bytes']} bytes "
                      f"({row['layers_read']} of {len(sizes_)} layers); repeat {row['repeat_s']:.2f} s, ratio "
                      f"{row['repeat_ratio']:.3f}, read {row['repeat_read_bytes']} bytes")
            # The bytes that crossed the wire, counted by the relay in front of the registry.
            relay.to_client = 0
            _, data = in_registry(root, f"{relay.addr}/{name.lower()}/vllm-openai",
                                  f"{relay.addr}/bench-relay/{name.lower()}:out", work / f"cache-relay-{name.lower()}")
            case["relay_bytes_to_tool"] = relay.to_client
            case["median_ratio"] = median([r["ratio"] for r in case["rounds"]])
            case["median_in_registry_s"] = median([r["in_registry_s"] for r in case["rounds"]])
            case["median_pull_s"] = median([r["pull_s"] for r in case["rounds"]])
            case["median_repeat_ratio"] = median([r["repeat_ratio"] for r in case["rounds"]])
            case["repeat_read_bytes"] = max(r["repeat_read_bytes"] for r in case["rounds"])
            case["read_bytes"] = case["rounds"][0]["read_bytes"]
            case["goal_bytes"] = vllm_layer + (1 << 20)
            own = data["images"][0]["read"]["bytes"]
            print(f"   relay: {relay.to_client} bytes to the tool (its own count {own}); "
                  f"goal <= vLLM's layer + 1 MiB = {case['goal_bytes']}")
            results["cases"][name] = case
    finally:
        relay.close()
        reg.stop()
        for ref in refs:
            docker("rmi", "-f", ref, check=False)
        shutil.rmtree(work, ignore_errors=True)
    summary(results, sizes)
    if not args.no_save:
        out = RESULTS / f"{dt.date.today().isoformat()}-registry.json"
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out.relative_to(REPO)}")
    return 0


def summary(results: dict[str, Any], sizes: list[float]) -> None:
    print("\n== in-registry vs docker pull of the base (medians) ==")
    print(f"  {'case':<22} {'base GiB':>9} {'in-reg s':>9} {'pull s':>8} {'ratio':>7} {'read MiB':>9} "
          f"{'relay MiB':>10} {'goal MiB':>9} {'repeat ratio':>13} {'repeat read KiB':>16}")
    for name, c in results["cases"].items():
        print(f"  {name:<22} {c['base_compressed_bytes'] / GiB:>9.2f} {c['median_in_registry_s']:>9.2f} "
              f"{c['median_pull_s']:>8.2f} {c['median_ratio']:>7.3f} {c['read_bytes'] / 2**20:>9.2f} "
              f"{c['relay_bytes_to_tool'] / 2**20:>10.2f} {c['goal_bytes'] / 2**20:>9.2f} "
              f"{c['median_repeat_ratio']:>13.3f} {c['repeat_read_bytes'] / 1024:>16.1f}")
    first, last = (results["cases"][f"{s:g}GiB"] for s in (sizes[0], sizes[-1]))
    targets = {
        "time / docker pull <= 0.2 (every size)": all(results["cases"][f"{s:g}GiB"]["median_ratio"] <= 0.2
                                                      for s in sizes),
        "bytes read <= vLLM's layer + 1 MiB (every size)": all(
            results["cases"][f"{s:g}GiB"]["relay_bytes_to_tool"] <= results["cases"][f"{s:g}GiB"]["goal_bytes"]
            for s in sizes),
        f"bytes read at {sizes[0]:g} GiB <= 8 MB": first["relay_bytes_to_tool"] <= 8_000_000,
        f"bytes read at {sizes[-1]:g} GiB within 1 MiB of {sizes[0]:g} GiB":
            abs(last["relay_bytes_to_tool"] - first["relay_bytes_to_tool"]) <= (1 << 20),
        "repeat build: base bytes read <= 1 MB (every case, layout included)": all(
            c["repeat_read_bytes"] <= 1_000_000 for c in results["cases"].values()),
        "repeat build: time / docker pull <= 0.05 (every case, layout included)": all(
            c["median_repeat_ratio"] <= 0.05 for c in results["cases"].values()),
    }
    results["targets"] = targets
    for text, met in targets.items():
        print(f"  [{'   met' if met else 'MISSED'}] {text}")


if __name__ == "__main__":
    sys.exit(main())
