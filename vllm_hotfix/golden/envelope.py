"""The golden's own numerical envelope for a model at its serving dtype, measured on the host, without vLLM.

A threshold measured on the image a reference is recorded from is
calibrated on what it judges: a wrong image recorded as the trusted one
sets its own noise and then passes against itself. The envelope is measured
on the golden alone, so nothing a served image sent enters it. For every
prompt of the prompt set, the float32 golden's own greedy reply (as many
tokens as the served replies have) is teacher-forced through:

- the golden at the serving dtype and its other roundings (the *worlds* a
  served reply is scored in, :mod:`.scoring`): a position where a world
  ranks another token first is ambiguous, counted and left out, as the judge
  leaves it out; elsewhere the worlds' smallest margin is what the judge
  credits;
- one more rounding that is none of the worlds (*fresh*, :data:`.scoring.FRESH`):
  how far its lead of the golden's token falls below that smallest margin is
  the *excess*, what one more right computation (the engine is one) can lose
  beyond what the worlds foresaw. Per prompt class (``short``: every
  attention block is read; ``long``: the indexer chooses), the largest excess
  gives the class's threshold (:data:`.judge.MARGIN_MULTIPLE` x it);
- the golden at float32, the model's definition: the *margin error*
  ``|(a - b) at the serving dtype - (a - b) at float32|`` (a, b the serving-dtype
  golden's two best tokens), its distribution, for the record and for the
  recording's refusal (a trusted image whose replies lie further from the
  golden than the golden lies from the definition is not trusted).

:func:`by_layer` measures where the serving dtype and float32 part, layer by
layer (the residual stream's relative distance, the MoE's expert choice), for
the record. Imports torch: import it only where :mod:`.forward` can be.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any

import torch

from .forward import Golden, Prefix
from .judge import MARGIN_MULTIPLE, quantile

log = logging.getLogger(__name__)

MEASURE = ("teacher-forced on the float32 golden's own greedy reply to each prompt, nothing served; per position: "
           "the excess, how far a fresh rounding's lead of the golden's token falls below the worlds' smallest margin "
           "(the threshold's measure); the margin error, |(a - b) at the serving dtype - (a - b) at float32|, a and "
           "b the serving-dtype golden's two best tokens (the distribution's)")


def _dists(model: Golden, ids: Sequence[int], cont: Sequence[int], prefix: Prefix | None = None) -> torch.Tensor:
    """The distributions of ``cont``'s tokens after ``ids`` [L, vocab] (``prefix``: ``ids`` run by ``model``)."""
    prefix = model.prefill(ids) if prefix is None else prefix
    rows = model.extend(prefix, [list(cont[:-1])])[0]
    return torch.cat((prefix.last[None], rows)).float().cpu()


def measure(served: Golden, exact: Golden, prompts: Sequence[Sequence[int]], classes: Sequence[str], tokens: int,
            worlds: Sequence[Golden], fresh: Golden, cancelled: Callable[[], bool] = lambda: False
            ) -> dict[str, Any]:
    """The envelope over the token IDs of ``prompts`` (each of prompt class ``classes[k]``), ``tokens`` generated
    positions each: ``served`` (the golden at the serving dtype) and ``worlds`` (its other roundings) are the
    worlds a reply is scored in, ``fresh`` one rounding more, ``exact`` the golden at float32. Called off
    (:class:`concurrent.futures.CancelledError`, nothing kept), asked between two prompts, once ``cancelled`` says
    so (the run it was measured ahead for ended first)."""
    errors: dict[str, list[float]] = {}
    excess: dict[str, list[float]] = {}
    counts: dict[str, dict[str, int]] = {}
    for ids, klass in zip(prompts, classes, strict=True):
        if cancelled():
            raise CancelledError()
        defined = exact.prefill(ids)
        cont = exact.greedy(defined, tokens)[0]
        if not cont:
            continue
        low, high = _dists(served, ids, cont), _dists(exact, ids, cont, defined)
        others = [_dists(w, ids, cont) for w in worlds]
        extra = _dists(fresh, ids, cont)
        tally = counts.setdefault(klass, {"prompts": 0, "positions": 0, "ambiguous": 0, "flips": 0})
        tally["prompts"] += 1
        top = torch.topk(low, 2, dim=-1).indices
        a_low, a_high = low.gather(1, top), high.gather(1, top)
        diff = ((a_low[:, 0] - a_low[:, 1]) - (a_high[:, 0] - a_high[:, 1])).abs().tolist()
        flips = (high.argmax(-1) != top[:, 0]).tolist()
        ambiguous = torch.zeros(len(cont), dtype=torch.bool)
        for o in others:
            ambiguous |= o.argmax(-1) != top[:, 0]
        credited = torch.stack([_lead(d, top[:, 0]) for d in (low, *others)]).amin(0)
        lost = (credited - _lead(extra, top[:, 0])).clamp_min(0).tolist()
        for j, error in enumerate(diff):
            tally["positions"] += 1
            if ambiguous[j]:
                tally["ambiguous"] += 1
                continue
            errors.setdefault(klass, []).append(float(error))
            excess.setdefault(klass, []).append(float(lost[j]))
            tally["flips"] += bool(flips[j])
    out: dict[str, Any] = {}
    for klass, tally in sorted(counts.items()):
        values = errors.get(klass) or []
        entry: dict[str, Any] = dict(tally)
        if values:
            worst = max(excess[klass])
            entry.update({"measured": len(values), "median_nats": round(statistics.median(values), 6),
                          "p90_nats": round(quantile(values, 0.9), 6), "max_nats": round(max(values), 6),
                          "excess_p90_nats": round(quantile(excess[klass], 0.9), 6),
                          "excess_max_nats": round(worst, 6),
                          "threshold_nats": round(MARGIN_MULTIPLE * worst, 6)})
        out[klass] = entry
    return {"measure": MEASURE, "dtype": str(served.dtype).removeprefix("torch."), "against": "float32",
            "tokens_each": tokens, "margin_multiple": MARGIN_MULTIPLE,
            "worlds": [list(w.jostle or ()) for w in worlds], "fresh": list(fresh.jostle or ()), "classes": out}


def _lead(dist: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Per position, how far ``token`` [L] leads the best other token in ``dist`` [L, vocab] (negative where it
    is not the first)."""
    own = dist.gather(1, token[:, None])[:, 0]
    return own - dist.scatter(1, token[:, None], float("-inf")).amax(-1)


def by_layer(served: Golden, exact: Golden, ids: Sequence[int]) -> list[dict[str, Any]]:
    """Where ``served`` and ``exact`` part over the sequence ``ids``, per layer: the residual stream's relative
    distance after the layer (median and largest over the tokens) and, on MoE layers, the share of tokens whose
    chosen experts differ."""
    traces = []
    for model in (served, exact):
        model.trace = []
        try:
            model.prefill(ids, all_positions=True)
        finally:
            traces.append(model.trace or [])
            model.trace = None
    low = {(kind, i): t for kind, i, t in traces[0]}
    high = {(kind, i): t for kind, i, t in traces[1]}
    out = []
    for i in range(served.cfg.layers):
        a, b = low[("stream", i)], high[("stream", i)]
        rel = ((a - b).norm(dim=-1) / b.norm(dim=-1).clamp_min(1e-30)).tolist()
        row: dict[str, Any] = {"layer": i, "stream_rel_median": round(statistics.median(rel), 6),
                               "stream_rel_max": round(max(rel), 6)}
        if ("experts", i) in low:
            differ = (low[("experts", i)] != high[("experts", i)]).any(-1).float().mean().item()
            row["experts_differ_share"] = round(differ, 6)
        out.append(row)
    return out
