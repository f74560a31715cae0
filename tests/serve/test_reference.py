"""Reference answers: `serve-check --record-reference` and `--reference` against tests/fake_openai.py.

The fake server's replies follow from the prompt alone, so answers recorded
from a healthy one are the answers any healthy one gives. Its switches make
concurrent requests answer wrongly, diverge at a near-tie, or stop early,
all with HTTP 200 and without --min-tokens.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from conftest import REPO, cli, fails, free_port
from vllm_hotfix.checking import reference
from vllm_hotfix.checking.reference import Answer, Reply

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
    with fake("--delay", "0.01") as url:
        r = cli("serve-check", "--url", url, "--record-reference", str(ref), "--concurrency", "1,4",
                "--requests", "24", "--report", str(report))
    assert r.rc == 0, r.err
    assert f"recorded 24 reference answers to {ref} (sha256 " in r.out
    assert "every reply matched" in r.out
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
    assert first["reference"]["sha256"] == data["sha256"] and first["reference"]["tolerance_nats"] == 0.5
    with fake() as url:
        r = _check(url, ref_path, tmp_path / "r.json", levels="1,2,4")
    assert r.rc == 0, r.err
    assert "wrong answers 0, near-ties 0" in r.err
    report = json.loads((tmp_path / "r.json").read_text())
    by_prompt = {k: a["reply_sha256"] for k, a in enumerate(data["answers"])}
    for level in report["levels"]:
        assert level["successes"] == 8 and level["wrong_answers"] == 0 and level["near_ties"] == 0
        for ev in level["per_request"]:
            assert ev["judged_by"] == "reference" and ev["passed"] and ev["divergence"] is None
            assert ev["reply_sha256"] == by_prompt[ev["prompt"]]


def test_wrong_answer_fails_without_min_tokens(recorded: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ref_path, _ = recorded
    with fake("--wrong-at-concurrency", "2") as url:
        # Status alone cannot see it: every request is answered, every reply full length.
        r = cli("serve-check", "--url", url, "--concurrency", "1,2", "--requests", "8")
        assert r.rc == 0, r.err
        r = _check(url, ref_path, tmp_path / "r.json")
    fails(r, "serve sweep failed at concurrency 2", "wrong answer at position 2: served token_id:",
          "is not among the served top-5 there")
    assert r.rc == 7 and "concurrency   1:    8/8" in r.err
    level = json.loads((tmp_path / "r.json").read_text())["levels"][1]
    wrong = [ev for ev in level["per_request"] if not ev["passed"]]
    assert wrong and level["wrong_answers"] == len(wrong) == level["failures"]
    assert all(ev["divergence"] == 2 and ev["http_status"] == 200 and ev["reply_tokens"] == 32 for ev in wrong)


def test_near_tie_passes_and_a_wider_gap_needs_more_tolerance(recorded: tuple[Path, dict[str, Any]],
                                                              tmp_path: Path) -> None:
    ref_path, _ = recorded
    with fake("--tie-at-concurrency", "2") as url:
        r = _check(url, ref_path, tmp_path / "tie.json")
    assert r.rc == 0, r.err
    level = json.loads((tmp_path / "tie.json").read_text())["levels"][1]
    ties = [ev for ev in level["per_request"] if ev["divergence"] is not None]
    assert ties and level["near_ties"] == len(ties) and level["successes"] == 8
    assert all(ev["divergence"] == 1 and ev["passed"] and ev["gap_nats"] == pytest.approx(0.2) for ev in ties)
    assert level["widest_near_tie_nats"] == pytest.approx(0.2)
    with fake("--tie-at-concurrency", "2", "--tie-gap", "0.8") as url:
        r = _check(url, ref_path, tmp_path / "wide.json")
        fails(r, "serve sweep failed at concurrency 2", "wrong answer at position 1:",
              "0.800 nats below it (tolerance 0.5)")
        r = cli("serve-check", "--url", url, "--reference", str(ref_path), "--logprob-tolerance", "1",
                "--concurrency", "1,2", "--requests", "8")
        assert r.rc == 0, r.err


def test_early_stop_at_a_non_tie_fails(recorded: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ref_path, _ = recorded
    with fake("--short-at-concurrency", "2", "--short-length", "3") as url:
        r = _check(url, ref_path, tmp_path / "r.json")
    fails(r, "serve sweep failed at concurrency 2", "wrong answer at position 2: served token_id:0",
          "(the reply ends there, finish_reason stop)", "5.000 nats below it")
    level = json.loads((tmp_path / "r.json").read_text())["levels"][1]
    short = [ev for ev in level["per_request"] if not ev["passed"]]
    assert short and all(ev["reply_tokens"] == 3 and ev["finish_reason"] == "stop" for ev in short)
    assert level["shortest_reply_tokens"] == 3


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
    r = cli("serve-check", "--url", "http://127.0.0.1:9", "--logprob-tolerance", "1")
    fails(r, "--logprob-tolerance needs --reference or --record-reference")
    r = cli("smoke", "some/image:x", "--reference", str(ref_path))
    fails(r, "--reference and --record-reference need --serve-model")


def _answer(tokens: list[str]) -> Answer:
    return Answer("p", 3, tuple(tokens), tuple(-0.1 for _ in tokens), tuple({t: -0.1} for t in tokens), "length", "")


def _reply(tokens: list[str], top: list[dict[str, float]], finish: str = "length") -> Reply:
    return Reply("", finish, 3, len(tokens), tuple(tokens), tuple(t[tok] for tok, t in zip(tokens, top, strict=True)),
                 tuple(top))


def test_judge_edge_cases() -> None:
    ans = _answer(["a", "b", "c"])
    assert reference.judge(ans, _reply(["a", "b", "c"], [{"a": -0.1}, {"b": -0.1}, {"c": -0.1}])).ok
    # Ended early with no token at the divergence: nothing says it was a tie.
    j = reference.judge(ans, _reply(["a"], [{"a": -0.1}], "stop"))
    assert not j.ok and j.position == 1 and "the reply ended there (finish_reason stop)" in j.detail
    # Went on where the reference ended.
    j = reference.judge(_answer(["a"]), _reply(["a", "x"], [{"a": -0.1}, {"x": -0.1}]))
    assert not j.ok and j.position == 1
    # A tie exactly at the tolerance passes; another tokenizer fails before any token is compared.
    j = reference.judge(ans, _reply(["a", "x"], [{"a": -0.1}, {"x": -1.0, "b": -1.5}]), 0.5)
    assert j.ok and j.position == 1 and j.gap == pytest.approx(0.5)
    other = Reply("", "length", 4, 3, ("a", "b", "c"), (-0.1,) * 3, ({},) * 3)
    assert "another model or tokenizer" in reference.judge(ans, other).detail
    no_logprobs = Reply("abc", "length", 3, 3, None, (), ())
    assert "no logprobs" in reference.judge(ans, no_logprobs).detail


def test_prompt_set_is_fixed_and_mixed() -> None:
    assert reference.make_prompts() == reference.PROMPTS and len(set(reference.PROMPTS)) == 24
    lengths = sorted(len(p) for p in reference.PROMPTS)
    assert lengths[0] < 100 and lengths[-1] > 5000
    # The same text whatever the Python: a hash of (seed, prompt, sentence) picks it. (A reference
    # file keeps its own prompts, so changing the set later leaves recorded references usable.)
    assert reference.digest({"p": list(reference.PROMPTS)}) == \
        "e5c100f2b036c5506b00136887144b4c6342cc31ced983751ab0243460634a53"


def test_keep_going_judges_every_level(recorded: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    ref_path, _ = recorded
    with fake("--wrong-at-concurrency", "2") as url:
        r = _check(url, ref_path, tmp_path / "r.json", "--keep-going", levels="1,2,4")
    fails(r, "serve sweep failed at concurrency 2; also failed at concurrency 4", "wrong answer")
    levels = json.loads((tmp_path / "r.json").read_text())["levels"]
    assert [(lv["concurrency"], lv["failures"] > 0) for lv in levels] == [(1, False), (2, True), (4, True)]
