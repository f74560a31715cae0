"""Time the golden forward on a model folder, measure its envelope and, given a reference, hold vLLM's replies to it.

    python3 gpu-runs/golden_run.py MODEL_DIR [--reference answers.json] [--tokens 32] [--device cuda]
                                   [--prompts 0,2,4] [--out golden.json]

On a GPU host with torch, tokenizers and the tool's checkout (no vLLM, no
Docker needed): loads the model as the ``golden`` check does (at the serving
dtype, CUDA where there is one), generates the golden's own greedy reply to
every prompt of the prompt set (the reference's, else the tool's), measures
the golden's envelope (:mod:`vllm_hotfix.golden.envelope`: the golden at the
serving dtype against float32 on its own replies, per prompt class: what a
recording keeps and a judged run is held to) and where the two part layer by
layer (``by_layer``, on the first prompt), and says how long each part took.
With ``--reference`` (a file ``smoke --record-reference`` wrote on the same
model), it scores every answer the reference holds (concurrency 1 over HTTP
and every fixed-batch level, each to the prompt the host scheduled)
teacher-forced, and reports vLLM's margin errors against the golden
(``noise``: per prompt class and per prompt; ``noise_float32_golden``: the
same against the float32 golden), whether they lie outside the envelope
(``outside_envelope``: the recording's refusal), the judged positions at the
envelope's thresholds with the coverage per level and per prompt class
(``judged_at_envelope``, ``coverage_shortfall``), how the golden's greedy
replies compare with the reference's concurrency-1 answers, and, where the
file holds a ``golden`` section, the envelope it recorded and the judgement
at it. Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_hotfix.golden import coverage, judge  # noqa: E402
from vllm_hotfix.golden.scoring import Served, missing  # noqa: E402


def reference_replies(ref: Any) -> list[Served]:
    """Every answer a reference holds, as the golden scores them: request ``i`` of a level to prompt ``i mod
    prompts``, as the host scheduled it."""
    count = len(ref.answers)
    out = [Served("http", 1, k, k, a.tokens, a.logprobs, a.top, a.prompt_tokens) for k, a in enumerate(ref.answers)]
    for level, replies in sorted((ref.levels.get("answers") or {}).items(), key=lambda kv: int(kv[0])):
        for i, a in enumerate(replies):
            out.append(Served("fixed", int(level), i, i % count, tuple(a["tokens"]), tuple(a["logprobs"]),
                              tuple(a["top_logprobs"]), a.get("prompt_tokens")))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--reference", type=Path)
    ap.add_argument("--tokens", type=int, default=None, help="greedy tokens per prompt (the reference's max_tokens)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda where there is one)")
    ap.add_argument("--prompts", default=None, help="indices of the prompt set to use, e.g. 0,2,4 (default: all; "
                                                     "with --reference, its answers to those prompts alone)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    absent = missing()
    if absent:
        print(f"golden_run: {absent}", file=sys.stderr)
        return 2
    import torch

    from vllm_hotfix.golden.scoring import Scorer
    from vllm_hotfix.inimage import reference as answers

    ref = answers.load(args.reference) if args.reference is not None else None
    every = list(ref.prompts) if ref is not None else list(answers.PROMPTS)
    picked = [int(i) for i in args.prompts.split(",")] if args.prompts else list(range(len(every)))
    prompts = [every[i] for i in picked]
    tokens = args.tokens or (ref.max_tokens if ref is not None else 32)
    scorer = Scorer(args.model, args.device)
    golden = scorer.golden
    report: dict[str, Any] = {"model": str(args.model), "device": scorer.timing.device,
                              "torch": torch.__version__, "load_s": round(scorer.timing.load_s, 3)}
    sync = torch.cuda.synchronize if golden.device.type == "cuda" else (lambda: None)
    start = time.monotonic()
    greedy, margins, prompt_tokens = [], [], []
    by_class: dict[str, list[float]] = {}
    for prompt in prompts:
        ids = scorer.prompt_ids(prompt)
        prompt_tokens.append(len(ids))
        got, margin = golden.greedy(golden.prefill(ids), tokens)
        greedy.append(got)
        margins.extend(margin)
        by_class.setdefault(golden.cfg.prompt_class(len(ids)), []).extend(margin)
    sync()
    margins.sort()
    report["greedy"] = {"prompts": len(prompts), "tokens_each": tokens, "seconds": round(time.monotonic() - start, 3),
                        "prompt_tokens": prompt_tokens, "distinct_replies": len({tuple(g) for g in greedy}),
                        "margin_nats": {"median": margins[len(margins) // 2], "p10": margins[len(margins) // 10],
                                        "p90": margins[len(margins) * 9 // 10]}}
    start = time.monotonic()
    measured = scorer.envelope(prompts, tokens)
    sync()
    report["envelope"] = measured
    from vllm_hotfix.golden import envelope

    report["by_layer"] = {"prompt": 0, "layers": envelope.by_layer(golden, scorer.exact(),
                                                                   scorer.prompt_ids(prompts[0]))}
    limits = judge.thresholds({"envelope": measured})
    if limits is not None:
        # What share of the golden's own greedy positions clears its class's threshold: the coverage a server
        # that replied as the golden would get, per class.
        report["greedy"]["over_threshold"] = {
            k: coverage.tally(sum(m > (limits.of(k) or float("inf")) for m in v), len(v))
            for k, v in sorted(by_class.items())}
    if ref is not None:
        replies = [r for r in reference_replies(ref) if r.prompt in picked]
        start = time.monotonic()
        scored = scorer.score(every, replies)
        sync()
        report["scoring"] = {**scorer.timing.to_dict(), "replies": len(replies),
                             "seconds": round(time.monotonic() - start, 3)}
        unscored = [f"{s.name}: {s.problem}" for s in scored if s.problem]
        if unscored:
            report["unscored"] = unscored[:10]
        served = judge.noise(scored)
        report["noise"] = served
        report["outside_envelope"] = judge.outside(served, measured)
        if limits is not None:
            judged = judge.judge(scored, limits)
            report["judged_at_envelope"] = judged.to_dict()
            report["coverage_shortfall"] = coverage.shortfall(judged.coverage)
        exact = Scorer(args.model, args.device, "float32")
        report["noise_float32_golden"] = judge.noise(exact.score(every, replies))
        if ref.golden:
            recorded = judge.thresholds(ref.golden)
            report["recorded_golden"] = {k: ref.golden.get(k) for k in ("envelope", "noise")}
            if recorded is not None:
                report["judged_at_recorded_envelope"] = judge.judge(scored, recorded).to_dict()
        same = [list(int(t.split(":")[1]) for t in ref.answers[i].tokens) == g for i, g in zip(picked, greedy,
                                                                                             strict=True)]
        report["greedy_vs_reference"] = {"identical": sum(same), "prompts": len(same)}
    text = json.dumps(report, indent=1, sort_keys=True)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
