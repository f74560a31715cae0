"""Reference answers and the oracle: `serve-check --record-reference` and `--reference` against
tests/fake_openai.py.

The fake server's replies follow from the prompt alone, so answers recorded
from a healthy one are the answers any healthy one gives, bit for bit. Its
switches make concurrent requests answer another prompt's tokens, diverge at
a near-tie, stop early, carry batching's noise (--jitter), a NaN, a finish
reason other than stop or length, or a length that does not add up, or
differ from the reference in one bit (--nudge), all with HTTP 200 and
without --min-tokens. At concurrency 1 a reply must be the reference's bit
for bit; above it only its form is judged (status, length, finish reason, no
NaN) and how far it moved is measured: a model whose replies move far under
load (--wrong: tokens outside the concurrency-1 answer's top-5) records and
passes, as a right image of such a model must.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, cli, fails, free_port
from vllm_hotfix.inimage import oracle, reference
from vllm_hotfix.inimage.reference import Answer, Reply
from vllm_hotfix.judges import oracle as verdict_of
from vllm_hotfix.trust import reference_fit

FAKE = REPO / "tests" / "fake_openai.py"


@contextmanager
def fake(*extra: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "serve", "test-model", "--port", str(port), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """Answers recorded once from a healthy server (the trusted image), and the sweep that followed."""
    folder = tmp_path_factory.mktemp("reference")
    ref, report = folder / "answers.json", folder / "recorded.json"
    with fake("--delay", "0.01", "--tie-at-concurrency", "2", "--tie-gap", "0.2") as url:
        r = cli("serve-check", "--url", url, "--record-reference", str(ref), "--concurrency", "1,4",
                "--requests", "24", "--report", str(report))
    assert r.rc == 0, r.err
    assert f"recorded 24 reference answers to {ref} (sha256 " in r.out
    assert "every reply at concurrency 1 bitwise" in r.out
    return ref, json.loads(report.read_text())


def _check(url: str, ref: Path, report: Path, *extra: str, levels: str = "1,2") -> Any:
    return cli("serve-check", "--url", url, "--reference", str(ref), "--concurrency", levels, "--requests", "8",
               "--report", str(report), *extra)


def test_recorded_reference_then_matched(recorded: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ref_path, first = recorded
    data = json.loads(ref_path.read_text())
    assert data["format"] == reference.FORMAT and data["max_tokens"] == 32 and data["top_logprobs"] == 5
    assert data["model"] == "test-model" and data["served_model"] == "test-model" and data["tool_version"]
    assert [a["prompt"] for a in data["answers"]] == list(reference.PROMPTS)
    assert all(len(a["tokens"]) == 32 and all(t.startswith("token_id:") for t in a["tokens"]) for a in data["answers"])
    assert all(len(top) == 5 for a in data["answers"] for top in a["top_logprobs"])
    # What recording measured: the prompt set again at concurrency 1 (bitwise equal), the noise at 16.
    assert data["repeat"] == {"concurrency": 1, "requests": 24, "identical": 24}
    noise = data["noise"]
    assert noise["concurrency"] == 16 and noise["requests"] == noise["replies"] == 48 and noise["beyond_top_k"] == 0
    assert noise["token_divergences"] + noise["identical"] == 48 and noise["token_divergences"] > 0
    assert noise["deviation_nats"]["max"] == pytest.approx(0.2) and noise["deviation_nats"]["measured"] == 48
    assert noise["first_difference"]["min"] == 1 and len(noise["first_difference"]["positions"]) == \
        noise["token_divergences"]
    assert data["prompt_sensitivity"] == {"prompts": 24, "distinct_replies": 24,
                                          "median_first_token_gap_nats": pytest.approx(2.4)}
    assert data["settings"] == {"server": data["recorded_from"], "known": False}  # serve-check: not known here
    assert first["reference"]["sha256"] == data["sha256"]
    assert "tolerance_nats" not in first["reference"]
    with fake() as url:
        r = _check(url, ref_path, tmp_path / "r.json", levels="1,2,4")
    assert r.rc == 0, r.err
    assert "wrong answers 0, identical 8, moved 0" in r.err
    report = json.loads((tmp_path / "r.json").read_text())
    by_prompt = {k: a["reply_sha256"] for k, a in enumerate(data["answers"])}
    for level in report["levels"]:
        assert level["successes"] == 8 and level["wrong_answers"] == 0 and level["identical"] == 8
        assert (level["movement"] is None) == (level["concurrency"] == 1)
        for ev in level["per_request"]:
            assert ev["judged_by"] == ("exact" if level["concurrency"] == 1 else "form") and ev["passed"]
            assert ev["basis"] == ("reference" if level["concurrency"] == 1 else "concurrency-1")
            assert ev["divergence"] is None and ev["max_logprob_diff"] == 0
            assert ev["reply_sha256"] == by_prompt[ev["prompt"]]


def test_one_bit_off_at_concurrency_1_is_a_wrong_answer_with_evidence(recorded: tuple[Path, dict[str, Any]],
                                                                      tmp_path: Path) -> None:
    ref_path, _ = recorded
    with fake("--nudge-at-concurrency", "1") as url:
        r = _check(url, ref_path, tmp_path / "r.json", levels="1")
    fails(r, "serve sweep failed at concurrency 1", "wrong answer (not bitwise the reference)",
          "first difference at position 3")
    level = json.loads((tmp_path / "r.json").read_text())["levels"][0]
    assert level["wrong_answers"] == level["failures"] == 8 and level["identical"] == 0
    for ev in level["per_request"]:
        # Same tokens, one logprob one bit lower: the first differing position and the difference, named.
        assert not ev["passed"] and ev["judged_by"] == "exact" and ev["http_status"] == 200
        assert ev["divergence"] == 3 and ev["token_divergence"] is None
        assert 0 < ev["max_logprob_diff"] < 1e-15


def test_replies_that_move_far_above_concurrency_1_pass_and_are_measured(recorded: tuple[Path, dict[str, Any]],
                                                                         tmp_path: Path) -> None:
    ref_path, _ = recorded
    with fake("--wrong-at-concurrency", "2") as url:
        r = _check(url, ref_path, tmp_path / "r.json")
    # From position 2 on, tokens the concurrency-1 reply had outside its top-5: a model's batch sensitivity,
    # measured and never judged over HTTP (the fixed-batch check decides each level of a smoke).
    assert r.rc == 0, r.err
    level = json.loads((tmp_path / "r.json").read_text())["levels"][1]
    far = [ev for ev in level["per_request"] if ev["token_divergence"] is not None]
    assert far and level["successes"] == 8 and level["wrong_answers"] == 0 and level["deviated"] == len(far)
    assert all(ev["passed"] and ev["judged_by"] == "form" and ev["basis"] == "concurrency-1"
               and ev["token_divergence"] == 2 and ev["deviation_nats"] is None for ev in far)
    moved = level["movement"]
    assert moved["replies"] == 8 and moved["beyond_top_k"] == len(far) and moved["identical"] == 8 - len(far)
    assert moved["first_difference"]["positions"] == [2] * len(far)
    assert f"moved {len(far)} (widest 0 nats, {len(far)} beyond top-k)" in r.err
    # At concurrency 1 the same fault is a wrong answer: bit for bit against the reference.
    with fake("--wrong-at-concurrency", "1") as url:
        r = _check(url, ref_path, tmp_path / "c1.json", levels="1")
    fails(r, "serve sweep failed at concurrency 1", "wrong answer (not bitwise the reference)")


def test_how_far_a_near_tie_moved_is_measured_in_nats(recorded: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ref_path, _ = recorded
    for gap in ("0.5", "3.0"):
        with fake("--tie-at-concurrency", "2", "--tie-gap", gap) as url:
            r = _check(url, ref_path, tmp_path / f"tie-{gap}.json")
        assert r.rc == 0, r.err
        level = json.loads((tmp_path / f"tie-{gap}.json").read_text())["levels"][1]
        ties = [ev for ev in level["per_request"] if ev["token_divergence"] is not None]
        assert ties and level["deviated"] == len(ties) and level["successes"] == 8
        assert all(ev["token_divergence"] == 1 and ev["gap_nats"] == pytest.approx(float(gap)) for ev in ties)
        assert level["widest_deviation_nats"] == pytest.approx(float(gap))
        assert level["movement"]["deviation_nats"]["max"] == pytest.approx(float(gap))
    # Noise without a divergence: every logprob shifted, the tokens the same, measured from position 0.
    with fake("--jitter-at-concurrency", "2", "--jitter", "0.9") as url:
        assert _check(url, ref_path, tmp_path / "j.json").rc == 0
    level = json.loads((tmp_path / "j.json").read_text())["levels"][1]
    assert level["movement"]["token_divergences"] == 0 and level["movement"]["first_difference"]["min"] == 0
    assert level["movement"]["deviation_nats"]["max"] == pytest.approx(0.9)


@pytest.mark.parametrize(("switch", "said"), [
    (("--nan-at-concurrency", "2"), "a NaN or infinite log-probability in the reply"),
    (("--finish-at-concurrency", "2"), "finish_reason 'abort', not stop or length"),
    (("--cut-at-concurrency", "2"), "wrong length: finish_reason length after 5 of the 32 tokens asked"),
])
def test_a_malformed_reply_above_concurrency_1_fails(recorded: tuple[Path, dict[str, Any]], tmp_path: Path,
                                                     switch: tuple[str, str], said: str) -> None:
    ref_path, _ = recorded
    with fake(*switch) as url:
        r = _check(url, ref_path, tmp_path / "r.json")
    fails(r, "serve sweep failed at concurrency 2", f"malformed reply: {said}")
    level = json.loads((tmp_path / "r.json").read_text())["levels"][1]
    bad = [ev for ev in level["per_request"] if not ev["passed"]]
    assert bad and all(ev["judged_by"] == "form" and ev["http_status"] == 200 for ev in bad)
    assert level["wrong_answers"] == len(bad)


def test_a_model_that_moves_far_under_load_records(tmp_path: Path) -> None:
    # Replies at 16 that serve tokens the concurrency-1 answer had outside its top-5 (issue 51's two models):
    # recorded, the movement kept; the same server then passes against what it recorded.
    answers = tmp_path / "a.json"
    with fake("--wrong-at-concurrency", "2") as url:
        r = cli("serve-check", "--url", url, "--record-reference", str(answers), "--concurrency", "1,2,16",
                "--requests", "16", "--report", str(tmp_path / "r.json"))
    assert r.rc == 0, r.err
    noise = json.loads(answers.read_text())["noise"]
    assert noise["beyond_top_k"] > 0 and noise["beyond_top_k"] + noise["identical"] == 48
    assert noise["first_difference"]["min"] == 2 and noise["deviation_nats"]["measured"] == noise["identical"]
    assert "beyond its top-k" in r.err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["failed_level"] is None and report["levels"][2]["movement"]["beyond_top_k"] > 0
    # A reply whose form is wrong at 16 is no sensitivity: the recording is refused, nothing written.
    for switch, said in ((("--nan-at-concurrency", "2"), "a NaN or infinite log-probability"),
                         (("--finish-at-concurrency", "2"), "finish_reason 'abort'")):
        with fake(*switch) as url:
            r = cli("serve-check", "--url", url, "--record-reference", str(tmp_path / "b.json"))
        fails(r, "cannot record reference answers from", "at concurrency 16: malformed reply: " + said)
        assert not (tmp_path / "b.json").exists()


def test_early_stop_above_concurrency_1_is_a_reply_of_its_own(recorded: tuple[Path, dict[str, Any]],
                                                              tmp_path: Path) -> None:
    ref_path, _ = recorded
    # A model may stop early (finish_reason stop): whole, measured where it left the concurrency-1 reply.
    with fake("--short-at-concurrency", "2", "--short-length", "3") as url:
        r = _check(url, ref_path, tmp_path / "r.json")
        assert r.rc == 0, r.err
        level = json.loads((tmp_path / "r.json").read_text())["levels"][1]
        short = [ev for ev in level["per_request"] if ev["reply_tokens"] == 3]
        assert short and all(ev["passed"] and ev["finish_reason"] == "stop" and ev["token_divergence"] == 2
                             for ev in short)
        assert level["shortest_reply_tokens"] == 3
        # For a model that cannot stop early, --min-tokens still fails it.
        r = _check(url, ref_path, tmp_path / "m.json", "--min-tokens", "32")
    fails(r, "serve sweep failed at concurrency 2", "every reply must have at least 32")


def test_per_request_evidence_matches_the_level_summaries(recorded: tuple[Path, dict[str, Any]],
                                                          tmp_path: Path) -> None:
    _, report = recorded
    with fake("--short-at-concurrency", "2", "--delay", "0.02") as url:
        r = cli("serve-check", "--url", url, "--concurrency", "1,2", "--requests", "8", "--min-tokens", "32",
                "--report", str(tmp_path / "short.json"))
    assert r.rc != 0
    plain = json.loads((tmp_path / "short.json").read_text())
    for level in [*report["levels"], *plain["levels"]]:
        evidence = level["per_request"]
        assert len(evidence) == level["requests"]
        assert [ev["index"] for ev in evidence] == list(range(level["requests"]))
        assert {ev["level"] for ev in evidence} == {level["concurrency"]}
        assert sum(ev["passed"] for ev in evidence) == level["successes"]
        assert sum(not ev["passed"] for ev in evidence) == level["failures"]
        reasons: dict[str, int] = {}
        for ev in evidence:
            reasons[ev["finish_reason"]] = reasons.get(ev["finish_reason"], 0) + 1
            assert ev["http_status"] == 200 and ev["latency_s"] > 0 and len(ev["reply_sha256"]) == 64
            assert ev["prompt_tokens"] > 0 and ev["prompt"] == ev["index"] % 24
        assert reasons == level["finish_reasons"]
        assert level["shortest_reply_tokens"] == min(ev["reply_tokens"] for ev in evidence)
    assert {ev["judged_by"] for lv in plain["levels"] for ev in lv["per_request"]} == {"min-tokens"}
    failed = [ev for ev in plain["levels"][1]["per_request"] if not ev["passed"]]
    assert failed and all(ev["reply_tokens"] == 1 and "every reply must have at least 32" in ev["error"]
                          for ev in failed)


def test_a_changed_reference_is_refused(recorded: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ref_path, _ = recorded
    data = json.loads(ref_path.read_text())
    data["answers"][3]["tokens"][5] = "token_id:7"
    changed = tmp_path / "changed.json"
    changed.write_text(json.dumps(data))
    # Refused before anything is asked of a server: none is listening on port 9.
    r = cli("serve-check", "--url", "http://127.0.0.1:9", "--reference", str(changed))
    fails(r, f"--reference {changed}: its content does not match the sha256 it carries")
    assert r.rc == 64 and len(r.err.strip().splitlines()) <= 2
    (tmp_path / "bad.json").write_text("{")
    fails(cli("serve-check", "--url", "http://127.0.0.1:9", "--reference", str(tmp_path / "bad.json")),
          "bad.json: not JSON")
    r = cli("serve-check", "--url", "http://127.0.0.1:9", "--record-reference", str(ref_path))
    fails(r, f"--record-reference {ref_path}: already exists")
    r = cli("smoke", "some/image:x", "--reference", str(ref_path))
    fails(r, "--reference and --record-reference need --serve-model")
    # A file of the earlier format (no settings, no noise) is refused, not judged with a constant.
    old = {k: v for k, v in data.items() if k not in ("settings", "noise", "repeat", "prompt_sensitivity", "sha256")}
    old["format"] = "vllm-hotfix-reference/1"
    (tmp_path / "old.json").write_text(json.dumps({**old, "sha256": reference.digest(old)}))
    r = cli("serve-check", "--url", "http://127.0.0.1:9", "--reference", str(tmp_path / "old.json"))
    fails(r, "recorded by an earlier version (vllm-hotfix-reference/1), without the settings")
    assert r.rc == 64


def _answer(tokens: list[str]) -> Answer:
    return Answer("p", 3, tuple(tokens), tuple(-0.1 for _ in tokens), tuple({t: -0.1} for t in tokens), "length", "")


def _reply(tokens: list[str], top: list[dict[str, float]], finish: str = "length") -> Reply:
    return Reply("", finish, 3, len(tokens), tuple(tokens), tuple(t[tok] for tok, t in zip(tokens, top, strict=True)),
                 tuple(top))


def test_oracle_edge_cases() -> None:
    ans = _answer(["a", "b", "c"])
    assert verdict_of.exact(ans, _reply(["a", "b", "c"], [{"a": -0.1}, {"b": -0.1}, {"c": -0.1}])).ok
    # Above concurrency 1: ended early with stop, or went on where the basis ended, is a reply of its own.
    v = verdict_of.moved(ans, _reply(["a"], [{"a": -0.1}], "stop"), 1, 3)
    assert v.ok and v.deviation.token_divergence == 1 and "the reply ends at position 1" in v.detail
    v = verdict_of.moved(_answer(["a"]), _reply(["a", "x"], [{"a": -0.1}, {"x": -0.1}]), 2, 2)
    assert v.ok and v.deviation.token_divergence == 1 and math.isinf(v.deviation.size)
    # A near-tie: measured in nats, passed above concurrency 1, never at concurrency 1.
    tie = _reply(["a", "x"], [{"a": -0.1}, {"x": -1.0, "b": -1.5}])
    v = verdict_of.moved(_answer(["a", "b"]), tie, 2, 2)
    assert v.ok and v.deviation.token_divergence == 1 and v.deviation.gap == pytest.approx(0.5)
    assert not verdict_of.exact(_answer(["a", "b"]), tie).ok
    # Its form decides: counted tokens, finish reason, length against the tokens asked.
    whole = _reply(["a", "b"], [{"a": -0.1}, {"b": -0.1}])
    assert oracle.form_fault(whole, 2, 2) is None
    assert oracle.form_fault(whole, 3, 3) == ("wrong length: 2 token(s) named, 3 counted, 2 log-probabilities and "
                                              "2 top-k lists, for at most 3 asked")
    assert oracle.form_fault(whole, 2, 1) is not None  # more than asked
    assert oracle.form_fault(_reply(["a", "b"], [{"a": -0.1}, {"b": -0.1}], "stop"), 2, 32) is None
    assert oracle.form_fault(_reply(["a"], [{"a": -0.1}], "error"), 1, 1) == "finish_reason 'error', not stop or length"
    assert oracle.form_fault(_reply([], [], "stop"), 0, 4) is not None  # nothing generated
    assert oracle.form_fault(_reply(["a"], [{"a": math.inf}]), 1, 1) == "a NaN or infinite log-probability in the reply"
    measured = oracle.movement([oracle.compare(ans, ans), v.deviation, oracle.compare(_answer(["a", "b"]),
                                _reply(["a", "y"], [{"a": -0.1}, {"y": -0.1}]))])
    assert measured == {"replies": 3, "identical": 1, "token_divergences": 2, "beyond_top_k": 1,
                        "deviation_nats": {"median": pytest.approx(0.25), "max": pytest.approx(0.5), "measured": 2},
                        "first_difference": {"min": 1, "median": 1.0, "positions": [1, 1]},
                        "first_token_divergence": {"min": 1, "median": 1.0}}
    # One bit in a top-k entry (not the chosen token's) is a difference too.
    bit = _reply(["a", "b", "c"], [{"a": -0.1}, {"b": -0.1, "z": -3.0}, {"c": -0.1}])
    base = Answer("p", 3, ("a", "b", "c"), (-0.1,) * 3, ({"a": -0.1}, {"b": -0.1, "z": -3.0}, {"c": -0.1}),
                  "length", "")
    assert verdict_of.exact(base, bit).ok
    off = Answer("p", 3, ("a", "b", "c"), (-0.1,) * 3,
                 ({"a": -0.1}, {"b": -0.1, "z": math.nextafter(-3.0, 0)}, {"c": -0.1}), "length", "")
    v = verdict_of.exact(off, bit)
    assert not v.ok and v.deviation.first_difference == 1 and v.deviation.max_logprob_diff > 0
    no_logprobs = Reply("abc", "length", 3, 3, None, (), ())
    assert "no logprobs" in verdict_of.exact(ans, no_logprobs).detail
    assert math.isinf(oracle.compare(ans, no_logprobs).size)


def test_settings_difference_names_each_setting() -> None:
    recorded = {"serve_args": ["--no-enable-prefix-caching"], "env": {"VLLM_BATCH_INVARIANT": "1"},
                "gpu": "NVIDIA H200", "vllm": "0.25.1", "torch": "2.11.0", "base_image_id": "sha256:b", "model": "m"}
    assert reference_fit.settings_difference(recorded, dict(recorded)) is None
    assert reference_fit.settings_difference(recorded, {"gpu": "NVIDIA H200"}) is None  # only what is known is compared
    said = reference_fit.settings_difference(recorded, {"gpu": "NVIDIA H100", "torch": "2.10.0", "vllm": "0.25.1"})
    assert said == "gpu 'NVIDIA H200' there, 'NVIDIA H100' here; torch '2.11.0' there, '2.10.0' here"
    with pytest.raises(ValueError, match="--serve-arg=--enable-prefix-caching"):
        oracle.check_serve_args(["--max-model-len", "8192", "--enable-prefix-caching"])


def test_prompt_set_is_fixed_and_mixed() -> None:
    assert reference.make_prompts() == reference.PROMPTS and len(set(reference.PROMPTS)) == 24
    lengths = sorted(len(p) for p in reference.PROMPTS)
    # From two 128-token KV blocks (the byte tokenizer of the test model: a token a character) to 45.
    assert lengths[0] > 2 * 128 - 60 and lengths[0] < 300 and lengths[-1] > 5000
    # The same text whatever the Python: a hash of (seed, prompt, sentence) picks it. (A reference
    # file keeps its own prompts, so changing the set later leaves recorded references usable.)
    assert reference.digest({"p": list(reference.PROMPTS)}) == \
        "ec8bd27c7e02d93e41b46102b9956652c2b7a8a2a82b355505974baf57fccfd2"


def test_keep_going_judges_every_level(recorded: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ref_path, _ = recorded
    with fake("--nan-at-concurrency", "2") as url:
        r = _check(url, ref_path, tmp_path / "r.json", "--keep-going", levels="1,2,4")
    fails(r, "serve sweep failed at concurrency 2; also failed at concurrency 4", "malformed reply")
    levels = json.loads((tmp_path / "r.json").read_text())["levels"]
    assert [(lv["concurrency"], lv["failures"] > 0) for lv in levels] == [(1, False), (2, True), (4, True)]
