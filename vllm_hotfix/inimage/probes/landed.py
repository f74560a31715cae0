"""Probe run inside a built image: does its Python import the package from where the hotfix put it?

Usage: python3 landed.py PACKAGE SITE_DIR
Only the image's own Python can say where it imports a package from (its
path, ``.pth`` files, the environment); every fact about the files themselves
is read from the image's layers, never asked of it. So this check can only add
a failure: a hostile interpreter that prints a pass changes no file check.
Prints one JSON object in the smoke format.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys


def main(argv: list[str]) -> int:
    package, site_dir = argv[0], argv[1]
    spec = importlib.util.find_spec(package)
    want = os.path.realpath(os.path.join(site_dir, package))
    if spec is None or not spec.submodule_search_locations:
        status, detail, found = "fail", f"{package} is not importable", None
    else:
        found = os.path.realpath(list(spec.submodule_search_locations)[0])
        status = "pass" if found == want else "fail"
        detail = (f"{package} imports from {found}" if found == want
                  else f"{package} imports from {found}, not {want} where the patched files are")
    print(json.dumps({"checks": [{"name": "import-location", "status": status, "detail": detail,
                                  "data": {"answered_by": "image-python", "package_dir": found}}]}))
    return 0 if status == "pass" else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
