"""Served replies scored by the golden forward, on the host: prompts tokenised here, one prefill per prompt.

The server names its tokens ``token_id:N`` (``return_tokens_as_token_ids``;
the fixed-batch probe writes them the same way), so a reply's tokens are
the model's IDs. The prompt's are not in a reply: the host tokenises each
prompt itself with the model folder's ``tokenizer.json`` (the ``tokenizers``
library), and a reply whose server counted another number of prompt tokens
cannot be scored (it fails the check: the image read another prompt).

The golden computes at the model's serving dtype (``torch_dtype``: the
engine's numerics); :meth:`Scorer.envelope` measures it against float32 on
its own replies (:mod:`.envelope`).

The engine computes the same model at the same dtype with kernels of its
own: it rounds at the same places, in other orders, so here and there an
element comes out one step of the dtype apart. On a short prompt that moves
a margin by a fraction of a nat. Where the indexer chooses (more blocks than
it keeps), and where a router chooses experts, one such step can change a
choice, and the change runs through every later layer: the same right
computation then ranks another token first, or leads by nats less. So every
reply is scored in several *worlds*: the golden, and the golden rounded
otherwise (:data:`WORLDS`: after every attention and every MLP, a share of
the output's elements moved one step of the dtype, by a fixed hash of the
token's position, :attr:`~.forward.Golden.jostle`), teacher-forced on the
same served tokens. A position is *ambiguous* where a world ranks another
token first (it is left out and counted); elsewhere its margin is the
smallest of the worlds' margins. How far yet another rounding (:data:`FRESH`,
never one of the worlds) falls below that smallest margin on the golden's
own replies is the envelope's measure (:mod:`.envelope`); 1.5 times its
largest is what a judged position's margin must exceed.

Every prompt runs through each world once (:meth:`~.forward.Golden.prefill`),
and every distinct reply to it as one batch of continuations of that
prefix (:meth:`~.forward.Golden.extend`): the same reply at several levels is
scored once. A reply's distributions are a function of its prompt and its
tokens alone, so they can be computed before the run's replies come back:
:meth:`Scorer.prepare` computes those of the replies a run is expected to
give (a right image's: the reference's answers) and the envelope of a
recording, and :meth:`Scorer.score` then computes only the replies it has
not seen. torch and tokenizers are imported only here, when a score is
asked for; :func:`missing` says what a host lacks before anything is tried.
"""

from __future__ import annotations

import copy
import importlib.util
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import CancelledError
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import Malformed
from .config import load as load_config
from .judge import Position, Scored

CONTINUATIONS_PER_BATCH = 16  # replies to one prompt run together through the golden
# The other roundings every reply is scored in, as (share of elements moved one step, seed); the envelope's
# held-out one moves more of them. A tenth is about what another order of the same sums changes in the
# engine's outputs (its decoding attention rounds each split's partial output to the dtype before merging them).
WORLDS: tuple[tuple[float, int], ...] = ((0.1, 1), (0.1, 2))
FRESH: tuple[float, int] = (0.3, 3)
NEEDS = ("torch", "tokenizers")


def missing() -> str | None:
    """What this host lacks to run the golden, in words (None: nothing)."""
    absent = [m for m in NEEDS if not _importable(m)]
    if absent:
        return (f"{' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} not installed on this host (the golden "
                "forward runs on the host, in PyTorch: pip install torch tokenizers)")
    return None


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules (blocked)
        return False


def token_id(text: str) -> int | None:
    """The ID in a token the server named ``token_id:N`` (None: not so named)."""
    name, sep, number = str(text).partition(":")
    if name != "token_id" or not sep or not number.isdigit():
        return None
    return int(number)


@dataclass(frozen=True, slots=True)
class Served:
    """One served reply to score: where it came from, its tokens, vLLM's log-probabilities and top-k."""

    source: str  # "http" or "fixed"
    level: int
    request: int
    prompt: int  # index into the prompt set
    tokens: tuple[str, ...]
    logprobs: tuple[float | None, ...] = ()
    top: tuple[Mapping[str, float], ...] = ()
    prompt_tokens: int | None = None  # as the server counted them


@dataclass
class Timing:
    """What scoring took: the model's load, the prompts' prefills, the replies' batches."""

    device: str = ""
    load_s: float = 0.0
    score_s: float = 0.0
    prompts: int = 0
    distinct_replies: int = 0
    worlds: int = 0  # computations each reply is scored in (the golden and its other roundings)
    tokens: int = 0
    # Computed by :meth:`Scorer.prepare` before the replies came back: its seconds, and how many of the distinct
    # replies scored were found computed there.
    ahead_s: float = 0.0
    ahead_replies: int = 0
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"device": self.device, "load_s": round(self.load_s, 3), "score_s": round(self.score_s, 3),
                "prompts": self.prompts, "distinct_replies": self.distinct_replies, "worlds": self.worlds,
                "tokens": self.tokens,
                **({"ahead_s": round(self.ahead_s, 3), "ahead_replies": self.ahead_replies} if self.ahead_s else {})}


class Scorer:
    """The golden of one model folder, with its tokenizer; :meth:`score` scores served replies."""

    def __init__(self, folder: Path, device: str | None = None, dtype: str | None = None) -> None:
        """``dtype``: what the golden computes in (default: the model's serving dtype)."""
        import torch
        from tokenizers import Tokenizer

        from .forward import _DTYPES, Golden
        from .forward import read_weights as read

        self.timing = Timing()
        start = time.monotonic()
        folder = Path(folder)
        tokenizer = folder / "tokenizer.json"
        if not tokenizer.is_file():
            raise Malformed(f"{folder}: no tokenizer.json (the golden tokenises the prompts itself)")
        try:
            self.tokenizer = Tokenizer.from_file(str(tokenizer))
        except Exception as exc:  # tokenizers raises its own exception type, which has no import path
            raise Malformed(f"{tokenizer}: unreadable ({exc})") from None
        self.folder = folder
        cfg = load_config(folder)
        self.dtype = _DTYPES.get(dtype or cfg.dtype, torch.float32)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.weights = read(folder)
        self.golden = Golden(cfg, self.weights, device, self.dtype)
        # float32 is rounded no otherwise (a step of it is no rounding the engine makes): no other world to score
        self.worlds: tuple[tuple[float, int], ...] = WORLDS if self.dtype in (torch.bfloat16, torch.float16) else ()
        self.torch = torch
        # Distributions computed so far, per world (the golden first) and prompt: continuation -> [L, vocab], kept
        # on the golden's device for the scorer's life (one run's distinct replies: for the tiny models' vocabulary
        # of 259, about 33 KB a reply and world)
        self._known: dict[tuple[int, tuple[int, ...]], dict[tuple[int, ...], Any]] = {}
        self._envelopes: dict[tuple[tuple[str, ...], int], dict[str, Any]] = {}
        # Asked between two prompts by work done ahead (:meth:`prepare`): true once the run it is done for ended.
        self.cancelled: Callable[[], bool] = lambda: False
        self.timing.device = str(self.golden.device) + (
            f" ({torch.cuda.get_device_name(self.golden.device)})" if self.golden.device.type == "cuda" else "")
        self.timing.load_s = time.monotonic() - start

    def prompt_ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt).ids)

    def exact(self) -> Any:
        """The golden at float32 (the model's definition), for the envelope."""
        from .forward import Golden

        return Golden(self.golden.cfg, self.weights, self.golden.device, self.torch.float32)

    def rounded(self, jostle: tuple[float, int]) -> Any:
        """The golden rounded otherwise (:attr:`~.forward.Golden.jostle`): the same weights, another world."""
        world = copy.copy(self.golden)
        world.jostle = jostle
        return world

    def envelope(self, prompts: Sequence[str], tokens: int) -> dict[str, Any]:
        """The golden's envelope at its dtype against float32 over ``prompts`` (:mod:`.envelope`), ``tokens``
        generated positions each (measured once per scorer: :meth:`prepare` may have measured it)."""
        from . import envelope

        key = (tuple(prompts), int(tokens))
        if key in self._envelopes:
            return self._envelopes[key]
        start = time.monotonic()
        ids = [self.prompt_ids(p) for p in prompts]
        got = envelope.measure(self.golden, self.exact(), ids, [self.golden.cfg.prompt_class(len(i)) for i in ids],
                               tokens, [self.rounded(w) for w in self.worlds], self.rounded(FRESH), self.cancelled)
        got["seconds"] = round(time.monotonic() - start, 3)
        self._envelopes[key] = got
        return got

    def prepare(self, prompts: Sequence[str], expected: Mapping[int, Sequence[Sequence[int]]], *,
                envelope_tokens: int | None = None) -> None:
        """Before a run's replies come back: the distributions of the replies ``expected`` (prompt index -> token
        ID lists; a right image's answers) in every world, and with ``envelope_tokens`` (a recording) the
        envelope over ``prompts``. What the run then serves is scored as :meth:`score` would score it with nothing
        prepared; a reply prepared and never served is never judged. Called off (:class:`CancelledError`) between two
        prompts once :attr:`cancelled` says so."""
        start = time.monotonic()
        worlds = self._worlds()
        for k in sorted(expected):
            if self.cancelled():
                raise CancelledError()
            if not 0 <= k < len(prompts):
                continue
            ids = self.prompt_ids(prompts[k])
            distinct = sorted({tuple(int(t) for t in c) for c in expected[k]
                               if all(0 <= int(t) < self.golden.cfg.vocab for t in c)})
            for w, world in enumerate(worlds):
                self._distributions(w, world, ids, distinct)
        if envelope_tokens is not None:
            self.envelope(prompts, envelope_tokens)
        self.timing.ahead_s += time.monotonic() - start

    def _positions(self, dists: Sequence[Any], reply: Served, ids: list[int]) -> tuple[Position, ...]:
        """The positions of ``reply`` (served IDs ``ids``) from each world's distributions ``dists`` [L, vocab]
        (the golden's first): ambiguous where a world ranks another token first, else judged at the smallest of
        the worlds' margins."""
        torch = self.torch
        first = dists[0]
        vocab = first.shape[-1]
        # vLLM's two best tokens per position and its log-probabilities of them: what the noise compares.
        best: list[list[tuple[int, float]]] = []
        for j in range(len(ids)):
            named = dict(reply.top[j]) if j < len(reply.top) else {}
            ranked = sorted(((token_id(t), float(v)) for t, v in named.items()), key=lambda tv: -tv[1])
            pair = [(t, v) for t, v in ranked if t is not None and t < vocab][:2]
            best.append(pair if len(pair) == 2 else [])
        index = [[ids[j], *([t for t, _ in best[j]] or [ids[j], ids[j]])] for j in range(len(ids))]
        gathered = first.gather(1, torch.tensor(index, dtype=torch.long, device=first.device)).cpu().tolist()
        tops = [torch.topk(d, 2, dim=-1) for d in dists]
        golden = tops[0].indices[:, 0]
        ambiguous = torch.zeros_like(golden, dtype=torch.bool)
        for t in tops[1:]:
            ambiguous |= t.indices[:, 0] != golden
        margin = torch.stack([t.values[:, 0] - t.values[:, 1] for t in tops]).amin(0)
        golden_l, ambiguous_l, margin_l = golden.cpu().tolist(), ambiguous.cpu().tolist(), margin.cpu().tolist()
        out = []
        for j, tid in enumerate(ids):
            error = None
            if best[j]:
                (_, va), (_, vb) = best[j]
                error = abs((va - vb) - (gathered[j][1] - gathered[j][2]))
            out.append(Position(int(golden_l[j]), float(margin_l[j]), tid, float(gathered[j][0]), error,
                                bool(ambiguous_l[j])))
        return tuple(out)

    def _worlds(self) -> list[Any]:
        """The golden and its other roundings, in that order (one copy each per call: cheap, the weights shared)."""
        return [self.golden, *(self.rounded(jostle) for jostle in self.worlds)]

    def _distributions(self, w: int, world: Any, prompt_ids: list[int], distinct: Sequence[tuple[int, ...]]
                       ) -> dict[tuple[int, ...], Any]:
        """Each distinct reply's distributions [L, vocab] after the prompt under world ``w`` (the distribution of
        served token j is the prompt's last row for j = 0, else row j - 1 after it): those computed before are
        taken as they are, the others computed after one prefill of the prompt (none where nothing is new)."""
        known = self._known.setdefault((w, tuple(prompt_ids)), {})
        todo = [c for c in distinct if c not in known]
        if todo:
            prefix = world.prefill(prompt_ids)
            if w == 0:
                self.timing.tokens += len(prompt_ids)
            for a in range(0, len(todo), CONTINUATIONS_PER_BATCH):
                batch = todo[a:a + CONTINUATIONS_PER_BATCH]
                rows = world.extend(prefix, [list(c[:-1]) for c in batch])
                for c, r in zip(batch, rows, strict=True):
                    self.timing.tokens += max(0, len(c) - 1)
                    known[c] = self.torch.cat((prefix.last[None], r)) if c else prefix.last[None][:0]
        return {c: known[c] for c in distinct}

    def score(self, prompts: Sequence[str], replies: Sequence[Served]) -> list[Scored]:
        """Each of ``replies`` scored (in their order); a reply that cannot be scored says why."""
        start = time.monotonic()
        worlds_now = self._worlds()
        self.timing.worlds = len(worlds_now)
        out: dict[int, Scored] = {}
        by_prompt: dict[int, list[int]] = {}
        parsed: dict[int, list[int]] = {}
        for n, reply in enumerate(replies):
            base = Scored(reply.source, reply.level, reply.request, reply.prompt)
            if not 0 <= reply.prompt < len(prompts):
                out[n] = Scored(**{**_fields(base), "problem": f"prompt {reply.prompt} is not one of the prompt set"})
                continue
            named = [token_id(t) for t in reply.tokens]
            bad = next((t for t, i in zip(reply.tokens, named, strict=True)
                        if i is None or i >= self.golden.cfg.vocab), None)
            if bad is not None:
                out[n] = Scored(**{**_fields(base), "problem": f"the served token {bad!r} is no token ID of the model"})
                continue
            parsed[n] = [int(i) for i in named if i is not None]
            by_prompt.setdefault(reply.prompt, []).append(n)
        for k, members in sorted(by_prompt.items()):
            prompt_ids = self.prompt_ids(prompts[k])
            counted = {replies[n].prompt_tokens for n in members} - {None}
            if counted and counted != {len(prompt_ids)}:
                for n in members:
                    out[n] = Scored(replies[n].source, replies[n].level, replies[n].request, k, problem=(
                        f"the server counted {replies[n].prompt_tokens} prompt tokens, the model's tokenizer makes "
                        f"{len(prompt_ids)} of the prompt"))
                continue
            self.timing.prompts += 1
            distinct = sorted({tuple(parsed[n]) for n in members})
            self.timing.distinct_replies += len(distinct)
            ahead = self._known.get((0, tuple(prompt_ids)), {})
            self.timing.ahead_replies += sum(c in ahead for c in distinct)
            worlds = [self._distributions(w, world, prompt_ids, distinct) for w, world in enumerate(worlds_now)]
            klass = self.golden.cfg.prompt_class(len(prompt_ids))
            for n in members:
                reply = replies[n]
                served = tuple(parsed[n])
                out[n] = Scored(reply.source, reply.level, reply.request, k,
                                self._positions([w[served] for w in worlds], reply, list(served))
                                if served else (), klass=klass)
        self.timing.score_s += time.monotonic() - start
        return [out[n] for n in range(len(replies))]


def _fields(s: Scored) -> dict[str, Any]:
    return {"source": s.source, "level": s.level, "request": s.request, "prompt": s.prompt}
