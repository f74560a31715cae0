"""Probe run inside an image: compile patched sources to fresh bytecode.

Usage: python3 compile.py ROOT [--as=NAMED_ROOT] RELPATH=LEVELS ...
Compiles ROOT/RELPATH at each optimisation level in LEVELS (e.g. "0,1") with the image's own Python, as
checked-hash pycs: valid exactly while the source bytes are the ones compiled,
whatever the file times in the image. With --as, the code objects name their
source NAMED_ROOT/RELPATH instead (a Python of the image's version on the
host then writes the bytes the image's own would). Prints one JSON object mapping RELPATH
to its pyc paths relative to ROOT with their bytes (base64), or to an error.
"""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import py_compile
import sys


def main(argv: list[str]) -> int:
    root, rels = argv[0], argv[1:]
    named = root
    if rels and rels[0].startswith("--as="):
        named, rels = rels[0][len("--as="):], rels[1:]
    out: dict[str, dict[str, object]] = {}
    status = 0
    for arg in rels:
        rel, _, levels = arg.partition("=")
        src = os.path.join(root, rel)
        pycs: dict[str, str] = {}
        try:
            for level in sorted({0, *(int(x) for x in levels.split(",") if x)}):
                opt = "" if level == 0 else level
                cfile = importlib.util.cache_from_source(src, optimization=opt)
                py_compile.compile(
                    src,
                    cfile=cfile,
                    dfile=os.path.join(named, rel) if named != root else None,
                    doraise=True,
                    optimize=level,
                    invalidation_mode=py_compile.PycInvalidationMode.CHECKED_HASH,
                )
                with open(cfile, "rb") as fh:
                    pycs[os.path.relpath(cfile, root)] = base64.b64encode(fh.read()).decode("ascii")
            out[rel] = {"pycs": pycs}
        except py_compile.PyCompileError as exc:
            out[rel] = {"error": " ".join(str(exc.msg).split())}
            status = 1
    print(json.dumps(out))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
