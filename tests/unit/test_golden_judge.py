"""The golden check's judge, pure: judged positions, the first disagreement, the envelope's thresholds per prompt
class, ambiguous positions left out and counted, the coverage and its floors, a recording held to the envelope (the
circular case refused), the check's status in every case, the replies a run brings back and the prompts the host
scheduled for them, and the reference file that keeps the envelope."""

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
    ([reply(pos(5, 2.0), pos(6, 3.0))], Status.PASS, "2 of 2 judged positions agree"),
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


def envelope(short: float = 0.4, long: float | None = None, median: float = 0.1, p90: float = 0.3) -> dict:
    """A golden section's envelope: per class, its margin errors' median, 90th percentile and largest, and the
    threshold that gives (as golden.envelope.measure writes it)."""
    def entry(top: float) -> dict:
        return {"prompts": 1, "positions": 10, "ambiguous": 0, "flips": 0, "measured": 10, "median_nats": median,
                "p90_nats": p90, "max_nats": top, "threshold_nats": judge.MARGIN_MULTIPLE * top}
    return {"classes": {"short": entry(short), **({"long": entry(long)} if long is not None else {})}}


def test_noise_is_the_served_margin_errors_over_unambiguous_positions_per_class():
    replies = [reply(pos(1, 5.0, error=0.1), pos(2, 5.0, error=0.4), pos(3, 5.0, error=None)),
               reply(pos(1, 5.0, error=0.2)), Scored("fixed", 1, 2, 2, problem="unreadable"),
               Scored("fixed", 1, 3, 3, (pos(1, 5.0, error=3.0), Position(1, 5.0, 1, -0.5, 9.0, ambiguous=True)),
                      klass="long")]
    n = judge.noise(replies)
    assert n["positions"] == 4 and n["replies"] == 3 and n["max_nats"] == 3.0
    assert n["by_class"]["short"]["median_nats"] == 0.2 and n["by_class"]["long"]["max_nats"] == 3.0
    assert n["by_prompt_max_nats"] == {"0": 0.4, "3": 3.0}
    assert "threshold_nats" not in n  # a measurement of the image, never a threshold
    with pytest.raises(ValueError, match="no position"):
        judge.noise([reply(pos(1, 5.0, error=None))])


def test_recording_within_the_envelope_keeps_it_and_judges_at_its_thresholds():
    env = envelope(short=1.0)
    check, section = judge.recorded([reply(pos(1, 5.0, error=0.2), pos(2, 0.2, served=3, error=0.2))], env,
                                    levels=(1,))
    assert check.status is Status.PASS, check.detail
    assert section is not None and section["envelope"] == env
    found = judge.thresholds(section)
    assert found is not None and found.of("short") == pytest.approx(judge.MARGIN_MULTIPLE * 1.0)
    assert section["recorded"]["confident"] == 1 and section["noise"]["median_nats"] == 0.2
    assert section["recorded"]["coverage"] == {"levels": {"1": {"judged": 1, "positions": 2}},
                                               "classes": {"short": {"judged": 1, "positions": 2}}}


def test_recording_is_refused_when_the_trusted_image_lies_outside_the_envelope():
    # every position agrees with the golden, but the served margin errors' median is beyond the envelope's p90
    check, section = judge.recorded([reply(pos(1, 50.0, error=2.0), pos(1, 50.0, error=2.0), pos(1, 50.0))],
                                    envelope(p90=0.3))
    assert check.status is Status.FAIL and section is None
    assert "beyond the golden's own envelope" in check.detail and "nothing recorded" in check.detail


def test_the_circular_case_is_refused_at_recording():
    """Replies wrong at 37% of positions, with the errors they make measured against the golden (median 0.79):
    they set their own threshold and passed when the recording measured it; held to the golden's envelope they
    are refused, and nothing is kept to judge a later run against."""
    positions = []
    for j in range(100):
        # where the wrong image served the golden's runner-up, its own top-2 differs from the golden's by more
        # than the golden's margin there: its own noise is wide exactly where it is wrong
        margin = 2.0 + (j % 5) * 0.25
        positions.append(pos(5, margin, served=6, error=margin + 0.5) if j % 100 < 37 else
                         pos(5, 6.0 + j % 4, error=0.79))
    scored = [reply(*positions[:50], request=0), reply(*positions[50:], request=1, prompt=1)]
    assert judge.noise(scored)["median_nats"] == 0.79
    before = judge.Thresholds({"short": judge.MARGIN_MULTIPLE * max(p.margin_error or 0 for p in positions)})
    assert judge.check(judge.judge(scored, before)).status is Status.PASS  # the recording's own noise: circular
    check, section = judge.recorded(scored, envelope(short=1.0, p90=0.5))
    assert check.status is Status.FAIL and section is None, check.detail
    assert "the server sent token_id:6" in check.detail and "nothing recorded" in check.detail


def test_a_recording_that_judged_too_little_keeps_nothing():
    scored = [reply(pos(1, 5.0), *[pos(2, 0.1)] * 9)]  # 1 of 10 judged: under the floor
    check, section = judge.recorded(scored, envelope(short=1.0), levels=(1,))
    assert check.status is Status.INCOMPLETE and section is None
    assert "under the floor" in check.detail


@pytest.mark.parametrize(("section", "expected"), [
    ({"envelope": envelope(short=1.0)}, judge.Thresholds({"short": 1.5})),
    ({"envelope": envelope(short=0.0)}, judge.Thresholds({"short": 0.0})),
    ({"envelope": envelope(short=1.0, long=2.0)}, judge.Thresholds({"short": 1.5, "long": 3.0})),
    # a class the envelope measured nothing of (every position ambiguous) judges nothing
    ({"envelope": {"classes": {"short": {"threshold_nats": 1.0}, "long": {"positions": 4, "measured": 0}}}},
     judge.Thresholds({"short": 1.0})),
    ({"envelope": {"classes": {"medium": {"threshold_nats": 1.0}}}}, None),
    ({"envelope": {"classes": {"short": {"threshold_nats": -1}}}}, None),
    ({"envelope": {"classes": {"short": {"threshold_nats": "1"}}}}, None),
    ({"envelope": {"classes": {"short": {"threshold_nats": math.nan}}}}, None),
    ({"envelope": {"classes": {}}}, None),
    # an earlier reference's noise, measured on the recording image: no envelope, no thresholds
    ({"noise": {"threshold_nats": 1.5}}, None),
    ({}, None),
    (None, None),
])
def test_thresholds_of_a_reference_section(section, expected):
    assert judge.thresholds(section) == expected


def test_each_prompt_class_is_judged_at_its_own_threshold_and_ambiguous_positions_are_left_out():
    limits = judge.Thresholds({"short": 1.0, "long": 5.0})
    long_reply = Scored("fixed", 1, 1, 1, (pos(5, 2.0, served=6),), klass="long")
    blurred = Scored("fixed", 1, 2, 2, (Position(5, 9.0, 6, -0.5, 0.1, ambiguous=True),), klass="long")
    j = judge.judge([long_reply, reply(pos(5, 2.0)), blurred], limits)
    # the long prompt's margin 2 is under its threshold 5; the ambiguous position is counted, not judged
    assert (j.confident, j.agreeing, j.first, j.ambiguous) == (1, 1, None, 1)
    assert j.coverage["classes"] == {"long": {"judged": 0, "positions": 2}, "short": {"judged": 1, "positions": 1}}
    j = judge.judge([Scored("fixed", 1, 1, 1, (pos(5, 9.0, served=6),), klass="long")], judge.Thresholds({"short": 1}))
    assert j.confident == 0  # a class the envelope has no threshold for is not judged


def test_coverage_under_a_floor_is_incomplete_never_a_pass():
    judged_well = [reply(pos(5, 2.0), pos(5, 2.0), level=1), reply(pos(5, 2.0), pos(5, 0.1), level=2)]
    assert judge.check(judge.judge(judged_well, 1.0), levels=(1, 2)).status is Status.PASS
    thin = [reply(pos(5, 2.0), pos(5, 2.0), level=1), reply(pos(5, 0.1), *[pos(5, 0.2)] * 4, level=2)]
    got = judge.check(judge.judge(thin, 1.0), levels=(1, 2))
    assert got.status is Status.INCOMPLETE and "0 of 5 positions at concurrency 2" in got.detail
    assert got.data["coverage"]["levels"]["2"] == {"judged": 0, "positions": 5}
    # a level the schedule asked for that no reply answered is a shortfall too
    missing = judge.check(judge.judge(judged_well, 1.0), levels=(1, 2, 4))
    assert missing.status is Status.INCOMPLETE and "nothing at concurrency 4" in missing.detail
    # a disagreement still fails, whatever the coverage
    wrong = [reply(pos(5, 2.0, served=4)), reply(*[pos(5, 0.1)] * 9)]
    assert judge.check(judge.judge(wrong, 1.0), levels=(1,)).status is Status.FAIL


def sweep_reply(tokens: list[int]) -> dict:
    return {"text": "", "finish_reason": "length", "prompt_tokens": 10, "completion_tokens": len(tokens),
            "tokens": [f"token_id:{t}" for t in tokens], "logprobs": [-0.1] * len(tokens),
            "top": [{f"token_id:{t}": -0.1} for t in tokens], "model": "m"}


def probe_reply(request: int, prompt: int, tokens: list[int]) -> dict:
    return {"request": request, "prompt": prompt, "prompt_tokens": 10, "tokens": [f"token_id:{t}" for t in tokens],
            "logprobs": [-0.1] * len(tokens), "top_logprobs": [{f"token_id:{t}": -0.1} for t in tokens],
            "finish_reason": "length"}


def test_every_reply_is_judged_to_the_prompt_the_host_scheduled():
    """The HTTP sweep at every level and the fixed batches' first pass at every level; request i asks prompt
    i mod prompts whatever the runner says (a probe line here names prompt 3 for request 0)."""
    http = {"1:0": sweep_reply([1, 2]), "1:5": sweep_reply([3]), "2:0": sweep_reply([9]), "16:3": sweep_reply([9])}
    probe = {(0, 1): [probe_reply(0, 3, [1, 2])], (0, 4): [probe_reply(0, 0, [1]), probe_reply(1, 0, [2])],
             (1, 1): [probe_reply(0, 0, [7])]}
    got = golden_check.served_replies(http, 4, probe)
    assert [(s.source, s.level, s.request, s.prompt) for s in got] == [
        ("http", 1, 0, 0), ("http", 1, 5, 1), ("http", 2, 0, 0), ("http", 16, 3, 3), ("fixed", 1, 0, 0),
        ("fixed", 4, 0, 0), ("fixed", 4, 1, 1)]
    assert got[0].tokens == ("token_id:1", "token_id:2") and got[0].top[1] == {"token_id:2": -0.1}
    assert got[4].prompt_tokens == 10


def test_a_probe_reply_out_of_the_hosts_order_is_malformed():
    with pytest.raises(Malformed, match="names request 1, not the 0 the host scheduled"):
        golden_check.served_replies({}, 4, {(0, 2): [probe_reply(1, 1, [5]), probe_reply(0, 0, [5])]})


def test_a_malformed_reply_is_named():
    with pytest.raises(Malformed, match="fixed reply 2:0"):
        golden_check.served_replies({}, 4, {(0, 2): [{"request": 0, "prompt": 0, "tokens": 5}]})


def test_the_reference_keeps_the_golden_section_inside_its_sha256(tmp_path: Path):
    ref = answers.Reference("m", "m", 4, 5, (answers.Answer("p", 3, ("token_id:1",), (-0.1,), ({},), "length",
                                                             answers.tokens_sha256(["token_id:1"])),),
                            "0", "now", "image")
    plain = answers.write(ref, tmp_path / "plain.json")
    assert "golden" not in json.loads((tmp_path / "plain.json").read_text())  # a file without one is unchanged
    section = {"envelope": envelope(short=0.3), "noise": {"max_nats": 0.3}, "recorded": {"confident": 10}}
    kept = answers.write(answers.Reference(**{**{f: getattr(ref, f) for f in ref.__dataclass_fields__},
                                              "golden": section}), tmp_path / "golden.json")
    assert kept.sha256 != plain.sha256
    loaded = answers.load(tmp_path / "golden.json")
    assert loaded.golden == section
    assert judge.thresholds(loaded.golden) == judge.Thresholds({"short": pytest.approx(0.45)})
    assert loaded.summary()["golden"]["noise"]["max_nats"] == 0.3
    assert loaded.summary()["golden"]["envelope"] == section["envelope"]
    data = json.loads((tmp_path / "golden.json").read_text())
    data["golden"]["envelope"]["classes"]["short"]["threshold_nats"] = 99
    (tmp_path / "golden.json").write_text(json.dumps(data))
    with pytest.raises(Exception, match="does not match the sha256"):
        answers.load(tmp_path / "golden.json")


def test_a_reference_without_the_golden_envelope_skips_the_check_and_says_why(tmp_path: Path):
    # an earlier reference: the noise measured on its recording image, no envelope
    got, section = golden_check.run(tmp_path, ["p"], [], section={"noise": {"threshold_nats": 1.5}}, recording=False)
    assert got.status is Status.SKIP and section is None
    assert "records no golden envelope" in got.detail or "not installed" in got.detail


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


def test_every_scheduled_request_without_a_reply_is_named_unanswered():
    """The HTTP sweep's levels it reached, every request of them without a reply (with the server's answer where
    the runner measured one); the fixed batches' levels of the schedule, every request the first pass did not
    reply to (a level the probe died in, and every level after it)."""
    http = {"1:0": {}, "1:1": {}, "2:0": {}}
    probe = {(0, 1): [probe_reply(0, 0, [1]), probe_reply(1, 1, [2])], (0, 2): [probe_reply(0, 0, [1])],
             (1, 1): [probe_reply(0, 0, [1])]}
    gone = golden_check.unanswered(http, [1, 2], 2, 2, probe, [1, 2, 4], 2,
                                   "torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
                                   {(2, 1): "HTTP 400: Out of range float values are not JSON compliant: nan"})
    assert [(g.source, g.level, g.request, g.prompt) for g in gone] == [
        ("http", 2, 1, 1), ("fixed", 2, 1, 1), ("fixed", 4, 0, 0), ("fixed", 4, 1, 1)]
    assert gone[0].problem == "HTTP 400: Out of range float values are not JSON compliant: nan"
    assert "illegal memory access" in gone[1].problem
    # a sweep that reached every level and a probe that answered every request leave nothing unanswered
    full = {(0, c): [probe_reply(i, i, [1]) for i in range(2)] for c in (1, 2)}
    assert golden_check.unanswered({f"{c}:{i}": {} for c in (1, 2) for i in range(2)}, [1, 2], 2, 2, full,
                                   [1, 2], 2, "") == []


@pytest.mark.parametrize("recording", [True, False])
def test_a_request_the_image_did_not_answer_fails_the_golden_check_before_anything_is_computed(
        recording: bool, tmp_path: Path):
    """Whether the host has torch or not is not asked of a fail that needs no computation: the golden answers every
    prompt, and an image whose engine died on one did not give the golden's answer. Nothing is recorded."""
    gone = golden_check.unanswered({}, [], 0, 1, {}, [4], 2, "RuntimeError: Triton Error [CUDA]: an illegal memory "
                                                          "access was encountered")
    if golden_check.missing():
        pytest.skip("this host cannot run the golden (the skip for that comes first)")
    check, section = golden_check.run(tmp_path / "no-model", ["p"], [], section={"envelope": {}},
                                      recording=recording, levels=[4], gone=gone)
    assert check.status is Status.FAIL and section is None
    assert check.detail.startswith("the image gave no reply to 2 scheduled requests, each of which the golden "
                                   "answers (fixed batches at concurrency 4 (2)): e.g. fixed batches at concurrency "
                                   "4, request 0 (prompt 0): the probe gave no reply (RuntimeError: Triton Error")
    assert check.detail.endswith("; nothing recorded") is recording
    assert check.data["unanswered"] == 2 and check.data["by_source"] == {"fixed:4": 2}


def test_the_margin_curve_counts_unambiguous_positions_over_each_margin_and_their_disagreements():
    scored = [reply(pos(5, 0.7), pos(6, 2.2, served=1), Position(7, 9.0, 7, -0.1, 0.1, ambiguous=True)),
              Scored("http", 2, 0, 1, (pos(3, 1.2),), klass="long")]
    got = judge.curve(scored)
    assert set(got) == {"short", "long"}
    short = {t: (n, wrong) for t, n, wrong in got["short"]}
    assert short[0.5] == (2, 1) and short[1.0] == (1, 1) and short[2.0] == (1, 1) and short[2.5] == (0, 0)
    assert {t: n for t, n, _ in got["long"]}[1.0] == 1 and {t: n for t, n, _ in got["long"]}[1.5] == 0
    assert judge.judge(scored, 1.0).to_dict()["by_margin"] == got


def test_served_keeps_each_distinct_reply_per_prompt_once_and_leaves_out_what_was_not_scored():
    def reply(level: int, prompt: int, ids: list[int], problem: str = "") -> Scored:
        return Scored("http", level, 0, prompt, tuple(Position(t, 1.0, t, -0.1, None) for t in ids), problem)

    scored = [reply(1, 10, [5, 6]), reply(2, 10, [5, 6]), reply(4, 10, [5, 7]), reply(1, 2, [9]),
              reply(8, 3, [], problem="the server counted 12 prompt tokens")]
    assert judge.served(scored) == {"2": [[9]], "10": [[5, 6], [5, 7]]}
