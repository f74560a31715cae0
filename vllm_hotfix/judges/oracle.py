"""The oracle's verdict on one reply: bit for bit at concurrency 1; above it, whole, its movement measured.

Measured on an H200 (the patched image, a tiny MiniMax-M3): with vLLM's
prefix caching on, the same server asked the same prompts twice in a row at
concurrency 1 gave bitwise-equal log-probabilities for only 4 of 24 replies;
with ``--no-enable-prefix-caching`` and ``VLLM_BATCH_INVARIANT=1`` it gave 24
of 24, again after a restart (whether the second setting is needed was not
measured, so both are kept). Under those settings a reply at concurrency 1
is the reference answer exactly, or it is wrong:

- **concurrency 1** (:func:`exact`): tokens, their log-probabilities and the
  top-k log-probabilities must equal the reference's bit for bit (a float
  read from JSON is the float the server wrote, so ``==`` compares the
  bits). The evidence names the first position that differs and the largest
  log-probability difference over the prefix where the tokens agree.
- **above concurrency 1** (:func:`moved`) an HTTP reply's numerics follow
  whatever batch it landed in, and how far they move depends on the model:
  on the default tiny model every reply at 16 stayed near its concurrency-1
  answer, while two other tiny models (another seed, 2 and 3 layers) parted
  there from their concurrency-1 answers where that answer's token was not
  even among the served top-5, on a right image (issue 51). No tolerance
  drawn from one model holds for another, so a reply there is judged by its
  form alone (:func:`~vllm_hotfix.inimage.oracle.form_fault`: HTTP status,
  length, finish reason, no NaN) and how far it moved from the same image's
  concurrency-1 reply is measured (:func:`~vllm_hotfix.inimage.oracle.movement`),
  never judged. What decides each level above 1 is the fixed-batch check
  (``exact-levels``, :mod:`.fixed_batches`), where the batches are the same
  every run and the answers must be bitwise the reference's.

The measures themselves (:func:`~vllm_hotfix.inimage.oracle.compare`, the
form's faults) are the shared ones the image's recording uses too; the
verdict is made here, on the host.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ..inimage.oracle import Deviation, Tokens, compare, form_fault

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Verdict:
    """A reply judged: passed or not, why, and the deviation that decided it."""

    ok: bool
    deviation: Deviation
    detail: str = ""


def exact(answer: Tokens, reply: Tokens) -> Verdict:
    """Concurrency 1: the reply must be the reference answer, bit for bit."""
    dev = compare(answer, reply)
    if dev.identical:
        return Verdict(True, dev)
    return Verdict(False, dev, f"wrong answer (not bitwise the reference): {dev.detail}; first difference at "
                               f"position {dev.first_difference}, largest logprob difference over the shared "
                               f"prefix {dev.max_logprob_diff:.3g} nats")


def moved(basis: Tokens, reply: Tokens, completion_tokens: int, max_tokens: int) -> Verdict:
    """Above concurrency 1: the reply passes unless its form is wrong (``form_fault``); how far it moved
    from ``basis`` (the same image's concurrency-1 reply) is measured in its deviation, never judged."""
    dev = compare(basis, reply)
    fault = form_fault(reply, completion_tokens, max_tokens)
    if fault is not None:
        return Verdict(False, dev, f"malformed reply: {fault}")
    return Verdict(True, dev, "" if dev.identical else f"moved: {dev.detail}")
