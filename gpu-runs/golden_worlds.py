"""The replies a smoke's golden check scored, scored again in several computations of the same model.

    python3 gpu-runs/golden_worlds.py MODEL_DIR REPORT.json [--out worlds.json] [--classes long,short]
                                      [--device cuda]

A measurement for choosing how the golden decides which positions it can
judge, never a judgement: REPORT.json is a smoke report (``--report``, a
recording's included, refused or not) whose ``golden`` check keeps the
distinct replies it scored (``data.served``: per prompt, token IDs). Each is
teacher-forced through the golden (:mod:`vllm_hotfix.golden.forward`) in
these computations ("worlds"):

- ``P``: the golden at the serving dtype (what the check computes);
- ``F``: the golden at float32 (the model's definition; the envelope's other side);
- ``A<u>``: ``P`` with every block choice contested within ``u`` of the
  serving dtype's epsilon read the other way (the check's alternate world is
  ``A4``);
- ``R<u>s<n>``: ``P`` with each such choice read the other way or not, by a
  fixed coin per head, query and layer (seed ``n``): one mixture of them;
- ``J<p>s<n>``: ``P`` rounded otherwise (:attr:`~vllm_hotfix.golden.forward.Golden.jostle`
  ``(p, n)``: after every attention and every MLP, a share ``p`` of the
  output's elements moved one step of the serving dtype): whatever block
  choices and expert choices follow from it. The check scores every reply in
  ``P`` and the worlds of :data:`vllm_hotfix.golden.scoring.WORLDS`.

Writes, per prompt of the chosen classes, per distinct reply: the served IDs
and, per world, per position ``[first, second, their log-probabilities, the
log-probability of the served token]``. The served token is what the image sent: comparing it with
each world's first token says which rule of ambiguity and which margin would
have judged it rightly; the image's replies never enter a world.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_hotfix.golden.scoring import Scorer, missing  # noqa: E402
from vllm_hotfix.inimage import reference as prompt_set  # noqa: E402

WORLDS = ("P", "F", "A4", "A1", "A0.25", "R4s0", "J0.01s1", "J0.1s1", "J0.1s2", "J0.1s4", "J0.3s3", "J0.3s5")


def golden_data(report: dict[str, Any]) -> dict[str, Any]:
    for check in report.get("checks") or ():
        if isinstance(check, dict) and check.get("name") == "golden":
            return dict(check.get("data") or {})
    raise SystemExit("the report has no golden check")


def make_worlds(scorer: Scorer, names: list[str]) -> dict[str, Any]:
    import torch

    from vllm_hotfix.golden import forward as fw

    eps = float(torch.finfo(scorer.dtype).eps)

    class Mixture(fw.Golden):
        """Each contested choice (:attr:`~vllm_hotfix.golden.forward.Golden.contest`) read the other way or not, by a
        fixed coin per head, query and layer."""

        coin = 0
        layer = 0

        def attend(self, i, *args, **kwargs):  # type: ignore[no-untyped-def]
            self.layer = i
            return super().attend(i, *args, **kwargs)

        def allowed(self, scores, positions, keys):  # type: ignore[no-untyped-def]
            sp = self.cfg.sparse
            gap, _, _, contested = fw.merit(scores, positions, sp)
            heads = torch.arange(gap.shape[0], device=gap.device)[:, None]
            h = (positions[None, :] * 2_654_435_761 + heads * 40_503 + self.layer * 97 + self.coin * 7_919) % 65_521
            swap = contested[None] & (gap < self.contest) & (h % 2 == 1)
            keep = fw.select(scores, positions, keys, sp, None)
            return torch.where(swap[..., None], fw.select(scores, positions, keys, sp, self.contest), keep)

    out = {}
    for name in names:
        w = copy.copy(scorer.exact() if name == "F" else scorer.golden)
        if name.startswith("A"):
            w.contest = float(name[1:]) * eps
        elif name.startswith("R"):
            u, _, s = name[1:].partition("s")
            w.__class__ = Mixture
            w.contest, w.coin = float(u) * eps, int(s)
        elif name.startswith("J"):
            p, _, s = name[1:].partition("s")
            w.jostle = (float(p), int(s))
        out[name] = w
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("report", type=Path)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--classes", default="long")
    ap.add_argument("--worlds", default=",".join(WORLDS))
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    absent = missing()
    if absent:
        raise SystemExit(absent)
    import torch

    served = golden_data(json.loads(args.report.read_text())).get("served")
    if not isinstance(served, dict) or not served:
        raise SystemExit(f"{args.report}: the golden check keeps no served replies (data.served)")
    start = time.monotonic()
    scorer = Scorer(args.model, args.device)
    names = [n for n in args.worlds.split(",") if n]
    worlds = make_worlds(scorer, names)
    classes = set(args.classes.split(","))
    result: dict[str, Any] = {"model": str(args.model), "worlds": names, "device": scorer.timing.device,
                              "dtype": str(scorer.dtype).removeprefix("torch."), "prompts": {}}
    for key, replies in served.items():
        ids = scorer.prompt_ids(prompt_set.PROMPTS[int(key)])
        klass = scorer.golden.cfg.prompt_class(len(ids))
        if klass not in classes:
            continue
        entry: dict[str, Any] = {"tokens": len(ids), "class": klass, "replies": [{"ids": r, "worlds": {}}
                                                                                for r in replies]}
        for name, world in worlds.items():
            with torch.no_grad():
                prefix = world.prefill(ids)
                rows = world.extend(prefix, [list(r[:-1]) for r in replies])
            for reply, r, dist in zip(entry["replies"], replies, rows, strict=True):
                d = torch.cat((prefix.last[None], dist)).float() if r else prefix.last[None][:0].float()
                top = torch.topk(d, 2, dim=-1)
                lp = d.gather(1, torch.tensor(r, device=d.device)[:, None])[:, 0] if r else d[:, 0]
                reply["worlds"][name] = [[int(a), int(b), round(float(va), 4), round(float(vb), 4), round(float(s), 4)]
                                         for (a, b), (va, vb), s in zip(top.indices.tolist(), top.values.tolist(),
                                                                        lp.tolist(), strict=True)]
        result["prompts"][key] = entry
        print(f"prompt {key} ({len(ids)} tokens, {len(replies)} replies): {time.monotonic() - start:.1f} s",
              file=sys.stderr, flush=True)
    result["seconds"] = round(time.monotonic() - start, 3)
    text = json.dumps(result, separators=(",", ":"))
    if args.out:
        args.out.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
