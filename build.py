#!/usr/bin/env python3
"""Entry point: `python build.py --help`. All logic lives in vllm_hotfix/."""

import os
import sys

if __name__ == "__main__":
    from vllm_hotfix import early_load

    # An assembled build ends in a load into the engine: open it now, so that
    # the engine readies it while the rest of the tool is imported.
    early_load.head_start(sys.argv[1:])

    import logging

    from vllm_hotfix.cli import run

    code = run()
    # Everything the run opened is closed by now (containers, scratch folders
    # and sockets in context managers): skip the interpreter's teardown of
    # every module, which costs a measurable part of a quick build.
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:  # a reader that went away (`| head`): nothing more to say to it
            pass
    os._exit(code)
