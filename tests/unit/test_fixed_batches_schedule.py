"""exact-levels (judges/fixed_batches.py) takes each reply's prompt from the schedule the host gave the probe
(request i of a level asks prompt i mod prompts), never from the prompt index the runner's report names, and holds
the prompt's token count to the one recorded for that prompt."""

from __future__ import annotations

import json

from vllm_hotfix.inimage import reference as answers
from vllm_hotfix.judges import fixed_batches
from vllm_hotfix.verdicts import Status

PROMPTS = ["alpha", "beta", "gamma"]


def probe_line(passed: int, level: int, claimed: int, counted: int = 5) -> dict:
    """A probe's level whose replies all name prompt ``claimed`` (the runner's say), to requests 0..3, prompt i
    counted ``counted + i mod 3`` tokens long."""
    return {"pass": passed, "level": level, "seconds": 0.1, "replies": [
        {"request": i, "prompt": claimed, "prompt_tokens": counted + i % len(PROMPTS), "tokens": [f"token_id:{i}"],
         "logprobs": [-0.1], "top_logprobs": [{f"token_id:{i}": -0.1}], "finish_reason": "length"}
        for i in range(4)]}


def run(claimed: int, counted: int = 5) -> fixed_batches.ProbeRun:
    lines = [probe_line(p, c, claimed, counted) for p in (0, 1) for c in (1, 2)]
    return fixed_batches.parse(json.dumps({"lines": [*lines, {"done": True}], "exit": 0}).encode())


def test_a_recording_keeps_the_prompt_the_host_scheduled_for_each_request():
    section = fixed_batches.record(run(claimed=0), PROMPTS, [1, 2], 4, 1)
    for level in ("1", "2"):
        assert [a["prompt"] for a in section["answers"][level]] == [0, 1, 2, 0]
        assert [a["prompt_tokens"] for a in section["answers"][level]] == [5, 6, 7, 5]


def test_a_judged_run_pairs_each_reply_with_the_prompt_the_host_scheduled():
    section = fixed_batches.record(run(claimed=0), PROMPTS, [1, 2], 4, 1)
    stored = fixed_batches.stored(section, 1, PROMPTS)
    assert [a.prompt for a in stored] == ["alpha", "beta", "gamma", "alpha"]
    ref = answers.Reference("m", "m", 1, 5, tuple(stored[:3]), "0", "now", "image", levels=section)
    check, evidence = fixed_batches.judge(ref, run(claimed=2), [1, 2], 4)
    assert check.status is Status.PASS, check.detail
    assert [r["prompt"] for r in evidence["levels"][0]["replies"]] == [0, 1, 2, 0]


def test_a_reply_to_a_prompt_counted_otherwise_than_recorded_is_wrong():
    """Same tokens, but the image counted other prompt tokens than the recording did for the prompt the host
    scheduled: it read another prompt."""
    section = fixed_batches.record(run(claimed=0), PROMPTS, [1, 2], 4, 1)
    ref = answers.Reference("m", "m", 1, 5, tuple(fixed_batches.stored(section, 1, PROMPTS)[:3]), "0", "now",
                            "image", levels=section)
    check, _ = fixed_batches.judge(ref, run(claimed=0, counted=6), [1, 2], 4)
    assert check.status is Status.FAIL
    assert "request 0 (prompt 0): the image counted 6 prompt tokens, 5 were recorded for this prompt" in check.detail
