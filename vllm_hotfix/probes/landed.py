"""Probe run inside a built image: did the patch land where Python imports it?

Usage: python3 landed.py PACKAGE VERSION JSON
JSON maps each patched path (relative to the package's parent folder) to the
sha256 the pipeline produced. Checks, for each file, from where the image's
own Python imports the package: the bytes have that sha256, and every pyc the
image holds for it is valid for those bytes (none stale). Also checks the
installed package version. Prints one JSON object in the smoke format.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import sys


def pyc_state(source: bytes, source_path: str, pyc_path: str) -> str:
    """'fresh' when Python would use this pyc for these bytes and get them."""
    with open(pyc_path, "rb") as fh:
        header = fh.read(16)
    if len(header) < 16 or header[:4] != importlib.util.MAGIC_NUMBER:
        return "foreign magic (ignored by this Python)"
    flags = int.from_bytes(header[4:8], "little")
    if flags & 0b1:  # hash-based
        if header[8:16] == importlib.util.source_hash(source):
            return "fresh"
        return "stale (hash-based, unchecked)" if not flags & 0b10 else "stale (hash mismatch)"
    st = os.stat(source_path)
    mtime = int.from_bytes(header[8:12], "little")
    size = int.from_bytes(header[12:16], "little")
    if mtime == (int(st.st_mtime) & 0xFFFFFFFF) and size == (st.st_size & 0xFFFFFFFF):
        # Python trusts a timestamp pyc whose time and size match; so do we.
        return "fresh"
    return "stale (timestamp mismatch)"


def main(argv: list[str]) -> int:
    package, version, expected = argv[0], argv[1], json.loads(argv[2])
    checks: list[dict[str, object]] = []
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        checks.append({"name": "patch-landed", "status": "fail", "detail": f"{package} is not importable"})
        print(json.dumps({"checks": checks}))
        return 1
    site = os.path.dirname(os.path.realpath(list(spec.submodule_search_locations)[0]))
    problems: list[str] = []
    files: dict[str, object] = {}
    for rel, sha in sorted(expected.items()):
        path = os.path.join(site, rel)
        if os.path.islink(path) or not os.path.isfile(path):
            problems.append(f"{path} is missing or not a regular file")
            continue
        with open(path, "rb") as fh:
            data = fh.read()
        got = hashlib.sha256(data).hexdigest()
        pycs = {}
        for level in ("", 1, 2):
            pyc = importlib.util.cache_from_source(path, optimization=level)
            if os.path.exists(pyc):
                pycs[os.path.basename(pyc)] = pyc_state(data, path, pyc)
        files[rel] = {"sha256": got, "bytecode": pycs}
        if got != sha:
            problems.append(f"{path} has sha256 {got[:12]}, expected {sha[:12]} (altered after the build?)")
        for name, state in pycs.items():
            if state.startswith("stale"):
                problems.append(f"{name} for {rel} is {state}")
    checks.append({
        "name": "patch-landed",
        "status": "fail" if problems else "pass",
        "detail": "; ".join(problems) if problems else f"{len(expected)} patched file(s) in {site} match",
        "data": {"site_dir": site, "files": files},
    })
    try:
        installed = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        installed = None
    checks.append({
        "name": "package-version",
        "status": "pass" if installed == version else "fail",
        "detail": f"{package} {installed} installed, base had {version}",
    })
    print(json.dumps({"checks": checks}))
    return 1 if any(c["status"] == "fail" for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
