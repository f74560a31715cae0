"""What the private layer over the compile cache costs a warm smoke: the base's cache mounted in place (as before)
against the same folder read-only under an overlay volume (``compile_cache.given``, the run of an image not yet
trusted), on the local engine, with no GPU.

A warm smoke reads its caches and writes little: the run here starts one container of a stand-in base that reads
every file of a synthetic cache folder (Triton- and inductor-like: many small files and some larger objects) and
writes a few new entries, then exits. Reported per way: the median wall time of the whole step (the volume's making
and removal included), over interleaved rounds. It reports; it never fails on a number.

    python3 bench/compile_cache.py [--files 4000] [--mb 400] [--rounds 5] [--image REF]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_hotfix.checking import compile_cache  # noqa: E402
from vllm_hotfix.engine import Engine  # noqa: E402

READ_AND_WRITE = ("find /root/.cache -type f -exec cat {} + > /dev/null && mkdir -p /root/.cache/triton/new && "
                  "head -c 4194304 /dev/zero > /root/.cache/triton/new/kernel.so && echo done")


def fill(leaf: Path, files: int, megabytes: int) -> int:
    """A cache of ``files`` files, nine in ten of 4 KiB, the rest sharing what is left of ``megabytes``."""
    small, large = files * 9 // 10, max(1, files - files * 9 // 10)
    big = max(4096, (megabytes * 1024 * 1024 - small * 4096) // large)
    total = 0
    for i in range(files):
        folder = leaf / ("triton" if i % 2 else "torchinductor") / f"{i % 97:02x}"
        folder.mkdir(parents=True, exist_ok=True)
        size = 4096 if i < small else big
        (folder / f"entry-{i}.bin").write_bytes(os.urandom(size))
        total += size
    return total


def main() -> None:
    args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args.add_argument("--files", type=int, default=4000)
    args.add_argument("--mb", type=int, default=400)
    args.add_argument("--rounds", type=int, default=5)
    args.add_argument("--image", default="vllm-hotfix/standin-rootfs:bookworm-pip")
    opts = args.parse_args()
    engine = Engine()
    with tempfile.TemporaryDirectory(prefix="vllm-hotfix-bench-cache-") as tmp:
        shared = compile_cache.folder(Path(tmp), "sha256:" + "d" * 64, None, ["bench"])
        total = fill(shared.host, opts.files, opts.mb)
        print(f"cache {shared.host}: {opts.files} files, {total / 2**20:.0f} MiB; image {opts.image}")
        times: dict[str, list[float]] = {compile_cache.SHARED: [], compile_cache.LAYERED: []}
        for round_ in range(opts.rounds):
            ways = list(times) if round_ % 2 == 0 else list(reversed(times))
            for way in ways:
                os.sync()
                start = time.monotonic()
                with compile_cache.given(engine, replace(shared, access=way)) as mounted:
                    done = engine.run(opts.image, ["sh", "-c", READ_AND_WRITE], writable=[mounted.mount],
                                      timeout=600)
                times[way].append(time.monotonic() - start)
                assert done.exit_code == 0 and "done" in done.stdout, done
                # The bench's own write: kept by the shared way, gone with the layered way's private layer.
                new = shared.host / "triton" / "new"
                if new.exists():
                    for f in new.iterdir():
                        f.unlink()
                    new.rmdir()
        for way, got in times.items():
            print(f"{way:>8}: median {statistics.median(got):.2f} s over {len(got)} runs "
                  f"({', '.join(f'{t:.2f}' for t in got)})")
        delta = statistics.median(times[compile_cache.LAYERED]) - statistics.median(times[compile_cache.SHARED])
        print(f"the private layer adds {delta:+.2f} s to the step (median against median)")


if __name__ == "__main__":
    main()
