"""golden/coverage.py, pure: what a golden check's coverage must say (judged positions per level and per prompt
class) and the floors under which it is no pass, as the check and the verification policy both read it."""

from __future__ import annotations

import pytest

from vllm_hotfix.golden import coverage


def cover(levels: dict[int, tuple[int, int]], classes: dict[str, tuple[int, int]]) -> dict:
    return {"levels": {str(c): coverage.tally(*v) for c, v in levels.items()},
            "classes": {k: coverage.tally(*v) for k, v in classes.items()}}


FULL = cover({c: (400, 1536) for c in (1, 2, 4, 8, 16)}, {"short": (1500, 4000), "long": (300, 2000)})


def test_tally_is_the_entry_format():
    assert coverage.tally(3, 10) == {"judged": 3, "positions": 10}


def test_the_floors_are_a_quarter_of_every_level_and_a_tenth_of_the_long_prompts():
    assert coverage.LEVEL_FLOOR == 0.25
    assert dict(coverage.CLASS_FLOOR) == {"short": 0.25, "long": 0.10} and coverage.CLASSES == ("short", "long")


def test_coverage_over_every_floor_is_no_shortfall():
    assert coverage.shortfall(FULL, levels=(1, 2, 4, 8, 16)) is None
    # exactly at a floor meets it
    assert coverage.shortfall(cover({1: (25, 100)}, {"short": (25, 100), "long": (10, 100)})) is None


@pytest.mark.parametrize(("coverage_", "levels", "words"), [
    (cover({1: (24, 100)}, {"short": (24, 100)}), (), "24 of 100 positions at concurrency 1 (24.0%, under the floor "
                                                      "of 25%)"),
    (cover({1: (50, 100), 16: (10, 100)}, {"short": (60, 200)}), (), "at concurrency 16"),
    (cover({1: (50, 100)}, {"short": (41, 90), "long": (9, 100)}), (), "9 of 100 positions of long prompts (9.0%, "
                                                                        "under the floor of 10%)"),
    (cover({1: (50, 100)}, {"short": (20, 100)}), (), "of short prompts"),
    # a level of the schedule that the coverage does not name
    (cover({1: (50, 100)}, {"short": (50, 100)}), (1, 2), "the golden judged nothing at concurrency 2"),
    (None, (), "names no coverage"),
    ({"levels": {}, "classes": {}}, (), "malformed"),
    ({"levels": {"1": {"judged": 1, "positions": 0}}, "classes": {}}, (), "at concurrency 1 is malformed"),
    ({"levels": {"1": {"judged": 5, "positions": 4}}, "classes": {}}, (), "at concurrency 1 is malformed"),
    ({"levels": {"1": {"judged": True, "positions": 4}}, "classes": {}}, (), "at concurrency 1 is malformed"),
    (cover({1: (50, 100)}, {"medium": (50, 100)}), (), "unknown prompt class 'medium'"),
    ({"levels": {"1": coverage.tally(50, 100)}, "classes": {"long": "all"}}, (), "of long prompts is malformed"),
])
def test_a_shortfall_names_what_fell_short(coverage_, levels, words):
    said = coverage.shortfall(coverage_, levels=levels)
    assert said is not None and words in said, said


def test_an_absent_class_asked_nothing_and_is_no_shortfall():
    # a prompt set without long prompts: the long class is absent, not zero
    assert coverage.shortfall(cover({1: (30, 100)}, {"short": (30, 100)}), levels=(1,)) is None
