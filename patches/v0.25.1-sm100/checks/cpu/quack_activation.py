"""Check (no GPU needed): quack.activation defines sub_packed_f32x2.

vLLM 0.25.1's vllm/third_party/fmha_sm100/cute/src/common/utils.py calls
quack.activation.sub_packed_f32x2; quack-kernels 0.6.5 no longer defines it
and MiniMax-M3's SM100 sparse attention then fails at engine start with an
AttributeError. The pins in pins.txt put quack-kernels 0.6.4 back.

It imports quack.activation and looks the name up. Importing quack needs
torch, numpy and CUDA's Python bindings; in an image that lacks one of them
entirely (no distribution provides it), the module's source is read instead
and the name must be bound at its top level, which is where 0.6.4 binds it
(and what hasattr would find). Prints one JSON line of checks.
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata as md
import importlib.util
import json
import os
import sys

NAME = "sub_packed_f32x2"
CHECK = "quack-activation-sub-packed-f32x2"


def bound_at_top(path: str) -> bool:
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), path)
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            targets = [node.target]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == NAME:
            return True
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == NAME for a in node.names):
                return True
        if any(isinstance(t, ast.Name) and t.id == NAME for t in targets):
            return True
    return False


def main() -> int:
    version = md.version("quack-kernels") if importlib.util.find_spec("quack") else "absent"
    try:
        module = importlib.import_module("quack.activation")
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        spec = importlib.util.find_spec("quack")
        if not missing or missing == "quack" or spec is None or importlib.util.find_spec(missing) is not None:
            print(json.dumps({"checks": [{"name": CHECK, "status": "fail", "detail": f"import failed: {exc}"}]}))
            return 1
        path = os.path.join(list(spec.submodule_search_locations or [])[0], "activation.py")
        found = os.path.isfile(path) and bound_at_top(path)
        detail = (f"quack-kernels {version}: {NAME} is {'bound' if found else 'NOT bound'} at the top of {path} "
                  f"(read, not imported: importing quack needs {missing}, which this image lacks)")
        print(json.dumps({"checks": [{"name": CHECK, "status": "pass" if found else "fail", "detail": detail}]}))
        return 0 if found else 1
    except BaseException as exc:  # noqa: BLE001
        print(json.dumps({"checks": [{"name": CHECK, "status": "fail",
                                      "detail": f"import failed: {type(exc).__name__}: {exc}"[:400]}]}))
        return 1
    found = hasattr(module, NAME)
    detail = f"quack-kernels {version}: quack.activation {'has' if found else 'LACKS'} {NAME}"
    print(json.dumps({"checks": [{"name": CHECK, "status": "pass" if found else "fail", "detail": detail}]}))
    return 0 if found else 1


if __name__ == "__main__":
    sys.exit(main())
