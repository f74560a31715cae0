"""Probe run inside an image: where does its Python import a package from?

Usage: python3 locate.py PACKAGE [RELPATH ...]
RELPATH is relative to the package's parent folder (vllm/models/x.py).
Prints one JSON object; each regular file reached without links comes with
its bytes (base64), so the caller needs no copy per file. The folders from
/ down to the package's parent come with their mode, owner and time: a layer
that puts files below them must restate them unchanged. Never imports the
package itself: importing vLLM
pulls in torch and CUDA, which a probe must not need.
"""

from __future__ import annotations

import base64
import importlib.metadata
import importlib.util
import json
import os
import platform
import stat
import sys
import sysconfig


def describe(path: str) -> dict[str, object]:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return {"kind": "missing"}
    if stat.S_ISLNK(st.st_mode):
        kind = "symlink"
    elif stat.S_ISREG(st.st_mode):
        kind = "file"
    elif stat.S_ISDIR(st.st_mode):
        kind = "dir"
    else:
        kind = "other"
    return {"kind": kind, "mode": stat.S_IMODE(st.st_mode), "size": st.st_size}


def bytecode_levels(source: str) -> list[int]:
    """Optimisation levels (0, 1, 2) for which the image holds a pyc."""
    levels = []
    for level in (0, 1, 2):
        opt = "" if level == 0 else level
        if os.path.exists(importlib.util.cache_from_source(source, optimization=opt)):
            levels.append(level)
    return levels


def install_scheme() -> dict[str, str]:
    """The folders pip installs into with this Python (its default scheme, as pip reads it from sysconfig; in a
    virtual environment, headers go to its include/site/pythonX.Y, as pip puts them)."""
    paths = sysconfig.get_paths()
    scheme = {k: v for k, v in paths.items() if k in ("purelib", "platlib", "scripts", "data", "include")}
    if sys.prefix != getattr(sys, "base_prefix", sys.prefix):
        version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
        scheme["include"] = os.path.join(sys.prefix, "include", "site", version)
    return scheme


def main(argv: list[str]) -> int:
    package, rels = argv[0], argv[1:]
    result: dict[str, object] = {
        "python": sys.version.split()[0],
        "executable": sys.executable,
        "cache_tag": sys.implementation.cache_tag,
        # The architecture this interpreter runs as (aarch64 under emulation too).
        "machine": platform.machine(),
        # The folders the base's own start-up puts on sys.path (its .pth files and environment processed):
        # what a check started without them (python -S) is given explicitly.
        # (Run with -c: the working folder's "" is left out.)
        "sys_path": [p for p in sys.path if p and os.path.isdir(p)],
        # Where pip installs a wheel's parts with this Python: what the pip layer of pinned wheels is judged
        # against.
        "scheme": install_scheme(),
    }
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        result["error"] = f"package {package} is not importable"
        print(json.dumps(result))
        return 0
    package_dir = os.path.realpath(list(spec.submodule_search_locations)[0])
    parent = os.path.dirname(package_dir)
    result["package_dir"] = package_dir
    result["site_dir"] = parent
    # realpath above: every folder on the way is a real folder, not a link.
    dirs = []
    path = "/"
    for part in parent.strip("/").split("/"):
        path = os.path.join(path, part)
        st = os.lstat(path)
        dirs.append([path, stat.S_IMODE(st.st_mode), st.st_uid, st.st_gid, int(st.st_mtime)])
    result["dirs"] = dirs
    try:
        result["version"] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        result["version"] = None
    files: dict[str, object] = {}
    for rel in rels:
        full = os.path.join(parent, rel)
        info = describe(full)
        # A symlinked folder on the way would also redirect a COPY.
        info["real"] = os.path.realpath(full) == os.path.normpath(full)
        info["opt_levels"] = bytecode_levels(full)
        if info["kind"] == "file" and info["real"]:
            with open(full, "rb") as fh:
                info["data_b64"] = base64.b64encode(fh.read()).decode("ascii")
        files[rel] = info
    result["files"] = files
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
