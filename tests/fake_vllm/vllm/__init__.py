"""A stand-in for the few parts of vLLM's offline engine that probes/batches.py uses, for tests without a GPU.

Not vLLM: a deterministic toy whose replies depend on the prompt and, in their
log-probabilities, on how many sequences share each step (as a real engine's
numerics follow the batch), so a test can tell a fixed schedule from another.
Its engine arguments also take the fake server's faults (tests/fake_openai.py):
``--wrong-at-concurrency K`` (tokens from position 2 on are another prompt's in
any step of K or more sequences), ``--die-at-concurrency K`` (the step raises
the seed's CUDA error), ``--unrepeatable`` (log-probabilities vary per run).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SamplingParams:
    temperature: float = 1.0
    max_tokens: int = 16
    logprobs: int | None = None
