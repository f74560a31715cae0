#!/usr/bin/env python3
"""The registry build's layer scan alone, in one process: bytes read and CPU time on stand-in layer blobs.

`python3 bench/layer_scan.py [--rounds 7]` builds three gzipped layers in
memory (8 MiB files of random bytes at the bottom, vLLM's sources and
dist-info above them, a small `.pth` layer on top) and asks
:func:`vllm_hotfix.registry.layerscan.locate` where vLLM lives, twice: with
the package's layer alone, and with 25,000 files of dependencies in the same
layer (about 200 MB), most of them sorting before `vllm/` as torch's and
nvidia's do in vllm/vllm-openai. It reports the bytes the scan read, the
layers it opened and the median CPU time of the rounds. No engine, no
registry: the scan reads the blobs from memory, so the figures are the
reader's own. To compare two trees of the tool, run it under each
(`PYTHONPATH=TREE`). It reports; it never fails on a number.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import random
import statistics
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

from vllm_hotfix.registry.layerscan import LayerRef, locate  # noqa: E402

SITE = "usr/local/lib/python3.12/dist-packages"
REL = "vllm/models/m/indexer.py"
GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"


def blob(members: dict[str, bytes | None]) -> bytes:
    """A gzipped layer tar of ``members`` (None: a folder), in path order as Docker and BuildKit write them."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in sorted(members.items(), key=lambda m: m[0].split("/")):
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), compresslevel=1, mtime=0)


def folders(path: str) -> dict[str, bytes | None]:
    parts = path.split("/")
    return {"/".join(parts[:i]): None for i in range(1, len(parts) + 1)}


def base(dependencies: bool, noise: random.Random) -> list[bytes]:
    package: dict[str, bytes | None] = {
        **folders(f"{SITE}/vllm/models/m"), f"{SITE}/vllm/__init__.py": b"", f"{SITE}/{REL}": b"x = 1\n",
        **folders(f"{SITE}/vllm-0.25.1.dist-info"),
        f"{SITE}/vllm-0.25.1.dist-info/METADATA": b"Metadata-Version: 2.1\nName: vllm\nVersion: 0.25.1\n",
        f"{SITE}/vllm-0.25.1.dist-info/RECORD": b"vllm/__init__.py,,\nvllm/models/m/indexer.py,,\n"}
    for i in range(3000):  # the package's own modules
        folder = f"{SITE}/vllm/mod{i // 100}"
        package.update({folder: None, f"{folder}/f{i}.py": noise.randbytes(2000)})
    if dependencies:
        for i in range(20000):  # before vllm/ in path order
            folder = f"{SITE}/{'nvidia' if i % 2 else 'torch'}"
            package.update({folder: None, f"{folder}/f{i}.so": noise.randbytes(8000)})
        for i in range(5000):  # after it
            package.update({f"{SITE}/zmq": None, f"{SITE}/zmq/f{i}.py": noise.randbytes(8000)})
    filler: dict[str, bytes | None] = {"opt": None, **{f"opt/big{i}": noise.randbytes(8 << 20) for i in range(6)}}
    return [blob(filler), blob(package), blob({**folders(SITE), f"{SITE}/standin.pth": b"import standin\n"})]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    for dependencies in (False, True):
        blobs = base(dependencies, random.Random(1))
        refs = [LayerRef("sha256:" + hashlib.sha256(b).hexdigest(), GZIP, len(b)) for b in blobs]
        by_digest = {r.digest: b for r, b in zip(refs, blobs, strict=True)}

        def opener(ref: LayerRef, blobs_of: dict[str, bytes] = by_digest) -> io.BytesIO:
            return io.BytesIO(blobs_of[ref.digest])

        cpu = []
        for _ in range(args.rounds):
            start = time.process_time()
            got = locate(refs, opener, "vllm", [REL], "bench/base")
            cpu.append(time.process_time() - start)
        case = "package layer with its dependencies" if dependencies else "package layer alone"
        print(f"{case:37s} blobs {' + '.join(str(len(b)) for b in blobs)} bytes: read {got.bytes_read} bytes of "
              f"{got.layers_read} layer(s); CPU median {statistics.median(cpu) * 1000:.0f} ms "
              f"(min {min(cpu) * 1000:.0f}, max {max(cpu) * 1000:.0f}, {args.rounds} rounds)")


if __name__ == "__main__":
    main()
