"""The golden's own numerical envelope for a model at its serving dtype, measured on the host, without vLLM.

A threshold measured on the image a reference is recorded from is
calibrated on what it judges: a wrong image recorded as the trusted one
sets its own noise and then passes against itself. The envelope is measured
on the golden alone, so nothing a served image sent enters it: for every
prompt of the prompt set, the float32 golden's own greedy reply (as many
tokens as the served replies have), teacher-forced through the golden at the
serving dtype (the numerics the engine computes in, :mod:`.forward` with
``dtype``) and at float32; at each position, the serving-dtype golden's two
best tokens ``a`` and ``b``, and how far their lead ``a - b`` differs between
the two computations: the *margin error* of one right computation in the
serving dtype against the model's definition. Per prompt class (``short``:
every attention block is read; ``long``: the indexer chooses), its
distribution, its largest value and the threshold it gives
(:data:`.judge.MARGIN_MULTIPLE` x the largest). Positions whose block choice
is ambiguous at the serving dtype's resolution (:mod:`.scoring`) are counted
and left out, as the judge leaves them out.

:func:`by_layer` measures where the two computations part, layer by layer
(the residual stream's relative distance, the MoE's expert choice), for the
record. Imports torch: import it only where :mod:`.forward` can be.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Sequence
from typing import Any

import torch

from .forward import Golden
from .judge import MARGIN_MULTIPLE, quantile

log = logging.getLogger(__name__)

MEASURE = ("per position, |(golden a - golden b) at the serving dtype - (golden a - golden b) at float32|, a and b "
           "the serving-dtype golden's two best tokens; teacher-forced on the float32 golden's own greedy reply to "
           "each prompt; nothing served")


def _continuation(exact: Golden, ids: Sequence[int], tokens: int) -> list[int]:
    return exact.greedy(exact.prefill(ids), tokens)[0]


def _dists(model: Golden, ids: Sequence[int], cont: Sequence[int]) -> tuple[torch.Tensor, list[float]]:
    """The distributions of ``cont``'s tokens after ``ids`` [L, vocab] and each position's block-choice gap."""
    prefix = model.prefill(ids)
    rows, gaps = model.extend_gaps(prefix, [list(cont[:-1])])[0]
    return torch.cat((prefix.last[None], rows)), [prefix.last_gap, *gaps.cpu().tolist()]


def measure(served: Golden, exact: Golden, prompts: Sequence[Sequence[int]], classes: Sequence[str], tokens: int,
            resolution: float, alternate: Golden) -> dict[str, Any]:
    """The envelope of ``served`` (the golden at the serving dtype) against ``exact`` (float32) over the token IDs
    of ``prompts`` (each of prompt class ``classes[k]``), ``tokens`` generated positions each; ``resolution``: the
    relative block-score gap under which a choice is contested, and ``alternate`` the served golden with every
    contested choice read the other way (:mod:`.scoring`): a position where the two rank another token first is
    ambiguous, as the judge leaves it out."""
    errors: dict[str, list[float]] = {}
    extra: dict[str, list[tuple[float, float]]] = {}
    counts: dict[str, dict[str, int]] = {}
    for ids, klass in zip(prompts, classes, strict=True):
        cont = _continuation(exact, ids, tokens)
        if not cont:
            continue
        low, gaps = _dists(served, ids, cont)
        high, _ = _dists(exact, ids, cont)
        other = _dists(alternate, ids, cont)[0] if any(g < resolution for g in gaps) else low
        tally = counts.setdefault(klass, {"prompts": 0, "positions": 0, "ambiguous": 0, "flips": 0})
        tally["prompts"] += 1
        top = torch.topk(low, 2, dim=-1).indices
        a_low = low.gather(1, top).float().cpu()
        a_high = high.gather(1, top).float().cpu()
        diff = ((a_low[:, 0] - a_low[:, 1]) - (a_high[:, 0] - a_high[:, 1])).abs().tolist()
        flips = (high.argmax(-1).cpu() != top[:, 0].cpu()).tolist()
        contested = (other.argmax(-1).cpu() != top[:, 0].cpu()).tolist()
        below, span = _one_sided(low, high, other, top)
        for j, error in enumerate(diff):
            tally["positions"] += 1
            if contested[j]:
                tally["ambiguous"] += 1
                continue
            errors.setdefault(klass, []).append(float(error))
            extra.setdefault(klass, []).append((below[j], span[j]))
            tally["flips"] += bool(flips[j])
    out: dict[str, Any] = {}
    for klass, tally in sorted(counts.items()):
        values = errors.get(klass) or []
        entry: dict[str, Any] = dict(tally)
        if values:
            top_error = max(values)
            entry.update({"measured": len(values), "median_nats": round(statistics.median(values), 6),
                          "p90_nats": round(quantile(values, 0.9), 6), "max_nats": round(top_error, 6),
                          "threshold_nats": round(MARGIN_MULTIPLE * top_error, 6),
                          # for the record, not the threshold: how far float32's lead of the golden's token falls
                          # below the margin the judge credits (the smaller of the two worlds'), and how far
                          # float32's margin lies outside the span of the two worlds'
                          "below_max_nats": round(max(b for b, _ in extra[klass]), 6),
                          "span_max_nats": round(max(w for _, w in extra[klass]), 6)})
        out[klass] = entry
    return {"measure": MEASURE, "dtype": str(served.dtype).removeprefix("torch."), "against": "float32",
            "tokens_each": tokens, "margin_multiple": MARGIN_MULTIPLE, "ambiguity_resolution": resolution,
            "classes": out}


def _one_sided(low: torch.Tensor, high: torch.Tensor, other: torch.Tensor, top: torch.Tensor
               ) -> tuple[list[float], list[float]]:
    """Per position (``top``: the serving-dtype golden's two best tokens a, b): how far float32's lead of a over
    its best rival falls below the margin the judge credits (the smaller of the two worlds' leads of their own
    first over their second), and how far float32's a - b lies outside the span of the two worlds' a - b."""
    low, high, other = low.float().cpu(), high.float().cpu(), other.float().cpu()
    top = top.cpu()
    credited = torch.minimum(*(t.topk(2, dim=-1).values.diff(dim=-1).neg().squeeze(-1) for t in (low, other)))
    a = top[:, :1]
    rival = high.scatter(1, a, float("-inf")).max(dim=-1).values
    lead = high.gather(1, a).squeeze(-1) - rival
    pair = [(t.gather(1, top)[:, 0] - t.gather(1, top)[:, 1]) for t in (low, other, high)]
    lo, hi = torch.minimum(pair[0], pair[1]), torch.maximum(pair[0], pair[1])
    span = (pair[2] - hi).clamp_min(0) + (lo - pair[2]).clamp_min(0)
    return (credited - lead).clamp_min(0).tolist(), span.tolist()


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
