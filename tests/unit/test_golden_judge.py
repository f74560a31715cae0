"""The golden check's judge, pure: confident positions, the first disagreement, the noise and its threshold, the
check's status in every case, the replies a run brings back, and the reference file that keeps the noise."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from vllm_hotfix.errors import Malformed
from vllm_hotfix.golden import check as golden_check
from vllm_hotfix.golden import judge
from vllm_hotfix.golden.judge import Position, Scored
from vllm_hotfix.inimage import reference as answers
from vllm_hotfix.verdicts import Status


def pos(golden: int, margin: float, served: int | None = None, error: float | None = 0.1) -> Position:
    return Position(golden, margin, golden if served is None else served, -0.5, error)


def reply(*positions: Position, source: str = "fixed", level: int = 1, request: int = 0, prompt: int = 0) -> Scored:
    return Scored(source, level, request, prompt, tuple(positions))


@pytest.mark.parametrize(("replies", "threshold", "counts", "first"), [
    # every position confident and agreeing
    ([reply(pos(5, 2.0), pos(6, 3.0))], 1.0, (2, 2, 2), None),
    # a disagreement below the threshold is not judged
    ([reply(pos(5, 0.5, served=7), pos(6, 3.0))], 1.0, (2, 1, 1), None),
    # a margin equal to the threshold is not confident (strictly more)
    ([reply(pos(5, 1.0, served=7))], 1.0, (1, 0, 0), None),
    # the first confident disagreement is named: the second reply, position 1
    ([reply(pos(5, 2.0)), reply(pos(1, 2.0), pos(2, 4.0, served=9), level=4, request=3, prompt=2)], 1.0,
     (3, 3, 2), ("fixed batches at concurrency 4, request 3 (prompt 2)", 1, 2, 9)),
    # an HTTP reply is named as one
    ([reply(pos(5, 2.0, served=6), source="http", request=7, prompt=7)], 1.0, (1, 1, 0),
     ("HTTP sweep at concurrency 1, request 7 (prompt 7)", 0, 5, 6)),
])
def test_judge_counts_confident_positions_and_names_the_first_disagreement(replies, threshold, counts, first):
    j = judge.judge(replies, threshold)
    assert (j.positions, j.confident, j.agreeing) == counts
    if first is None:
        assert j.first is None
    else:
        assert j.first is not None
        assert (j.first.reply, j.first.position, j.first.golden, j.first.served) == first


@pytest.mark.parametrize(("replies", "status", "words"), [
    ([reply(pos(5, 2.0), pos(6, 3.0))], Status.PASS, "2 of 2 confident positions agree"),
    ([reply(pos(5, 2.0, served=4))], Status.FAIL, "the golden's token_id:5 leads by 2 nats, the server sent "
                                                   "token_id:4"),
    # nothing confident: the golden judged nothing, which is no pass
    ([reply(pos(5, 0.2), pos(6, 0.3))], Status.INCOMPLETE, "the golden judged nothing"),
    ([], Status.INCOMPLETE, "the golden judged nothing"),
    # a reply that could not be scored fails: nothing judged it
    ([reply(pos(5, 2.0)), Scored("fixed", 2, 1, 1, problem="the server counted 9 prompt tokens")], Status.FAIL,
     "could not be scored by the golden"),
])
def test_check_status_in_each_case(replies, status, words):
    got = judge.check(judge.judge(replies, 1.0))
    assert got.name == "golden" and got.status is status and words in got.detail, got.detail


def test_noise_is_the_largest_margin_error_and_the_threshold_its_multiple():
    replies = [reply(pos(1, 5.0, error=0.1), pos(2, 5.0, error=0.4), pos(3, 5.0, error=None)),
               reply(pos(1, 5.0, error=0.2)), Scored("fixed", 1, 2, 2, problem="unreadable")]
    n = judge.noise(replies)
    assert n["positions"] == 3 and n["replies"] == 2 and n["max_nats"] == 0.4
    assert n["threshold_nats"] == pytest.approx(judge.MARGIN_MULTIPLE * 0.4)
    assert n["median_nats"] == 0.2
    assert n["by_prompt_max_nats"] == {"0": 0.4} and n["threshold_by_prompt_nats"] == {"0": pytest.approx(0.6)}
    with pytest.raises(ValueError, match="no position"):
        judge.noise([reply(pos(1, 5.0, error=None))])


def test_recording_keeps_the_noise_where_the_trusted_replies_agree():
    check, section = judge.recorded([reply(pos(1, 5.0, error=0.3), pos(2, 0.2, served=3, error=0.3))])
    assert check.status is Status.PASS, check.detail
    found = judge.thresholds(section)
    assert section is not None and found is not None and found.of(0) == pytest.approx(judge.MARGIN_MULTIPLE * 0.3)
    assert section["recorded"]["confident"] == 1


def test_recording_is_refused_when_the_trusted_image_lies_far_from_the_golden():
    far = judge.NOISE_CEILING * 2
    check, section = judge.recorded([reply(pos(1, 50.0, error=far), pos(1, 50.0, error=far), pos(1, 50.0))])
    assert check.status is Status.FAIL and section is None
    assert "not the model's definition" in check.detail


@pytest.mark.parametrize(("section", "expected"), [
    ({"noise": {"threshold_nats": 1.5}}, judge.Thresholds({}, 1.5)),
    ({"noise": {"threshold_nats": 0}}, judge.Thresholds({}, 0.0)),
    ({"noise": {"threshold_nats": 2, "threshold_by_prompt_nats": {"3": 0.5}}}, judge.Thresholds({3: 0.5}, 2.0)),
    ({"noise": {"threshold_nats": 2, "threshold_by_prompt_nats": {"x": 0.5}}}, None),
    ({"noise": {"threshold_nats": 2, "threshold_by_prompt_nats": {"3": -1}}}, None),
    ({"noise": {"threshold_nats": "1"}}, None),
    ({"noise": {"threshold_nats": math.nan}}, None),
    ({"noise": {}}, None),
    ({}, None),
    (None, None),
])
def test_thresholds_of_a_reference_section(section, expected):
    assert judge.thresholds(section) == expected


def test_each_prompt_is_judged_at_its_own_threshold():
    limits = judge.Thresholds({0: 1.0, 1: 5.0}, None)
    j = judge.judge([reply(pos(5, 2.0, served=6), prompt=1), reply(pos(5, 2.0), prompt=0),
                     reply(pos(5, 9.0, served=6), prompt=2)], limits)
    # prompt 1's margin 2 is under its threshold 5; prompt 2 has none and the default is None: not judged
    assert (j.confident, j.agreeing, j.first) == (1, 1, None)
    j = judge.judge([reply(pos(5, 9.0, served=6), prompt=2)], judge.Thresholds({0: 1.0}, 3.0))
    assert j.first is not None and j.first.prompt == 2


def sweep_reply(tokens: list[int]) -> dict:
    return {"text": "", "finish_reason": "length", "prompt_tokens": 10, "completion_tokens": len(tokens),
            "tokens": [f"token_id:{t}" for t in tokens], "logprobs": [-0.1] * len(tokens),
            "top": [{f"token_id:{t}": -0.1} for t in tokens], "model": "m"}


def probe_reply(request: int, prompt: int, tokens: list[int]) -> dict:
    return {"request": request, "prompt": prompt, "prompt_tokens": 10, "tokens": [f"token_id:{t}" for t in tokens],
            "logprobs": [-0.1] * len(tokens), "top_logprobs": [{f"token_id:{t}": -0.1} for t in tokens],
            "finish_reason": "length"}


def test_the_replies_judged_are_the_http_sweep_at_concurrency_1_and_every_fixed_level_of_the_first_pass():
    http = {"1:0": sweep_reply([1, 2]), "1:5": sweep_reply([3]), "2:0": sweep_reply([9]), "16:3": sweep_reply([9])}
    probe = {(0, 1): [probe_reply(0, 0, [1, 2])], (0, 4): [probe_reply(0, 0, [1]), probe_reply(1, 1, [2])],
             (1, 1): [probe_reply(0, 0, [7])]}
    got = golden_check.served_replies(http, 4, probe)
    assert [(s.source, s.level, s.request, s.prompt) for s in got] == [
        ("http", 1, 0, 0), ("http", 1, 5, 1), ("fixed", 1, 0, 0), ("fixed", 4, 0, 0), ("fixed", 4, 1, 1)]
    assert got[0].tokens == ("token_id:1", "token_id:2") and got[0].top[1] == {"token_id:2": -0.1}
    assert got[3].prompt_tokens == 10


def test_a_malformed_reply_is_named():
    with pytest.raises(Malformed, match="fixed reply 2:0"):
        golden_check.served_replies({}, 4, {(0, 2): [{"request": 0, "prompt": 0, "tokens": 5}]})


def test_the_reference_keeps_the_golden_section_inside_its_sha256(tmp_path: Path):
    ref = answers.Reference("m", "m", 4, 5, (answers.Answer("p", 3, ("token_id:1",), (-0.1,), ({},), "length",
                                                             answers.tokens_sha256(["token_id:1"])),),
                            "0", "now", "image")
    plain = answers.write(ref, tmp_path / "plain.json")
    assert "golden" not in json.loads((tmp_path / "plain.json").read_text())  # a file without one is unchanged
    section = {"noise": {"max_nats": 0.3, "threshold_nats": 0.45}, "recorded": {"confident": 10}}
    kept = answers.write(answers.Reference(**{**{f: getattr(ref, f) for f in ref.__dataclass_fields__},
                                              "golden": section}), tmp_path / "golden.json")
    assert kept.sha256 != plain.sha256
    loaded = answers.load(tmp_path / "golden.json")
    assert loaded.golden == section and judge.thresholds(loaded.golden) == judge.Thresholds({}, 0.45)
    assert loaded.summary()["golden"]["noise"]["max_nats"] == 0.3
    data = json.loads((tmp_path / "golden.json").read_text())
    data["golden"]["noise"]["threshold_nats"] = 99
    (tmp_path / "golden.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match="does not match the sha256"):
        answers.load(tmp_path / "golden.json")


def test_a_reference_without_the_golden_noise_skips_the_check_and_says_why(tmp_path: Path):
    got, section = golden_check.run(tmp_path, ["p"], [], section={}, recording=False)
    assert got.status is Status.SKIP and section is None
    assert "records no golden noise" in got.detail or "not installed" in got.detail


def test_the_report_page_shows_each_reports_golden_check():
    from vllm_hotfix import report_page

    failed = judge.check(judge.judge([reply(pos(5, 2.0, served=4), level=8, request=3, prompt=1)], 1.0),
                         {"noise": {"median_nats": 0.25, "max_nats": 1.5}, "timing": {"device": "cuda (H100)",
                                                                                      "score_s": 2.5}})
    skipped = judge.skipped("torch is not installed on this host")
    shown = [report_page.Shown(name, {"checks": [{"name": c.name, "status": c.status.value, "detail": c.detail,
                                                   "data": c.data}]})
             for name, c in (("mutant", failed), ("cpu-host", skipped))]
    rows = report_page.golden_rows(shown)
    assert rows[0] == ("mutant", "fail", 1, 1, 1, 0, "fixed batches at concurrency 8, request 3 (prompt 1), "
                       "position 0: golden token_id:5, served token_id:4, margin 2", 0.25, 1.5, "cuda (H100)", 2.5)
    assert rows[1][:2] == ("cpu-host", "skip") and "torch is not installed" in str(rows[1][6])
    page = report_page.render(report_page.Page("t", shown))
    assert "id='golden'" in page and "served token_id:4" in page
