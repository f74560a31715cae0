#!/usr/bin/env python3
"""Entry point: `python build.py --help`. All logic lives in vllm_hotfix/."""

import sys

try:
    from vllm_hotfix.cli import run
except ModuleNotFoundError as exc:
    # A Python without the tool's dependencies (another than the one `make setup` made) is said in one line, not a
    # traceback; a module of the tool itself missing is a bug, and goes on as one.
    if not exc.name or exc.name.partition(".")[0] == "vllm_hotfix":
        raise
    from vllm_hotfix.errors import NotInstalled

    print(f"error: {sys.executable} lacks {exc.name}, a dependency of the tool: run `make setup` (it installs the "
          "tool and its dependencies into .venv), then `.venv/bin/python build.py ...`", file=sys.stderr)
    sys.exit(NotInstalled.exit_code)

if __name__ == "__main__":
    sys.exit(run())
