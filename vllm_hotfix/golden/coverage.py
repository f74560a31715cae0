"""How much of a run the golden judged, and the floor below which its ``golden`` check is no pass. Pure.

A golden check that judged one position of six thousand says almost nothing
about the image; a ``pass`` must therefore carry its coverage, and both the
check (on the host that ran it) and the verification policy (on any host that
reads the signed verdict later) hold it to the same floor:

- per **level** (concurrency 1, 2, 4, 8, 16; the HTTP sweep's and the fixed
  batches' replies of that level together), the share of generated positions
  the golden judged (confident and unambiguous) must reach :data:`LEVEL_FLOOR`;
- per **prompt class** (``short``: every attention block is read; ``long``:
  the prompt is longer than the indexer's ``topk_blocks x block_size``
  tokens, so the indexer chooses blocks), the share must reach the class's
  floor in :data:`CLASS_FLOOR`.

The floors are the ones the GPU records are held to (docs/gpu-verification.md
says which record measured what): a quarter of every level, a tenth of the
long prompts' positions.

The data a ``golden`` check carries (``Check.data["coverage"]``)::

    {"levels":  {"1": {"judged": 410, "positions": 1536}, "2": {...}, ...},
     "classes": {"short": {"judged": ..., "positions": ...}, "long": {...}}}

A level or class with no positions at all is absent (nothing was asked of it);
one that is present with ``positions`` 0 is malformed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

LEVEL_FLOOR = 0.25
CLASS_FLOOR: Mapping[str, float] = {"short": 0.25, "long": 0.10}
CLASSES = tuple(CLASS_FLOOR)


def tally(judged: int, positions: int) -> dict[str, int]:
    """One level's or class's entry."""
    return {"judged": int(judged), "positions": int(positions)}


def _share(entry: Any) -> float | None:
    """``judged / positions`` of one entry, None where it is malformed."""
    if not isinstance(entry, Mapping):
        return None
    judged, positions = entry.get("judged"), entry.get("positions")
    if not (isinstance(judged, int) and isinstance(positions, int)) or isinstance(judged, bool) \
            or isinstance(positions, bool) or positions <= 0 or not 0 <= judged <= positions:
        return None
    return judged / positions


def shortfall(coverage: Any, *, levels: tuple[int, ...] = ()) -> str | None:
    """Why ``coverage`` (a ``golden`` check's ``data["coverage"]``) does not meet the floors, in one phrase; None
    where it does. ``levels``: the levels that must be present (the schedule the run was given); a level of the
    schedule the coverage does not name is a shortfall."""
    if not isinstance(coverage, Mapping):
        return "the golden check names no coverage (judged positions per level and per prompt class)"
    by_level, by_class = coverage.get("levels"), coverage.get("classes")
    if not isinstance(by_level, Mapping) or not isinstance(by_class, Mapping) or not by_level:
        return "the golden check's coverage is malformed (no levels or no prompt classes)"
    for level in levels:
        if str(level) not in by_level:
            return f"the golden judged nothing at concurrency {level}"
    for level, entry in sorted(by_level.items(), key=lambda kv: (len(str(kv[0])), str(kv[0]))):
        share = _share(entry)
        if share is None:
            return f"the golden check's coverage at concurrency {level} is malformed"
        if share < LEVEL_FLOOR:
            return (f"the golden judged {entry['judged']} of {entry['positions']} positions at concurrency {level} "
                    f"({share:.1%}, under the floor of {LEVEL_FLOOR:.0%})")
    for name, entry in by_class.items():
        if name not in CLASS_FLOOR:
            return f"the golden check's coverage names an unknown prompt class {name!r}"
        share = _share(entry)
        if share is None:
            return f"the golden check's coverage of {name} prompts is malformed"
        if share < CLASS_FLOOR[name]:
            return (f"the golden judged {entry['judged']} of {entry['positions']} positions of {name} prompts "
                    f"({share:.1%}, under the floor of {CLASS_FLOOR[name]:.0%})")
    return None
