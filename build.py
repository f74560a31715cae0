#!/usr/bin/env python3
"""Entry point: `python build.py --help`. All logic lives in vllm_hotfix/."""

import sys

from vllm_hotfix.cli import run

if __name__ == "__main__":
    sys.exit(run())
