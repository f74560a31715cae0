"""Probe run inside a container: which GPUs does it see?

Usage: python3 gpu_list.py
Asks the CUDA driver library itself (``libcuda.so.1`` through ctypes), so the
answer does not depend on torch being in the image: a GPU request that reached
the container but brought no driver, or no device, is told apart from one that
works. Prints one JSON object ``{"devices": [...], "nodes": [...], "error":
...}`` and exits 0 when at least one GPU is seen, 1 otherwise. Stdlib only.
"""

from __future__ import annotations

import ctypes
import glob
import json
import sys
from typing import Any


def cuda_error(lib: Any, rc: int) -> str:
    name = ctypes.c_char_p()
    try:
        lib.cuGetErrorName(rc, ctypes.byref(name))
    except AttributeError:
        return f"CUDA error {rc}"
    return (name.value or b"").decode() or f"CUDA error {rc}"


def devices() -> tuple[list[str], str | None]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        return [], f"no CUDA driver library in the container ({exc})"
    rc = lib.cuInit(0)
    if rc != 0:
        return [], f"cuInit failed: {cuda_error(lib, rc)}"
    count = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        return [], f"cuDeviceGetCount failed: {cuda_error(lib, rc)}"
    names = []
    for i in range(count.value):
        dev = ctypes.c_int()
        buf = ctypes.create_string_buffer(256)
        if lib.cuDeviceGet(ctypes.byref(dev), i) == 0 and lib.cuDeviceGetName(buf, 256, dev) == 0:
            names.append(buf.value.decode(errors="replace"))
        else:
            names.append(f"device {i} (name unreadable)")
    if not names:
        return [], "the CUDA driver sees no device"
    return names, None


def main() -> int:
    names, error = devices()
    print(json.dumps({"devices": names, "nodes": sorted(glob.glob("/dev/nvidia*")), "error": error}))
    return 0 if names else 1


if __name__ == "__main__":
    sys.exit(main())
