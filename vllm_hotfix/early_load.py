"""Open an assembled build's load before the rest of the tool is imported.

An assembled build (``image --builder assemble``) ends in a ``docker load``.
The engine unpacks a load's archive in a process of its own, whose start
takes it about as long as Python takes to import the tool. So the entry
script reads the command line first and, for such a build, opens the load
at once (it imports only this, :mod:`tarball` and :mod:`engine_http`); the
run's :class:`engine.Engine` takes the open load over when it loads.

Every archive the assemble builder loads begins with LEAD, an empty file
the engine ignores; NOTHING completes LEAD into an archive that loads
nothing, sent when the run ends without loading (reused, failed, a wrong
guess from the command line).
"""

from __future__ import annotations

from collections.abc import Sequence

from .engine_http import open_load_early
from .tarball import Entry, end, member

LEAD = member(Entry("vllm-hotfix", b"", 0o644))
_EMPTY_MANIFEST = member(Entry("manifest.json", b"[]", 0o644))
NOTHING = _EMPTY_MANIFEST + end(len(LEAD) + len(_EMPTY_MANIFEST))


def assembles(argv: Sequence[str]) -> bool:
    """Whether a command line asks for an assembled build (``image ... --builder assemble``)."""
    args = list(argv)
    return "image" in args and ("--builder=assemble" in args or any(
        a == "--builder" and b == "assemble" for a, b in zip(args, args[1:], strict=False)))


def head_start(argv: Sequence[str]) -> None:
    """Open the load now if ``argv`` asks for an assembled build; a wrong guess costs an empty load."""
    if assembles(argv):
        open_load_early(LEAD, NOTHING)
