"""What the golden check leaves at the end of a smoke, with and without the work done ahead while the image runs.

A judged smoke's golden check scores every distinct reply in three worlds once the runner's replies are back, and
a recording first measures the golden's envelope: seconds on the host at the end of the smoke's longest path.
``golden/warm.py`` does what needs nothing served while the image runs (the reference's answers scored, a
recording's envelope). Here, on this host's torch (no engine, no image), for a tiny MiniMax-M3 made by
gpu-runs/tiny_minimax_m3.py and a GPU record's reference answers as the replies a right image serves (the sweep's
at concurrency 1 and every fixed-batch level's, as the check receives them):

- cold: the check's scorer made and every reply scored after the run (the check before warm.py prepared anything);
- ahead: the scorer made and :meth:`Scorer.prepare` run first (untimed: it overlaps the image's run), then the
  same replies scored: what is left after the run.

The replies' distributions are checked equal between the two. It reports; it never fails on a number.

    python3 bench/golden_ahead.py ANSWERS.json [--seed 0 --layers 2] [--device cpu] [--threads N] [--rounds 3]
                                  [--prompts N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_hotfix.golden import warm  # noqa: E402
from vllm_hotfix.golden.check import served_replies  # noqa: E402
from vllm_hotfix.golden.scoring import Scorer  # noqa: E402
from vllm_hotfix.inimage import reference  # noqa: E402


def replies(ref: reference.Reference) -> list:
    """The reference's answers as a right image's runner sends them back: the sweep's replies at concurrency 1
    (request i asks prompt i mod prompts) and the fixed batches' first pass at every level."""
    prompts = len(ref.prompts)

    def said(a: reference.Answer) -> dict:
        return {"tokens": list(a.tokens), "logprobs": list(a.logprobs), "top": [dict(t) for t in a.top],
                "prompt_tokens": a.prompt_tokens}

    http = {f"1:{i}": said(ref.answers[i % prompts]) for i in range(32)}
    probe = {(0, int(level)): [{**r, "request": i} for i, r in enumerate(rs)]
             for level, rs in (ref.levels.get("answers") or {}).items()}
    return served_replies(http, prompts, probe)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("answers", help="a reference answers.json a GPU record keeps (its model made again here)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=0, help="the first N prompts only (0: all of them)")
    args = ap.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    ref = reference.load(Path(args.answers))
    if args.prompts:
        ref = replace(ref, answers=ref.answers[:args.prompts], levels={
            **ref.levels, "answers": {k: [r for i, r in enumerate(v) if i % len(ref.answers) < args.prompts]
                                      for k, v in (ref.levels.get("answers") or {}).items()}})
    served = replies(ref)
    expected = warm.expected_answers(ref, len(ref.prompts))
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        subprocess.run([sys.executable, str(ROOT / "gpu-runs" / "tiny_minimax_m3.py"), str(model), "--seed",
                        str(args.seed), "--layers", str(args.layers)], check=True, capture_output=True)
        cold, left, ahead_s = [], [], []
        for _ in range(args.rounds):
            t0 = time.monotonic()
            fresh = Scorer(model, args.device)
            want = fresh.score(ref.prompts, served)
            cold.append(time.monotonic() - t0)
            prepared = Scorer(model, args.device)
            t0 = time.monotonic()
            prepared.prepare(ref.prompts, expected)
            ahead_s.append(time.monotonic() - t0)
            t0 = time.monotonic()
            got = prepared.score(ref.prompts, served)
            left.append(time.monotonic() - t0)
            same = [g.positions for g in got] == [w.positions for w in want]
            print(f"round: cold {cold[-1]:.2f} s; ahead {ahead_s[-1]:.2f} s, then {left[-1]:.2f} s left "
                  f"({prepared.timing.ahead_replies} of {prepared.timing.distinct_replies} distinct replies "
                  f"prepared); positions equal: {same}", flush=True)
            if not same:
                print("error: the prepared scorer's positions differ from the fresh one's", file=sys.stderr)
                return 1
    print(json.dumps({"model": f"seed {args.seed}, {args.layers} layers", "device": args.device,
                      "threads": torch.get_num_threads(), "replies": len(served),
                      "cold_s": round(statistics.median(cold), 2), "ahead_s": round(statistics.median(ahead_s), 2),
                      "left_s": round(statistics.median(left), 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
